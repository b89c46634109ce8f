"""Residual add + RMSNorm in one pass: the decoder layer's `hidden_states = residual + hidden_states` followed by the
next norm (`post_attention_layernorm`, or the next layer's `input_layernorm`).

Unfused, Hugging Face's eager path runs the add (read 2·N·s, write N·s) and then the eight-kernel RMSNorm of
`rms_norm.py`; fused, one kernel reads x and the residual once and writes the new residual and the normalised output
once. Per row of width N in a dtype of s bytes (the weight counted once per call, ~0 per row, as in `rms_norm.py`):

    unfused, Llama (offset 0)  = 3·s·N + (4·s + 28)·N = (7·s + 28)·N   fp16/bf16: 42·N   (fp32: 12·N + 28·N = 40·N)
    unfused, Gemma (offset 1)  = 3·s·N + (2·s + 36)·N = (5·s + 36)·N   fp16/bf16: 46·N   (fp32: 40·N)
    fused                      = 4·s·N  (read x and residual, write out and new residual)   bf16: 8·N (fp32: 16·N)

so a memory-bound kernel should gain ~5.3× (Llama) / ~5.8× (Gemma) in bf16 and ~2.5× in fp32, 9 launches → 1. An
engine that already adds in place saves the add's allocation but not its traffic. Rows wider than 16384 loop over
chunks of 8192 and read x and the residual twice (fused = 6·s·N, the second read mostly from L2).

The sum rounds to the input dtype before the norm reads it, exactly as the bf16 add in the decoder layer does; the
norm then casts like `rms_norm` (Llama: round x̂ to the input dtype, then the weight product rounds again; Gemma:
(offset + w)·x̂ in fp32, rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import cdiv, launchable, new_output, run
from fusionscope.kernels.pdl import launch_options, wait_for_previous
from fusionscope.kernels.rms_norm import (
    SOFT_BF16,
    _scale,
    _to_dtype,
    check_norm_args,
    check_out,
    launch_config,
    output_dtype,
    rms_norm_reference,
    row_layout,
)
from torch.library import triton_op


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x), the add in the input dtype as in HF's decoder layer, the norm cast like
    `LlamaRMSNorm` (offset 0) / `Gemma2RMSNorm` (offset 1). x, residual: (..., N); weight: (N,). Bytes per row:"""
    h = residual + x  # read 2·N·s, write N·s: rounds in the input dtype (fp64 when checking in fp64)
    return rms_norm_reference(h, weight, eps, offset), h  # the unfused norm: (4·s + 28)·N Llama, (2·s + 36)·N Gemma


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # input, rows × N: row (i0, i1, i2) starts at i0·sx0 + i1·sx1 + i2·sx2, elements sxn apart
    r_ptr,  # residual, same logical shape and dtype as x, strides sr0, sr1, sr2, srn
    w_ptr,  # weight (N,), elements swn apart
    out_ptr,  # normalised output (may be x itself: in place), strides so0, so1, so2, son
    ro_ptr,  # new residual x + residual in x's dtype (may be the residual itself), strides sq0, sq1, sq2, sqn
    M,  # number of rows = M0·M1·M2
    M1,  # sizes of the two inner row dims (M0 is implied)
    M2,
    N,  # row width, the normalised dim
    sx0,
    sx1,
    sx2,
    sxn,
    sr0,
    sr1,
    sr2,
    srn,
    so0,
    so1,
    so2,
    son,
    sq0,
    sq1,
    sq2,
    sqn,
    swn,
    eps,  # fp32
    offset,  # fp32: 0 for Llama, 1 for Gemma
    ROWS: tl.constexpr,  # rows per program (several for narrow rows)
    BLOCK: tl.constexpr,  # power of two ≥ N when ONE_BLOCK, else the chunk width
    ONE_BLOCK: tl.constexpr,  # the whole row fits one block: x and the residual are read once
    HAS_OFFSET: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # round to bf16 in software (the interpreter's cast truncates)
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
    r_row = r_ptr + (i0 * sr0 + i1 * sr1 + i2 * sr2)[:, None]
    o_row = out_ptr + (i0 * so0 + i1 * so1 + i2 * so2)[:, None]
    q_row = ro_ptr + (i0 * sq0 + i1 * sq1 + i2 * sq2)[:, None]
    in_dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_row + cols[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_row + cols[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
        h = _to_dtype(x + r, in_dtype, SOFT_BF16)  # the residual add rounds in the input dtype
        tl.store(q_row + cols[None, :] * sqn, h, mask=mask)
        h = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        w = tl.load(w_ptr + cols * swn, mask=cols < N, other=0.0).to(tl.float32)
        y = _scale(h * rstd[:, None], w[None, :], offset, in_dtype, HAS_OFFSET, SOFT_BF16)
        tl.store(o_row + cols[None, :] * son, _to_dtype(y, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)
    else:
        # Two passes; the second recomputes x + residual rather than reading back the new residual, so that in place
        # (out is x, the new residual is the residual) every element is loaded before it is overwritten.
        sq = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            x = tl.load(x_row + c[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_row + c[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
            h = _to_dtype(x + r, in_dtype, SOFT_BF16).to(tl.float32)
            sq += h * h
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / N + eps)
        for start in range(0, N, BLOCK):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            x = tl.load(x_row + c[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_row + c[None, :] * srn, mask=mask, other=0.0).to(tl.float32)
            h = _to_dtype(x + r, in_dtype, SOFT_BF16)
            tl.store(q_row + c[None, :] * sqn, h, mask=mask)
            w = tl.load(w_ptr + c * swn, mask=c < N, other=0.0).to(tl.float32)
            y = _scale(h.to(tl.float32) * rstd[:, None], w[None, :], offset, in_dtype, HAS_OFFSET, SOFT_BF16)
            tl.store(o_row + c[None, :] * son, _to_dtype(y, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def _add_rms_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
    offset: float,
) -> None:
    """Writes RMSNorm(x + residual) into `out` and x + residual into `residual_out` (arguments already checked)."""
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    if M == 0:
        return
    (_, M1, M2), (sx, sr, so, sq) = row_layout(
        tuple(x.shape[:-1]), *(t.stride()[:-1] for t in (x, residual, out, residual_out))
    )
    cfg = launch_config(M, N)
    grid = (cdiv(M, cfg["ROWS"]),)
    launchable(_add_rms_norm_kernel)[grid](
        x, residual, weight, out, residual_out, M, M1, M2, N,
        *sx, x.stride(-1), *sr, residual.stride(-1), *so, out.stride(-1), *sq, residual_out.stride(-1),
        weight.stride(0), eps, offset, HAS_OFFSET=offset != 0.0, SOFT_BF16=SOFT_BF16, **cfg, **launch_options(out),
    )  # fmt: skip


triton_op("fusionscope::add_rms_norm", mutates_args={"out", "residual_out"})(_add_rms_norm_op)


def _add_rms_norm_inplace_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> None:
    """The engine's allocation-free form: x + residual into `residual`, RMSNorm of it into `x`. A separate op, so that
    its schema says which arguments it mutates instead of aliasing outputs to inputs."""
    _add_rms_norm_op(x, residual, weight, x, residual, eps, offset)


triton_op("fusionscope::add_rms_norm_inplace", mutates_args={"x", "residual"})(_add_rms_norm_inplace_op)


def _empty(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every output this module allocates comes from here (the in-place test checks that nothing does)."""
    return new_output(x, dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    out: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one kernel: the decoder layer's residual add, rounded in the input
    dtype, fused with the norm that follows it (offset 0: `LlamaRMSNorm` casting; offset 1: `Gemma2RMSNorm`).

    x, residual: (..., N), the same shape and dtype (fp32/fp16/bf16), any strides (up to three non-mergeable leading
    dims). weight: (N,), fp32/fp16/bf16. The output dtype is promote(x, weight) for offset 0, x's dtype otherwise; the
    new residual has x's dtype. out: an output tensor, or a tuple (out, new_residual_out) whose entries may be None.
    inplace=True writes the new residual into `residual` and the output into `x` and returns (x, residual): no
    allocation (needs an output dtype equal to x's). Returns (out, new_residual).
    """
    check_norm_args(x, weight)
    if not isinstance(residual, torch.Tensor):
        raise ValueError(f"residual must be a tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device} but x is on {x.device}")
    dtype = output_dtype(x.dtype, weight.dtype, offset)
    if inplace:
        if out is not None:
            raise ValueError("pass either inplace=True (results go into x and residual) or out=, not both")
        if dtype != x.dtype:
            raise ValueError(
                f"inplace=True writes the output into x ({x.dtype}), but with a {weight.dtype} weight and offset "
                f"{offset} the output dtype is {dtype}"
            )
        run("add_rms_norm_inplace", _add_rms_norm_inplace_op, x, residual, weight, float(eps), float(offset))
        return x, residual
    if isinstance(out, tuple | list):
        if len(out) != 2:
            raise ValueError(f"out must be a tensor or a tuple (out, new_residual_out), got {len(out)} entries")
        y, new_residual = out
    else:
        y, new_residual = out, None
    if y is None:
        y = _empty(x, dtype)
    else:
        check_out(y, x, dtype)
    if new_residual is None:
        new_residual = _empty(x, x.dtype)
    else:
        check_out(new_residual, x, x.dtype, "new_residual_out")
    run("add_rms_norm", _add_rms_norm_op, x, residual, weight, y, new_residual, float(eps), float(offset))
    return y, new_residual
