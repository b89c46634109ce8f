"""Patching GPT-2 (add_layer_norm with the residual carried across blocks, linear_act on Conv1D), BERT-style
modules, bias_gelu's refusal, and the sampling pipeline: the kernels run where the finder found their sites, the
logits stay within tolerance, and leaving the patch restores the model and the sampler exactly. Models, inputs and
samplers live on DEVICE: the GPU where there is one, else the CPU, where the kernels run in Triton's interpreter
(tests/conftest.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

import fusionscope.kernels as kernels
import pytest
import torch
from fusionscope.kernels import kept_probs_reference
from fusionscope.kernels.tolerances import tolerance
from torch import nn
from transformers import BertConfig, BertLMHeadModel, GPT2Config, GPT2LMHeadModel
from transformers.models.bert.modeling_bert import BertSelfOutput

from fusionscope.apply import numerics
from fusionscope.apply.patching import Patcher, find_sites, patch
from fusionscope.apply.sampler import Sampler
from fusionscope.fusions import linear_act

# these tests are of the layout patchers; the captured-graph path is tested in tests/test_rewrite.py
patch = partial(patch, rewrite=False)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYERS = 2
SAMPLING = (0.7, 50, 0.9)


def gpt2(dtype: torch.dtype = torch.float32, **overrides: Any) -> GPT2LMHeadModel:
    """Weights drawn on the CPU, then moved: the same values on every machine."""
    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=128, n_positions=64, **overrides)
    return GPT2LMHeadModel(config).to(DEVICE, dtype).eval()


def bert(layers: int = LAYERS) -> BertLMHeadModel:
    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                        vocab_size=128, max_position_embeddings=64, is_decoder=True)  # fmt: skip
    return BertLMHeadModel(config).to(DEVICE).eval()


@pytest.fixture(autouse=True)
def ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 GEMMs in full precision (torch's default): the fp32 comparisons below, at 1e-5, hold on CUDA for IEEE
    fp32, not for TF32 (10-bit mantissa, ~1e-3), which an earlier caller may have switched on."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture(scope="module")
def sites() -> dict[str, list[str]]:
    return find_sites(gpt2())


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Counts calls of the kernels the patches import (they import them when patching, after this fixture), and
    notes the weight linear_act was given: (data_ptr, strides)."""
    counts: Counter = Counter()
    counts.weights = []  # type: ignore[attr-defined]
    for name in ("add_layer_norm", "linear_act", "sample"):
        real = getattr(kernels, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            if _name == "linear_act":
                counts.weights.append((args[1].data_ptr(), args[1].stride()))  # type: ignore[attr-defined]
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    yield counts


def ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def logits(model: nn.Module, **kwargs: Any) -> numerics.Reference:
    """Prefill over 6 tokens, then one decode step with the model's cache."""
    return numerics.reference(model, ids(), decode_steps=1, **kwargs)


def assert_close(test: numerics.Reference, ref: numerics.Reference, dtype: torch.dtype) -> None:
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(test.prefill_logits, ref.prefill_logits, atol=atol, rtol=rtol)
    torch.testing.assert_close(test.decode_logits, ref.decode_logits, atol=atol, rtol=rtol)


def assert_equal(test: numerics.Reference, ref: numerics.Reference) -> None:
    assert torch.equal(test.prefill_logits, ref.prefill_logits) and torch.equal(test.decode_logits, ref.decode_logits)
    assert torch.equal(test.tokens, ref.tokens)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What a patch must leave as it found it: every transformers/torch.nn class's attributes, the Parameter
    objects and their storage, and which instances have a forward of their own."""
    classes = {
        c for m in model.modules() for c in type(m).__mro__ if c.__module__.startswith(("transformers", "torch"))
    }
    return {
        "classes": {c: dict(vars(c)) for c in classes},
        "params": [(name, id(p), p.data_ptr()) for name, p in model.named_parameters()],
        "forwards": [name for name, m in model.named_modules() if "forward" in vars(m)],
    }


def where(sites: dict[str, list[str]], fusions: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"fusion": f, "module_paths": sites[f]} for f in fusions]


# every LayerNorm but block 0's ln_1, whose add (wte + wpe) is made inline in GPT2Model.forward
FUSABLE = [*[f"transformer.h.{i}.ln_{n}" for i in range(LAYERS) for n in (1, 2)][1:], "transformer.ln_f"]
C_FC = [f"transformer.h.{i}.mlp.c_fc" for i in range(LAYERS)]


def test_the_finder_reports_the_sites_patched(sites: dict[str, list[str]]) -> None:
    assert set(FUSABLE) <= set(sites["add_layer_norm"]) and len(FUSABLE) == 2 * LAYERS
    assert sites["linear_act"] == C_FC
    assert "bias_gelu" not in sites  # linear_act takes c_fc's bias and GELU in its epilogue


@pytest.mark.parametrize(
    ("fusions", "dtype"),
    [
        (("add_layer_norm",), torch.float32),
        (("linear_act",), torch.float32),
        (("add_layer_norm", "linear_act"), torch.float32),
        (("add_layer_norm", "linear_act"), torch.bfloat16),
    ],
    ids=["add_layer_norm", "linear_act", "all", "all-bf16"],
)
def test_gpt2_patched_logits_and_exact_restore(
    fusions: tuple[str, ...], dtype: torch.dtype, sites: dict[str, list[str]], calls: Counter
) -> None:
    model = gpt2(dtype)
    before, state = logits(model), snapshot(model)
    with patch(model, where(sites, fusions)) as result:
        patched = logits(model)
        assert not result.skipped_paths.get("linear_act")
    assert_close(patched, before, dtype)
    forwards = 2  # prefill and one decode step
    if "add_layer_norm" in fusions:
        assert result.applied["add_layer_norm"] == FUSABLE
        assert set(result.skipped_paths["add_layer_norm"]) == {"transformer.h.0.ln_1"}
        assert "inline in the model's forward" in result.skipped["add_layer_norm"]
        assert calls["add_layer_norm"] == 2 * LAYERS * forwards
    if "linear_act" in fusions:
        assert result.applied["linear_act"] == C_FC
        assert calls["linear_act"] == LAYERS * forwards
        # Conv1D's W (K, N) is handed over as its transposed view, not a copy
        c_fc = model.transformer.h[0].mlp.c_fc.weight
        assert calls.weights[0] == (c_fc.data_ptr(), (1, c_fc.shape[1]))
    assert snapshot(model) == state
    assert_equal(logits(model), before)


@pytest.mark.parametrize(
    ("paths", "rewritten"),
    [
        (["transformer.ln_f"], ["transformer.h.1", "transformer.ln_f"]),  # the last block carries into ln_f
        (["transformer.h.1.ln_1"], ["transformer.h.0", "transformer.h.1"]),  # block 0 carries, block 1 fuses
        (["transformer.h.0.ln_2"], ["transformer.h.0"]),  # in-block add: nothing carried
    ],
)
def test_one_site_rewrites_the_modules_it_needs(paths: list[str], rewritten: list[str], calls: Counter) -> None:
    model = gpt2()
    before = logits(model)
    with patch(model, [{"fusion": "add_layer_norm", "module_paths": paths}]) as result:
        assert [name for name, m in model.named_modules() if "forward" in vars(m)] == rewritten
        patched = logits(model)
    assert result.applied["add_layer_norm"] == paths
    assert calls["add_layer_norm"] == 2
    assert_close(patched, before, torch.float32)


def test_recorded_hidden_states_are_true_sums(sites: dict[str, list[str]], calls: Counter) -> None:
    """While transformers records each block's output, no block carries: the states are the sums, only the in-block
    add + ln_2 stays fused."""
    model = gpt2()
    with torch.inference_mode():
        ref = model(ids(), output_hidden_states=True)
        with patch(model, where(sites, ("add_layer_norm",))):
            out = model(ids(), output_hidden_states=True)
    assert len(out.hidden_states) == LAYERS + 1
    for test, expected in zip(out.hidden_states, ref.hidden_states):
        torch.testing.assert_close(test, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert calls["add_layer_norm"] == LAYERS


def test_other_inputs_and_training_run_the_unfused_forwards(sites: dict[str, list[str]], calls: Counter) -> None:
    """ln_f handed a tensor no block carried normalises it itself; in training mode every rewritten module runs its
    class's forward (the kernels keep no autograd history): bit-equal, with gradients."""
    model = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    x = torch.randn(2, 3, 64).to(DEVICE)
    with torch.inference_mode():
        norm = model.transformer.ln_f(x)
    model.train()
    ref = model(ids()).logits
    with patch(model, where(sites, ("add_layer_norm", "linear_act"))):
        with torch.inference_mode():
            assert torch.equal(model.transformer.ln_f(x), norm)
        out = model(ids()).logits
        out.sum().backward()
    assert torch.equal(out, ref) and out.requires_grad
    assert model.transformer.h[0].mlp.c_fc.weight.grad is not None
    assert sum(calls.values()) == 0


def test_bert_style_modules(calls: Counter) -> None:
    """BERT: linear_act in the intermediate and LM-head transform (exact GELU), add_layer_norm in the post-LN
    outputs; the embeddings' LayerNorm reads an add made inline and is skipped with that reason."""
    model = bert()
    found = find_sites(model)
    before, state = logits(model), snapshot(model)
    with patch(model, where(found, ("add_layer_norm", "linear_act"))) as result:
        patched = logits(model)
    assert_close(patched, before, torch.float32)
    assert result.applied["linear_act"] == found["linear_act"] and len(found["linear_act"]) == LAYERS + 1
    assert len(result.applied["add_layer_norm"]) == 2 * LAYERS
    assert list(result.skipped_paths["add_layer_norm"]) == ["bert.embeddings.LayerNorm"]
    assert calls["add_layer_norm"] == 2 * 2 * LAYERS and calls["linear_act"] == 2 * (LAYERS + 1)
    assert snapshot(model) == state
    assert_equal(logits(model), before)


class NormThenAdd(BertSelfOutput):
    """BertSelfOutput's children and bytecode names, but the residual added after the LayerNorm, not before it."""

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states) + input_tensor
        return hidden_states


def test_a_post_norm_output_that_adds_after_the_norm_is_refused_at_that_statement(calls: Counter) -> None:
    model = bert(layers=1)
    output = model.bert.encoder.layer[0].attention.output
    output.__class__ = NormThenAdd
    before = logits(model)
    path = "bert.encoder.layer.0.attention.output.LayerNorm"
    with patch(model, [{"fusion": "add_layer_norm", "module_paths": [path]}]) as result:
        assert "forward" not in vars(output)
        patched = logits(model)
    assert result.applied == {}
    assert (
        "at `hidden_states = self.LayerNorm(hidden_states) + input_tensor`"
        in result.skipped_paths["add_layer_norm"][path]
    )
    assert calls["add_layer_norm"] == 0
    assert_equal(patched, before)


def test_an_instance_forward_of_ones_own_is_refused_not_bypassed(calls: Counter) -> None:
    """A block or MLP whose forward was replaced on the instance keeps it: the rewrite would run the class's
    computation instead. One such block refuses its stack's add_layer_norm sites; the MLP refuses linear_act."""
    model = gpt2()
    block, mlp = model.transformer.h[1], model.transformer.h[0].mlp

    def halved(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return type(self).forward(self, *args, **kwargs) * 0.5

    block.forward = halved.__get__(block)
    mlp.forward = halved.__get__(mlp)
    before = logits(model)
    with patch(model, [{"fusion": "add_layer_norm", "module_paths": FUSABLE},
                       {"fusion": "linear_act", "module_paths": C_FC}]) as result:  # fmt: skip
        patched = logits(model)
    assert "add_layer_norm" not in result.applied and set(result.skipped_paths["add_layer_norm"]) == set(FUSABLE)
    assert "GPT2Block's forward is already replaced on the instance" in result.skipped["add_layer_norm"]
    assert result.applied["linear_act"] == [C_FC[1]]
    assert "GPT2MLP's forward is already replaced" in result.skipped_paths["linear_act"][C_FC[0]]
    assert calls["add_layer_norm"] == 0 and calls["linear_act"] == 2
    assert_close(patched, before, torch.float32)
    assert vars(block)["forward"].__func__ is halved and vars(mlp)["forward"].__func__ is halved


def test_an_activation_without_an_epilogue_is_refused() -> None:
    model = gpt2(activation_function="quick_gelu")
    patcher = Patcher(model)
    mlp, attn = "transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_attn"
    support = linear_act.patch(patcher, [mlp, attn])
    assert not support[mlp].ok and "QuickGELUActivation" in support[mlp].reason
    assert not support[attn].ok and "GPT2Attention.forward is not a layout" in support[attn].reason
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]


def test_a_parent_whose_forward_does_more_is_refused() -> None:
    """GPT2MLP's children, but a forward that scales the activation: not the layout the rewrite reproduces."""

    class ScaledMLP(nn.Module):
        def __init__(self, mlp: nn.Module) -> None:
            super().__init__()
            self.c_fc, self.act, self.c_proj, self.dropout = mlp.c_fc, mlp.act, mlp.c_proj, mlp.dropout

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.c_proj(self.act(self.c_fc(x)) * 2))

    model = gpt2()
    model.transformer.h[0].mlp = ScaledMLP(model.transformer.h[0].mlp)
    support = linear_act.patch(Patcher(model), C_FC)
    assert support[C_FC[1]].ok and not support[C_FC[0]].ok
    assert "ScaledMLP.forward is not a layout" in support[C_FC[0]].reason


def test_bias_gelu_is_refused_with_its_reason() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8, bias=False)
            self.bias = nn.Parameter(torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + nn.functional.gelu(self.fc(x) * 2 + self.bias)

    model = nn.Sequential(Block(), Block()).to(DEVICE)
    with patch(model, [{"fusion": "bias_gelu", "module_paths": ["0", "1"]}]) as result:
        pass
    assert not result.applied and set(result.skipped_paths["bias_gelu"]) == {"0", "1"}
    assert "inline in Block.forward" in result.skipped["bias_gelu"]


SAMPLING_SITE = [{"fusion": "sampling", "module_paths": ["sampling"]}]


def test_sampling_swaps_the_pick_and_puts_it_back(calls: Counter) -> None:
    model = gpt2()
    sampler = Sampler(SAMPLING, DEVICE)
    original = vars(sampler)["pick"]
    with patch(model, SAMPLING_SITE, sampler=sampler) as result:
        assert result.applied == {"sampling": ["sampling"]}
        run = logits(model, sampler=sampler)
        again = logits(model, sampler=sampler)  # reset() reseeds: the same draws
    assert run.tokens.dtype == torch.int64 and run.tokens.shape == (2, 2)
    assert ((run.tokens >= 0) & (run.tokens < 128)).all() and torch.equal(run.tokens, again.tokens)
    assert calls["sample"] == 4
    assert vars(sampler)["pick"] is original


def test_the_fused_draw_keeps_hf_s_set() -> None:
    """Many rows of one logits row: every draw lies in HF's kept set and the frequencies follow its probabilities;
    top_k = 1 is the exact argmax."""
    logits_row = (torch.randn(1, 100, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
    rows = logits_row.expand(2048, -1)
    sampler = Sampler(SAMPLING, DEVICE)
    with patch(nn.Linear(1, 1, device=DEVICE), SAMPLING_SITE, sampler=sampler):
        tokens = sampler(torch.zeros(2048, 1, dtype=torch.long, device=DEVICE), rows[:, None, :])
    assert tokens.shape == (2048, 1) and tokens.dtype == torch.int64
    probs = kept_probs_reference(logits_row, *SAMPLING)[0]
    assert probs[tokens.flatten()].gt(0).all()
    frequency = torch.bincount(tokens.flatten(), minlength=100) / tokens.numel()
    assert (frequency - probs).abs().sum() / 2 < 0.08  # total variation; ~0.04 expected from 2048 draws
    greedy = Sampler((0.7, 1, 0.9), DEVICE)
    some = torch.randn(8, 1, 100, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with patch(nn.Linear(1, 1, device=DEVICE), SAMPLING_SITE, sampler=greedy):
        ids_so_far = torch.zeros(8, 1, dtype=torch.long, device=DEVICE)
        assert torch.equal(greedy(ids_so_far, some), some[:, -1].argmax(-1, keepdim=True))


@pytest.mark.parametrize("argmax", [False, True], ids=["no-sampler", "argmax"])
def test_a_greedy_run_has_no_sampling_to_patch(argmax: bool) -> None:
    sampler = Sampler(None, DEVICE) if argmax else None  # built in the test: no CUDA generator at collection
    with patch(gpt2(), SAMPLING_SITE, sampler=sampler) as result:
        pass
    assert not result.applied and result.skipped["sampling"] == "greedy run: no sampling pipeline (sampling)"
