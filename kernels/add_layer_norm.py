"""Residual add fused with LayerNorm, for GPT-2/BERT-style blocks: new_residual = x + residual; out = LN(new_residual).

Why: eager runs the add and the layer norm as two kernels, and the sum makes a round trip through memory between
them. Fused, one program per row reads x and residual once, writes the new residual (which the next block needs) and
the normalised row, keeping the sum in registers for the statistics.

Bytes per row of width N in a dtype of size s (weight/bias: N·s_w each, read once and then served from cache):
  unfused = add (read 2·N·s, write N·s) + layer_norm (read N·s, write N·s; plus 8 bytes of mean/rstd) = 5·N·s
  fused   = read 2·N·s, write 2·N·s                                                                 = 4·N·s
For a memory-bound kernel that predicts 5/4 = 1.25x on the pair, and one launch instead of two (which dominates at
decode, where M is the batch size). Measured on an H200 (bf16, 8192 x 4096, CUDA-graph timing): 68.5 us fused
(3.9 TB/s) vs 104 us eager, 1.5x; 4 rows: 2.5 us vs 7.7 us of GPU time. At decode the host cost of an eager
call decides, and there the fused call gains little: 26–50 us through the replayed launch (`dispatch`) against
34–36 us for eager's two aten ops, measured on different calls of a host whose speed varies (reports/bench/).

Numerics, as eager: the sum is rounded to the input dtype (it is the stored residual, and eager's layer_norm reads that
rounded value); the statistics and the affine transform are computed in fp32 (as `F.layer_norm` does for half types on
CUDA), and the output is rounded once. Rounding to bf16 uses integer round-to-nearest-even so that Triton's
interpreter, whose fp32→bf16 cast truncates, gives the GPU's result.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import launchable, new_output, pow2, run
from fusionscope.kernels.pdl import launch_options, wait_for_previous
from fusionscope.kernels.rounding import round_to
from torch.library import triton_op

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_WIDTH = 16384  # one block holds a whole row


def add_layer_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager GPT-2/BERT order: (layer_norm(x + residual), x + residual). x, residual: (..., N)."""
    h = x + residual  # read 2·N·s, write N·s (rounded to the dtype)
    out = F.layer_norm(h, (h.shape[-1],), weight, bias, eps)  # read N·s (+ weight, bias), write N·s
    return out, h


@triton.jit
def _add_layer_norm_kernel(
    x_ptr,  # (D0, D1, N) input; strides stride_x0, stride_x1, stride_xn (rows are (i0, i1) pairs)
    r_ptr,  # (D0, D1, N) residual
    w_ptr,  # (N,) weight, element stride stride_w (unused when HAS_WEIGHT is False)
    b_ptr,  # (N,) bias, element stride stride_b (unused when HAS_BIAS is False)
    o_ptr,  # (D0, D1, N) normalised output (may alias x)
    ro_ptr,  # (D0, D1, N) new residual x + residual (may alias residual)
    w2_ptr,  # SECOND: the second LayerNorm's (N,) weight, element stride stride_w2
    b2_ptr,  # SECOND: its (N,) bias, element stride stride_b2
    o2_ptr,  # SECOND: its (D0, D1, N) output; strides stride_o20, stride_o21, stride_o2n
    a_ptr,  # ADDEND: (D0, D1, N) added to x first (GPT-NeoX's `mlp + attention`), strides stride_a0, ...
    D1,  # size of the second leading dim: row m is (m // D1, m % D1)
    N,
    eps,
    stride_x0,
    stride_x1,
    stride_xn,
    stride_r0,
    stride_r1,
    stride_rn,
    stride_w,
    stride_b,
    stride_o0,
    stride_o1,
    stride_on,
    stride_ro0,
    stride_ro1,
    stride_ron,
    stride_w2,
    stride_b2,
    stride_o20,
    stride_o21,
    stride_o2n,
    stride_a0,
    stride_a1,
    stride_an,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SECOND: tl.constexpr,  # a second LayerNorm of the same sum (its own weight and bias, both present)
    ADDEND: tl.constexpr,  # h = (x + addend) + residual, the inner sum rounded as eager's add rounds it
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    row = tl.program_id(0)
    i0 = (row // D1).to(tl.int64)
    i1 = (row % D1).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    # both loads happen before any store, so the outputs may alias the inputs (in-place update)
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + cols * stride_xn, mask=mask).to(tl.float32)
    r = tl.load(r_ptr + i0 * stride_r0 + i1 * stride_r1 + cols * stride_rn, mask=mask).to(tl.float32)
    if ADDEND:
        a = tl.load(a_ptr + i0 * stride_a0 + i1 * stride_a1 + cols * stride_an, mask=mask).to(tl.float32)
        x = round_to(x + a, ro_ptr.dtype.element_ty)
    h = round_to(x + r, ro_ptr.dtype.element_ty)  # the stored residual, rounded as eager's add rounds it
    tl.store(ro_ptr + i0 * stride_ro0 + i1 * stride_ro1 + cols * stride_ron, h.to(ro_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(h, axis=0) / N
    d = tl.where(mask, h - mean, 0.0)
    var = tl.sum(d * d, axis=0) / N
    normed = d * tl.rsqrt((var + eps).to(tl.float32))  # eps may arrive as fp64 (torch.compile passes Python floats so)
    y = normed
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols * stride_w, mask=mask).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols * stride_b, mask=mask).to(tl.float32)
    y = round_to(y, o_ptr.dtype.element_ty)
    tl.store(o_ptr + i0 * stride_o0 + i1 * stride_o1 + cols * stride_on, y.to(o_ptr.dtype.element_ty), mask=mask)
    if SECOND:
        y2 = normed * tl.load(w2_ptr + cols * stride_w2, mask=mask).to(tl.float32)
        y2 = round_to(y2 + tl.load(b2_ptr + cols * stride_b2, mask=mask).to(tl.float32), o2_ptr.dtype.element_ty)
        tl.store(o2_ptr + i0 * stride_o20 + i1 * stride_o21 + cols * stride_o2n, y2.to(o2_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


def _rows_3d(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """t (..., N) as rows (D0, D1) of N: (D0, D1, stride0, stride1, strideN), without a view (a launcher that only
    reads metadata can be replayed, see `dispatch`). Any layout works for up to 3 dims; more leading dims must
    collapse into the first, as `t.view(-1, *t.shape[-2:])` would. None when they do not."""
    shape, stride = t.shape, t.stride()
    if t.dim() == 1:
        return 1, 1, 0, 0, stride[0]
    if t.dim() == 2:
        return 1, shape[0], 0, stride[0], stride[1]
    if t.dim() == 3:
        return shape[0], shape[1], stride[0], stride[1], stride[2]
    leading = [(n, s) for n, s in zip(shape[:-2], stride[:-2]) if n != 1]
    if any(outer[1] != inner[1] * inner[0] for outer, inner in itertools.pairwise(leading)):
        return None
    d0 = 1
    for n, _ in leading:
        d0 *= n
    return d0, shape[-2], leading[-1][1] if leading else 0, stride[-2], stride[-1]


def _num_warps(block_n: int) -> int:
    return min(max(block_n // 256, 1), 16)


def _add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
) -> None:
    _launch(x, residual, weight, bias, eps, out, residual_out, None, None)


def _add_layer_norm_pair_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    weight2: torch.Tensor,
    bias2: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    out2: torch.Tensor,
    residual_out: torch.Tensor,
    addend: torch.Tensor | None,
) -> None:
    _launch(x, residual, weight, bias, eps, out, residual_out, (weight2, bias2, out2), addend)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    addend: torch.Tensor | None,
) -> None:
    (d0, d1, *sx), (_, _, *sr), (_, _, *so), (_, _, *sro) = (_rows_3d(t) for t in (x, residual, out, residual_out))
    w2, b2, out2 = second if second is not None else (x, x, out)
    _, _, *so2 = _rows_3d(out2)
    _, _, *sa = _rows_3d(addend if addend is not None else x)
    n = x.shape[-1]
    block_n = pow2(n)
    launchable(_add_layer_norm_kernel)[(d0 * d1,)](
        x, residual, weight if weight is not None else x, bias if bias is not None else x, out, residual_out,
        w2, b2, out2, addend if addend is not None else x, d1, n, eps, *sx, *sr,
        weight.stride(0) if weight is not None else 0, bias.stride(0) if bias is not None else 0,
        *so, *sro, w2.stride(0) if second is not None else 0, b2.stride(0) if second is not None else 0, *so2, *sa,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, SECOND=second is not None,
        ADDEND=addend is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n), **launch_options(out),
    )  # fmt: skip


triton_op("fusionscope::add_layer_norm", mutates_args={"out", "residual_out"})(_add_layer_norm_op)
triton_op("fusionscope::add_layer_norm_pair", mutates_args={"out", "out2", "residual_out"})(_add_layer_norm_pair_op)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (layer_norm(x + residual) * weight + bias, x + residual) in one launch, one program per row.

    x, residual: (..., N), N <= 16384, fp32/fp16/bf16, same dtype; any strides for up to 3 dims, and for more dims
    leading dims that collapse into one without a copy (else ValueError). weight, bias: (N,) or None, any float dtype.
    out: optional (out, new_residual) buffers shaped like x in x's dtype (same layout rules); they may be x and
    residual themselves (in-place update). Freshly allocated outputs are contiguous.
    """
    _check_inputs(x, residual, (("weight", weight), ("bias", bias)))
    if out is None:
        out = (new_output(x), new_output(x))
    if len(out) != 2:
        raise ValueError("out must be a tuple (out, new_residual)")
    _check_outputs(x, residual, out)
    run("add_layer_norm", _add_layer_norm_op, x, residual, weight, bias, float(eps), out[0], out[1])
    return out[0], out[1]


def add_layer_norm_pair(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    weight2: torch.Tensor,
    bias2: torch.Tensor,
    eps: float,
    addend: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (LN(h) * weight + bias, LN(h) * weight2 + bias2, h) for h = x + residual, in one launch; with
    `addend`, h = (x + addend) + residual, each sum rounded to the dtype as eager's two adds round them.

    Why: GPT-NeoX's parallel block normalises one residual twice, once for attention and once for the MLP, each with
    its own weight and bias; eager runs the add and two LayerNorms, reading h three times. Here the statistics are
    computed once and both outputs written from registers. Per row of N (size s): unfused 3·N·s (add) + 2·2·N·s
    (two norms) = 7·N·s in three launches, fused 5·N·s in one. Its `hidden = mlp + attention + hidden` makes the
    sum with two adds; `addend` takes the first too (one launch and 3·N·s less). Same inputs and layout rules as
    `add_layer_norm` (the addend's as x's); outputs freshly allocated (contiguous)."""
    _check_inputs(x, residual, (("weight", weight), ("bias", bias), ("weight2", weight2), ("bias2", bias2)))
    if addend is not None:
        _check_inputs(x, addend, ())
    for name, t in (("weight", weight), ("bias", bias), ("weight2", weight2), ("bias2", bias2)):
        if t is None:
            raise ValueError(f"{name} is required: both LayerNorms take a weight and a bias")
    out, out2, h = new_output(x), new_output(x), new_output(x)
    _check_outputs(x, residual, (out, h))
    if addend is not None:
        _check_outputs(x, addend, (out, h))  # the addend's layout, under the same rule
    run("add_layer_norm_pair", _add_layer_norm_pair_op, x, residual, weight, bias, weight2, bias2, float(eps), out,
        out2, h, addend)  # fmt: skip
    return out, out2, h


def add_layer_norm_pair_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    weight2: torch.Tensor,
    bias2: torch.Tensor,
    eps: float,
    addend: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager GPT-NeoX order: the add (`x + addend + residual` with an addend), then each LayerNorm of the sum."""
    h = x + residual if addend is None else x + addend + residual
    n = (h.shape[-1],)
    return F.layer_norm(h, n, weight, bias, eps), F.layer_norm(h, n, weight2, bias2, eps), h


def _check_inputs(x: torch.Tensor, residual: torch.Tensor, params: tuple[tuple[str, torch.Tensor | None], ...]) -> None:
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty (..., N) tensor; got {tuple(x.shape)}")
    if x.dtype not in _DTYPES or residual.dtype != x.dtype:
        raise ValueError(f"x and residual must share one of fp32/fp16/bf16; got {x.dtype} and {residual.dtype}")
    n = x.shape[-1]
    if n > MAX_WIDTH:
        raise ValueError(f"width N = {n} exceeds {MAX_WIDTH}, the widest row one block holds")
    for name, t in (("residual", residual), *params):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    for name, t in params:
        if t is not None and (t.shape != (n,) or not t.dtype.is_floating_point):
            raise ValueError(f"{name} must be a floating ({n},) tensor; got {tuple(t.shape)} {t.dtype}")


def _check_outputs(x: torch.Tensor, residual: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    for name, t in (("out[0]", out[0]), ("out[1]", out[1])):
        if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(
                f"{name} must be {tuple(x.shape)} {x.dtype} on {x.device}; got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    for name, t in (("x", x), ("residual", residual), ("out[0]", out[0]), ("out[1]", out[1])):
        if t.dim() > 3 and _rows_3d(t) is None:
            raise ValueError(
                f"{name} {tuple(t.shape)} with strides {t.stride()}: its leading dims cannot be viewed as one without "
                "a copy; pass a tensor of at most 3 dims or one whose leading dims collapse"
            )
