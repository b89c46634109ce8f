"""The MLP and attention patches (silu_and_mul, gelu_and_mul, qkv, gate_up, rope, flash_attention) on tiny random
models: sites from the finder, patched through `patching.patch`, logits of a prefill and one cached decode step within
the kernels' tolerance of the unpatched model, the kernels seen running, one GEMM per fused group, memory unchanged,
and after the `with` block the model exactly as before (same Parameters, own storages, no instance forward, no class
touched, outputs bit-equal). Models and tensors live on DEVICE: the GPU where there is one, else the CPU, where the
kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import cache, partial

import pytest
import torch
import transformers
from fusionscope.kernels.tolerances import assert_close
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from fusionscope.apply.attention import read_attention
from fusionscope.apply.patching import find_sites, patch

# these tests are of the layout patchers; the captured-graph path is tested in tests/test_rewrite.py
patch = partial(patch, rewrite=False)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MINE = ("silu_and_mul", "gelu_and_mul", "qkv", "gate_up", "rope", "flash_attention")
BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}  # fmt: skip
CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),  # q/k/v with bias
    "qwen3": (transformers.Qwen3Config, {}),  # q_norm / k_norm before the rope
    "mistral": (transformers.MistralConfig, {}),
    "gemma": (transformers.GemmaConfig, {}),  # GELU tanh MLP
    "gemma2": (transformers.Gemma2Config, {}),  # softcapping, sandwich norms
    "phi3": (transformers.Phi3Config, {}),  # fused qkv_proj / gate_up_proj
}
PROMPT = torch.tensor([[5, 17, 99, 3, 64, 8]], device=DEVICE)
KERNEL_OPS = {"silu_and_mul": "fusionscope.silu_and_mul", "gelu_and_mul": "fusionscope.gelu_and_mul",
              "rope": "fusionscope.rope"}  # fmt: skip
GEMMS = ("aten.mm", "aten.addmm", "fusionscope.gemv")  # a fused one-row projection runs as the GEMV


def build(
    family: str, dtype: torch.dtype = torch.float32, attn: str = "eager", device: torch.device = DEVICE, **extra: object
) -> nn.Module:
    """Weights drawn on the CPU, then moved: the same values on every machine."""
    config_class, own = CONFIGS[family]
    config = config_class(**{**BASE, **own, **extra})
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    for p in model.parameters():  # norms start at 0 / 1: give them values so a wrong weight would show
        if p.dim() == 1:
            nn.init.normal_(p, 0.0, 0.5)
    return model.to(device)


@pytest.fixture(autouse=True)
def ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 GEMMs in full precision (torch's default): the fp32 comparisons below, down to 1e-6, hold on CUDA for
    IEEE fp32, not for TF32 (10-bit mantissa, ~1e-3), which an earlier caller may have switched on."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@cache
def sites(family: str) -> dict[str, list[str]]:
    """find_sites on the fp32 eager model of `family` (the same paths at any dtype)."""
    return find_sites(build(family))


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active by overload packet name (`aten.mm`, `fusionscope.rope`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def cache_keyword(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def prefill_and_decode(
    model: nn.Module, counter: OpCounter | None = None, prompt: torch.Tensor = PROMPT
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the prompt and of one decode step with the DynamicCache the prefill filled."""
    with counter if counter is not None else nullcontext():
        first = model(prompt, use_cache=True)
        token = first.logits[:, -1:].argmax(-1)
        second = model(token, use_cache=True, **{cache_keyword(model): first.past_key_values})
    return first.logits, second.logits


def where(model_sites: dict[str, list[str]], fusions: tuple[str, ...]) -> list[dict]:
    return [{"fusion": f, "module_paths": model_sites[f]} for f in fusions]


def assert_logits_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    """Within the kernels' tolerance of the dtype (kernels/tolerances.py): measured at ~6e-8 (fp32) and ≤ 8e-3 (bf16,
    logits up to 1.4) on these models, against 1e-5 and 1.6e-2 + 1.6e-2·|logit| allowed."""
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, dtype)


def class_attributes(model: nn.Module) -> dict[type, dict]:
    classes = {c for m in model.modules() for c in type(m).__mro__ if c.__module__.startswith("transformers")}
    return {c: dict(vars(c)) for c in classes}


def storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def owns_its_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


ALONE = [("llama", "silu_and_mul"), ("llama", "qkv"), ("llama", "gate_up"), ("llama", "rope"),
         ("llama", "flash_attention"), ("qwen2", "qkv"), ("qwen2", "rope"), ("qwen3", "rope"), ("qwen3", "qkv"),
         ("mistral", "rope"), ("mistral", "flash_attention"), ("gemma", "gelu_and_mul"), ("gemma", "rope"),
         ("gemma", "flash_attention"), ("gemma2", "gelu_and_mul"), ("gemma2", "rope"), ("phi3", "silu_and_mul"),
         ("phi3", "flash_attention")]  # fmt: skip


def test_sites_are_the_mlp_and_attention_modules() -> None:
    found = sites("llama")
    for fusion in ("silu_and_mul", "gate_up"):
        assert found[fusion] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for fusion in ("qkv", "rope", "flash_attention"):
        assert found[fusion] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert sites("gemma")["gelu_and_mul"] == ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize(("family", "fusion"), ALONE, ids=[f"{f}-{k}" for f, k in ALONE])
def test_one_fusion_alone_keeps_the_logits_and_runs(family: str, fusion: str) -> None:
    model = build(family)
    model_sites = sites(family)
    before, plain = OpCounter(), OpCounter()
    want = prefill_and_decode(model, before)
    with patch(model, where(model_sites, (fusion,))) as result:
        assert result.skipped == {} and result.applied == {fusion: model_sites[fusion]}
        got = prefill_and_decode(model, plain)
    assert_logits_close(got, want, torch.float32)
    layers, forwards = 2, 2
    if fusion in KERNEL_OPS:
        assert plain.counts[KERNEL_OPS[fusion]] == layers * forwards
    elif fusion in ("qkv", "gate_up"):
        n = 3 if fusion == "qkv" else 2
        gemms = sum(before.counts[g] for g in GEMMS) - sum(plain.counts[g] for g in GEMMS)
        assert gemms == layers * forwards * (n - 1)
    else:  # flash_attention: torch's fused attention instead of eager's softmax
        assert before.counts["aten._softmax"] == layers * forwards and plain.counts["aten._softmax"] == 0
        assert sum(c for op, c in plain.counts.items() if "scaled_dot_product" in op) == layers * forwards
    assert prefill_and_decode(model)[0].equal(want[0])


@pytest.mark.parametrize(("family", "dtype"), [("llama", torch.float32), ("qwen2", torch.float32),
                                               ("qwen3", torch.bfloat16), ("gemma", torch.bfloat16),
                                               ("mistral", torch.float32)],
                         ids=["llama-fp32", "qwen2-fp32", "qwen3-bf16", "gemma-bf16", "mistral-fp32"])  # fmt: skip
def test_all_together_and_restored_exactly(family: str, dtype: torch.dtype) -> None:
    model = build(family, dtype)
    model_sites = sites(family)
    fusions = tuple(f for f in MINE if f in model_sites)
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    classes = class_attributes(model)
    config = model.config
    counter = OpCounter()
    want = prefill_and_decode(model)
    with patch(model, where(model_sites, fusions)) as result:
        assert result.skipped == {} and sorted(result.applied) == sorted(fusions)
        got = prefill_and_decode(model, counter)
        plain = prefill_and_decode(model)  # outside a dispatch mode the kernels take their direct launch path
        assert class_attributes(model) == classes
        assert config._attn_implementation == "eager"
        assert all(m.config._attn_implementation == "sdpa" for n, m in model.named_modules() if n.endswith("self_attn"))
    assert_logits_close(got, want, dtype)
    assert all(a.equal(b) for a, b in zip(got, plain, strict=True))
    for fusion in fusions:
        if fusion in KERNEL_OPS:
            assert counter.counts[KERNEL_OPS[fusion]] == 4, fusion
    assert class_attributes(model) == classes
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert all(m.config is config for n, m in model.named_modules() if n.endswith("self_attn"))
    assert {name: p for name, p in model.named_parameters()} == params
    assert all(p.detach().equal(values[name]) for name, p in params.items())
    again = prefill_and_decode(model)
    assert all(a.equal(b) for a, b in zip(again, want, strict=True))


@pytest.mark.parametrize(("family", "fusion"), [("llama", "qkv"), ("qwen2", "qkv"), ("llama", "gate_up")])
def test_fused_weights_cost_no_memory_and_come_back_as_their_own(family: str, fusion: str) -> None:
    model = build(family)
    names = ("q_proj", "k_proj", "v_proj") if fusion == "qkv" else ("gate_proj", "up_proj")
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names]
    params = [(linear.weight, linear.bias) for linear in linears]
    values = [(w.detach().clone(), None if b is None else b.detach().clone()) for w, b in params]
    total = storage_bytes(model)
    with patch(model, where(sites(family), (fusion,))):
        assert storage_bytes(model) == total
        assert not any(owns_its_storage(linear.weight) for linear in linears)  # views of the fused tensor
        if family == "qwen2":
            assert all(linear.bias is not None and not owns_its_storage(linear.bias) for linear in linears)
    assert storage_bytes(model) == total
    for linear, (w, b), (w0, b0) in zip(linears, params, values, strict=True):
        assert linear.weight is w and linear.bias is b
        assert owns_its_storage(w) and w.detach().equal(w0)
        assert b is None or (owns_its_storage(b) and b.detach().equal(b0))
    assert len({linear.weight.untyped_storage().data_ptr() for linear in linears}) == len(linears)


def test_a_projection_called_on_another_input_computes_its_own() -> None:
    """The kept views answer only the input they were computed from: another tensor gets its own GEMM."""
    model = build("llama")
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, 64).to(DEVICE), torch.randn(1, 3, 64).to(DEVICE)
    want = (attn.q_proj(x), attn.k_proj(y), attn.v_proj(x))
    with patch(model, where(sites("llama"), ("qkv",))), torch.no_grad():
        got = (attn.q_proj(x), attn.k_proj(y), attn.v_proj(x))
        x.add_(1.0)  # same object, new version: the kept v view is stale
        moved = attn.v_proj(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(moved, nn.functional.linear(x, attn.v_proj.weight), atol=1e-6, rtol=1e-6)


def test_an_in_place_write_before_the_next_first_projection_is_seen() -> None:
    """Inference tensors have no version counter, so only identity guards the kept views; but the projection called
    first computes the group afresh, so a write between two forwards (each calling q_proj first) is seen."""
    model = build("llama")
    attn = model.model.layers[0].self_attn
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    with patch(model, where(sites("llama"), ("qkv",))), torch.inference_mode():
        x = torch.randn(1, 3, 64).to(DEVICE)
        for linear in linears:  # q_proj computes the group, k_proj and v_proj return their kept views
            linear(x)
        x.mul_(-2.0)  # an inference tensor: no version counter moves
        got = [linear(x) for linear in linears]
        want = [nn.functional.linear(x, linear.weight) for linear in linears]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("family", "refused"), [("llama", set()), ("qwen3", set()), ("phi3", {"rope"})])
def test_training_mode_runs_the_class_forwards_bit_for_bit_with_gradients(family: str, refused: set[str]) -> None:
    """In training mode every rewritten forward (norms, layers, MLPs, projections, attention) runs its class's
    forward: the logits and every gradient are bit-equal to the unpatched model's, and no kernel runs. (flash_attention
    is left out: it switches the attention function through the config, not a forward, and SDPA's sums round
    differently from eager attention's. Phi-3's attention has no rope rewrite.)"""
    model = build(family).train()
    model_sites = sites(family)
    fusions = tuple(f for f in (*MINE, "rms_norm", "add_rms_norm") if f in model_sites and f != "flash_attention")

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = model(PROMPT).logits
        out.float().square().sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run()
    counter = OpCounter()
    with patch(model, where(model_sites, fusions)) as result:
        assert set(result.skipped) == refused and sorted(result.applied) == sorted(set(fusions) - refused)
        with counter:
            got, grads = run()
    assert torch.equal(got, want)
    assert grads.keys() == want_grads.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(grads[n], want_grads[n]) for n in grads)
    assert not [op for op in counter.counts if op.startswith("fusionscope.")]


def test_already_fused_models_are_not_offered_and_their_rope_is_refused() -> None:
    """Phi-3 has one qkv_proj and one gate_up_proj: nothing to fuse. Its attention slices qkv_proj's output, which
    the rope rewrite does not reproduce: refused with that statement."""
    found = sites("phi3")
    assert "qkv" not in found and "gate_up" not in found
    model = build("phi3")
    with patch(model, where(found, ("rope",))) as result:
        assert result.applied == {}
        assert "qkv = self.qkv_proj(hidden_states)" in result.skipped["rope"]
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_softcapping_keeps_eager_attention() -> None:
    """Gemma-2's attention soft-caps its logits; SDPA cannot: flash_attention is refused, the model is unchanged."""
    model = build("gemma2")
    with patch(model, where(sites("gemma2"), ("flash_attention",))) as result:
        assert result.applied == {}
        assert "soft-capping" in result.skipped["flash_attention"]
        assert all(m.config is model.config for n, m in model.named_modules() if n.endswith("self_attn"))


def test_softcapping_off_lets_gemma2_take_sdpa() -> None:
    model = build("gemma2", attn_logit_softcapping=None)
    want = prefill_and_decode(model)
    with patch(model, where(sites("gemma2"), ("flash_attention", "rope"))) as result:
        assert result.skipped == {}
        got = prefill_and_decode(model)
    assert_logits_close(got, want, torch.float32)


@pytest.mark.parametrize(("act", "fusion", "reason"), [("relu", "silu_and_mul", "ReLU has no fused GLU kernel"),
                                                       ("gelu_pytorch_tanh", "silu_and_mul", "is gelu_and_mul's"),
                                                       ("silu", "gelu_and_mul", "is silu_and_mul's")])  # fmt: skip
def test_an_mlp_with_another_activation_is_refused(act: str, fusion: str, reason: str) -> None:
    model = build("llama", hidden_act=act)
    with patch(model, [{"fusion": fusion, "module_paths": ["model.layers.0.mlp"]}]) as result:
        assert result.applied == {} and reason in result.skipped[fusion]
        assert "forward" not in vars(model.model.layers[0].mlp)


@pytest.mark.parametrize(("act", "approximate"), [("gelu_pytorch_tanh", "tanh"), ("gelu", "none"),
                                                  ("gelu_new", "tanh")])  # fmt: skip
def test_gelu_and_mul_takes_its_approximation_from_the_activation(act: str, approximate: str) -> None:
    """The other approximation is further from the MLP's output than the tolerance: the test tells them apart."""
    model = build("llama", hidden_act=act)
    mlp = model.model.layers[1].mlp
    x = 6 * torch.randn(2, 3, 64).to(DEVICE)
    counter = OpCounter()
    with torch.no_grad():
        want = mlp(x)
        other = "none" if approximate == "tanh" else "tanh"
        wrong = mlp.down_proj(nn.functional.gelu(mlp.gate_proj(x), approximate=other) * mlp.up_proj(x))
        with patch(model, [{"fusion": "gelu_and_mul", "module_paths": ["model.layers.1.mlp"]}]) as result, counter:
            got = mlp(x)
    assert result.skipped == {} and counter.counts["fusionscope.gelu_and_mul"] == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(wrong, want, atol=1e-5, rtol=1e-5)


class Llama517Attention(LlamaAttention):
    """LlamaAttention.forward as transformers 5.17 writes it (the GPU machine's version): the cache parameter is
    `past_key_values`, its update takes no `kwargs=`, and no decorator renames anything."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def test_the_517_attention_form_is_read_and_patched() -> None:
    """5.17's cache parameter name and update call are read from the source and reproduced: same outputs and the
    same cache contents as the class's own forward."""
    shape = read_attention(Llama517Attention)
    assert not isinstance(shape, str), shape
    assert (shape.cache_name, shape.update_kwargs, shape.aliases) == ("past_key_values", False, ())
    installed = read_attention(LlamaAttention)
    new_form = "cache" in inspect.signature(LlamaAttention.forward).parameters  # 5.24
    assert (installed.cache_name, installed.update_kwargs) == (
        ("cache", True) if new_form else ("past_key_values", False)
    )
    model = build("llama")
    old = model.model.layers[0].self_attn
    attn = Llama517Attention(model.config, layer_idx=0).to(DEVICE).eval()
    attn.load_state_dict(old.state_dict())
    model.model.layers[0].self_attn = attn
    h = torch.randn(1, 4, 64).to(DEVICE)
    cos, sin = model.model.rotary_emb(h, torch.arange(4, device=DEVICE)[None])
    with torch.no_grad():
        want_cache = DynamicCache(config=model.config)
        want = attn(h, (cos, sin), None, past_key_values=want_cache)[0]
        with patch(model, where(sites("llama"), ("rope",))) as result:
            assert result.skipped == {}
            got_cache = DynamicCache(config=model.config)
            got = attn(h, (cos, sin), None, past_key_values=got_cache)[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got_cache.layers[0].keys.equal(want_cache.layers[0].keys)
    assert got_cache.layers[0].values.equal(want_cache.layers[0].values)


KERNELS_NEED = "the kernels need a CUDA device, or TRITON_INTERPRET=1 on a CPU; this model is on cpu"


def test_kernel_fusions_are_refused_on_a_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU runs the Triton kernels only in the interpreter, chosen by TRITON_INTERPRET=1, which `patch` reads as it
    starts: with "0" every kernel-backed fusion the finder found is refused with that reason at each of its paths and
    nothing of the model is rewritten; flash_attention, torch's SDPA and no bundled kernel, is still applied. The model
    is on the CPU on every machine, since that is the case refused, so no kernel is ever reached."""
    model = build("llama", device=torch.device("cpu"))
    model_sites = sites("llama")  # the finder's paths do not depend on the device
    prompt = PROMPT.cpu()
    want = prefill_and_decode(model, prompt=prompt)
    counter = OpCounter()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with patch(model, where(model_sites, tuple(model_sites))) as result:
        got = prefill_and_decode(model, counter, prompt)
        assert not [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert result.applied == {"flash_attention": model_sites["flash_attention"]}
    assert set(result.skipped) == set(model_sites) - {"flash_attention"}
    assert {"silu_and_mul", "qkv", "gate_up", "rope", "rms_norm", "add_rms_norm"} <= set(result.skipped)
    for fusion, reasons in result.skipped_paths.items():
        assert reasons == dict.fromkeys(model_sites[fusion], KERNELS_NEED), fusion
    assert not [op for op in counter.counts if op.startswith("fusionscope.")]
    assert counter.counts["aten._softmax"] == 0  # SDPA ran instead of eager attention
    assert_logits_close(got, want, torch.float32)
