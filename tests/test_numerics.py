"""Numerics checks: the figures of `compare` on logits made by hand, `judge` on figures and on models whose RMSNorms
are swapped (on the instance) for the Triton kernel or for a deliberately wrong norm, and SmolLM2-135M on real text."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from fusionscope.apply.numerics import (
    TOLERANCES,
    Reference,
    compare,
    fp32_copy,
    judge,
    kept_positions,
    reference,
    text_ids,
    tolerance_table,
)
from fusionscope.apply.sampler import Sampler
from fusionscope.models import ModelSpec, build_workload

CPU = torch.device("cpu")
TINY_LLAMA = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=128, max_position_embeddings=64,
)  # fmt: skip
TINY_GEMMA2 = dict(
    model_type="gemma2", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, intermediate_size=128, vocab_size=128, max_position_embeddings=64, query_pre_attn_scalar=32,
    sliding_window=16, hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip


def tiny(config: dict, dtype: torch.dtype = torch.float32, **overrides: object) -> nn.Module:
    spec = ModelSpec(name=config["model_type"], source="preset", config={**config, **overrides})
    return build_workload(spec, CPU, dtype, prompt_len=8, decode_steps=1, seed=0).module


def prompt(vocab: int, batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def made(prefill: torch.Tensor, tokens: torch.Tensor, decode: torch.Tensor) -> Reference:
    return Reference(prefill_logits=prefill, tokens=tokens, decode_logits=decode)


def hand_made(batch: int = 2, seq: int = 4, steps: int = 5, vocab: int = 32) -> Reference:
    g = torch.Generator().manual_seed(0)
    prefill = torch.randn(batch, seq, vocab, generator=g) * 3
    decode = torch.randn(batch, steps, vocab, generator=g) * 3
    tokens = torch.cat([prefill[:, -1:].argmax(-1), decode.argmax(-1)], dim=1)
    return made(prefill, tokens, decode)


# ---------------------------------------------------------------- compare on hand-made logits


def test_identical_references_give_zero_error_and_full_agreement() -> None:
    ref = hand_made()
    f = compare(ref, ref)
    assert (f["max_abs"], f["max_rel"], f["kl_mean"], f["kl_max"]) == (0.0, 0.0, 0.0, 0.0)
    assert (f["top1"], f["top5"], f["tokens_equal"]) == (1.0, 1.0, 1.0)
    assert f["first_divergence"] is None
    assert f["positions"] == 2 * 4 + 2 * 5 and f["decode_compared"] == 2 * 5
    assert f["ref_scale"] == pytest.approx(
        float(ref.prefill_logits.abs().max().clamp_min(ref.decode_logits.abs().max()))
    )


def test_one_perturbed_logit_gives_its_size_and_the_analytic_kl() -> None:
    """Logit j of one row raised by δ: KL(p ‖ q) = log(1 − p_j + p_j·e^δ) − δ·p_j, every other row exact."""
    ref = hand_made()
    prefill = ref.prefill_logits.clone()
    delta, j = 0.75, 7
    prefill[1, 2, j] += delta
    f = compare(made(prefill, ref.tokens, ref.decode_logits), ref)
    p_j = torch.softmax(ref.prefill_logits[1, 2].double(), -1)[j].item()
    kl = math.log(1 - p_j + p_j * math.exp(delta)) - delta * p_j
    assert f["max_abs"] == pytest.approx(delta, rel=1e-6)
    assert f["max_rel"] == pytest.approx(delta / f["ref_scale"], rel=1e-6)
    assert f["kl_max"] == pytest.approx(kl, rel=1e-4)
    assert f["kl_mean"] == pytest.approx(kl / f["positions"], rel=1e-4)
    assert f["decode_max_abs"] == 0.0 and f["decode_kl_mean"] == 0.0


def test_a_shifted_row_has_logit_error_but_no_kl() -> None:
    """The softmax is shift-invariant: a constant added to a row moves max_abs and nothing else."""
    ref = hand_made()
    prefill = ref.prefill_logits.clone()
    prefill[0, 1] += 2.0
    f = compare(made(prefill, ref.tokens, ref.decode_logits), ref)
    assert f["max_abs"] == pytest.approx(2.0, rel=1e-6)
    assert f["kl_max"] < 1e-12 and (f["top1"], f["top5"]) == (1.0, 1.0)


def test_a_swapped_top1_lowers_top1_but_not_top5() -> None:
    ref = hand_made()
    prefill = ref.prefill_logits.clone()
    row = prefill[0, 0]
    first, second = row.topk(2).indices.tolist()
    row[first], row[second] = row[second].item(), row[first].item()
    f = compare(made(prefill, ref.tokens, ref.decode_logits), ref)
    assert f["top1"] == pytest.approx(1 - 1 / f["positions"])
    assert f["top5"] == 1.0
    assert f["kl_mean"] > 0


def test_a_token_leaving_the_top5_costs_a_fifth_of_a_position() -> None:
    ref = hand_made()
    prefill = ref.prefill_logits.clone()
    row = prefill[1, 3]
    fifth = row.topk(5).indices[-1]
    row[fifth] = row.min() - 1.0
    f = compare(made(prefill, ref.tokens, ref.decode_logits), ref)
    assert f["top5"] == pytest.approx(1 - 0.2 / f["positions"])
    assert f["top1"] == 1.0


def test_a_tie_at_the_top_counts_as_agreement() -> None:
    """bf16 logits tie often; an argmax that ties for the other side's maximum is the same prediction."""
    ref = hand_made()
    prefill = ref.prefill_logits.clone()
    row = prefill[0, 2]
    top = row.argmax()
    other = (top + 1) % row.numel()
    row[other] = row[top]  # a tie, resolved by argmax to the lower index on this side only
    tied = made(prefill, ref.tokens, ref.decode_logits)
    assert compare(tied, ref)["top1"] == 1.0


def test_a_token_change_at_column_3_is_the_first_divergence_and_ends_the_decode_comparison() -> None:
    """Decode step t was fed columns 0..t of `tokens`: once column 3 differs, steps 3 and later see other inputs and
    their logits are not compared (garbage there must not count)."""
    ref = hand_made(steps=5)
    tokens = ref.tokens.clone()
    tokens[0, 3] = (tokens[0, 3] + 1) % ref.prefill_logits.shape[-1]
    decode = ref.decode_logits.clone()
    decode[0, 3:] = 1e4
    f = compare(made(ref.prefill_logits, tokens, decode), ref)
    assert f["first_divergence"] == 3
    assert f["tokens_equal"] == pytest.approx(1 - 1 / tokens.numel())
    assert f["decode_compared"] == 3 + 5  # row 0: steps 0..2; row 1: all five
    assert f["max_abs"] == 0.0


def test_a_different_first_pick_is_divergence_zero_and_compares_no_decode_step() -> None:
    ref = hand_made(batch=1, steps=3)
    tokens = ref.tokens.clone()
    tokens[0, 0] += 1
    f = compare(made(ref.prefill_logits, tokens, ref.decode_logits + 1.0), ref)
    assert f["first_divergence"] == 0
    assert f["decode_compared"] == 0 and f["decode_max_abs"] is None and f["decode_kl_mean"] is None
    assert f["max_abs"] == 0.0  # the prefill itself matched


def test_a_decode_fault_shows_in_the_pooled_and_the_decode_figures() -> None:
    ref = hand_made()
    decode = ref.decode_logits.clone()
    decode[1, 1, 0] += 5.0  # the argmax may move; the step itself was fed the same tokens
    f = compare(made(ref.prefill_logits, ref.tokens, decode), ref)
    assert f["max_abs"] == pytest.approx(5.0) and f["decode_max_abs"] == pytest.approx(5.0)
    assert f["decode_kl_mean"] > 0


def test_a_nan_logit_is_not_read_as_no_error() -> None:
    ref = hand_made()
    prefill = ref.prefill_logits.clone()
    prefill[1, 1, 3] = float("nan")
    f = compare(made(prefill, ref.tokens, ref.decode_logits), ref)
    assert math.isnan(f["max_abs"]) and math.isnan(f["kl_mean"])
    ok, reason = judge(f, f, compare(ref, ref), torch.float32)
    assert not ok and "max_abs" in reason and "nan" in reason


def test_references_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_logits"):
        compare(hand_made(seq=4), hand_made(seq=3))


# ---------------------------------------------------------------- judge on figures


def figures(kl: float, max_abs: float, top1: float = 1.0, scale: float = 10.0) -> dict:
    return {"kl_mean": kl, "max_abs": max_abs, "top1": top1, "ref_scale": scale}


def test_judge_passes_a_bf16_fusion_as_far_from_fp32_as_eager() -> None:
    eager = figures(1.0e-3, 0.8)
    ok, reason = judge(figures(1.2e-3, 0.6, top1=0.98), figures(1.1e-3, 0.9), eager, torch.bfloat16)
    assert ok, reason
    assert "kl_mean" in reason and "max_abs" in reason and "top1" in reason


@pytest.mark.parametrize(
    ("fused_vs_fp32", "top1", "named"),
    [
        (figures(1.6e-3, 0.9), 1.0, "kl_mean"),  # 1.6× eager's KL
        (figures(1.0e-3, 2.5), 1.0, "max_abs"),  # 3.1× eager's max_abs
        (figures(1.0e-3, 0.9), 0.85, "top1"),  # flips 15% of argmaxes against eager
    ],
)
def test_judge_fails_naming_the_figure(fused_vs_fp32: dict, top1: float, named: str) -> None:
    ok, reason = judge(figures(1e-3, 0.5, top1=top1), fused_vs_fp32, figures(1.0e-3, 0.8), torch.bfloat16)
    assert not ok
    assert reason.startswith(named)


def test_judge_leaves_top1_to_real_weights() -> None:
    args = (figures(1e-4, 0.05, top1=0.8), figures(1e-4, 0.1), figures(1e-4, 0.1), torch.bfloat16)
    assert not judge(*args)[0]
    ok, reason = judge(*args, real_weights=False)
    assert ok and "not judged" in reason


def test_judge_in_fp32_rests_on_the_floors() -> None:
    """fp32 eager is its own fp32 reference (distance 0): kernel rounding passes, a real error does not."""
    zero = figures(0.0, 0.0)
    assert judge(figures(1e-11, 4e-5, scale=36.0), figures(1e-11, 4e-5, scale=36.0), zero, torch.float32)[0]
    ok, reason = judge(figures(3e-7, 4e-5, scale=36.0), figures(3e-7, 4e-5, scale=36.0), zero, torch.float32)
    assert not ok and reason.startswith("kl_mean")
    ok, reason = judge(figures(1e-10, 0.02, scale=36.0), figures(1e-10, 0.02, scale=36.0), zero, torch.float32)
    assert not ok and reason.startswith("max_abs")


def test_the_tolerance_table_covers_the_run_dtypes_and_refuses_others() -> None:
    assert set(TOLERANCES) == {torch.float32, torch.float16, torch.bfloat16}
    rows = tolerance_table()
    assert [r["dtype"] for r in rows] == ["float32", "float16", "bfloat16"]
    assert all(r["kl_ratio"] == 1.5 for r in rows)  # the product's target: no further from fp32 than 1.5× eager
    with pytest.raises(ValueError, match=r"no numerics tolerance for torch\.float64"):
        judge(figures(0, 0), figures(0, 0), figures(0, 0), torch.float64)


# ---------------------------------------------------------------- reference and fp32_copy on tiny models


def test_reference_decodes_greedily_with_the_cache() -> None:
    """Each decode step's logits are the last position of a cache-free forward over the prompt and the tokens so
    far, and each token is the argmax of the logits before it."""
    model = tiny(TINY_LLAMA)
    ids = prompt(128)
    ref = reference(model, ids, decode_steps=3)
    assert ref.prefill_logits.shape == (2, 8, 128) and ref.prefill_logits.dtype == torch.float32
    assert ref.tokens.shape == (2, 4) and ref.decode_logits.shape == (2, 3, 128)
    assert torch.equal(ref.tokens[:, 0], ref.prefill_logits[:, -1].argmax(-1))
    assert torch.equal(ref.tokens[:, 1:], ref.decode_logits.argmax(-1))
    with torch.inference_mode():
        for t in range(3):
            full = model(torch.cat([ids, ref.tokens[:, : t + 1]], dim=1), use_cache=False).logits[:, -1]
            torch.testing.assert_close(ref.decode_logits[:, t], full, atol=1e-5, rtol=1e-5)


def test_reference_keeps_the_last_positions_within_its_logit_budget() -> None:
    model = tiny(TINY_LLAMA)
    ids = prompt(128)
    full = reference(model, ids, decode_steps=1)
    kept = reference(model, ids, decode_steps=1, max_logits=2 * 128 * 3)
    assert kept.prefill_logits.shape == (2, 3, 128)
    torch.testing.assert_close(kept.prefill_logits, full.prefill_logits[:, -3:], atol=1e-6, rtol=1e-6)
    assert torch.equal(kept.tokens, full.tokens)
    assert kept_positions(1, 512, 128256) == 512  # Llama-3.1-8B at batch 1: every position
    assert kept_positions(8, 512, 128256) == 65  # batch 8: the last 65 of each sequence
    assert kept_positions(64, 512, 2**21) == 1  # never fewer than the last


def test_reference_with_a_sampler_draws_the_same_tokens_each_time() -> None:
    """The sampler is reset first, so a fused and an unfused run draw from the same seed."""
    model = tiny(TINY_LLAMA)
    ids = prompt(128)
    sampler = Sampler((0.7, 50, 0.9), CPU, seed=3)
    sampler(ids, torch.randn(2, 1, 128))  # advance its generator: reference must not depend on that
    first = reference(model, ids, decode_steps=4, sampler=sampler)
    second = reference(model, ids, decode_steps=4, sampler=sampler)
    assert torch.equal(first.tokens, second.tokens)


def test_fp32_copy_is_an_independent_fp32_twin_with_ties_kept() -> None:
    model = tiny(TINY_LLAMA, torch.bfloat16, tie_word_embeddings=True)
    params = {name: p for name, p in model.named_parameters()}
    copy32 = fp32_copy(model)
    assert copy32.lm_head.weight is copy32.model.embed_tokens.weight
    for name, p in copy32.named_parameters():
        assert p.dtype == torch.float32 and isinstance(p, nn.Parameter)
        assert torch.equal(p, params[name].float())  # the bf16 weights exactly, widened
        assert p.data_ptr() != params[name].data_ptr()
    assert all(p is params[name] and p.dtype == torch.bfloat16 for name, p in model.named_parameters())
    assert all(b.dtype == torch.float32 for name, b in copy32.named_buffers() if "inv_freq" in name)
    ids = prompt(128)
    with torch.inference_mode():
        widened = copy32(ids).logits
        twin = tiny(TINY_LLAMA, torch.bfloat16, tie_word_embeddings=True)
        for p in twin.parameters():
            p.data = p.data.float()
        torch.testing.assert_close(widened, twin(ids).logits, atol=0, rtol=0)


def test_fp32_copy_of_an_fp32_model_shares_no_storage() -> None:
    model = tiny(TINY_LLAMA)
    copy32 = fp32_copy(model, device="cpu")
    with torch.no_grad():
        copy32.model.norm.weight.add_(1.0)
    assert torch.equal(model.model.norm.weight, torch.ones(64))


# ---------------------------------------------------------------- judge on models: kernel norms pass, wrong ones fail


def norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def kernel_norm(eps_scale: float = 1.0) -> Callable[..., torch.Tensor]:
    """An RMSNorm forward through the Triton kernel; eps_scale ≠ 1 is a patcher that read the wrong epsilon."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from fusionscope.kernels import rms_norm

        eps = getattr(self, "variance_epsilon", None) or self.eps
        offset = 1.0 if type(self).__name__.startswith("Gemma") else 0.0
        return rms_norm(x, self.weight, eps * eps_scale, offset=offset)

    return forward


def scaled_weight_norm(scale: float) -> Callable[..., torch.Tensor]:
    """LlamaRMSNorm with its weight off by a factor: a norm that loaded a slightly wrong weight."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * scale) * h.to(x.dtype)

    return forward


@contextmanager
def swapped(modules: list[nn.Module], forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    for m in modules:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def verdict(model: nn.Module, ids: torch.Tensor, forward: Callable[..., torch.Tensor], steps: int = 3,
            real_weights: bool = False) -> tuple[bool, str]:  # fmt: skip
    """judge() of `model` with its norms swapped for `forward`, against itself unpatched and its fp32 copy."""
    dtype = next(model.parameters()).dtype
    eager = reference(model, ids, steps)
    exact = reference(fp32_copy(model), ids, steps) if dtype != torch.float32 else eager
    with swapped(norms(model), forward):
        fused = reference(model, ids, steps)
    return judge(compare(fused, eager), compare(fused, exact), compare(eager, exact), dtype, real_weights)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GEMMA2], ids=["llama", "gemma2"])
def test_judge_passes_the_rms_norm_kernel_and_fails_a_wrong_epsilon_in_fp32(config: dict) -> None:
    model = tiny(config)
    ids = prompt(128)
    ok, reason = verdict(model, ids, kernel_norm())
    assert ok, reason
    ok, reason = verdict(model, ids, kernel_norm(eps_scale=2.0))
    assert not ok and reason.startswith(("kl_mean", "max_abs")), reason
    assert not any("forward" in vars(m) for m in norms(model))


def test_judge_in_bf16_passes_the_kernel_and_fails_a_weight_off_by_one_percent() -> None:
    model = tiny(TINY_LLAMA, torch.bfloat16)
    ids = prompt(128)
    ok, reason = verdict(model, ids, kernel_norm())
    assert ok, reason
    ok, reason = verdict(model, ids, scaled_weight_norm(1.01))
    assert not ok and reason.startswith("kl_mean"), reason


# ---------------------------------------------------------------- SmolLM2-135M, real weights, real text


@pytest.fixture(scope="module")
def smollm(smollm2: tuple) -> tuple[nn.Module, torch.Tensor]:
    """The session's fp32 SmolLM2-135M (tests/conftest.py) and 2 × 16 tokens of English."""
    model, tokenizer = smollm2
    return model, text_ids(tokenizer, length=16, batch=2)


# The patched-model checks run every kernel in the interpreter, whose cost grows with the tokens processed (rope: one
# program per token and head block, ~15–25 ms each; SmolLM2 has 30 layers): they take the first PATCHED_LEN tokens of
# each row and one decode step (which reads the KV cache the prefill wrote).
PATCHED_LEN = 6


def test_smollm2_predicts_real_text_and_bf16_agrees_with_fp32(smollm: tuple[nn.Module, torch.Tensor]) -> None:
    model, ids = smollm
    ref = reference(model, ids, decode_steps=2)
    hits = (ref.prefill_logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item()
    # measured 9 of 30 (2026-12-01); a random-weight model of this vocabulary hits ~1 in 49152
    assert hits >= 0.2, f"SmolLM2 predicted only {hits:.0%} of the next tokens of plain English"
    bf16 = fp32_copy(model)
    for p in bf16.parameters():  # what loading in bf16 gives: weights rounded, rotary buffers kept in fp32
        p.data = p.data.to(torch.bfloat16)
    eager = compare(reference(bf16, ids, decode_steps=2), reference(fp32_copy(bf16), ids, decode_steps=2))
    assert eager["top1"] >= 0.9 and eager["kl_mean"] < 1e-2, eager


def test_smollm2_rms_norm_kernel_passes_and_a_wrong_epsilon_fails(smollm: tuple[nn.Module, torch.Tensor]) -> None:
    """fp32, every RMSNorm (30 layers × 2 + the final one) through the kernel in the interpreter."""
    model, ids = smollm
    ids = ids[:, :PATCHED_LEN]
    ok, reason = verdict(model, ids, kernel_norm(), steps=1, real_weights=True)
    assert ok, reason
    ok, reason = verdict(model, ids, kernel_norm(eps_scale=2.0), steps=1, real_weights=True)
    assert not ok and reason.startswith("kl_mean"), reason


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_smollm2_every_patchable_fusion_keeps_real_text_numerics(smollm: tuple[nn.Module, torch.Tensor],
                                                                 dtype: torch.dtype) -> None:  # fmt: skip
    """The patch `apply` makes — every fusion the finder finds in SmolLM2, patched where it found it, the kernels in
    the interpreter — judged on real text against the unpatched model in the same dtype and against fp32, with the
    top-1 rule real weights get (2 × 6 tokens and one decode step: at most 14 positions, so in bf16 one flipped argmax
    is allowed). fp32 is judged by the same rule, with every fusion the finder finds, over 32 greedy tokens:
    tests/test_rewrite.py's SmolLM2 test.

    The fused reference is the patch's example call, run once every patch is on: the graphs are captured on these
    inputs, where the default example's (three prefills of a 4-token prompt and a decode step, ~11 s each in the
    interpreter) would be captured first and these captured again."""
    import fusionscope

    model32, ids = smollm
    ids = ids[:, :PATCHED_LEN]
    model = model32
    if dtype != torch.float32:
        model = fp32_copy(model32)
        for p in model.parameters():  # what loading in bf16 gives: weights rounded, rotary buffers kept in fp32
            p.data = p.data.to(dtype)
    eager = reference(model, ids, decode_steps=1)
    fp32 = reference(model32, ids, decode_steps=1)
    fused_runs: list[Reference] = []
    fusions = ["add_rms_norm", "rms_norm", "silu_and_mul", "rope", "qkv", "gate_up"]
    with fusionscope.patch(model, fusions, example=lambda m: fused_runs.append(reference(m, ids, 1))) as p:
        assert p.capture == "", p.capture
    (fused,) = fused_runs
    assert len(p.applied["add_rms_norm"]) == 60 and len(p.applied["qkv"]) == 30, p.skipped
    ok, reason = judge(compare(fused, eager), compare(fused, fp32), compare(eager, fp32), dtype, real_weights=True)
    assert ok, reason
