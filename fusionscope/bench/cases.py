"""The benchmark cases: for each bundled kernel, a shape sweep and the variants it is compared with.

Shapes cover decode (1, 16, 64 rows) and prefill (4096, 32768 rows) at hidden 4096 and 8192, intermediate 14336,
vocab 128256 for `sample`. Variants: `eager` (the unfused form as Hugging Face writes it), `compile`
(torch.compile of that form), `torch` (a fused PyTorch op where one exists, e.g. F.rms_norm), `liger`
(Liger-Kernel, when importable) and `fusionscope` (ours). Every case states its minimal DRAM traffic — each input
read once, each output written once — which is what GB/s and % of copy bandwidth are computed from. Every variant
allocates its outputs, ours included (`out=` would save our call an allocation the peers pay for).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

DECODE_ROWS = (1, 16, 64)
PREFILL_ROWS = (4096, 32768)
HIDDEN = (4096, 8192)
INTERMEDIATE = 14336
VOCAB = 128256
ROPE_HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3-8B)
ROPE_SHAPES = ((1, 1), (16, 1), (64, 1), (1, 4096), (8, 4096))  # (batch, sequence)
CACHE_LEN = 4096  # static KV cache length for rope_and_cache
CACHE_FILL = (0.15, 1.0)  # decode_attention: valid fraction of the CACHE_LEN-row static cache at the measured step
GLU_PREFILL_ROWS = (4096, 16384)
QKV = (4096, (4096, 1024, 1024), (1, 16, 64, 256))  # hidden, output sizes, rows (Llama-3-8B's q, k, v)
LINEAR = (4096, 16384)  # hidden → intermediate of a GPT-style MLP
W4A16_ROWS = (1, 4, 16)  # decode rows of the int4 GEMM (prefill: PREFILL_ROWS[0]); shapes from HIDDEN and INTERMEDIATE
W4A16_GROUP = 128
EPS = 1e-6


@dataclass
class Case:
    """One shape of one kernel, with its inputs built lazily so only one case lives in GPU memory at a time."""

    kernel: str
    label: str
    phase: str  # "decode" | "prefill"
    build: Callable[[torch.device, torch.dtype], dict[str, Any]]
    traffic: Callable[[dict[str, Any]], int]
    variants: dict[str, Callable[[dict[str, Any]], Any]]
    reference: Callable[[dict[str, Any]], Any] | None = None  # float64 reference on the same inputs
    extra: dict[str, Any] = field(default_factory=dict)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kernel_module(name: str):
    return importlib.import_module(f"fusionscope.kernels.{name}")


def _liger(path: str, attr: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{path}"), attr)
    except Exception:
        return None


def _f64(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _phase(rows: int) -> str:
    return "decode" if rows <= max(DECODE_ROWS) else "prefill"


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """One torch.compile wrapper per baseline function, specialised per shape (dynamic=False)."""
    return torch.compile(fn, dynamic=False)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward as Hugging Face writes it (the unfused baseline)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _hf_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + r
    return hf_rms_norm(h, w, EPS), h


def _norm_inputs(rows: int, hidden: int, names: str) -> Callable[[torch.device, torch.dtype], dict[str, Any]]:
    """Inputs of a (rows, hidden) norm: `names` picks x, r (residual), w (weight), b (bias)."""

    def build(dev: torch.device, dt: torch.dtype) -> dict[str, Any]:
        make = {
            "x": lambda: torch.randn(rows, hidden, device=dev, dtype=dt),
            "r": lambda: torch.randn(rows, hidden, device=dev, dtype=dt),
            "w": lambda: torch.rand(hidden, device=dev, dtype=dt) + 0.5,
            "b": lambda: torch.randn(hidden, device=dev, dtype=dt),
        }
        return {name: make[name]() for name in names.split()}

    return build


def rms_norm_case(rows: int, hidden: int, residual: bool = False) -> Case:
    """`residual`: the post-norm variant (OLMo-2's `residual + post_attention_layernorm(x)`), the add in the kernel's
    launch (`rms_norm(..., residual=)`); label suffix "+r". Its reference rounds the fp64 norm to the input dtype
    before the add, as the stored norm is rounded."""
    mod = kernel_module("rms_norm")
    if residual:
        return _rms_norm_residual_case(mod, rows, hidden)
    variants: dict[str, Callable] = {
        "eager": lambda i: hf_rms_norm(i["x"], i["w"], EPS),
        "compile": lambda i: _compiled(hf_rms_norm)(i["x"], i["w"], EPS),
        "torch": lambda i: F.rms_norm(i["x"], (i["x"].shape[-1],), i["w"], EPS),
        "fusionscope": lambda i: mod.rms_norm(i["x"], i["w"], EPS),
    }
    if liger := _liger("rms_norm", "LigerRMSNormFunction"):
        variants["liger"] = lambda i: liger.apply(i["x"], i["w"], EPS, 0.0, "llama", False)
    return Case(
        "rms_norm",
        f"{rows}x{hidden}",
        _phase(rows),
        build=_norm_inputs(rows, hidden, "x w"),
        traffic=lambda i: nbytes(i["x"], i["w"]) + nbytes(i["x"]),
        variants=variants,
        reference=lambda i: mod.rms_norm_reference(**_ref_args(_f64(i), ("x", "w")), eps=EPS),
    )


def _hf_rms_norm_residual(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return r + hf_rms_norm(x, w, EPS)


def _rms_norm_residual_case(mod: Any, rows: int, hidden: int) -> Case:
    def reference(i: dict[str, Any]) -> torch.Tensor:
        norm = mod.rms_norm_reference(i["x"].double(), i["w"].double(), EPS).to(i["x"].dtype)
        return i["r"].double() + norm.double()

    variants: dict[str, Callable] = {
        "eager": lambda i: _hf_rms_norm_residual(i["x"], i["r"], i["w"]),
        "compile": lambda i: _compiled(_hf_rms_norm_residual)(i["x"], i["r"], i["w"]),
        "torch": lambda i: i["r"] + F.rms_norm(i["x"], (i["x"].shape[-1],), i["w"], EPS),
        "fusionscope": lambda i: mod.rms_norm(i["x"], i["w"], EPS, residual=i["r"]),
    }
    return Case(
        "rms_norm",
        f"{rows}x{hidden}+r",
        _phase(rows),
        build=_norm_inputs(rows, hidden, "x r w"),
        traffic=lambda i: 3 * nbytes(i["x"]) + nbytes(i["w"]),
        variants=variants,
        reference=reference,
    )


def _ref_args(inputs: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    names = {"x": "x", "w": "weight", "r": "residual", "b": "bias", "g": "gate", "u": "up"}
    return {names[k]: inputs[k] for k in keys}


def add_rms_norm_case(rows: int, hidden: int) -> Case:
    mod = kernel_module("add_rms_norm")
    variants: dict[str, Callable] = {
        "eager": lambda i: _hf_add_rms_norm(i["x"], i["r"], i["w"]),
        "compile": lambda i: _compiled(_hf_add_rms_norm)(i["x"], i["r"], i["w"]),
        "torch": lambda i: F.rms_norm(i["x"] + i["r"], (i["x"].shape[-1],), i["w"], EPS),
        "fusionscope": lambda i: mod.add_rms_norm(i["x"], i["r"], i["w"], EPS),
    }
    if liger := _liger("fused_add_rms_norm", "LigerFusedAddRMSNormFunction"):
        variants["liger"] = lambda i: liger.apply(i["x"], i["r"], i["w"], EPS, 0.0, "llama", False)
    return Case(
        "add_rms_norm",
        f"{rows}x{hidden}",
        _phase(rows),
        build=_norm_inputs(rows, hidden, "x r w"),
        traffic=lambda i: 4 * nbytes(i["x"]) + nbytes(i["w"]),
        variants=variants,
        reference=lambda i: mod.add_rms_norm_reference(**_ref_args(_f64(i), ("x", "r", "w")), eps=EPS),
    )


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def _gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.gelu(g, approximate="tanh") * u


GLU = {  # kernel → (HF's eager form, Liger's op, extra kernel arguments)
    "silu_and_mul": (_silu_mul, ("swiglu", "LigerSiLUMulFunction"), {}),
    "gelu_and_mul": (_gelu_tanh_mul, ("geglu", "LigerGELUMulFunction"), {"approximate": "tanh"}),
}


def glu_case(name: str, rows: int, width: int) -> Case:
    mod = kernel_module(name)
    fused = getattr(mod, name)
    eager, liger_name, extra = GLU[name]
    variants: dict[str, Callable] = {
        "eager": lambda i: eager(i["g"], i["u"]),
        "compile": lambda i: _compiled(eager)(i["g"], i["u"]),
        "fusionscope": lambda i: fused(i["g"], i["u"], **extra),
    }
    if liger := _liger(*liger_name):
        variants["liger"] = lambda i: liger.apply(i["g"], i["u"])
    return Case(
        name,
        f"{rows}x{width}",
        _phase(rows),
        build=lambda dev, dt: {
            "g": torch.randn(rows, width, device=dev, dtype=dt),
            "u": torch.randn(rows, width, device=dev, dtype=dt),
        },
        traffic=lambda i: 3 * nbytes(i["g"]),
        variants=variants,
        reference=lambda i: getattr(mod, f"{name}_reference")(_f64(i)["g"], _f64(i)["u"], **extra),
    )


def hf_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def _rope_inputs(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dev: torch.device, dt: torch.dtype):
    """q, k (and v) as Hugging Face produces them: (B, S, H, D) projections viewed as (B, H, S, D); cos, sin."""

    def proj(h: int) -> torch.Tensor:
        return torch.randn(batch, seq, h, dim, device=dev, dtype=dt).transpose(1, 2)

    angles = torch.rand(batch, seq, dim // 2, device=dev) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    return {
        "q": proj(heads),
        "k": proj(kv_heads),
        "v": proj(kv_heads),
        "cos": emb.cos().to(dt),
        "sin": emb.sin().to(dt),
    }


def rope_case(batch: int, seq: int, heads: int, kv_heads: int, dim: int) -> Case:
    mod = kernel_module("rope")
    variants: dict[str, Callable] = {
        "eager": lambda i: hf_rope(i["q"], i["k"], i["cos"], i["sin"]),
        "compile": lambda i: _compiled(hf_rope)(i["q"], i["k"], i["cos"], i["sin"]),
        "fusionscope": lambda i: mod.rope(i["q"], i["k"], i["cos"], i["sin"]),
    }
    if liger := _liger("rope", "LigerRopeFunction"):
        variants["liger"] = lambda i: liger.apply(i["q"], i["k"], i["cos"], i["sin"])
    return Case(
        "rope",
        f"B{batch} S{seq} H{heads}/{kv_heads} D{dim}",
        "decode" if seq == 1 else "prefill",
        build=lambda dev, dt: _rope_inputs(batch, seq, heads, kv_heads, dim, dev, dt),
        traffic=lambda i: 2 * nbytes(i["q"], i["k"]) + nbytes(i["cos"], i["sin"]),
        variants=variants,
        reference=lambda i: mod.rope_reference(*(_f64(i)[n] for n in ("q", "k", "cos", "sin"))),
    )


def rope_and_cache_case(batch: int, heads: int, kv_heads: int, dim: int, cache_len: int) -> Case:
    """Decode: rotate q and k and write k and v into a static cache — HF's rope then StaticCache's two
    index_copy_ calls vs one launch."""
    mod = kernel_module("rope")

    def eager(i: dict[str, Any]) -> torch.Tensor:
        q, k = hf_rope(i["q"], i["k"], i["cos"], i["sin"])
        i["kc"].index_copy_(2, i["pos"], k)
        i["vc"].index_copy_(2, i["pos"], i["v"])
        return q

    def build(dev: torch.device, dt: torch.dtype) -> dict[str, Any]:
        return {
            **_rope_inputs(batch, 1, heads, kv_heads, dim, dev, dt),
            "kc": torch.randn(batch, kv_heads, cache_len, dim, device=dev, dtype=dt),
            "vc": torch.randn(batch, kv_heads, cache_len, dim, device=dev, dtype=dt),
            "pos": torch.tensor([cache_len // 2 + 1], device=dev),
        }

    return Case(
        "rope_and_cache",
        f"B{batch} S1 H{heads}/{kv_heads} D{dim} cache{cache_len}",
        "decode",
        build=build,
        traffic=lambda i: 2 * nbytes(i["q"], i["k"], i["v"]) + nbytes(i["cos"], i["sin"]),
        variants={
            "eager": eager,
            "fusionscope": lambda i: mod.rope_and_cache(
                *(i[n] for n in ("q", "k", "v", "cos", "sin", "kc", "vc", "pos"))
            ),
        },
        reference=lambda i: mod.rope_reference(*(_f64(i)[n] for n in ("q", "k", "cos", "sin")))[0],
    )


def hf_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Hugging Face's sdpa path on a StaticCache at decode: `repeat_kv` copies of the whole cache, a boolean mask of
    the valid rows, SDPA, then `sdpa_attention_forward`'s `.transpose(1, 2).contiguous()`."""
    from transformers.models.llama.modeling_llama import repeat_kv

    groups = q.shape[1] // k_cache.shape[1]
    out = F.scaled_dot_product_attention(
        q, repeat_kv(k_cache, groups), repeat_kv(v_cache, groups), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2).contiguous()


def decode_attention_case(batch: int, heads: int, kv_heads: int, dim: int, cache_len: int, fill: float) -> Case:
    """One query token per sequence against a static cache with `length` = fill · cache_len valid rows: HF's sdpa
    path (repeat_kv, mask, SDPA over all cache_len rows), PyTorch's SDPA with `enable_gqa` and the mask, and ours
    (one launch reading rows 0..length-1 of K and V once, `length` read on the device). Traffic: q, the valid K and
    V rows, the output."""
    mod = kernel_module("decode_attention")
    length = max(1, min(cache_len, round(fill * cache_len)))
    scale = dim**-0.5

    def build(dev: torch.device, dt: torch.dtype) -> dict[str, Any]:
        return {
            "q": torch.randn(batch, 1, heads, dim, device=dev, dtype=dt).transpose(1, 2),
            "kc": torch.randn(batch, kv_heads, cache_len, dim, device=dev, dtype=dt),
            "vc": torch.randn(batch, kv_heads, cache_len, dim, device=dev, dtype=dt),
            "length": torch.tensor([length], device=dev),
            "mask": (torch.arange(cache_len, device=dev) < length).expand(batch, 1, 1, cache_len),
        }

    def torch_gqa(i: dict[str, Any]) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            i["q"], i["kc"], i["vc"], attn_mask=i["mask"], scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous()

    return Case(
        "decode_attention",
        f"B{batch} H{heads}/{kv_heads} D{dim} len{length}/{cache_len}",
        "decode",
        build=build,
        traffic=lambda i: 2 * nbytes(i["q"]) + 2 * nbytes(i["kc"][:, :, :length]),
        variants={
            "eager": lambda i: hf_decode_attention(i["q"], i["kc"], i["vc"], i["mask"], scale),
            "compile": lambda i: _compiled(hf_decode_attention)(i["q"], i["kc"], i["vc"], i["mask"], scale),
            "torch": torch_gqa,
            "fusionscope": lambda i: mod.decode_attention(i["q"], i["kc"], i["vc"], i["length"], scale),
        },
        reference=lambda i: mod.decode_attention_reference(
            *(_f64(i)[n] for n in ("q", "kc", "vc")), i["length"], scale
        ),
        extra={"length": length},
    )


def _hf_add_layer_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    h = x + r
    return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h


def add_layer_norm_case(rows: int, hidden: int) -> Case:
    mod = kernel_module("add_layer_norm")
    variants: dict[str, Callable] = {
        "eager": lambda i: _hf_add_layer_norm(i["x"], i["r"], i["w"], i["b"]),
        "compile": lambda i: _compiled(_hf_add_layer_norm)(i["x"], i["r"], i["w"], i["b"]),
        "fusionscope": lambda i: mod.add_layer_norm(i["x"], i["r"], i["w"], i["b"], EPS),
    }
    if liger := _liger("layer_norm", "LigerLayerNormFunction"):
        variants["liger"] = lambda i: liger.apply(i["x"] + i["r"], i["w"], i["b"], EPS)
    return Case(
        "add_layer_norm",
        f"{rows}x{hidden}",
        _phase(rows),
        build=_norm_inputs(rows, hidden, "x r w b"),
        traffic=lambda i: 4 * nbytes(i["x"]) + nbytes(i["w"], i["b"]),
        variants=variants,
        reference=lambda i: mod.add_layer_norm_reference(**_ref_args(_f64(i), ("x", "r", "w", "b")), eps=EPS),
    )


def _hf_add_layer_norm_pair(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor, w2: torch.Tensor,
                            b2: torch.Tensor):  # fmt: skip
    h = x + r
    return F.layer_norm(h, (h.shape[-1],), w, b, EPS), F.layer_norm(h, (h.shape[-1],), w2, b2, EPS), h


def add_layer_norm_pair_case(rows: int, hidden: int) -> Case:
    """GPT-NeoX's parallel block: the residual add and both LayerNorms of the sum."""
    mod = kernel_module("add_layer_norm")
    first, second = _norm_inputs(rows, hidden, "x r w b"), _norm_inputs(rows, hidden, "w b")
    names = ("x", "r", "w", "b", "w2", "b2")

    def build(dev: torch.device, dt: torch.dtype) -> dict[str, Any]:
        two = second(dev, dt)
        return {**first(dev, dt), "w2": two["w"], "b2": two["b"]}

    return Case(
        "add_layer_norm_pair",
        f"{rows}x{hidden}",
        _phase(rows),
        build=build,
        traffic=lambda i: 5 * nbytes(i["x"]) + nbytes(i["w"], i["b"], i["w2"], i["b2"]),
        variants={
            "eager": lambda i: _hf_add_layer_norm_pair(*(i[n] for n in names)),
            "compile": lambda i: _compiled(_hf_add_layer_norm_pair)(*(i[n] for n in names)),
            "fusionscope": lambda i: mod.add_layer_norm_pair(*(i[n] for n in names), EPS),
        },
        reference=lambda i: mod.add_layer_norm_pair_reference(*(_f64(i)[n] for n in names), EPS),
    )


def _bias_gelu_tanh(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b, approximate="tanh")


def bias_gelu_case(rows: int, width: int) -> Case:
    mod = kernel_module("bias_gelu")
    return Case(
        "bias_gelu",
        f"{rows}x{width}",
        _phase(rows),
        build=lambda dev, dt: {
            "x": torch.randn(rows, width, device=dev, dtype=dt),
            "b": torch.randn(width, device=dev, dtype=dt),
        },
        traffic=lambda i: 2 * nbytes(i["x"]) + nbytes(i["b"]),
        variants={
            "eager": lambda i: _bias_gelu_tanh(i["x"], i["b"]),
            "compile": lambda i: _compiled(_bias_gelu_tanh)(i["x"], i["b"]),
            "fusionscope": lambda i: mod.bias_gelu(i["x"], i["b"], approximate="tanh"),
        },
        reference=lambda i: mod.bias_gelu_reference(_f64(i)["x"], _f64(i)["b"], approximate="tanh"),
    )


def linear_act_case(rows: int, hidden: int, width: int, activation: str = "gelu_tanh") -> Case:
    mod = kernel_module("linear_act")
    return Case(
        "linear_act",
        f"{rows}x{hidden}->{width} {activation}",
        _phase(rows),
        build=lambda dev, dt: {
            "x": torch.randn(rows, hidden, device=dev, dtype=dt),
            "w": torch.randn(width, hidden, device=dev, dtype=dt) / hidden**0.5,
            "b": torch.randn(width, device=dev, dtype=dt),
        },
        traffic=lambda i: nbytes(i["x"], i["w"], i["b"]) + i["x"].shape[0] * i["w"].shape[0] * i["x"].element_size(),
        variants={
            "eager": lambda i: mod.linear_act_unfused(i["x"], i["w"], i["b"], activation),
            "fusionscope": lambda i: mod.linear_act(i["x"], i["w"], i["b"], activation),
        },
        reference=lambda i: mod.linear_act_reference(_f64(i)["x"], _f64(i)["w"], _f64(i)["b"], activation),
    )


def gemv_case(hidden: int, width: int, bias: bool = False) -> Case:
    """One row through a Linear: cuBLAS (`F.linear`) vs the streaming GEMV."""
    mod = kernel_module("gemv")
    return Case(
        "gemv",
        f"1x{hidden}->{width}{' +b' if bias else ''}",
        "decode",
        build=lambda dev, dt: {
            "x": torch.randn(1, hidden, device=dev, dtype=dt),
            "w": torch.randn(width, hidden, device=dev, dtype=dt) / hidden**0.5,
            "b": torch.randn(width, device=dev, dtype=dt) if bias else None,
        },
        traffic=lambda i: (
            nbytes(*(t for t in (i["x"], i["w"], i["b"]) if t is not None)) + width * i["x"].element_size()
        ),
        variants={
            "eager": lambda i: F.linear(i["x"], i["w"], i["b"]),
            "fusionscope": lambda i: mod.gemv(i["x"], i["w"], i["b"]),
        },
        reference=lambda i: mod.gemv_reference(_f64(i)["x"], _f64(i)["w"], _f64(i)["b"]),
    )


def _torchao_int4(group_size: int) -> tuple[Callable[[torch.Tensor], Any] | None, str]:
    """(a builder of torchao's int4 weight-only Linear from a float (N, K) weight, torchao's version), or (None, why
    it is not available here)."""
    try:
        import torchao
        from torchao.quantization import quantize_
    except Exception as exc:
        return None, f"torchao is not importable here ({type(exc).__name__}: {exc})"
    try:
        from torchao.quantization import Int4WeightOnlyConfig as config
    except ImportError:  # torchao before 0.10 named it as a function
        from torchao.quantization import int4_weight_only as config

    def make(weight: torch.Tensor) -> torch.nn.Module:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        linear.weight.data.copy_(weight)
        quantize_(linear, config(group_size=group_size))
        return linear

    return make, str(torchao.__version__)


def w4a16_case(rows: int, K: int, N: int, group_size: int = W4A16_GROUP) -> Case:
    """x (rows, K) @ an int4 (K → N) weight quantised from a random one: our fused kernel vs the unfused chain
    (`eager`: dequantise into a full weight, then cuBLAS), cuBLAS on the float weight before quantisation
    (`unquantized`; its max_err is the quantisation's, not a kernel's) and torchao's int4 weight-only GEMM where torchao
    imports (its version in the variant's name; where it does not, the `torchao` variant fails saying so). Traffic is
    what the fused kernel reads and writes: x, the packed weight, scales, zeros and the output."""
    mod = kernel_module("w4a16_gemm")
    make_torchao, torchao_version = _torchao_int4(group_size)

    def build(dev: torch.device, dt: torch.dtype) -> dict[str, Any]:
        w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        packed = mod.quantize_w4(w, group_size)
        return {"x": torch.randn(rows, K, device=dev, dtype=dt), "w": w, "qweight": packed.qweight,
                "scales": packed.scales, "zeros": packed.zeros}  # fmt: skip

    def packed(i: dict[str, Any]) -> tuple:
        return i["x"], i["qweight"], i["scales"], i["zeros"], group_size

    def torchao(i: dict[str, Any]) -> torch.Tensor:
        if make_torchao is None:
            raise RuntimeError(torchao_version)
        if "torchao" not in i:
            i["torchao"] = make_torchao(i["w"])
        return i["torchao"](i["x"])

    return Case(
        "w4a16_gemm",
        f"{rows}x{K}->{N} g{group_size}",
        "decode" if rows <= max(W4A16_ROWS) else "prefill",
        build=build,
        traffic=lambda i: nbytes(i["x"], i["qweight"], i["scales"], i["zeros"]) + rows * N * i["x"].element_size(),
        variants={
            "eager": lambda i: mod.w4a16_reference(*packed(i)),
            "fusionscope": lambda i: mod.w4a16_gemm(*packed(i)),
            "unquantized": lambda i: F.linear(i["x"], i["w"]),
            f"torchao-{torchao_version}" if make_torchao else "torchao": torchao,
        },
        reference=lambda i: mod.w4a16_reference(_f64(i)["x"], i["qweight"], _f64(i)["scales"], i["zeros"], group_size),
        extra={"group_size": group_size, "torchao": torchao_version},
    )


def hf_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Hugging Face's logits-processor chain as `generate()` applies it, then softmax and multinomial."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(temperature)(None, logits)
    scores = TopKLogitsWarper(top_k)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)


SAMPLING = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}


def _one_launch(mod: Any, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run `call` with `sample`'s two-launch candidates path switched off (the one-launch kernel, for comparison)."""
    enabled = mod.TWO_STAGE["enabled"]
    mod.TWO_STAGE["enabled"] = False
    try:
        return call()
    finally:
        mod.TWO_STAGE["enabled"] = enabled


def sample_case(batch: int, vocab: int, settings: dict[str, float] | None = None) -> Case:
    mod = kernel_module("sample")
    settings = settings or SAMPLING
    t, k, p = settings["temperature"], settings["top_k"], settings["top_p"]
    return Case(
        "sample",
        f"B{batch} V{vocab} T{t:g} k{k} p{p:g}",
        "decode",
        build=lambda dev, dt: {"logits": torch.randn(batch, vocab, device=dev, dtype=dt) * 3},
        traffic=lambda i: nbytes(i["logits"]) + i["logits"].shape[0] * 8,
        variants={
            "eager": lambda i: hf_sample(i["logits"].float(), **settings),
            "fusionscope": lambda i: mod.sample(i["logits"], **settings),
            "fusionscope-1launch": lambda i: _one_launch(mod, lambda: mod.sample(i["logits"], **settings)),
        },
        extra={"settings": settings},
    )


def horizontal_case(kernel: str, rows: int, hidden: int, sizes: tuple[int, ...]) -> Case:
    """n Linears on one input (q/k/v, gate/up) as n GEMMs vs one GEMM over the concatenated weights."""
    mod = kernel_module("horizontal")

    def build(dev: torch.device, dt: torch.dtype) -> dict[str, Any]:
        linears = [torch.nn.Linear(hidden, n, bias=False, device=dev, dtype=dt) for n in sizes]
        separate = [torch.nn.Linear(hidden, n, bias=False, device=dev, dtype=dt) for n in sizes]
        for a, b in zip(separate, linears):
            a.weight.data.copy_(b.weight.data)
        return {"x": torch.randn(rows, hidden, device=dev, dtype=dt), "separate": separate,
                "fused": mod.fuse_linears(linears)}  # fmt: skip

    return Case(
        kernel,
        f"{rows}x{hidden}->{'+'.join(map(str, sizes))}",
        _phase(rows),
        build=build,
        traffic=lambda i: (
            nbytes(i["x"])
            + sum(nbytes(lin.weight) for lin in i["separate"])
            + rows * sum(sizes) * i["x"].element_size()
        ),
        variants={
            "eager": lambda i: tuple(lin(i["x"]) for lin in i["separate"]),
            "fusionscope": lambda i: i["fused"](i["x"]),
        },
    )


def _rows_sweep() -> Iterator[tuple[int, int]]:
    for hidden in HIDDEN:
        for rows in DECODE_ROWS + PREFILL_ROWS:
            yield rows, hidden


def rms_norm_cases() -> list[Case]:
    """The sweep, then the same shapes with the residual operand (a post-norm layer's add)."""
    return [rms_norm_case(rows, hidden, residual) for residual in (False, True) for rows, hidden in _rows_sweep()]


def add_rms_norm_cases() -> list[Case]:
    return [add_rms_norm_case(rows, hidden) for rows, hidden in _rows_sweep()]


def silu_and_mul_cases() -> list[Case]:
    return [glu_case("silu_and_mul", rows, INTERMEDIATE) for rows in (*DECODE_ROWS, *GLU_PREFILL_ROWS)]


def gelu_and_mul_cases() -> list[Case]:
    return [glu_case("gelu_and_mul", rows, INTERMEDIATE) for rows in (*DECODE_ROWS, *GLU_PREFILL_ROWS)]


def rope_cases() -> list[Case]:
    return [rope_case(batch, seq, *ROPE_HEADS) for batch, seq in ROPE_SHAPES]


def rope_and_cache_cases() -> list[Case]:
    return [rope_and_cache_case(batch, *ROPE_HEADS, CACHE_LEN) for batch in DECODE_ROWS]


def decode_attention_cases() -> list[Case]:
    """Llama-3-8B's heads (ROPE_HEADS) on a CACHE_LEN-row static cache, at each decode batch and cache fill."""
    return [decode_attention_case(batch, *ROPE_HEADS, CACHE_LEN, fill) for batch in DECODE_ROWS for fill in CACHE_FILL]


def add_layer_norm_cases() -> list[Case]:
    return [
        case(rows, hidden) for rows, hidden in _rows_sweep() for case in (add_layer_norm_case, add_layer_norm_pair_case)
    ]


def bias_gelu_cases() -> list[Case]:
    # GPT-2-style MLP: the activation runs on the 4×hidden intermediate; 32768 × 32768 would be 2 GiB per bf16
    # tensor, and the 4096-row case is already memory-bound, so prefill stops at PREFILL_ROWS[0]
    return [bias_gelu_case(rows, 4 * hidden) for rows, hidden in _rows_sweep() if rows <= PREFILL_ROWS[0]]


def linear_act_cases() -> list[Case]:
    return [linear_act_case(rows, *LINEAR) for rows in (*DECODE_ROWS, PREFILL_ROWS[0])]


def gemv_cases() -> list[Case]:
    """Llama-3-8B's o_proj and down_proj, and Phi-3-mini's o_proj (3072 wide), at one row."""
    return [gemv_case(HIDDEN[0], HIDDEN[0]), gemv_case(INTERMEDIATE, HIDDEN[0]), gemv_case(3072, 3072, bias=True)]


def w4a16_gemm_cases() -> list[Case]:
    """Llama-3-8B's projections at decode and prefill rows: hidden → hidden, hidden → intermediate, intermediate →
    hidden."""
    hidden = HIDDEN[0]
    shapes = ((hidden, hidden), (hidden, INTERMEDIATE), (INTERMEDIATE, hidden))
    return [w4a16_case(rows, K, N) for K, N in shapes for rows in (*W4A16_ROWS, PREFILL_ROWS[0])]


def sample_cases() -> list[Case]:
    return [sample_case(batch, VOCAB) for batch in (1, 64)]


def qkv_cases() -> list[Case]:
    hidden, sizes, all_rows = QKV
    return [horizontal_case("qkv", rows, hidden, sizes) for rows in all_rows]


CASES: dict[str, Callable[[], list[Case]]] = {
    "rms_norm": rms_norm_cases,
    "add_rms_norm": add_rms_norm_cases,
    "silu_and_mul": silu_and_mul_cases,
    "gelu_and_mul": gelu_and_mul_cases,
    "rope": rope_cases,
    "rope_and_cache": rope_and_cache_cases,
    "decode_attention": decode_attention_cases,
    "add_layer_norm": add_layer_norm_cases,
    "bias_gelu": bias_gelu_cases,
    "linear_act": linear_act_cases,
    "gemv": gemv_cases,
    "w4a16_gemm": w4a16_gemm_cases,
    "sample": sample_cases,
    "qkv": qkv_cases,
}
