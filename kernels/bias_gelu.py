"""Bias add + gelu (+ residual add) fused into one pass: the epilogue of a GPT-2 / BERT MLP projection.

Eager PyTorch runs `gelu(x + bias)` as two elementwise kernels, and a following residual add as a third; each writes
a temporary that the next reads straight back. Per row of width N in a dtype of element size s (the bias, N·s, is
read once per launch, not per row, and is left out):

    unfused = add (read N·s, write N·s) + gelu (read N·s, write N·s)          = 4·N·s
              + residual add (read 2·N·s, write N·s)                           = 7·N·s with residual
    fused   = read x, write out                                                = 2·N·s
              + read residual                                                  = 3·N·s with residual

All are memory-bound (tens of FLOP per element at most), so the fused kernel should run in about 1/2 of the unfused
time without residual (2×) and 3/7 with it (2.33×), at equal bandwidth. The kernel reproduces eager's roundings:
`x + bias` rounds to the dtype, gelu rounds, `+ residual` rounds. GPT-2's `gelu_new` is approximate="tanh", BERT's
`gelu` is approximate="none".

Shapes: x (..., N), bias (N,), residual None or (..., N), output (..., N). Leading dims may be strided, as long as
they collapse into at most two row dims (any view of rows does); the last dim (and bias) may have any stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import cdiv, launchable, new_output, run
from fusionscope.kernels.gelu_and_mul import _check_approximate, _gelu
from fusionscope.kernels.rounding import round_to
from fusionscope.kernels.silu_and_mul import _launch, _row_dims
from torch.library import triton_op

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor, approximate: str = "none", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Eager `gelu(x + bias)` (+ `residual`), rounded after each op as unfused code does. x (..., N), bias (N,)."""
    h = x + bias  # read N·s (bias N·s once), write N·s (rounds to the dtype)
    g = torch.nn.functional.gelu(h, approximate=approximate)  # read N·s, write N·s (rounds)
    if residual is None:
        return g
    return residual + g  # read 2·N·s, write N·s (rounds)


@triton.jit
def _bias_gelu_kernel(
    x_ptr,  # (R0, R1, N) input, strides stride_x0, stride_x1 (row dims) and stride_xn (columns)
    bias_ptr,  # (N,) bias, stride stride_bn
    res_ptr,  # (R0, R1, N) residual, strides stride_r0, stride_r1, stride_rn; unread unless HAS_RESIDUAL
    out_ptr,  # (R0, R1, N) output, strides stride_o0, stride_o1, stride_on; same dtype as x, bias and residual
    R1,  # size of the inner row dim: row r of the grid is (r // R1, r % R1)
    N,  # columns
    stride_x0,
    stride_x1,
    stride_xn,
    stride_bn,
    stride_r0,
    stride_r1,
    stride_rn,
    stride_o0,
    stride_o1,
    stride_on,
    TANH: tl.constexpr,  # approximate="tanh"
    HAS_RESIDUAL: tl.constexpr,  # out = residual + gelu(x + bias)
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)  # int64: rows × row stride can pass 2³¹ elements
    r0 = row // R1
    r1 = row % R1
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols * stride_bn, mask=mask, other=0.0).to(tl.float32)
    h = round_to(x + b, dtype)  # eager's `x + bias` output rounds to the dtype
    y = round_to(_gelu(h, TANH), dtype)  # and so does its gelu output
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + r0 * stride_r0 + r1 * stride_r1 + cols * stride_rn, mask=mask, other=0.0)
        y = round_to(r.to(tl.float32) + y, dtype)
    tl.store(out_ptr + r0 * stride_o0 + r1 * stride_o1 + cols * stride_on, y.to(dtype), mask=mask)  # exact cast


def _bias_gelu_op(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor, approximate: str
) -> None:
    """Writes [residual +] gelu(x + bias, approximate) into `out`; x, residual, out (..., N), bias (N,), one dtype."""
    _check_approximate(approximate, "bias_gelu")
    has_residual = residual is not None
    res = residual if residual is not None else x  # a placeholder pointer the kernel never reads
    r0, r1, (sx, sr, so) = _row_dims(x, res, out)
    n = out.shape[-1]
    if r0 * r1 == 0 or n == 0:
        return
    block, num_warps = _launch(n)
    grid = (r0 * r1, cdiv(n, block))
    launchable(_bias_gelu_kernel)[grid](
        x, bias, res, out, r1, n, *sx, bias.stride(0), *sr, *so,
        TANH=approximate == "tanh", HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


triton_op("fusionscope::bias_gelu", mutates_args={"out"})(_bias_gelu_op)


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor,
    approximate: str = "none",
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gelu(x + bias)`, plus `residual` when given, in one kernel, rounded as the unfused eager ops round.

    x: (..., N), fp32/fp16/bf16; bias: (N,); residual: None or (..., N); all one dtype and device. approximate:
    "none" (erf, BERT) or "tanh" (GPT-2's gelu_new). out: optional preallocated (..., N) buffer of x's dtype.
    Returns out.
    """
    _check_approximate(approximate, "bias_gelu")
    if x.dtype not in _DTYPES:
        raise ValueError(f"bias_gelu: x must be fp32, fp16 or bf16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("bias_gelu: x must have at least one dim")
    if bias.shape != x.shape[-1:]:
        raise ValueError(f"bias_gelu: bias must be ({x.shape[-1]},) for x {tuple(x.shape)}, got {tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"bias_gelu: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"bias_gelu: {name} must share x's dtype and device ({x.dtype} on {x.device}), "
                f"got {t.dtype} on {t.device}"
            )
    if out is None:
        out = new_output(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"bias_gelu: out must be {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    run("bias_gelu", _bias_gelu_op, x, bias, residual, out, approximate)
    return out
