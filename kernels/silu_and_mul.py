"""SwiGLU activation, `silu(gate) * up`, fused into one pass: the MLP of Llama, Mistral, Qwen and most decoders.

Hugging Face's LlamaMLP computes `self.act_fn(self.gate_proj(x)) * self.up_proj(x)`: two elementwise kernels, the
first writing `silu(gate)` to a temporary that the second reads straight back. Per row of width I (the intermediate
size) in a dtype of element size s:

    unfused = silu (read I·s, write I·s) + mul (read 2·I·s, write I·s) = 5·I·s
    fused   = read gate and up (2·I·s), write out (I·s)                = 3·I·s

Both are memory-bound (a few FLOP per element), so the fused kernel should run in about 3/5 of the unfused time:
a 1.67× speed-up at equal bandwidth. The kernel reproduces eager's two roundings (silu rounds to the dtype, then the
product rounds again), so in fp16/bf16 it agrees with Hugging Face's output bit for bit, except where the kernel's
and aten's fp32 silu, a few fp32 ulps apart, straddle a rounding tie: there the silu lands one ulp off, and the output
up to two (the tests allow exactly that; on an H200, 100.000% of 117M bf16 outputs were bit-exact).

Shapes: `gate` (..., 2·I) with the gate half first and `up=None` (the output of a fused gate_up projection), or
`gate` and `up` both (..., I); output (..., I). Leading dims may be strided, as long as they collapse into at most
two row dims (any view of rows does); the last dim may have any stride.

Two schedules. Strided operands (the two halves of a gate_up output) run row by row, a 2-D grid of rows × column
blocks. Contiguous gate, up and out — how a patched MLP calls it when gate_up is not fused — are one flat run of
elements (`FLAT`: elements per program and warps), with no row arithmetic and full-width vector loads across row
ends: the row schedule reached 97.4% of copy bandwidth there at 16384 × 14336 bf16 where torch.compile's flat
kernel reached 102.2% (H200, 2026-12-01; a kernel that reads twice what it writes may pass a copy's figure).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, new_output, pow2, run
from fusionscope.kernels.pdl import launch_options, wait_for_previous
from fusionscope.kernels.rounding import round_to
from torch.library import triton_op

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Eager SwiGLU exactly as Hugging Face's LlamaMLP rounds it: gate/up (..., I), or gate (..., 2·I) with up=None."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)  # views: no bytes moved
    act = torch.nn.functional.silu(gate)  # read I·s, write I·s (rounds to the dtype)
    return act * up  # read 2·I·s, write I·s (rounds again)


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,  # (R0, R1, N) gate, strides stride_g0, stride_g1 (row dims) and stride_gn (columns)
    up_ptr,  # (R0, R1, N) up, strides stride_u0, stride_u1, stride_un
    out_ptr,  # (R0, R1, N) output, strides stride_o0, stride_o1, stride_on; same dtype as gate and up
    R1,  # size of the inner row dim: row r of the grid is (r // R1, r % R1)
    N,  # columns (the intermediate size I)
    stride_g0,
    stride_g1,
    stride_gn,
    stride_u0,
    stride_u1,
    stride_un,
    stride_o0,
    stride_o1,
    stride_on,
    BLOCK: tl.constexpr,  # columns per program
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    row = tl.program_id(0).to(tl.int64)  # int64: rows × row stride can pass 2³¹ elements
    r0 = row // R1
    r1 = row % R1
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gate_ptr + r0 * stride_g0 + r1 * stride_g1 + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r0 * stride_u0 + r1 * stride_u1 + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    # silu as aten computes it (x / (1 + exp(-x))), rounded to the dtype like eager's silu output
    act = round_to(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty)
    y = round_to(act * u, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # exact cast: already rounded
    tl.store(out_ptr + r0 * stride_o0 + r1 * stride_o1 + cols * stride_on, y, mask=mask)


@triton.jit
def _silu_and_mul_flat_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """The same arithmetic over `numel` contiguous elements, BLOCK per program."""
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty)
    y = round_to(act * u, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)


# The contiguous schedule: elements per program, warps. On the H200 (reports/bench/tune_silu.json, 2026-12-01),
# 1024/4 tied torch.compile at 16384 × 14336 bf16 (321.4 against 321.1 µs, 4.39 TB/s) and beat it at decode sizes
# (1.20 against 1.24 µs at 1 × 14336, 1.33 against 1.42 µs at 16 × 11008); wider blocks lost up to 2× at decode.
FLAT = Tunables(BLOCK=1024, num_warps=4)


def _row_dims(*tensors: torch.Tensor) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Collapse the leading dims that `tensors` (all one shape (..., N)) share into two row dims (R0, R1).

    Adjacent dims merge when every tensor lays them out as one (outer stride = inner stride × inner size), as
    TensorIterator coalesces them; size-1 dims drop. Returns R0, R1 and each tensor's (stride_0, stride_1, stride_n).
    """
    dims: list[tuple[int, list[int]]] = []  # (size, stride of each tensor), outermost first
    for d, size in enumerate(tensors[0].shape[:-1]):
        if size == 1:
            continue
        strides = [t.stride(d) for t in tensors]
        if dims and all(outer == inner * size for outer, inner in zip(dims[-1][1], strides)):
            dims[-1] = (dims[-1][0] * size, strides)
        else:
            dims.append((size, strides))
    if len(dims) > 2:
        raise ValueError(
            f"the leading dims {tuple(tensors[0].shape[:-1])} with strides "
            f"{[tuple(t.stride()[:-1]) for t in tensors]} do not collapse into two row dims; pass a tensor whose "
            "leading dims can be viewed as rows (e.g. .contiguous())"
        )
    while len(dims) < 2:
        dims.insert(0, (1, [0] * len(tensors)))
    (r0, s0), (r1, s1) = dims
    return r0, r1, [(a, b, t.stride(-1)) for a, b, t in zip(s0, s1, tensors)]


def _launch(n: int) -> tuple[int, int]:
    """BLOCK and num_warps for rows of n columns: up to 2048 columns a program at 4 warps, 16 per thread; wider rows
    (I = 14336) take several programs along the grid's second axis. On an H200 (8192 x 14336 bf16), 2048 columns at
    4 warps beat 1024/4, 2048/8, 4096/8, 4096/16 and 8192/16 for all three kernels, silu_and_mul at 4.0 TB/s (a copy:
    4.1)."""
    block = min(max(pow2(n), 128), 2048)
    return block, max(1, min(4, block // 256))


def _silu_and_mul_op(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """Writes silu(gate) * up into `out`; gate, up and out all (..., N) of one dtype, any strides."""
    if out.numel() == 0:
        return
    if gate.is_contiguous() and up.is_contiguous() and out.is_contiguous():
        block = FLAT["BLOCK"]
        grid = (cdiv(out.numel(), block),)
        launchable(_silu_and_mul_flat_kernel)[grid](gate, up, out, out.numel(), BLOCK=block,
                                                    num_warps=FLAT["num_warps"], **launch_options(out))  # fmt: skip
        return
    r0, r1, (sg, su, so) = _row_dims(gate, up, out)
    n = out.shape[-1]
    block, num_warps = _launch(n)
    grid = (r0 * r1, cdiv(n, block))
    launchable(_silu_and_mul_kernel)[grid](
        gate, up, out, r1, n, *sg, *su, *so, BLOCK=block, num_warps=num_warps, **launch_options(out)
    )


triton_op("fusionscope::silu_and_mul", mutates_args={"out"})(_silu_and_mul_op)


def glu_operands(
    name: str, gate: torch.Tensor, up: torch.Tensor | None, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked (gate, up, out) of a gated activation: `up=None` splits a fused gate_up output into its two halves
    (views, no copy); `out` is allocated when None. Shared by silu_and_mul and gelu_and_mul; `name` prefixes errors."""
    if gate.dtype not in _DTYPES:
        raise ValueError(f"{name}: gate must be fp32, fp16 or bf16, got {gate.dtype}")
    if gate.dim() == 0:
        raise ValueError(f"{name}: gate must have at least one dim")
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"{name}: with up=None, gate's last dim holds gate and up halves and must be even, "
                f"got shape {tuple(gate.shape)}"
            )
        gate, up = gate.chunk(2, -1)
    elif up.shape != gate.shape:
        raise ValueError(f"{name}: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    elif up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(
            f"{name}: gate and up must share dtype and device, got {gate.dtype} on {gate.device} "
            f"and {up.dtype} on {up.device}"
        )
    if out is None:
        out = new_output(gate)
    elif out.shape != gate.shape or out.dtype != gate.dtype or out.device != gate.device:
        raise ValueError(
            f"{name}: out must be {tuple(gate.shape)} {gate.dtype} on {gate.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return gate, up, out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU in one kernel: `silu(gate) * up`, rounded as eager PyTorch rounds the two ops.

    gate: (..., 2·I) with the gate half first when `up` is None (a fused gate_up projection's output), else (..., I);
    up: (..., I) or None; fp32/fp16/bf16, all one dtype and device. out: optional preallocated (..., I) buffer of the
    same dtype. Returns out.
    """
    gate, up, out = glu_operands("silu_and_mul", gate, up, out)
    run("silu_and_mul", _silu_and_mul_op, gate, up, out)
    return out
