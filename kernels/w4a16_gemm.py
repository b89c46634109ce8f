"""W4A16: a GEMM whose int4 weights are dequantised in registers on the way into the dot, never written to memory.

A weight-only quantised Linear run as people write it in PyTorch unpacks the int4 weight with shifts and masks, casts
it, subtracts the zero point, multiplies by the scale — each op a kernel writing a full K×N temporary — and only then
calls cuBLAS on a bf16 weight it has just written. Per call, x: (M, K), K×N weights, activations of s bytes, group
size g (`w4a16_reference` is that chain, op by op):
    unfused = K·N·(0.5 + 4   shift: read the packed weight, write int32
                   + 4 + 4     mask: read and write int32 (the reshape and the slice are views)
                   + 1 + s     expand the zeros (uint8) and the scales to K×N
                   + 4 + s     cast q to the activations' dtype
                   + 1 + s     cast the zeros
                   + 3·s       subtract
                   + 3·s       multiply by the scales
                   + s)        the GEMM reads the weight back
              + (M·K + M·N)·s
            ≈ 38.5·K·N bytes in bf16 (s = 2), 19× the bf16 GEMM's 2·K·N, in 8 kernels and the GEMM
    fused   = K·N·0.5 + (K/g)·N·(s + 1) + (M·K + M·N)·s
            ≈ 0.523·K·N bytes in bf16 at g = 128, 3.8× fewer than the bf16 GEMM's 2·K·N
At decode sizes (M ≤ 16) the weight read is the whole cost, so the fused kernel is a weight-streaming problem: its
floor is 0.523·K·N bytes at the copy bandwidth.

## The packed layout (ours), `PackedW4`
- `qweight`: int32 (16·⌈K/128⌉, N). K is cut into blocks of 128 inputs; input k = 128·b + 16·j + r (block b, nibble
  j in 0..7, row r in 0..15) of output n is `(qweight[16·b + r, n] >> 4·j) & 0xF`. Unused nibbles past K are 0.
- `scales`: (G, N) in the activations' dtype, G = ⌈K/g⌉; `zeros`: uint8 (G, N), each in 0..15.
- w[k, n] = (q[k, n] − zeros[k // g, n]) · scales[k // g, n], and the GEMM is out = x @ w (+ bias), i.e. w is the
  transpose of nn.Linear's (N, K) weight. Symmetric quantisation is zeros = 8.
- g is a power of two ≥ 16 (32, 64 and 128 are the common ones) or ≥ K: one group per output channel.
- Bytes per weight: 0.5 + (s + 1)/g — 0.5234 at g = 128 in bf16 (0.5469 at 32, 0.5 + 3/K per channel).
Why this order: unpacking nibble j of a (16, BLOCK_N) slab of `qweight` yields 16 *consecutive* inputs, so each of the
8 planes of a block is one (BLOCK_M, 16) × (16, BLOCK_N) dot against a contiguous slice of x: no reshape or
interleave of registers, no strided gather of x, and the slab is loaded once (not once per nibble). N is the
contiguous dimension, so a program's (16, BLOCK_N) slab is 16 runs of 4·BLOCK_N bytes. GPTQ (K-packed, nibble j of
row i is input 8·i + j) and AWQ (N-packed in the order 0, 2, 4, 6, 1, 3, 5, 7) checkpoints convert with `from_gptq`
and `from_awq`, once, at load or patch time.

## Dequantising in registers
Per plane: `(packed >> 4·j) & 0xF | 0x4B000000` read as fp32 is 2²³ + q exactly, so subtracting 2²³ + zero (computed
once per group row) gives q − zero with one integer op and one fp32 add, where `q.to(float32)` would be an int-to-float
conversion, which the CUDA C Programming Guide's throughput table lists at 16 per clock per SM on sm_80/sm_90 against
128 for fp32 adds (the table, not a measurement here): at 4096 × 14336 the conversions alone would take ~14 µs on an
H200 by that rate, twice the weight read (~7 µs). The product (q − zero) · scale is exact in fp32 (a 4-bit integer
times a 16-bit float) and rounded once to the activations' dtype, so the fused kernel feeds the dot the very weights
the unfused chain writes; fused and unfused differ only in the order of the fp32 accumulation.

## Two schedules (`TILES`, fixed per regime: no autotuning, nothing at call time that a CUDA graph could not capture)
- decode (M ≤ 16): one 16-row tile, narrow column tiles, and split-K over the 128-blocks of K so that the programs
  outnumber the SMs (`FILL`): at K × N = 4096 × 4096 a 64-column tile gives 64 tiles, too few for 132 SMs, so K is
  split in 8 (512 programs); 14336 × 4096 is split in 8 too, 4096 × 14336 (224 tiles) in 2. The splits write fp32
  partial sums to a workspace the public function allocates with the output ((splits, M, N) fp32, the same size every
  call of a shape), and a second launch adds them in a fixed order (deterministic), adds the bias and rounds once.
- prefill (M > 16): 64- or 128-row tiles on the tensor cores, the dequantised plane going straight into `tl.dot` inside
  the K loop, grouped tile order for L2 reuse of the weight.
The tile sizes are the fastest of `reports/w4a16/gpu_w4a16.py tune` on an H200 (reports/w4a16/README.md), for decode
and for M = 4096; the 17–256-row tiles have not been measured.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, pow2, run
from fusionscope.kernels.rounding import round_to
from torch.library import triton_op

BLOCK = 128  # inputs per block of `qweight`: 16 rows × 8 nibbles
ROWS = 16  # int32 rows of `qweight` per block
NIBBLES = 8
MAGIC = 0x4B000000  # fp32 bits of 2**23: OR-ing a 4-bit q into the mantissa gives the float 2**23 + q
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PackedW4(NamedTuple):
    """Int4 weights in the layout above: `w4a16_gemm(x, *packed)` takes them as they are."""

    qweight: torch.Tensor  # int32 (16·⌈K/128⌉, N)
    scales: torch.Tensor  # (G, N), the activations' dtype
    zeros: torch.Tensor  # uint8 (G, N), 0..15
    group_size: int  # inputs per group; ≥ K: one group per output channel


# ---------------------------------------------------------------------------------------------- layout, plain torch


def group_count(K: int, group_size: int) -> int:
    """G, the rows of `scales` and `zeros`: ⌈K / g⌉ (1 for per-channel, g ≥ K)."""
    return 1 if group_size >= K else cdiv(K, group_size)


def check_group_size(group_size: int, K: int) -> int:
    """The group size as the kernel takes it: a power of two ≥ 16, or ≥ K (per channel); -1 means per channel and
    becomes K. ValueError otherwise (the kernel reloads a plane's scales only where a group starts, which it knows at
    compile time for these sizes)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size == -1:
        return K
    if group_size >= K or (group_size >= ROWS and group_size & (group_size - 1) == 0):
        return group_size
    raise ValueError(f"group_size must be a power of two >= {ROWS}, or >= K = {K} (per channel; -1), got {group_size}")


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """q: (K, N) integers in 0..15 → `qweight` (16·⌈K/128⌉, N) int32 in the layout of the module docstring."""
    K, N = q.shape
    blocks = cdiv(K, BLOCK)
    padded = torch.zeros(blocks * BLOCK, N, dtype=torch.int64, device=q.device)
    padded[:K] = q.to(torch.int64)
    planes = padded.view(blocks, NIBBLES, ROWS, N)  # input 128·b + 16·j + r at [b, j, r]
    shifts = (4 * torch.arange(NIBBLES, device=q.device, dtype=torch.int64)).view(1, NIBBLES, 1, 1)
    words = (planes << shifts).sum(dim=1)  # disjoint bits: the sum is the OR, in int64 (nibble 7 reaches bit 31)
    words = torch.where(words >= 2**31, words - 2**32, words)  # as two's-complement int32
    return words.reshape(blocks * ROWS, N).to(torch.int32)


def unpack_w4(qweight: torch.Tensor, K: int) -> torch.Tensor:
    """`qweight` → q: (K, N) int32 in 0..15, in plain PyTorch: shift, mask, reorder the planes, drop the padding."""
    rows, N = qweight.shape
    blocks = rows // ROWS
    shifts = 4 * torch.arange(NIBBLES, device=qweight.device, dtype=torch.int32)
    q = (qweight.reshape(blocks, 1, ROWS, N) >> shifts.view(1, NIBBLES, 1, 1)) & 0xF  # (blocks, 8, 16, N)
    return q.reshape(blocks * BLOCK, N)[:K]


def dequantize_w4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, K: int
) -> torch.Tensor:
    """w: (K, N) in the scales' dtype, w[k, n] = (q[k, n] − zeros[k // g, n]) · scales[k // g, n] — written op by op
    as a quantised Linear's forward writes it (each line a kernel and a K×N temporary on the GPU)."""
    group_size = check_group_size(group_size, K)
    per = min(group_size, K)
    q = unpack_w4(qweight, K)  # shift: read K·N/2, write 4·K·N; mask: read and write 4·K·N; slice: a view
    z = zeros.repeat_interleave(per, dim=0)[:K]  # read G·N, write K·N
    s = scales.repeat_interleave(per, dim=0)[:K]  # read G·N·s, write K·N·s
    return (q.to(s.dtype) - z.to(s.dtype)) * s  # casts: read 4·K·N and K·N; sub, mul: read 2, write 1 K·N·s each


def w4a16_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused chain and the one reference: dequantise into a full weight, then the GEMM (cuBLAS on the GPU).
    x: (..., K); returns (..., N) in the scales' dtype (x's, as `w4a16_gemm` requires). In float64 (x, scales and
    bias as float64) it is the exact answer the kernel is checked against."""
    w = dequantize_w4(qweight, scales, zeros, group_size, x.shape[-1])
    return F.linear(x, w.t(), bias)  # read K·N·s + M·K·s, write M·N·s


def quantize_w4(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> PackedW4:
    """Round-to-nearest int4 quantisation of an nn.Linear weight: (N, K), any float dtype → `PackedW4`, the scales in
    the weight's dtype.

    Asymmetric (GPTQ's min/max rule): per group, lo = min(w, 0), hi = max(w, 0), scale = (hi − lo)/15, zero =
    round(−lo/scale), so 0 is exact and zero lies in 0..15. Symmetric: scale = 2·max|w|/15, zero = 8. The scale is
    rounded to its storage dtype before q = clamp(round(w/scale) + zero, 0, 15) is taken against it. A group of zeros
    gets scale 1. group_size: a power of two ≥ 16, or -1 / ≥ K for one group per output channel."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float (N, K) tensor, got {tuple(weight.shape)} {weight.dtype}")
    N, K = weight.shape
    group_size = check_group_size(group_size, K)
    per = min(group_size, K)
    G = group_count(K, group_size)
    w = weight.detach().to(torch.float32).t()  # (K, N)
    if G * per > K:  # pad the last group with copies of its last row: min and max unchanged
        w = torch.cat([w, w[-1:].expand(G * per - K, N)])
    groups = w.reshape(G, per, N)
    if symmetric:
        scale = groups.abs().amax(dim=1) * (2 / 15)
    else:
        lo, hi = groups.amin(dim=1).clamp(max=0), groups.amax(dim=1).clamp(min=0)
        scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(weight.dtype)
    stored = scale.to(torch.float32)
    zero = torch.full_like(stored, 8.0) if symmetric else torch.round(-lo / stored).clamp(0, 15)
    q = torch.round(groups / stored[:, None]) + zero[:, None]
    q = q.clamp(0, 15).reshape(G * per, N)[:K]
    return PackedW4(pack_w4(q), scale, zero.to(torch.uint8), group_size)


# ----------------------------------------------------------------------------------------------------- conversions


def _unpack_int32(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """(R, C) int32, 8 nibbles per word along the last dim → (R, 8·C): value i of word c is nibble order[i]."""
    shifts = torch.tensor([4 * o for o in order], dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
) -> PackedW4:
    """A 4-bit GPTQ checkpoint's tensors → `PackedW4`. qweight: int32 (K/8, N), input 8·i + j of output n in nibble j
    of qweight[i, n]; qzeros: int32 (G, N/8), output 8·c + j's zero in nibble j of qzeros[g, c]; scales: (G, N).

    zero_offset: GPTQ's original format (AutoGPTQ, transformers' GPTQ checkpoints) stores zero − 1 and its kernels add
    1 back, modulo 16; `zero_offset=0` reads the later "gptq_v2" format, which stores the zero itself.
    g_idx: (K,) group of each input; only the plain order k // g is accepted. Act-order checkpoints (desc_act=True)
    permute the groups along K, which this layout does not hold: ValueError."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError("from_gptq takes int32 qweight (K/8, N) and qzeros (G, N/8), as 4-bit GPTQ stores them")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    G = scales.shape[0]
    if scales.shape != (G, N) or qzeros.shape != (G, cdiv(N, 8)) or K % G:
        raise ValueError(f"GPTQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")  # fmt: skip
    group_size = K // G
    if g_idx is not None:
        plain = torch.arange(K, device=g_idx.device) // group_size
        if g_idx.shape != (K,) or not torch.equal(g_idx.to(plain.dtype), plain):
            raise ValueError(
                "act-order GPTQ (g_idx permutes the groups along K, desc_act=True) is not supported: "
                "the packed layout holds groups of consecutive inputs; re-quantise without act-order"
            )
    q = _unpack_int32(qweight.t(), tuple(range(8))).t()  # (K, N)
    zeros = (_unpack_int32(qzeros, tuple(range(8)))[:, :N] + zero_offset) & 0xF
    return PackedW4(pack_w4(q), scales, zeros.to(torch.uint8), check_group_size(group_size, K))


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs output 8·c + AWQ_ORDER[i] into nibble i of word c


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> PackedW4:
    """A 4-bit AWQ (GEMM format) checkpoint's tensors → `PackedW4`. qweight: int32 (K, N/8) packed along the outputs,
    output 8·c + AWQ_ORDER[i] of input k in nibble i of qweight[k, c]; qzeros: int32 (G, N/8) packed the same way;
    scales: (G, N). The zeros are stored as they are (no offset)."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError("from_awq takes int32 qweight (K, N/8) and qzeros (G, N/8), as 4-bit AWQ stores them")
    K, N = qweight.shape[0], scales.shape[1]
    G = scales.shape[0]
    if qweight.shape[1] * 8 != N or qzeros.shape != (G, N // 8) or K % G:
        raise ValueError(f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")  # fmt: skip
    inverse = tuple(AWQ_ORDER.index(i) for i in range(8))  # nibble that holds output 8·c + i
    q = _unpack_int32(qweight, inverse)  # (K, N)
    zeros = _unpack_int32(qzeros, inverse)
    return PackedW4(pack_w4(q), scales, zeros.to(torch.uint8), check_group_size(K // G, K))


# ---------------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _w4a16_kernel(
    x_ptr,  # (M, K) activations; strides stride_xm, stride_xk
    qw_ptr,  # (16·⌈K/128⌉, N) int32 packed weights; strides stride_qk, stride_qn
    s_ptr,  # (G, N) scales in x's dtype; strides stride_sg, stride_sn
    z_ptr,  # (G, N) uint8 zero points; strides stride_zg, stride_zn
    b_ptr,  # (N,) bias, stride stride_b; read only if HAS_BIAS and not PARTIAL
    out_ptr,  # (M, N) output; or with PARTIAL the (splits, M, N) fp32 workspace (stride_os between splits)
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_b,
    stride_os,
    stride_om,
    stride_on,
    blocks_per_split,  # 128-input blocks of K each program along axis 1 handles (a multiple of SUBBLOCKS)
    GROUP: tl.constexpr,  # group size (a power of two ≥ 16); 0: one group per output channel
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # write fp32 partial sums of one split (the sum kernel finishes)
    UPCAST: tl.constexpr,  # interpreter: feed tl.dot fp32 tiles (its bf16 dot is wrong)
    PRECISION: tl.constexpr,  # "ieee" for fp32 activations, else unused ("tf32")
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBBLOCKS: tl.constexpr,  # 128-blocks per loop step: BLOCK_K / 128
    GROUP_M: tl.constexpr,
):
    # Grouped tile order (triton tutorial 03): GROUP_M row tiles share a column tile's weights while they are in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size_m)
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    m_ok = rm < M
    n_ok = rn < N
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # (BLOCK_M, 1)
    qw_cols = qw_ptr + rn[None, :] * stride_qn  # (1, BLOCK_N)

    first = tl.program_id(1) * blocks_per_split
    last = min(first + blocks_per_split, tl.cdiv(K, 128))
    k_end = min(last * 128, K)  # this split's inputs end here
    if GROUP == 0:  # one group: its scales and zeros once, for the whole of K
        s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + rn * stride_zn, mask=n_ok, other=0).to(tl.float32) + 8388608.0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last, SUBBLOCKS):
        for c in tl.static_range(SUBBLOCKS):
            b = step + c  # the last step of a split may hold fewer blocks than SUBBLOCKS: masked by `last`
            rows = b * 16 + rr
            slab = tl.load(
                qw_cols + rows[:, None].to(tl.int64) * stride_qk,
                mask=(rows < last * 16)[:, None] & n_ok[None, :],
                other=0,
            )  # (16, BLOCK_N) int32: 8 planes of 16 consecutive inputs
            for j in tl.static_range(8):
                k0 = b * 128 + 16 * j  # first input of this plane
                # nested, not `and`: both tests are compile-time, and the second divides by GROUP
                if GROUP != 0:  # noqa: SIM102
                    if (16 * j) % GROUP == 0:  # a group starts here (GROUP ≥ 128: only at j = 0)
                        g = min(k0, K - 1) // GROUP  # a plane past K (x masked to 0 there) reads the last group
                        s = tl.load(s_ptr + g * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
                        zf = tl.load(z_ptr + g * stride_zg + rn * stride_zn, mask=n_ok, other=0).to(tl.float32)
                        zf = zf + 8388608.0
                bits = ((slab >> (4 * j)) & 0xF) | 0x4B000000  # the fp32 2**23 + q
                w = (bits.to(tl.float32, bitcast=True) - zf[None, :]) * s[None, :]  # exact (q − zero) · scale
                rk = k0 + rr
                xj = tl.load(x_rows + rk[None, :] * stride_xk, mask=m_ok[:, None] & (rk < k_end)[None, :], other=0.0)
                if UPCAST:
                    acc = tl.dot(xj.to(tl.float32), round_to(w, dtype), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xj, w.to(dtype), acc, input_precision=PRECISION)

    out_mask = m_ok[:, None] & n_ok[None, :]
    offsets = rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_os + offsets, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn * stride_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if UPCAST:  # the interpreter truncates fp32 → bf16: round to nearest by hand (`rounding`)
            acc = round_to(acc, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_sum_kernel(
    ws_ptr,  # (SPLITS, M, N) fp32 partial sums, contiguous
    b_ptr,  # (N,) bias, stride stride_b; read only if HAS_BIAS
    out_ptr,  # (M, N) output; strides stride_om, stride_on
    M,
    N,
    stride_b,
    stride_om,
    stride_on,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: round to nearest by hand
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # a fixed order: the same sum every call
        acc += tl.load(ws_ptr + split * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n * stride_b, mask=ok, other=0.0).to(tl.float32)
    if UPCAST:
        acc = round_to(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------------- schedule

# Tiles by the number of rows M: (largest M, config); the first entry whose bound M does not exceed applies. BLOCK_K is
# a multiple of 128 (one block of `qweight`). SPLIT_K: 0 picks the split by `FILL`, n ≥ 1 forces n (capped by the
# blocks of K). decode and large: the fastest configurations of `reports/w4a16/gpu_w4a16.py tune` on an H200
# (2026-12-01, group 128, bf16, CUDA-graph replay medians; reports/w4a16/h200-2216/w4a16_tune.log), against the first
# choices BLOCK_K 256 (decode) and BLOCK_N 128 (large): decode BLOCK_K 128 at M = 1 / 16 took 11.80 / 12.11 µs at
# 4096 → 4096 (12.19 / 13.20 before), 33.86 / 35.27 at 4096 → 14336 (33.95 / 35.98), 30.25 / 31.46 at 14336 → 4096
# (30.69 / 32.48); large BLOCK_N 256 at M = 4096 took 492 / 1798 / 1849 µs (636 / 2191 / 2076). That 128 × 256 tile
# needs Hopper-class shared memory (it compiled within the H200's 227 KiB); small is still a first choice.
TILES = Tunables(
    decode=(16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0, "GROUP_M": 1, "num_warps": 4,
                 "num_stages": 3}),
    small=(256, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8, "num_warps": 4,
                 "num_stages": 3}),
    large=(None, {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8, "num_warps": 8,
                  "num_stages": 3}),
)  # fmt: skip
# SPLIT_K = 0: the smallest power-of-two split giving at least programs_per_sm programs per SM, at most max_split.
FILL = Tunables(programs_per_sm=2, max_split=16)
# Under the Triton interpreter (CPU tensors) a program costs per operation, not per element, so tiles there are as
# wide as numpy handles well: one SmolLM2-135M projection (16 × 576 → 1536, bf16) took 3.9 s with the decode tiles
# and 0.2 s with 2048 columns (2-core CPU, 2026-12-02). The block schedule along K is the GPU's.
INTERPRETER = Tunables(enabled=True, BLOCK_M=64, BLOCK_N=2048)
SUM_BLOCK = 1024  # elements per program of the split sum


def tiles_for(M: int) -> dict[str, int]:
    """The tile configuration of `TILES` for M rows."""
    for bound, config in TILES.values():
        if bound is None or bound >= M:
            return config
    raise ValueError("TILES needs a last entry without a bound")


@functools.cache
def _sm_count_of(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.compiler.assume_constant_result
def _sm_count(device: int) -> int:
    """The GPU's SM count; a constant to torch.compile, which traces `schedule` in the public function."""
    return _sm_count_of(device)


class Schedule(NamedTuple):
    """How one call is launched: the tiles, how many splits of K, and the 128-blocks each split handles."""

    tiles: dict[str, int]
    splits: int
    blocks_per_split: int


def schedule(M: int, N: int, K: int, device: torch.device) -> Schedule:
    """The launch of an (M, K) × (K, N) call: a function of the shape and the device only (the public function
    allocates the split-K workspace from it, the launcher launches from it)."""
    tiles = tiles_for(M)
    if device.type != "cuda" and INTERPRETER["enabled"]:
        tiles = dict(tiles, BLOCK_M=max(tiles["BLOCK_M"], min(pow2(M), INTERPRETER["BLOCK_M"])),
                     BLOCK_N=max(tiles["BLOCK_N"], min(pow2(N), INTERPRETER["BLOCK_N"])))  # fmt: skip
    sub = tiles["BLOCK_K"] // BLOCK
    steps = cdiv(cdiv(K, BLOCK), sub)  # loop steps over all of K
    split = int(tiles["SPLIT_K"])
    if split <= 0:
        programs = cdiv(M, tiles["BLOCK_M"]) * cdiv(N, tiles["BLOCK_N"])
        target = FILL["programs_per_sm"] * (_sm_count(device.index or 0) if device.type == "cuda" else 1)
        split = 1
        while programs * split < target and split * 2 <= min(steps, FILL["max_split"]):
            split *= 2
    per_split = cdiv(steps, min(split, steps))  # steps per split
    return Schedule(tiles, cdiv(steps, per_split), per_split * sub)


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
) -> None:
    M, K = x.shape
    N = qweight.shape[1]
    plan = schedule(M, N, K, x.device)
    tiles = plan.tiles
    partial = workspace is not None
    target = workspace if partial else out
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (cdiv(M, tiles["BLOCK_M"]) * cdiv(N, tiles["BLOCK_N"]), plan.splits)
    launchable(_w4a16_kernel)[grid](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        target,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        bias.stride(0) if bias is not None else 0,
        target.stride(0) if partial else 0,
        target.stride(-2),
        target.stride(-1),
        plan.blocks_per_split,
        GROUP=0 if group_count(K, group_size) == 1 else group_size,
        HAS_BIAS=bias is not None,
        PARTIAL=partial,
        UPCAST=interpreted,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_N=tiles["BLOCK_N"],
        SUBBLOCKS=tiles["BLOCK_K"] // BLOCK,
        GROUP_M=tiles["GROUP_M"],
        num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"],
    )
    if partial:
        launchable(_split_sum_kernel)[(cdiv(M * N, SUM_BLOCK),)](
            workspace,
            bias if bias is not None else scales,
            out,
            M,
            N,
            bias.stride(0) if bias is not None else 0,
            out.stride(0),
            out.stride(1),
            SPLITS=workspace.shape[0],
            HAS_BIAS=bias is not None,
            UPCAST=interpreted,
            BLOCK=SUM_BLOCK,
            num_warps=4,
        )


def _w4a16_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
) -> None:
    _launch(x, qweight, scales, zeros, group_size, bias, out, workspace)


triton_op("fusionscope::w4a16_gemm", mutates_args={"out", "workspace"})(_w4a16_op)


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> int:
    """ValueError naming what disagrees; returns the group size as the kernel takes it."""
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be (..., K) fp32/fp16/bf16, got {tuple(x.shape)} {x.dtype}")
    K = x.shape[-1]
    if K == 0:
        raise ValueError("x must have K >= 1 inputs")
    group_size = check_group_size(group_size, K)
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] != ROWS * cdiv(K, BLOCK):
        raise ValueError(f"qweight must be int32 ({ROWS * cdiv(K, BLOCK)}, N) for K = {K} (16 rows per 128 inputs), "
                         f"got {tuple(qweight.shape)} {qweight.dtype}")  # fmt: skip
    N, G = qweight.shape[1], group_count(K, group_size)
    if tuple(scales.shape) != (G, N) or scales.dtype != x.dtype:
        raise ValueError(f"scales must be ({G}, {N}) {x.dtype} (x's dtype), got {tuple(scales.shape)} {scales.dtype}")
    if tuple(zeros.shape) != (G, N) or zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be ({G}, {N}) uint8, got {tuple(zeros.shape)} {zeros.dtype}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({N},) {x.dtype} or None, got {tuple(bias.shape)} {bias.dtype}")
    tensors = [x, qweight, scales, zeros] + ([bias] if bias is not None else [])
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    return group_size


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ dequantised(qweight) (+ bias) with the int4 weights dequantised in registers (layout: module docstring).

    x: (..., K) fp32/fp16/bf16, any strides (leading dims that do not flatten to rows are copied first); qweight,
    scales, zeros: a `PackedW4`'s tensors (any strides); scales and bias in x's dtype; group_size as in `PackedW4`.
    Returns (..., N) in x's dtype, into `out` if given (leading dims flattening to rows, any strides). Besides the
    output, a decode call split along K allocates its (splits, M, N) fp32 workspace: a fixed size per shape, so a CUDA
    graph can capture the call. For inference: the result carries no autograd history."""
    group_size = _check(x, qweight, scales, zeros, group_size, bias)
    K, N = x.shape[-1], qweight.shape[1]
    x2d = x.reshape(math.prod(x.shape[:-1]), K)
    M = x2d.shape[0]
    out_shape = (*x.shape[:-1], N)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {out_shape} {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    try:
        out2d = out.view(M, N)
    except RuntimeError:
        raise ValueError(f"out's leading dims must flatten to rows without a copy (strides {out.stride()})") from None
    if M == 0 or N == 0:
        return out
    splits = schedule(M, N, K, x.device).splits
    workspace = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else None
    run("w4a16_gemm", _w4a16_op, x2d, qweight, scales, zeros, group_size, bias, out2d, workspace)
    return out
