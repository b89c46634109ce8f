"""The rms_norm and add_rms_norm patches on tiny random models: every site found is patched, the kernels run (2·L
add_rms_norm calls a forward), the logits match the unpatched model on prefill and on a decode step with the cache,
and leaving the patch puts the model back exactly. Sites that cannot be patched say why."""

from __future__ import annotations

from functools import partial

import fusionscope.kernels
import pytest
import torch
from fusionscope.kernels.tolerances import assert_close
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from fusionscope.apply.patching import find_sites, patch

# these tests are of the layout patchers; the captured-graph path is tested in tests/test_rewrite.py
patch = partial(patch, rewrite=False)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Gemma's default head_dim is 256; Phi-3's default pad id is outside a 128-token vocabulary
EXTRA = {
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16},
    "gemma3_text": {"head_dim": 16},
    "phi3": {"pad_token_id": 0},
}


def tiny(model_type: str, layers: int = 2, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random causal LM, weights drawn so that logits are O(1) and norm weights are not all ones (or zeros, for
    Gemma's 1 + w): a wrong cast or offset shows."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, **EXTRA.get(model_type, {}),
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def where(sites: dict[str, list[str]]) -> list[dict]:
    return [{"fusion": f, "module_paths": sites[f]} for f in ("add_rms_norm", "rms_norm")]


def prefill_and_decode(model: nn.Module, ids: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prompt, then of one more token through the cache the prompt filled."""
    out = model(ids, use_cache=True)
    return out.logits, model(step, past_key_values=out.past_key_values, use_cache=True).logits


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the kernel calls the patched forwards make (they look the kernels up on `fusionscope.kernels`)."""
    counts = {"add_rms_norm": 0, "rms_norm": 0}
    for name in counts:
        kernel = getattr(fusionscope.kernels, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            counts[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(fusionscope.kernels, name, counted)
    return counts


def class_attributes(model: nn.Module) -> dict[type, dict[str, object]]:
    return {cls: dict(vars(cls)) for cls in {type(m) for m in model.modules()}}


@pytest.mark.parametrize(
    ("model_type", "layers", "dtype"),
    [("llama", 3, torch.float32), ("qwen2", 2, torch.float32), ("qwen3", 2, torch.float32),
     ("mistral", 2, torch.float32), ("gemma", 2, torch.float32), ("gemma2", 3, torch.float32),
     ("gemma3_text", 2, torch.float32), ("phi3", 2, torch.float32), ("gemma2", 2, torch.bfloat16)],
    ids=lambda v: str(v).removeprefix("torch."),
)  # fmt: skip
def test_patched_model_matches_and_restores(model_type: str, layers: int, dtype: torch.dtype, calls: dict) -> None:
    model = tiny(model_type, layers, dtype)
    sites = find_sites(model)
    assert len(sites["add_rms_norm"]) == 2 * layers
    ids = torch.randint(0, 128, (1, 6), device=DEVICE)
    step = torch.randint(0, 128, (1, 1), device=DEVICE)
    params = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    classes = class_attributes(model)
    with torch.inference_mode():
        before = prefill_and_decode(model, ids, step)
        with patch(model, where(sites)) as p:
            assert p.applied == {"add_rms_norm": sites["add_rms_norm"], "rms_norm": sites["rms_norm"]}
            assert p.skipped == {}
            patched = prefill_and_decode(model, ids, step)
        after = prefill_and_decode(model, ids, step)

    assert calls == {"add_rms_norm": 2 * 2 * layers, "rms_norm": 2 * len(sites["rms_norm"])}  # prefill + decode
    for got, want in zip(patched, before):
        assert_close(got, want, dtype)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert not [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert {n: (p, p.data_ptr()) for n, p in model.named_parameters()} == params
    assert all(params[n][0] is p for n, p in model.named_parameters())
    after_classes = class_attributes(model)
    assert after_classes.keys() == classes.keys()
    for cls, attrs in classes.items():
        assert after_classes[cls].keys() == attrs.keys(), cls
        assert all(after_classes[cls][k] is v for k, v in attrs.items()), cls


@pytest.mark.parametrize(("model_type", "via"), [("llama", "call"), ("gemma2", "config")])
def test_recorded_hidden_states_are_whole(model_type: str, via: str, calls: dict) -> None:
    """With output_hidden_states (in the call or in the config) every layer's output is recorded, so no layer may
    carry its last add: the in-layer add + norm stay fused (L calls), the input and final norms run unfused, and the
    hidden states match."""
    model = tiny(model_type)
    sites = find_sites(model)
    ids = torch.randint(0, 128, (1, 5), device=DEVICE)
    asked = {"output_hidden_states": True} if via == "call" else {}
    with torch.inference_mode():
        model.config.output_hidden_states = via == "config"
        want = model(ids, **asked)
        with patch(model, where(sites)):
            got = model(ids, **asked)
            assert calls["add_rms_norm"] == 2
            model.config.output_hidden_states = False
            model(ids)  # the capture hooks transformers installed stay on the layers, idle: the carry is back
            assert calls["add_rms_norm"] == 2 + 4
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    for g, w in zip((got.logits, *got.hidden_states), (want.logits, *want.hidden_states)):
        assert_close(g, w, torch.float32)


def test_final_norm_given_another_tensor_runs_unfused(calls: dict) -> None:
    """The final norm fuses only the pair the last layer carried; any other input gets the norm's own forward."""
    model = tiny("llama")
    x = torch.randn(1, 3, 64, device=DEVICE)
    with torch.inference_mode():
        want = model.model.norm(x)
        with patch(model, where(find_sites(model))):
            got = model.model.norm(x)
    assert torch.equal(got, want)
    assert calls["add_rms_norm"] == 0


def test_positional_arguments_reach_attention_by_name() -> None:
    """Gemma-2's layer takes position_embeddings second: given positionally, the rewrite passes it to self_attn by
    name. (Asking for hidden states makes the layer return the whole sum, as the unpatched layer does.)"""
    model = tiny("gemma2")
    layer = model.model.layers[0]
    h = torch.randn(1, 4, 64, device=DEVICE)
    position_ids = torch.arange(4, device=DEVICE)[None]
    cos_sin = model.model.rotary_emb(h, position_ids)
    with torch.inference_mode():
        want = layer(h, cos_sin, None, position_ids)
        with patch(model, where(find_sites(model))):
            got = layer(h, cos_sin, None, position_ids, output_hidden_states=True)
    assert_close(got, want, torch.float32)


class ScaledLayer(LlamaDecoderLayer):
    """Llama's modules and forward, statement for statement, but for the branches scaled before each residual add, as
    Granite's decoder layer writes it (`residual_multiplier`)."""

    residual_multiplier = 0.5

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, position_embeddings=position_embeddings, **kwargs
        )
        hidden_states = residual + hidden_states * self.residual_multiplier
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states * self.residual_multiplier
        return hidden_states


def test_a_layer_whose_forward_does_more_is_left_alone(calls: dict) -> None:
    """Layer 1 has Llama's modules but its own forward: its sites, the input norm it would take a carry into and the
    final norm after it are skipped with the reason; layer 0's in-layer add + norm is still fused, exactly."""
    model = tiny("llama")
    layer = model.model.layers[1]
    ids = torch.randint(0, 128, (1, 5), device=DEVICE)
    with torch.inference_mode():
        layer.__class__ = ScaledLayer
        want = model(ids).logits
        sites = find_sites(model)
        with patch(model, where(sites)) as p:
            got = model(ids).logits
    assert p.applied["add_rms_norm"] == ["model.layers.0.post_attention_layernorm"]
    reasons = p.skipped_paths["add_rms_norm"]
    assert set(reasons) == {"model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"}
    assert "self.residual_multiplier" in reasons["model.layers.1.post_attention_layernorm"]
    assert "self.residual_multiplier" in reasons["model.layers.1.input_layernorm"]
    assert "after a stack of decoder layers" in reasons["model.norm"]
    assert calls["add_rms_norm"] == 1
    assert_close(got, want, torch.float32)


class HalfBranchLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer.forward but for one constant: the MLP branch is halved before its residual add. It reads the
    same `self.` attributes as Llama's forward; only its statements tell it apart."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, position_embeddings=position_embeddings, **kwargs
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + 0.5 * hidden_states
        return hidden_states


def test_a_layer_that_halves_a_branch_is_refused_at_that_statement(calls: dict) -> None:
    """Every site that would rewrite layer 1 is refused, naming the statement that differs from Llama's; the logits
    are the layer's own."""
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 5), device=DEVICE)
    with torch.inference_mode():
        model.model.layers[1].__class__ = HalfBranchLayer
        want = model(ids).logits
        with patch(model, where(find_sites(model))) as p:
            got = model(ids).logits
    reasons = p.skipped_paths["add_rms_norm"]
    assert set(reasons) == {"model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"}
    statement = "differs from the llama-shape decoder layer at `hidden_states = residual + 0.5 * hidden_states`"
    assert statement in reasons["model.layers.1.post_attention_layernorm"]
    assert statement in reasons["model.layers.1.input_layernorm"]
    assert p.applied["add_rms_norm"] == ["model.layers.0.post_attention_layernorm"]
    assert calls["add_rms_norm"] == 1
    assert_close(got, want, torch.float32)


def test_a_patched_model_in_training_mode_runs_the_unpatched_computation(calls: dict) -> None:
    """train() at call time: every rewritten layer and norm runs its class's forward, bit for bit, with gradients;
    the kernels, which have no backward, are never called. A final norm alone in training mode adds the pair the
    last (eval) layer handed over back first, then runs its class's forward."""
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 5), device=DEVICE)
    sites = find_sites(model)
    model.train()
    want = model(ids).logits
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with patch(model, where(sites)) as p:
        assert p.skipped == {}
        got = model(ids).logits
        got.sum().backward()
        assert calls == {"add_rms_norm": 0, "rms_norm": 0}
        model.eval()
        model.model.norm.train()
        with torch.inference_mode():
            mixed = model(ids).logits
    assert torch.equal(got, want) and got.requires_grad
    assert {n: p.grad for n, p in model.named_parameters()}.keys() == want_grads.keys()
    assert all(torch.equal(p.grad, want_grads[n]) for n, p in model.named_parameters())
    assert calls["add_rms_norm"] == 2 * 2 - 1  # every add + norm but the final one
    with torch.inference_mode():
        assert_close(mixed, model(ids).logits, torch.float32)


def test_the_shape_comes_from_what_the_forward_uses(calls: dict) -> None:
    """A Llama layer that also holds the sandwich norms, which its forward never calls, is patched as Llama-shape."""
    model = tiny("llama")
    for layer in model.model.layers:
        layer.pre_feedforward_layernorm = LlamaRMSNorm(64).to(DEVICE)
        layer.post_feedforward_layernorm = LlamaRMSNorm(64).to(DEVICE)
        nn.init.uniform_(layer.post_feedforward_layernorm.weight, 0.5, 1.5)
    ids = torch.randint(0, 128, (1, 5), device=DEVICE)
    with torch.inference_mode():
        want = model(ids).logits
        sites = find_sites(model)
        with patch(model, where(sites)) as p:
            got = model(ids).logits
    assert p.skipped == {}
    assert calls["add_rms_norm"] == 4
    assert_close(got, want, torch.float32)


class Block(nn.Module):
    """A hand-written block: an RMSNorm of a known class, but no decoder-layer shape the rewrite knows."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln = nn.LayerNorm(8)
        self.norm = LlamaRMSNorm(8)


def test_sites_that_cannot_be_patched_say_why() -> None:
    model = Stack().to(DEVICE)
    paths = ["blocks.1.norm", "blocks.0.proj", "norm", "ln", "missing"]
    with patch(model, [{"fusion": f, "module_paths": paths} for f in ("add_rms_norm", "rms_norm")]) as p:
        reasons = p.skipped_paths
        assert p.applied == {"rms_norm": ["blocks.1.norm", "norm"]}
        assert "forward" in model.blocks[1].norm.__dict__
    assert set(reasons["add_rms_norm"]) == set(paths)
    assert "Block is not a decoder layer of a known shape" in reasons["add_rms_norm"]["blocks.1.norm"]
    assert "after a stack of decoder layers" in reasons["add_rms_norm"]["norm"]
    assert set(reasons["rms_norm"]) == {"blocks.0.proj", "ln", "missing"}
    assert "Linear is not an RMSNorm" in reasons["rms_norm"]["blocks.0.proj"]
    assert "LayerNorm is not an RMSNorm" in reasons["rms_norm"]["ln"]
    assert "no module at 'missing'" in reasons["rms_norm"]["missing"]
    assert "forward" not in model.blocks[1].norm.__dict__


def test_rms_norm_refuses_norms_that_add_rms_norm_took() -> None:
    """Given the final norm and a fused input norm too, rms_norm says that add_rms_norm has them (its swap of them
    would never run); the catalogue applies add_rms_norm first."""
    model = tiny("llama")
    sites = find_sites(model)
    extra = ["model.norm", "model.layers.1.input_layernorm"]
    with patch(model, [*where(sites)[:1], {"fusion": "rms_norm", "module_paths": sites["rms_norm"] + extra}]) as p:
        reasons = p.skipped_paths["rms_norm"]
    assert p.applied["rms_norm"] == sites["rms_norm"]
    assert "already rewritten by the add_rms_norm fusion" in reasons["model.norm"]
    assert "add_rms_norm already fuses this norm" in reasons["model.layers.1.input_layernorm"]


def test_a_norm_copied_under_a_new_name_is_vouched_for(calls: dict) -> None:
    """An RMSNorm class outside the table whose forward is Llama's or Gemma's, statement for statement (a copy under
    a new name, a subclass), is patched; one whose forward or `_norm` differs is not."""

    class CopiedRMSNorm(nn.Module):
        def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.rand(hidden_size) + 0.5)
            self.variance_epsilon = eps

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)  # the same statements, other comments
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class OtherRMSNorm(CopiedRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states) * 2

    class SubRMSNorm(GemmaRMSNorm):
        """Inherits Gemma's forward: a copy of it."""

    class RescaledRMSNorm(GemmaRMSNorm):
        """Inherits Gemma's forward, but the `_norm` it calls is another."""

        def _norm(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * 2

    norms = {"a": CopiedRMSNorm(16), "b": OtherRMSNorm(16), "c": SubRMSNorm(16), "d": RescaledRMSNorm(16)}
    model = nn.ModuleDict(norms).to(DEVICE).eval()  # in training mode the patched norms run their class's forward
    with torch.no_grad():
        model["c"].weight.uniform_(-0.5, 0.5)
    x = torch.randn(3, 16, device=DEVICE)
    with torch.inference_mode():
        want = model["a"](x), model["c"](x)
        with patch(model, [{"fusion": "rms_norm", "module_paths": list(norms)}]) as p:
            got = model["a"](x), model["c"](x)
    assert p.applied == {"rms_norm": ["a", "c"]}
    assert "OtherRMSNorm is not an RMSNorm the kernels know" in p.skipped_paths["rms_norm"]["b"]
    assert "RescaledRMSNorm is not an RMSNorm the kernels know" in p.skipped_paths["rms_norm"]["d"]
    assert calls["rms_norm"] == 2
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)


def test_a_docstring_in_a_copied_norm_is_no_difference(calls: dict) -> None:
    """Docstrings are not statements: a copy of Llama's forward with one is vouched for, as a copy without is."""

    class DocumentedRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """Llama's RMSNorm, documented."""
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    model = nn.ModuleDict({"norm": DocumentedRMSNorm(16)}).to(DEVICE).eval()
    x = torch.randn(3, 16, device=DEVICE)
    with torch.inference_mode():
        want = model["norm"](x)
        with patch(model, [{"fusion": "rms_norm", "module_paths": ["norm"]}]) as p:
            got = model["norm"](x)
    assert p.applied == {"rms_norm": ["norm"]} and calls["rms_norm"] == 1
    assert_close(got, want, torch.float32)
