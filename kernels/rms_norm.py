"""RMSNorm in one pass: one read of x, one write of the output, the row statistic kept in registers.

Hugging Face's eager `LlamaRMSNorm` (and `Gemma2RMSNorm`) runs one kernel per torch op: a cast to fp32, `pow`, `mean`,
`+ eps`, `rsqrt`, a multiply, a cast back and the weight multiply, each reading and writing full rows, several of them
in fp32. Per row of width N with x in a dtype of s bytes (weight of s_w bytes, counted once per call: every program
reads the same N·s_w bytes, which after the first come from L2, so per row they cost ~0 DRAM traffic when M ≫ 1):

    unfused, Llama (offset 0)  = (4·s + 28)·N   fp16/bf16: 36·N   (fp32: 28·N, the two casts are no-ops)
    unfused, Gemma (offset 1)  = (2·s + 36)·N   fp16/bf16: 40·N   (fp32: 28·N)
    fused                      = 2·s·N  (read N·s, write N·s)     fp16/bf16: 4·N   (fp32: 8·N)

so a memory-bound kernel should run ~9× (Llama) / ~10× (Gemma) faster in bf16 and ~3.5× in fp32 once rows are wide
and many enough to be bandwidth-bound; for a handful of rows both sides are launch-bound and the gain is the launch
count, 8 → 1. The reduction over N stays in registers up to N = 16384 (one block per row); wider rows loop over the
row in chunks of 8192 and read x twice (fused = 3·s·N, the second read mostly from L2).

Casting follows Hugging Face exactly (see `rms_norm_reference`): for offset == 0 (Llama) the normalised row is rounded
to x's dtype and then multiplied by the weight, which rounds again in the promoted dtype of (x, weight); for offset != 0
(Gemma) the row is multiplied by (offset + weight) in fp32 and rounded once to x's dtype.

`weight_in_fp32=True` is the third casting, OLMo-2's (`Olmo2RMSNorm`, T5's): `(weight * x̂).to(input_dtype)` with x̂
in fp32, so the weight product runs in fp32 (the weight widened) and the result rounds once, to the dtype asked for
(x's by default). Why a mode and not a wrapper: the graph rewrite (`fusionscope.fusions.rms_norm`'s `upcast`) used to
get that order by handing the Llama kernel `x.float()` and casting its fp32 result back: two copy kernels around every
norm (on an H200, OLMo-2-7B bf16 decode: 260 copy kernels, 458 µs of a 5.28 ms step). Read in x's dtype and stored in
the output dtype, it is one launch at the fused traffic:

    unfused, OLMo-2 (weight_in_fp32)       = (2·s + 36)·N   fp16/bf16: 40·N   (as Gemma: the same ops on the row)
    x.float() → kernel in fp32 → .to(dtype) = (2·s + 16)·N   fp16/bf16: 20·N, 3 launches (the old rewrite)
    fused                                   = 2·s·N          fp16/bf16: 4·N, 1 launch

`residual=` adds a residual to the result in the same launch: `residual + norm(x)`, what a decoder layer that
normalises *after* its sublayer does (OLMo-2, Gemma-2: `h = residual + post_attention_layernorm(attn_out)`). Why in
this kernel: add_rms_norm fuses the add *before* a norm; an add after it was a separate elementwise launch per norm
(on an H200, OLMo-2-7B bf16 decode: 64 `aten::add` a step, ~80 µs plus their gaps). The rounding order is the unfused
code's: the norm's result is rounded to the output dtype first (as the model stores it), then added to the residual in
fp32 and rounded once more (`aten::add` of two bf16 tensors). The residual has the output's shape and dtype; the flag
is a constexpr, so the plain path compiles to the kernel it was. Per row: unfused (norm, then add) reads x and writes
the norm (2·s·N), the add reads both and writes the sum (3·s·N); fused = 3·s·N (read x and the residual, write once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, new_output, pow2, run
from fusionscope.kernels.pdl import launch_options, wait_for_previous
from torch.library import triton_op
from triton.runtime.interpreter import InterpretedFunction

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 16384  # widest row reduced in one block (elements); wider rows loop over CHUNK-wide pieces
CHUNK = 8192
# Rows from `evict_last_from` wide up to MAX_BLOCK (read once) load x with the evict_last cache hint. On an H200
# (bf16, tune_norms.py, 2026-11-29) at 32768×8192 it took 250 µs against 259 without the hint (torch.compile: 250); at
# 4096×8192 it made no difference (33.6 against 33.4 µs). Only width 8192 was measured with it.
LOAD_HINTS = Tunables(evict_last_from=8192)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    *,
    weight_in_fp32: bool = False,
    dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim, cast exactly like Hugging Face's `LlamaRMSNorm` (offset 0) / `Gemma2RMSNorm` (offset
    1), or with `weight_in_fp32` like `Olmo2RMSNorm`: `(weight * x̂).to(dtype)`, the product in the statistics'
    precision, rounded once to `dtype` (default x's). x: (..., N), weight: (N,). Statistics run in fp32, or in fp64
    when given fp64 inputs (the high-precision check: then the result stays fp64 unless `dtype` says otherwise).
    `residual`: `residual + norm`, the norm as returned without it (so already in its dtype), the sum in fp32 (fp64
    for fp64 inputs) rounded once to the norm's dtype: `aten::add` of the stored norm, the order the kernel follows.
    Bytes per row of width N, x in s bytes (weight traffic ~0 per row, see the module docstring):"""
    if residual is not None:
        y = rms_norm_reference(x, weight, eps, offset, weight_in_fp32=weight_in_fp32, dtype=dtype)
        wide = torch.promote_types(y.dtype, torch.float32)
        return (residual.to(wide) + y.to(wide)).to(y.dtype)
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)  # read N·s, write N·4 (a no-op for fp32 x)
    var = h.pow(2).mean(-1, keepdim=True)  # pow: read N·4, write N·4; mean: read N·4, write 4
    h = h * torch.rsqrt(var + eps)  # add, rsqrt: 4 bytes; mul: read N·4 + 4, write N·4
    if weight_in_fp32:  # Olmo2RMSNorm: mul: read N·4, write N·4; to: read N·4, write N·s
        return ((offset + weight.to(acc)) * h if offset else weight.to(acc) * h).to(dtype or x.dtype)
    if offset == 0.0:  # LlamaRMSNorm: round to x's dtype, then the weight product rounds again
        return weight * h.to(x.dtype)  # to: read N·4, write N·s; mul: read N·s, write N·s
    return (h * (offset + weight.to(acc))).to(
        x.dtype
    )  # Gemma2RMSNorm: mul: read N·4, write N·4; to: read N·4, write N·s


def output_dtype(
    x_dtype: torch.dtype, weight_dtype: torch.dtype, offset: float, weight_in_fp32: bool = False
) -> torch.dtype:
    """The dtype Hugging Face returns: `weight * h.to(x.dtype)` promotes (offset 0); `.type_as(x)` (Gemma) and
    `.to(input_dtype)` (OLMo-2, `weight_in_fp32`) keep x's."""
    return torch.promote_types(x_dtype, weight_dtype) if offset == 0.0 and not weight_in_fp32 else x_dtype


@triton.jit
def _to_dtype(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """v (fp32) rounded to nearest-even in `dtype`. On a GPU `.to` does exactly that. The Triton interpreter (3.9)
    truncates fp32 → bf16 instead (and its `rtne` mode drops the carry into the exponent), so there it is done on
    the bits: add 0x7FFF plus the lowest kept bit, keep the top 16 bits; NaN passes through unchanged."""
    if SOFT_BF16:
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            return tl.where(v != v, v.to(tl.bfloat16), rounded)
        else:
            return v.to(dtype)
    else:
        return v.to(dtype)


@triton.jit
def _scale(xhat, w, offset, in_dtype: tl.constexpr, HAS_OFFSET: tl.constexpr, SOFT_BF16: tl.constexpr):
    """The epilogue, in fp32: Gemma's (offset + w)·x̂ (rounded once later, at the store), or Llama's w·round(x̂)."""
    if HAS_OFFSET:
        return xhat * (offset + w)
    else:
        return _to_dtype(xhat, in_dtype, SOFT_BF16).to(tl.float32) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # input, rows × N: row (i0, i1, i2) starts at i0·sx0 + i1·sx1 + i2·sx2, elements sxn apart
    w_ptr,  # weight (N,), elements swn apart
    out_ptr,  # output, same logical shape as x, strides so0, so1, so2, son
    r_ptr,  # residual added to the result (HAS_RESIDUAL; else any pointer, never read), strides sr0, sr1, sr2, srn
    M,  # number of rows = M0·M1·M2
    M1,  # sizes of the two inner row dims (M0 is implied)
    M2,
    N,  # row width, the normalised dim
    sx0,
    sx1,
    sx2,
    sxn,
    so0,
    so1,
    so2,
    son,
    sr0,
    sr1,
    sr2,
    srn,
    swn,
    eps,  # fp32
    offset,  # fp32: 0 for Llama, 1 for Gemma
    ROWS: tl.constexpr,  # rows per program (several for narrow rows)
    BLOCK: tl.constexpr,  # power of two ≥ N when ONE_BLOCK, else the chunk width
    ONE_BLOCK: tl.constexpr,  # the whole row fits one block: x is read once
    HAS_OFFSET: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # round to bf16 in software (the interpreter's cast truncates)
    EVICT_X: tl.constexpr = "",  # cache hint for the loads of x ("", "evict_first", "evict_last"): tune_norms.py
    WEIGHT_IN_FP32: tl.constexpr = False,  # OLMo-2: w·x̂ in fp32, rounded once at the store (offset 0 only)
    HAS_RESIDUAL: tl.constexpr = False,  # store residual + round(norm), the sum rounded once more (a post-norm's add)
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    i2 = rows % M2
    i1 = (rows // M2) % M1
    i0 = rows // M2 // M1
    x_row = x_ptr + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    o_row = out_ptr + (i0 * so0 + i1 * so1 + i2 * so2)[:, None]
    r_row = r_ptr + (i0 * sr0 + i1 * sr1 + i2 * sr2)[:, None]
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols < N)[None, :]
        w = tl.load(w_ptr + cols * swn, mask=cols < N, other=0.0).to(tl.float32)  # issued before the reduction
        x = tl.load(x_row + cols[None, :] * sxn, mask=mask, other=0.0, eviction_policy=EVICT_X).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        if WEIGHT_IN_FP32:
            y = x * rstd[:, None] * w[None, :]
        else:
            y = _scale(x * rstd[:, None], w[None, :], offset, x_ptr.dtype.element_ty, HAS_OFFSET, SOFT_BF16)
        y = _to_dtype(y, out_ptr.dtype.element_ty, SOFT_BF16)
        if HAS_RESIDUAL:
            r = tl.load(r_row + cols[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
            y = _to_dtype(y.to(tl.float32) + r, out_ptr.dtype.element_ty, SOFT_BF16)
        tl.store(o_row + cols[None, :] * son, y, mask=mask)
    else:
        sq = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            x = tl.load(x_row + c[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
            sq += x * x
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / N + eps)
        for start in range(0, N, BLOCK):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            x = tl.load(x_row + c[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * swn, mask=c < N, other=0.0).to(tl.float32)
            if WEIGHT_IN_FP32:
                y = x * rstd[:, None] * w[None, :]
            else:
                y = _scale(x * rstd[:, None], w[None, :], offset, x_ptr.dtype.element_ty, HAS_OFFSET, SOFT_BF16)
            y = _to_dtype(y, out_ptr.dtype.element_ty, SOFT_BF16)
            if HAS_RESIDUAL:
                r = tl.load(r_row + c[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
                y = _to_dtype(y.to(tl.float32) + r, out_ptr.dtype.element_ty, SOFT_BF16)
            tl.store(o_row + c[None, :] * son, y, mask=mask)


SOFT_BF16 = isinstance(_rms_norm_kernel, InterpretedFunction)


def row_layout(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[tuple[int, int, int], list[tuple[int, ...]]]:
    """Group the leading dims `shape` (all but the normalised one) into at most three row dims, for tensors with the
    given leading-dim `strides`, so that no strided input needs a copy. Adjacent dims merge where every tensor allows
    it (stride_outer == stride_inner · size_inner): contiguous tensors give one row dim; a Qwen3 q slice of a fused
    qkv projection, (B, S, H, D) with strides (S·W, W, D, 1), gives two; a transposed (B, H, S, D) view gives three.
    Returns (M0, M1, M2) and, per tensor, its strides (s0, s1, s2). Raises ValueError past three."""
    groups: list[list] = []  # [size, [innermost stride per tensor]], innermost group first
    for d in reversed(range(len(shape))):
        if shape[d] == 1:
            continue
        st = [s[d] for s in strides]
        if groups and all(a == b * groups[-1][0] for a, b in zip(st, groups[-1][1], strict=True)):
            groups[-1][0] *= shape[d]
        else:
            groups.append([shape[d], st])
    if len(groups) > 3:
        raise ValueError(
            f"the leading dims {tuple(shape)} with strides {[tuple(s) for s in strides]} form {len(groups)} "
            "non-mergeable row dims; at most 3 are supported (make the input contiguous first)"
        )
    groups.reverse()  # outermost first
    # Pad with size-1 dims on the inside: Triton specialises integer arguments equal to 1, so for rows that merge into
    # one dim the kernel's `% M2`, `// M2`, `% M1`, `// M1` fold away at compile time.
    groups += [[1, [0] * len(strides)] for _ in range(3 - len(groups))]
    sizes = tuple(g[0] for g in groups)
    return sizes, [tuple(g[1][t] for g in groups) for t in range(len(strides))]


def launch_config(M: int, N: int) -> dict[str, int | bool]:
    """BLOCK = next power of two ≥ N up to MAX_BLOCK (beyond, CHUNK-wide loops); several rows per program while a
    block holds fewer than 2048 elements (narrow rows: Qwen3 head norms have N = 128, 16 rows a program); warps by
    elements per program: 4 up to 2048, 8 up to 8192, 16 above."""
    if N <= MAX_BLOCK:
        block = pow2(N)
        rows = min(max(1, 2048 // block), 16, pow2(M))
    else:
        block, rows = CHUNK, 1
    elems = block * rows
    warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16
    return {"ROWS": rows, "BLOCK": block, "ONE_BLOCK": N <= MAX_BLOCK, "num_warps": warps}


def load_hints(N: int) -> dict[str, str]:
    """rms_norm's cache hint for the loads of x at row width N (`LOAD_HINTS`)."""
    return {"EVICT_X": "evict_last" if LOAD_HINTS["evict_last_from"] <= N <= MAX_BLOCK else ""}


def check_norm_args(x: torch.Tensor, weight: torch.Tensor, what: str = "x") -> None:
    """Shared argument checks: float dtypes, weight (N,) on x's device."""
    if x.dim() < 1:
        raise ValueError(f"{what} must have at least one dimension (the normalised one), got a scalar")
    if x.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise ValueError(f"{what} and weight must be fp32/fp16/bf16, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match {what}'s last dim, got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but {what} is on {x.device}")


def check_out(out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, name: str = "out") -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(
            f"{name} must be a {tuple(x.shape)} {dtype} tensor on {x.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def _rms_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    offset: float,
    weight_in_fp32: bool = False,
    residual: torch.Tensor | None = None,
) -> None:
    """Writes RMSNorm(x) into `out`, rounded to out's dtype, plus `residual` when given (rounded once more); arguments
    already checked by `rms_norm`. Without a residual, x stands in for its pointer (never read: HAS_RESIDUAL is a
    constexpr), so the call keeps one tensor layout to key on."""
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    if M == 0:
        return
    r = x if residual is None else residual
    (_, M1, M2), (sx, so, sr) = row_layout(tuple(x.shape[:-1]), x.stride()[:-1], out.stride()[:-1], r.stride()[:-1])
    cfg = {**load_hints(N), **launch_config(M, N)}
    grid = (cdiv(M, cfg["ROWS"]),)
    launchable(_rms_norm_kernel)[grid](
        x, weight, out, r, M, M1, M2, N, *sx, x.stride(-1), *so, out.stride(-1), *sr, r.stride(-1), weight.stride(0),
        eps, offset, HAS_OFFSET=offset != 0.0, SOFT_BF16=SOFT_BF16, WEIGHT_IN_FP32=weight_in_fp32 and offset == 0.0,
        HAS_RESIDUAL=residual is not None, **cfg, **launch_options(out),
    )  # fmt: skip


triton_op("fusionscope::rms_norm", mutates_args={"out"})(_rms_norm_op)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    out: torch.Tensor | None = None,
    *,
    weight_in_fp32: bool = False,
    dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim in one kernel, cast like Hugging Face (offset 0: `LlamaRMSNorm`, the usual input and
    final norms and Qwen3's per-head q/k norms; offset 1: `Gemma2RMSNorm`; `weight_in_fp32`: `Olmo2RMSNorm`).

    x: (..., N), fp32/fp16/bf16, any strides (leading dims that do not merge into rows are indexed per dim, up to
    three such dims). weight: (N,), fp32/fp16/bf16. weight_in_fp32: multiply x̂ by the weight in fp32 (the weight
    widened) and round once, OLMo-2's `(weight * x̂).to(dtype)`, instead of Llama's `weight * x̂.to(x.dtype)` (with
    offset != 0 the product is in fp32 either way). dtype: the dtype that one rounding goes to (default x's), only with
    weight_in_fp32; otherwise the result dtype is Hugging Face's, promote(x, weight) for offset 0 (HF's
    `weight * h.to(x.dtype)`), x's dtype otherwise. residual: an x-shaped tensor of the result dtype, any strides,
    added in the same launch: `residual + norm(x)` with the norm rounded to the result dtype first and the fp32 sum
    rounded once more, as the unfused `residual + norm(x)` rounds (a post-norm decoder layer's add, OLMo-2's). out:
    optional preallocated (..., N) tensor of the result dtype. Returns out.
    """
    check_norm_args(x, weight)
    result = output_dtype(x.dtype, weight.dtype, offset, weight_in_fp32)
    if dtype is not None and dtype != result:
        if not weight_in_fp32:
            raise ValueError(
                f"dtype={dtype} needs weight_in_fp32=True (one rounding, to dtype); without it the result is {result}"
            )
        if dtype not in _FLOATS:
            raise ValueError(f"dtype must be fp32/fp16/bf16, got {dtype}")
        result = dtype
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise ValueError(f"residual must be a tensor, got {type(residual).__name__}")
        check_out(residual, x, result, "residual")
    if out is None:
        out = new_output(x, result)
    else:
        check_out(out, x, result)
    run("rms_norm", _rms_norm_op, x, weight, out, float(eps), float(offset), bool(weight_in_fp32), residual)
    return out
