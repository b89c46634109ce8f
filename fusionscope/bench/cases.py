"""The benchmark cases: for each bundled kernel, a shape sweep and the variants it is compared with.

Shapes cover decode (1, 16, 64 rows) and prefill (4096, 32768 rows) at hidden 4096 and 8192, intermediate 14336,
vocab 128256 for `sample`. Variants: `eager` (the unfused form as Hugging Face writes it), `compile`
(torch.compile of that form), `torch` (a fused PyTorch op where one exists, e.g. F.rms_norm), `liger`
(Liger-Kernel, when importable) and `fusionscope` (ours). Every case states its minimal DRAM traffic — each input
read once, each output written once — which is what GB/s and % of copy bandwidth are computed from.
"""

from __future__ import annotations

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
GLU_PREFILL_ROWS = (4096, 16384)
QKV = (4096, (4096, 1024, 1024), (1, 16, 64, 256))  # hidden, output sizes, rows (Llama-3-8B's q, k, v)
LINEAR = (4096, 16384)  # hidden → intermediate of a GPT-style MLP
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


def _rows_sweep() -> Iterator[tuple[str, int, int]]:
    for hidden in HIDDEN:
        for rows in DECODE_ROWS + PREFILL_ROWS:
            yield ("decode" if rows in DECODE_ROWS else "prefill"), rows, hidden


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward as Hugging Face writes it (the unfused baseline)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def rms_norm_cases() -> list[Case]:
    mod = kernel_module("rms_norm")
    liger = _liger("rms_norm", "LigerRMSNormFunction")
    compiled = _compiled(hf_rms_norm)
    cases = []
    for phase, rows, hidden in _rows_sweep():
        variants: dict[str, Callable] = {
            "eager": lambda i: hf_rms_norm(i["x"], i["w"], EPS),
            "compile": lambda i: compiled(i["x"], i["w"], EPS),
            "torch": lambda i: F.rms_norm(i["x"], (i["x"].shape[-1],), i["w"], EPS),
            "fusionscope": lambda i: mod.rms_norm(i["x"], i["w"], EPS, out=i["out"]),
        }
        if liger:
            variants["liger"] = lambda i, f=liger: f.apply(i["x"], i["w"], EPS, 0.0, "llama", False)
        cases.append(
            Case(
                "rms_norm",
                f"{rows}x{hidden}",
                phase,
                build=lambda dev, dt, r=rows, h=hidden: {
                    "x": torch.randn(r, h, device=dev, dtype=dt),
                    "w": torch.rand(h, device=dev, dtype=dt) + 0.5,
                    "out": torch.empty(r, h, device=dev, dtype=dt),
                },
                traffic=lambda i: nbytes(i["x"], i["w"]) + nbytes(i["x"]),
                variants=variants,
                reference=lambda i: mod.rms_norm_reference(**_ref_args(_f64(i), ("x", "w")), eps=EPS),
            )
        )
    return cases


def _ref_args(inputs: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    names = {"x": "x", "w": "weight", "r": "residual", "b": "bias", "g": "gate", "u": "up"}
    return {names[k]: inputs[k] for k in keys}


def add_rms_norm_cases() -> list[Case]:
    mod = kernel_module("add_rms_norm")
    liger = _liger("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")

    def eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r
        return hf_rms_norm(h, w, EPS), h

    compiled = _compiled(eager)
    cases = []
    for phase, rows, hidden in _rows_sweep():
        variants: dict[str, Callable] = {
            "eager": lambda i: eager(i["x"], i["r"], i["w"]),
            "compile": lambda i: compiled(i["x"], i["r"], i["w"]),
            "torch": lambda i: F.rms_norm(i["x"] + i["r"], (i["x"].shape[-1],), i["w"], EPS),
            "fusionscope": lambda i: mod.add_rms_norm(i["x"], i["r"], i["w"], EPS, out=(i["out"], i["res"])),
        }
        if liger:
            variants["liger"] = lambda i, f=liger: f.apply(i["x"], i["r"], i["w"], EPS, 0.0, "llama", False)
        cases.append(
            Case(
                "add_rms_norm",
                f"{rows}x{hidden}",
                phase,
                build=lambda dev, dt, r=rows, h=hidden: {
                    "x": torch.randn(r, h, device=dev, dtype=dt),
                    "r": torch.randn(r, h, device=dev, dtype=dt),
                    "w": torch.rand(h, device=dev, dtype=dt) + 0.5,
                    "out": torch.empty(r, h, device=dev, dtype=dt),
                    "res": torch.empty(r, h, device=dev, dtype=dt),
                },
                traffic=lambda i: 4 * nbytes(i["x"]) + nbytes(i["w"]),
                variants=variants,
                reference=lambda i: mod.add_rms_norm_reference(**_ref_args(_f64(i), ("x", "r", "w")), eps=EPS),
            )
        )
    return cases


def _glu_cases(
    name: str, act: Callable[[torch.Tensor], torch.Tensor], liger: Callable | None, extra: dict[str, Any]
) -> list[Case]:
    mod = kernel_module(name)
    fused = getattr(mod, name)

    def eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return act(g) * u

    compiled = _compiled(eager)
    cases = []
    for rows in (*DECODE_ROWS, *GLU_PREFILL_ROWS):
        variants: dict[str, Callable] = {
            "eager": lambda i: eager(i["g"], i["u"]),
            "compile": lambda i: compiled(i["g"], i["u"]),
            "fusionscope": lambda i: fused(i["g"], i["u"], out=i["out"], **extra),
        }
        if liger:
            variants["liger"] = lambda i, f=liger: f.apply(i["g"], i["u"])
        cases.append(
            Case(
                name,
                f"{rows}x{INTERMEDIATE}",
                "decode" if rows in DECODE_ROWS else "prefill",
                build=lambda dev, dt, r=rows: {
                    "g": torch.randn(r, INTERMEDIATE, device=dev, dtype=dt),
                    "u": torch.randn(r, INTERMEDIATE, device=dev, dtype=dt),
                    "out": torch.empty(r, INTERMEDIATE, device=dev, dtype=dt),
                },
                traffic=lambda i: 3 * nbytes(i["g"]),
                variants=variants,
                reference=lambda i: getattr(mod, f"{name}_reference")(_f64(i)["g"], _f64(i)["u"], **extra),
            )
        )
    return cases


def silu_and_mul_cases() -> list[Case]:
    return _glu_cases("silu_and_mul", F.silu, _liger("swiglu", "LigerSiLUMulFunction"), {})


def gelu_and_mul_cases() -> list[Case]:
    return _glu_cases(
        "gelu_and_mul",
        lambda g: F.gelu(g, approximate="tanh"),
        _liger("geglu", "LigerGELUMulFunction"),
        {"approximate": "tanh"},
    )


def hf_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def rope_cases() -> list[Case]:
    mod = kernel_module("rope")
    liger = _liger("rope", "LigerRopeFunction")
    compiled = _compiled(hf_rope)
    heads, kv_heads, dim = ROPE_HEADS
    cases = []
    for batch, seq in ROPE_SHAPES:
        variants: dict[str, Callable] = {
            "eager": lambda i: hf_rope(i["q"], i["k"], i["cos"], i["sin"]),
            "compile": lambda i: compiled(i["q"], i["k"], i["cos"], i["sin"]),
            "fusionscope": lambda i: mod.rope(i["q"], i["k"], i["cos"], i["sin"]),
        }
        if liger:
            variants["liger"] = lambda i, f=liger: f.apply(i["q"], i["k"], i["cos"], i["sin"])

        def build(dev: torch.device, dt: torch.dtype, b: int = batch, s: int = seq) -> dict[str, Any]:
            # q, k as Hugging Face produces them: (B, S, H, D) projections viewed as (B, H, S, D)
            q = torch.randn(b, s, heads, dim, device=dev, dtype=dt).transpose(1, 2)
            k = torch.randn(b, s, kv_heads, dim, device=dev, dtype=dt).transpose(1, 2)
            angles = torch.rand(b, s, dim // 2, device=dev) * 6.28
            emb = torch.cat((angles, angles), dim=-1)
            return {"q": q, "k": k, "cos": emb.cos().to(dt), "sin": emb.sin().to(dt)}

        cases.append(
            Case(
                "rope",
                f"B{batch} S{seq} H{heads}/{kv_heads} D{dim}",
                "decode" if seq == 1 else "prefill",
                build=build,
                traffic=lambda i: 2 * nbytes(i["q"], i["k"]) + nbytes(i["cos"], i["sin"]),
                variants=variants,
                reference=lambda i: mod.rope_reference(**{k: v for k, v in _f64(i).items()}),
            )
        )
    return cases


def rope_and_cache_cases() -> list[Case]:
    """Decode: rotate q and k and write k and v into a static cache (S_max 4096) — HF's rope then StaticCache's two
    index_copy_ calls (3 launches of HF's rope chain aside) vs one launch."""
    mod = kernel_module("rope")
    heads, kv_heads, dim = ROPE_HEADS
    cache_len = CACHE_LEN

    def eager(i: dict[str, Any]) -> torch.Tensor:
        q, k = hf_rope(i["q"], i["k"], i["cos"], i["sin"])
        i["kc"].index_copy_(2, i["pos"], k)
        i["vc"].index_copy_(2, i["pos"], i["v"])
        return q

    cases = []
    for batch in (1, 16, 64):

        def build(dev: torch.device, dt: torch.dtype, b: int = batch) -> dict[str, Any]:
            def proj(h: int) -> torch.Tensor:
                return torch.randn(b, 1, h, dim, device=dev, dtype=dt).transpose(1, 2)

            angles = torch.rand(b, 1, dim // 2, device=dev) * 6.28
            emb = torch.cat((angles, angles), dim=-1)
            return {
                "q": proj(heads), "k": proj(kv_heads), "v": proj(kv_heads),
                "cos": emb.cos().to(dt), "sin": emb.sin().to(dt),
                "kc": torch.randn(b, kv_heads, cache_len, dim, device=dev, dtype=dt),
                "vc": torch.randn(b, kv_heads, cache_len, dim, device=dev, dtype=dt),
                "pos": torch.tensor([cache_len // 2 + 1], device=dev),
            }  # fmt: skip

        cases.append(
            Case(
                "rope_and_cache",
                f"B{batch} S1 H{heads}/{kv_heads} D{dim} cache{cache_len}",
                "decode",
                build=build,
                traffic=lambda i: 2 * nbytes(i["q"], i["k"], i["v"]) + nbytes(i["cos"], i["sin"]),
                variants={
                    "eager": eager,
                    "fusionscope": lambda i: mod.rope_and_cache(
                        i["q"], i["k"], i["v"], i["cos"], i["sin"], i["kc"], i["vc"], i["pos"]
                    ),
                },
                reference=lambda i: mod.rope_reference(*(_f64(i)[n] for n in ("q", "k", "cos", "sin")))[0],
            )
        )
    return cases


def add_layer_norm_cases() -> list[Case]:
    mod = kernel_module("add_layer_norm")
    liger = _liger("layer_norm", "LigerLayerNormFunction")

    def eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
        h = x + r
        return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h

    compiled = _compiled(eager)
    cases = []
    for phase, rows, hidden in _rows_sweep():
        variants: dict[str, Callable] = {
            "eager": lambda i: eager(i["x"], i["r"], i["w"], i["b"]),
            "compile": lambda i: compiled(i["x"], i["r"], i["w"], i["b"]),
            "fusionscope": lambda i: mod.add_layer_norm(i["x"], i["r"], i["w"], i["b"], EPS),
        }
        if liger:
            variants["liger"] = lambda i, f=liger: f.apply(i["x"] + i["r"], i["w"], i["b"], EPS)
        cases.append(
            Case(
                "add_layer_norm",
                f"{rows}x{hidden}",
                phase,
                build=lambda dev, dt, r=rows, h=hidden: {
                    "x": torch.randn(r, h, device=dev, dtype=dt),
                    "r": torch.randn(r, h, device=dev, dtype=dt),
                    "w": torch.rand(h, device=dev, dtype=dt) + 0.5,
                    "b": torch.randn(h, device=dev, dtype=dt),
                },
                traffic=lambda i: 4 * nbytes(i["x"]) + nbytes(i["w"], i["b"]),
                variants=variants,
                reference=lambda i: mod.add_layer_norm_reference(**_ref_args(_f64(i), ("x", "r", "w", "b")), eps=EPS),
            )
        )
    return cases


def bias_gelu_cases() -> list[Case]:
    mod = kernel_module("bias_gelu")

    def eager(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + b, approximate="tanh")

    compiled = _compiled(eager)
    cases = []
    for phase, rows, hidden in _rows_sweep():
        width = 4 * hidden  # GPT-2-style MLP: the activation runs on the 4×hidden intermediate
        if rows == max(PREFILL_ROWS) and rows > 4096:
            continue  # 32768 × 32768 is 2 GiB per bf16 tensor; the 4096-row case is already memory-bound
        cases.append(
            Case(
                "bias_gelu",
                f"{rows}x{width}",
                phase,
                build=lambda dev, dt, r=rows, n=width: {
                    "x": torch.randn(r, n, device=dev, dtype=dt),
                    "b": torch.randn(n, device=dev, dtype=dt),
                },
                traffic=lambda i: 2 * nbytes(i["x"]) + nbytes(i["b"]),
                variants={
                    "eager": lambda i: eager(i["x"], i["b"]),
                    "compile": lambda i: compiled(i["x"], i["b"]),
                    "fusionscope": lambda i: mod.bias_gelu(i["x"], i["b"], approximate="tanh"),
                },
                reference=lambda i: mod.bias_gelu_reference(_f64(i)["x"], _f64(i)["b"], approximate="tanh"),
            )
        )
    return cases


def linear_act_cases() -> list[Case]:
    mod = kernel_module("linear_act")
    cases = []
    for rows in (*DECODE_ROWS, PREFILL_ROWS[0]):
        hidden, width = LINEAR
        cases.append(
            Case(
                "linear_act",
                f"{rows}x{hidden}->{width} gelu_tanh",
                "decode" if rows in DECODE_ROWS else "prefill",
                build=lambda dev, dt, r=rows, h=hidden, n=width: {
                    "x": torch.randn(r, h, device=dev, dtype=dt),
                    "w": torch.randn(n, h, device=dev, dtype=dt) / h**0.5,
                    "b": torch.randn(n, device=dev, dtype=dt),
                },
                traffic=lambda i: (
                    nbytes(i["x"], i["w"], i["b"]) + i["x"].shape[0] * i["w"].shape[0] * i["x"].element_size()
                ),
                variants={
                    "eager": lambda i: mod.linear_act_unfused(i["x"], i["w"], i["b"], "gelu_tanh"),
                    "fusionscope": lambda i: mod.linear_act(i["x"], i["w"], i["b"], "gelu_tanh"),
                },
                reference=lambda i: mod.linear_act_reference(_f64(i)["x"], _f64(i)["w"], _f64(i)["b"], "gelu_tanh"),
            )
        )
    return cases


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


def sample_cases() -> list[Case]:
    mod = kernel_module("sample")
    settings = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}
    cases = []
    for batch in (1, 64):
        cases.append(
            Case(
                "sample",
                f"B{batch} V{VOCAB} T0.7 k50 p0.9",
                "decode",
                build=lambda dev, dt, b=batch: {"logits": torch.randn(b, VOCAB, device=dev, dtype=dt) * 3},
                traffic=lambda i: nbytes(i["logits"]) + i["logits"].shape[0] * 8,
                variants={
                    "eager": lambda i: hf_sample(i["logits"].float(), **settings),
                    "fusionscope": lambda i: mod.sample(i["logits"], **settings),
                },
                extra={"settings": settings},
            )
        )
    return cases


def qkv_cases() -> list[Case]:
    mod = kernel_module("horizontal")
    hidden, sizes, all_rows = QKV
    cases = []
    for rows in all_rows:

        def build(dev: torch.device, dt: torch.dtype, r: int = rows) -> dict[str, Any]:
            linears = [torch.nn.Linear(hidden, n, bias=False, device=dev, dtype=dt) for n in sizes]
            separate = [torch.nn.Linear(hidden, n, bias=False, device=dev, dtype=dt) for n in sizes]
            for a, b in zip(separate, linears):
                a.weight.data.copy_(b.weight.data)
            return {
                "x": torch.randn(r, hidden, device=dev, dtype=dt),
                "separate": separate,
                "fused": mod.fuse_linears(linears),
            }

        cases.append(
            Case(
                "qkv",
                f"{rows}x{hidden}->{'+'.join(map(str, sizes))}",
                "decode" if rows <= 64 else "prefill",
                build=build,
                traffic=lambda i: (
                    nbytes(i["x"])
                    + sum(nbytes(lin.weight) for lin in i["separate"])
                    + i["x"].shape[0] * sum(sizes) * i["x"].element_size()
                ),
                variants={
                    "eager": lambda i: tuple(lin(i["x"]) for lin in i["separate"]),
                    "fusionscope": lambda i: i["fused"](i["x"]),
                },
            )
        )
    return cases


CASES: dict[str, Callable[[], list[Case]]] = {
    "rms_norm": rms_norm_cases,
    "add_rms_norm": add_rms_norm_cases,
    "silu_and_mul": silu_and_mul_cases,
    "gelu_and_mul": gelu_and_mul_cases,
    "rope": rope_cases,
    "rope_and_cache": rope_and_cache_cases,
    "add_layer_norm": add_layer_norm_cases,
    "bias_gelu": bias_gelu_cases,
    "linear_act": linear_act_cases,
    "sample": sample_cases,
    "qkv": qkv_cases,
}
