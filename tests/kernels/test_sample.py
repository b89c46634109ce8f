"""fusionscope::sample against Hugging Face's Temperature → TopK → TopP chain: greedy is the exact argmax, the kept set
and its renormalised probabilities match, draws follow that distribution (chi-square), and a generator state fixes
the tokens. Vocabularies stay small: every search step is a pass over the row in the interpreter."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from fusionscope.kernels.sample import kept_probs_reference, kept_scores_reference, sample, sample_reference
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import DTYPES, device, poisoned, randn


def _assert_kept_matches_hf(kept: torch.Tensor, logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The kernel's kept set equals HF's up to ties at the cut-off: a token may differ only if its score equals HF's
    lowest kept score (a tie group HF's sort splits, which the kernel keeps whole), or if the probability mass strictly
    above it is within 1e-5 of top_p (fp32 summation order)."""
    hf_kept = kept_scores_reference(logits, temperature, top_k, top_p) != -math.inf
    after_top_k = kept_scores_reference(logits, temperature, top_k, 1.0).double()  # what top-p sees
    probs = after_top_k.softmax(dim=-1)
    for row, i in (kept != hf_kept).nonzero().tolist():
        s = after_top_k[row]
        lowest_kept = s[hf_kept[row]].min()
        mass_above = probs[row][s > s[i]].sum().item()
        assert s[i] == lowest_kept or abs(mass_above - top_p) < 1e-5, (
            f"row {row}: token {i} kept by kernel={bool(kept[row, i])}, by HF={bool(hf_kept[row, i])}, "
            f"score {s[i].item()}, lowest kept {lowest_kept.item()}, mass above {mass_above}, top_p {top_p}"
        )


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("V", [50, 1000, 4097])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_top_k_1_is_argmax(rows: int, V: int, dtype: torch.dtype) -> None:
    logits = randn(rows, V, dtype=dtype, scale=3.0, strided=V == 1000)
    out = torch.full((rows,), -1, dtype=torch.int64, device=device())  # int64 holds no NaN: poison with -1
    tokens = sample(logits, 0.7, 1, 0.9, out=out)
    assert tokens is out
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_1_ties_take_the_lowest_index() -> None:
    logits = torch.zeros(3, 1000, device=device())
    logits[0, [7, 3, 900]] = 5.0
    logits[1, [999, 512]] = 2.0
    logits[2, :] = -1.0  # all equal
    logits[2, 4] = -math.inf
    assert sample(logits, 1.3, 1, 1.0).tolist() == [3, 512, 0]


@pytest.mark.parametrize(
    ("V", "dtype", "temperature", "top_k", "top_p"),
    [
        (50, torch.float32, 0.7, 0, 0.9),
        (50, torch.bfloat16, 1.3, 10, 1.0),
        (1000, torch.float32, 1.0, 40, 0.8),
        (1000, torch.float16, 0.6, 0, 0.5),
        (1000, torch.bfloat16, 0.9, 100, 0.95),
        (4097, torch.float32, 0.8, 50, 0.9),
        (4097, torch.float16, 1.1, 0, 0.7),
        (4097, torch.bfloat16, 0.7, 20, 1.0),
        (4097, torch.float32, 1.0, 0, 1.0),  # nothing removed
        (12345, torch.float32, 0.8, 30, 0.9),  # two 8192-wide chunks per pass
    ],
)
def test_kept_set_and_probs_match_hf(V: int, dtype: torch.dtype, temperature: float, top_k: int, top_p: float) -> None:
    rows = 3 if V <= 4097 else 2
    logits = randn(rows, V, dtype=dtype, scale=3.0, strided=V == 1000)
    out = (torch.full((rows,), -1, dtype=torch.int64, device=device()), poisoned((rows, V), torch.float32))
    tokens, probs = sample(
        logits, temperature, top_k, top_p, generator=torch.Generator().manual_seed(0), out=out, return_probs=True
    )
    assert tokens is out[0] and probs is out[1]
    kept = probs > 0
    _assert_kept_matches_hf(kept, logits, temperature, top_k, top_p)
    assert kept[torch.arange(rows), tokens].all()
    # The kernel's probabilities: softmax of logits / T over its own kept set, computed in float64.
    s = logits.double() / temperature
    expected = s.masked_fill(~kept, -math.inf).softmax(dim=-1)
    assert_close(probs, expected, torch.float32)
    # and they are HF's where the kept sets agree
    hf = kept_probs_reference(logits, temperature, top_k, top_p)
    same = ((hf > 0) == kept).all(dim=-1)
    assert_close(probs[same], hf[same], torch.float32)


def test_draws_only_kept_tokens() -> None:
    row = randn(1, 1000, dtype=torch.float32, scale=2.0)
    logits = row.expand(256, 1000)  # 256 draws from one row: row stride 0
    hf_kept = kept_scores_reference(row, 0.9, 30, 0.85)[0] != -math.inf
    tokens = sample(logits, 0.9, 30, 0.85, generator=torch.Generator().manual_seed(1))
    assert hf_kept[tokens].all()
    assert torch.unique(tokens).numel() > 1


def test_logits_with_masked_vocabulary() -> None:
    logits = randn(3, 300, dtype=torch.float32, scale=2.0)
    logits[:, 100:] = -math.inf  # e.g. padded vocabulary
    tokens, probs = sample(logits, 0.8, 0, 0.95, generator=torch.Generator().manual_seed(2), return_probs=True)
    assert (tokens < 100).all() and (probs[:, 100:] == 0).all()
    _assert_kept_matches_hf(probs > 0, logits, 0.8, 0, 0.95)


def test_chi_square_goodness_of_fit() -> None:
    """20000 draws from V = 10 at temperature 0.7, top_k 6, top_p 0.9 (HF keeps 4 tokens); p-value 0.77 with seed 0."""
    logits = torch.tensor([1.2, -0.3, 2.0, 0.4, -1.5, 0.9, 1.6, -0.8, 0.1, 2.3], device=device())
    probs = kept_probs_reference(logits[None], 0.7, 6, 0.9)[0].double()
    kept = probs > 0
    assert 1 < kept.sum() < 6  # both top-k and top-p remove tokens
    draws = 20000
    tokens = sample(logits.expand(draws, 10), 0.7, 6, 0.9, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=10).double()
    assert counts[~kept].sum() == 0
    expected = probs[kept] * draws
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(kept.sum() - 1), dtype=torch.float64)
    p_value = torch.special.gammaincc(dof / 2, chi2.cpu() / 2).item()
    print(f"chi-square p-value {p_value:.3f}")
    assert p_value > 1e-3, f"chi2 {chi2.item():.2f} on {int(dof)} dof, p-value {p_value:.2e}"


def test_same_generator_state_same_tokens() -> None:
    logits = randn(64, 1000, dtype=torch.bfloat16, scale=1.0)
    first = sample(logits, 1.0, 0, 1.0, generator=torch.Generator().manual_seed(123))
    second = sample(logits, 1.0, 0, 1.0, generator=torch.Generator().manual_seed(123))
    assert torch.equal(first, second)
    gen = torch.Generator().manual_seed(123)
    sample(logits, 1.0, 0, 1.0, generator=gen)
    assert not torch.equal(sample(logits, 1.0, 0, 1.0, generator=gen), first)  # the state advanced
    torch.manual_seed(7)
    default_first = sample(logits, 1.0, 0, 1.0)
    torch.manual_seed(7)
    assert torch.equal(sample(logits, 1.0, 0, 1.0), default_first)  # the default generator, likewise


def test_reference_is_transformers_chain() -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = randn(4, 500, dtype=torch.float32, scale=3.0)
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.3, 25, 1.0), (0.9, 40, 0.8), (1.0, 10, 0.5)]:
        chain = LogitsProcessorList()
        if temperature != 1.0:
            chain.append(TemperatureLogitsWarper(temperature))
        if top_k:
            chain.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p))
        hf = chain(None, logits.clone())
        assert torch.equal(kept_scores_reference(logits, temperature, top_k, top_p), hf)
        gen = torch.Generator(device()).manual_seed(0)
        tokens, kept, probs = sample_reference(logits, temperature, top_k, top_p, gen)
        assert torch.equal(kept, hf != -math.inf) and torch.equal(probs, hf.softmax(-1))
        assert kept[torch.arange(4), tokens].all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.0, 0, 0.9), "temperature"),
        ((-1.0, 0, 0.9), "temperature"),
        ((float("nan"), 0, 0.9), "temperature"),
        ((0.7, 0, 0.0), "top_p"),
        ((0.7, 0, 1.5), "top_p"),
        ((0.7, 0, -0.1), "top_p"),
        ((0.7, -1, 0.9), "top_k"),
        ((0.7, 2.5, 0.9), "top_k"),
    ],
)
def test_bad_parameters(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample(randn(2, 50, dtype=torch.float32), *args)


def test_bad_tensors() -> None:
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample(randn(50, dtype=torch.float32), 0.7, 0, 0.9)
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample(randn(2, 3, 50, dtype=torch.float32), 0.7, 0, 0.9)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        sample(torch.ones(2, 50, dtype=torch.int64, device=device()), 0.7, 0, 0.9)
    with pytest.raises(ValueError, match="int64"):
        sample(randn(2, 50, dtype=torch.float32), 0.7, 0, 0.9, out=torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="tuple"):
        sample(randn(2, 50, dtype=torch.float32), 0.7, 0, 0.9, out=torch.empty(2, dtype=torch.int64), return_probs=True)


@pytest.fixture
def two_stage(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The two-launch path switched on with small slices (V = 1000 → 8 slices of 128); returns a list that counts its
    launches, so a test can check which path ran."""
    module = importlib.import_module("fusionscope.kernels.sample")
    monkeypatch.setitem(module.TWO_STAGE, "enabled", True)
    monkeypatch.setitem(module.TWO_STAGE, "SLICE", 128)
    calls: list[int] = []
    launch = module._launch_two_stage

    def counted(*args: object) -> None:
        calls.append(1)
        launch(*args)

    monkeypatch.setattr(module, "_launch_two_stage", counted)
    return calls


def _single_stage(logits: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    module = importlib.import_module("fusionscope.kernels.sample")
    enabled = module.TWO_STAGE["enabled"]
    module.TWO_STAGE["enabled"] = False
    try:
        return sample(logits, *args, **kwargs)
    finally:
        module.TWO_STAGE["enabled"] = enabled


@pytest.mark.parametrize(
    ("V", "dtype", "temperature", "top_k", "top_p", "strided"),
    [
        (1000, torch.float32, 0.7, 50, 0.9, False),
        (1000, torch.bfloat16, 1.0, 20, 1.0, True),
        (4097, torch.float16, 0.8, 7, 0.5, False),
        (4097, torch.float32, 1.3, 64, 0.95, True),
    ],
)
def test_two_stage_draws_the_one_launch_tokens(
    two_stage: list[int], V: int, dtype: torch.dtype, temperature: float, top_k: int, top_p: float, strided: bool
) -> None:
    """Same seed, same Philox numbers per column: the candidates path picks the token the one-launch kernel picks
    (it could differ only where fp32 summation order moves a top-p cut-off; not on these rows)."""
    logits = randn(5, V, dtype=dtype, scale=3.0, strided=strided)
    out = torch.full((5,), -1, dtype=torch.int64, device=device())
    tokens = sample(logits, temperature, top_k, top_p, generator=torch.Generator().manual_seed(11), out=out)
    assert two_stage == [1] and tokens is out
    expected = _single_stage(logits, temperature, top_k, top_p, generator=torch.Generator().manual_seed(11))
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_two_stage_ties_wider_than_a_slice_keep_the_draw_exact(two_stage: list[int], top_p: float) -> None:
    """200 equal top scores and top_k 5: HF keeps the whole tie group, but a slice stores at most 16 (k's padded
    width) of its tied tokens. The others are counted and summed by number, and the stored one is the tied token the
    race would pick first, so every row draws exactly the one-launch kernel's token (whose distribution
    `test_chi_square_goodness_of_fit` checks) — including tokens that were never stored."""
    row = randn(1, 1000, dtype=torch.float32, scale=1.0)
    row[0, torch.randperm(1000)[:200]] = 9.0
    logits = row.expand(8, 1000)  # 8 draws among ~200 tied tokens: all 8 alike has a chance of about 200^-7
    tokens = sample(logits, 1.0, 5, top_p, generator=torch.Generator().manual_seed(3))
    assert two_stage == [1]
    expected = _single_stage(logits, 1.0, 5, top_p, generator=torch.Generator().manual_seed(3))
    assert torch.equal(tokens, expected)
    assert (row[0, tokens] == 9.0).all() and torch.unique(tokens).numel() > 1


def test_two_stage_is_used_only_where_it_applies(two_stage: list[int]) -> None:
    logits = randn(2, 1000, dtype=torch.float32, scale=2.0)
    sample(logits, 0.7, 1, 0.9)  # greedy: the exact argmax path
    sample(logits, 0.7, 0, 0.9)  # no top-k: nothing bounds the candidates
    sample(logits, 0.7, 65, 0.9)  # k above MAX_K
    sample(logits, 0.7, 50, 0.9, return_probs=True)  # probabilities need the whole row
    sample(logits[:, :128], 0.7, 50, 0.9)  # one slice: nothing to split
    assert two_stage == []
