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
Tensor-core kernel, per plane: `(packed >> 4·j) & 0xF | 0x4B000000` read as fp32 is 2²³ + q exactly, so subtracting
2²³ + zero (computed once per group row) gives q − zero with one integer op and one fp32 add, where `q.to(float32)`
would be an int-to-float conversion, which the CUDA C Programming Guide's throughput table lists at 16 per clock per SM
on sm_80/sm_90 against 128 for fp32 adds (the table, not a measurement here): at 4096 × 14336 the conversions alone
would take ~14 µs on an H200 by that rate, twice the weight read (~7 µs). The product (q − zero) · scale is exact in
fp32 (a 4-bit integer times a 16-bit float) and rounded once to the activations' dtype, so the tensor-core kernel feeds
the dot the very weights the unfused chain writes: the two differ only in the order of the fp32 accumulation.
GEMV kernel: no shift for nibbles 0–3 — the nibble at bits 4i..4i+3 OR-ed with the exponent of 2^(23 − 4i) reads as
2^(23 − 4i) + q, its lowest bit worth 1 — and one shift of the word by 16 for nibbles 4–7: one AND-OR per weight
(ptxas makes it one LOP3), one fp32 subtract of 2^(23 − 4i) + zero, then one FMA per row of x. The scale multiplies
each group's fp32 sum of x·(q − zero) once per column, never a weight, so no weight is rounded: the GEMV is at least as
close to the float64 answer as the unfused chain (tests check it) but not bit-comparable to it.

## Schedules (`TILES`, fixed per range of M: no autotuning, nothing at call time that a CUDA graph could not capture)
At decode sizes a call is a weight-streaming problem; what limits a kernel is bytes in flight and instructions per
weight, not FLOPs. The schedule measured on the H200 on 2026-12-01 (`SHIPPED_BEFORE`: 16-row MMA tiles, 64 columns, 8
dots with K = 16 per 128-block) read at 25–37% of the copy bandwidth at M = 1–16 whatever its tiles: for one row the
MMA does 16× the needed work and each plane's operand goes through a layout conversion.
- gemv (M = 1, `_w4a16_gemv_kernel`): CUDA cores, no tl.dot. A program owns BLOCK_N columns (256: each of the 16 rows
  of a block's slab is a 1 KiB contiguous run of `qweight`) and a range of 128-blocks along K; it keeps one (16,
  BLOCK_N) fp32 accumulator per row of x (BLOCK_M ≤ 4 rows per program, each weight dequantised once for all of
  them) and sums the 16 slab rows only at the end, so nothing in the loop leaves the slab's register layout.
  PREFETCH loads block b + 1 before working on block b (Triton's pipeliner only stages loads that feed a dot; the
  bytes in flight come from this, from the resident programs and from BLOCK_K's blocks per step). Split-K as below.
  Compiled for sm_90 here (Triton 3.9, ptxas, no GPU): 128 registers at M = 1 and 254 at M = 4 with 8 warps, no
  spills; per weight at M = 1 one FFMA, one LOP3 and about one FADD, and in all 5.7–7.8 SASS instructions per weight
  for 512–256 columns (the whole kernel's count over one step's weights, prologue included; the rest is x loads,
  their bf16 → fp32 and addressing, shared by BLOCK_N / 32 columns per thread). At 132 SMs issuing 128 per clock at
  1.98 GHz that is 10–14 µs for 4096 × 14336 against ~7 µs for its 30.8 MB at 4.4 TB/s: issue, not bandwidth, may
  be the limit at M = 1, more so at M = 4 (one FFMA per row); the sweep measures it.
- decode (2 ≤ M ≤ 16) and prefill (M > 16, `_w4a16_mma_kernel`): tensor cores, the dequantisation inside the K loop.
  UNPACK "tile" unpacks a whole (16·BLOCK_K/128, BLOCK_N) slab at once: viewed as (blocks, 1, 16, BLOCK_N) and
  shifted by the 8 nibble offsets it is (blocks, 8, 16, BLOCK_N), whose first three dims merge into BLOCK_K inputs in
  their natural order (input 128·b + 16·j + r), so each step is one dot with K = BLOCK_K ≥ 128 against a contiguous
  x tile, and Triton pipelines both loads (cp.async, num_stages buffers) into one wgmma per step (sm_90 TTGIR: no
  layout conversion in the loop). Its known cost: each thread holds one column's consecutive inputs while the
  operand's shared layout is N-major, so the dequantised tile is stored with one 2-byte store per weight. UNPACK
  "planes" is the schedule measured before (8 dots of K = 16 per block). Grouped tile order (GROUP_M) for L2 reuse.
- split-K (both kernels): SPLIT_K = 0 splits K in the smallest power of two giving `FILL` programs per SM (at most
  max_split); the splits write fp32 partial sums to a workspace the public function allocates with the output
  ((splits, M, N) fp32, the same size every call of a shape), and a second launch adds them in a fixed order
  (deterministic), adds the bias and rounds once.
The shipped tiles are the sweep's best on the H200 (2026-12-02 11:48, `reports/w4a16/w4a16_sweep_1148.*`: 23
schedules, each checked against float64, then timed against bf16 cuBLAS with L2-cold weights on Llama-3-8B's three
projection shapes): M = 1 the GEMV with 128 columns and 256 inputs per step, 4 warps, no prefetch (10.1 / 25.0 /
25.2 µs: 1.27× faster than bf16 cuBLAS by geometric mean, at 21–29% of the read roof — issue-bound, as counted
above); M = 4 and 16 the tile-unpacking MMA with 16 × 64 × 128 tiles (≈ bf16 cuBLAS, 0.99–1.01×; the GEMV at M = 4
was 0.56–0.65×); M = 4096 256 × 128 × 128 with 8 warps and 2 stages (0.52× bf16 cuBLAS; the schedule before 0.35×).
M from 17 to 256 keeps an unmeasured first choice.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, pow2, run, sm_count
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
def _x_times(x_ptr, row, M, stride_xm, stride_xk, rk, k_end, w):
    """x[row, rk] (masked to 0 past M and k_end) as fp32, times w (16, BLOCK_N) row by row: one FMA per weight."""
    end = tl.where(row < M, k_end, 0)  # a row past M reads nothing
    xj = tl.load(x_ptr + row.to(tl.int64) * stride_xm + rk * stride_xk, mask=rk < end, other=0.0)
    return xj.to(tl.float32)[:, None] * w


@triton.jit
def _store_row(out_ptr, row, M, N, rn, stride_om, stride_on, acc, b_ptr, stride_b, HAS_BIAS: tl.constexpr,
               UPCAST: tl.constexpr, PARTIAL: tl.constexpr):  # fmt: skip
    """One row's (16, BLOCK_N) sums reduced over the slab rows and stored: as fp32 partial sums (PARTIAL), or + bias,
    rounded once to the output's dtype."""
    total = tl.sum(acc, axis=0)
    end = tl.where(row < M, N, 0)  # a row past M writes nothing
    offsets = row.to(tl.int64) * stride_om + rn * stride_on
    if PARTIAL:
        tl.store(out_ptr + offsets, total, mask=rn < end)
    else:
        if HAS_BIAS:
            total += tl.load(b_ptr + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)
        if UPCAST:  # the interpreter truncates fp32 → bf16: round to nearest by hand (`rounding`)
            total = round_to(total, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=rn < end)


@triton.jit
def _gemv_block(
    slab,  # (16, BLOCK_N) int32: block b of `qweight`, its 8 planes of 16 consecutive inputs
    b,
    x_ptr,
    s_ptr,
    z_ptr,
    row0,
    M,
    K,
    k_end,
    rn,
    n_ok,
    stride_xm,
    stride_xk,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    acc0,
    acc1,
    acc2,
    acc3,
    s,  # GROUP == 0: the scales of the one group, as fp32; otherwise unused (loaded here)
    zf,  # GROUP == 0: the zeros, as fp32; otherwise unused
    GROUP: tl.constexpr,
    PLANES: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Add one 128-block's products to the per-row (16, BLOCK_N) accumulators; returns them."""
    rr = tl.arange(0, 16)
    high = slab >> 16  # nibbles 4-7 at bits 0-15 (the sign bits above are masked off)
    for j in tl.static_range(8):
        k0 = b * 128 + 16 * j  # first input of this plane
        if GROUP != 0:  # noqa: SIM102 (both tests are compile-time)
            if j % PLANES == 0:  # a group starts here (or, for GROUP > 128, this block's part of one)
                g = min(k0, K - 1) // GROUP  # a plane past K (x masked to 0 there) reads the last group
                s = tl.load(s_ptr + g * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
                zf = tl.load(z_ptr + g * stride_zg + rn * stride_zn, mask=n_ok, other=0).to(tl.float32)
        # The nibble at bits 4i..4i+3 of a word OR-ed with the exponent of 2**(23 - 4i) reads as the fp32
        # 2**(23 - 4i) + q: its lowest bit is worth 1 there. Subtracting 2**(23 - 4i) + zero gives q − zero.
        word = slab if j < 4 else high
        bits = (word & (0xF << (4 * (j % 4)))) | ((150 - 4 * (j % 4)) << 23)
        w = bits.to(tl.float32, bitcast=True) - (zf + (1 << (23 - 4 * (j % 4))))[None, :]  # q − zero, exact
        rk = k0 + rr
        p0 = _x_times(x_ptr, row0, M, stride_xm, stride_xk, rk, k_end, w)
        if BLOCK_M > 1:
            p1 = _x_times(x_ptr, row0 + 1, M, stride_xm, stride_xk, rk, k_end, w)
        if BLOCK_M > 2:
            p2 = _x_times(x_ptr, row0 + 2, M, stride_xm, stride_xk, rk, k_end, w)
            p3 = _x_times(x_ptr, row0 + 3, M, stride_xm, stride_xk, rk, k_end, w)
        if GROUP == 0:
            acc0 += p0
            if BLOCK_M > 1:
                acc1 += p1
            if BLOCK_M > 2:
                acc2 += p2
                acc3 += p3
        else:
            if j % PLANES == 0:
                part0 = p0
                if BLOCK_M > 1:
                    part1 = p1
                if BLOCK_M > 2:
                    part2 = p2
                    part3 = p3
            else:
                part0 += p0
                if BLOCK_M > 1:
                    part1 += p1
                if BLOCK_M > 2:
                    part2 += p2
                    part3 += p3
            if (j + 1) % PLANES == 0:  # the group (or this block's part of it) ends: scale once
                acc0 += part0 * s[None, :]
                if BLOCK_M > 1:
                    acc1 += part1 * s[None, :]
                if BLOCK_M > 2:
                    acc2 += part2 * s[None, :]
                    acc3 += part3 * s[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit
def _w4a16_gemv_kernel(
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
    PLANES: tl.constexpr,  # nibble planes (16 inputs each) per scale application: min(GROUP, 128) / 16
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # write fp32 partial sums of one split (the sum kernel finishes)
    UPCAST: tl.constexpr,  # interpreter: round the output to bf16 by hand
    BLOCK_M: tl.constexpr,  # rows of x per program, 1, 2 or 4 (each weight dequantised once, used BLOCK_M times)
    BLOCK_N: tl.constexpr,
    SUBBLOCKS: tl.constexpr,  # 128-blocks per loop step: BLOCK_K / 128 (their loads issued together)
    PREFETCH: tl.constexpr,  # load block b + 1 before working on block b (one block per step)
):
    # CUDA-core GEMV: the (16, BLOCK_N) int32 slab of a 128-block is 16 contiguous runs of 4·BLOCK_N bytes; each word
    # gives 8 weights by one AND-OR each (no shift for nibbles 0-3, one shift of the word for 4-7), one fp32 subtract
    # of the zero, and one FMA per row of x. The scale multiplies a group's fp32 sum once per group and column. Every
    # tensor in the loop is (16, BLOCK_N) or a slice of it, in the slab's layout: no layout conversion, and the sum over
    # the slab's 16 rows waits until the end (no shuffles in the loop). Rows of x are separate accumulators (a 3-D
    # (rows, 16, BLOCK_N) product made Triton convert the slab's layout through shared memory at every plane).
    # Triton does not pipeline loads that feed no dot (num_stages changes nothing here): the bytes in flight come from
    # the resident programs, the SUBBLOCKS slabs a step loads together, and PREFETCH.
    row0 = tl.program_id(2) * BLOCK_M
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    n_ok = rn < N
    qw_cols = qw_ptr + rn[None, :] * stride_qn  # (1, BLOCK_N)

    first = tl.program_id(1) * blocks_per_split
    last = min(first + blocks_per_split, tl.cdiv(K, 128))
    k_end = min(last * 128, K)  # this split's inputs end here
    if GROUP == 0:  # one group: its scales and zeros once, for the whole of K
        s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + rn * stride_zn, mask=n_ok, other=0).to(tl.float32)
    else:  # loaded per group inside `_gemv_block`
        s = tl.zeros((BLOCK_N,), dtype=tl.float32)
        zf = s
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)  # (row of the slab, column), one per row of x
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        rows = first * 16 + rr
        ahead = tl.load(qw_cols + rows[:, None].to(tl.int64) * stride_qk, mask=(rows < last * 16)[:, None] &
                        n_ok[None, :], other=0)  # fmt: skip
        for b in range(first, last):
            slab = ahead
            rows = (b + 1) * 16 + rr  # past the split's end: masked, no memory traffic
            ahead = tl.load(qw_cols + rows[:, None].to(tl.int64) * stride_qk, mask=(rows < last * 16)[:, None] &
                            n_ok[None, :], other=0)  # fmt: skip
            acc0, acc1, acc2, acc3 = _gemv_block(slab, b, x_ptr, s_ptr, z_ptr, row0, M, K, k_end, rn, n_ok,
                                                 stride_xm, stride_xk, stride_sg, stride_sn, stride_zg, stride_zn,
                                                 acc0, acc1, acc2, acc3, s, zf, GROUP, PLANES, BLOCK_M)  # fmt: skip
    else:
        for step in range(first, last, SUBBLOCKS):
            for c in tl.static_range(SUBBLOCKS):
                b = step + c  # the last step of a split may hold fewer blocks than SUBBLOCKS: masked by `last`
                rows = b * 16 + rr
                slab = tl.load(
                    qw_cols + rows[:, None].to(tl.int64) * stride_qk,
                    mask=(rows < last * 16)[:, None] & n_ok[None, :],
                    other=0,
                )  # (16, BLOCK_N) int32: 8 planes of 16 consecutive inputs
                acc0, acc1, acc2, acc3 = _gemv_block(slab, b, x_ptr, s_ptr, z_ptr, row0, M, K, k_end, rn, n_ok,
                                                     stride_xm, stride_xk, stride_sg, stride_sn, stride_zg,
                                                     stride_zn, acc0, acc1, acc2, acc3, s, zf, GROUP, PLANES,
                                                     BLOCK_M)  # fmt: skip

    if GROUP == 0:  # the one scale per column, applied once
        acc0 = acc0 * s[None, :]
        acc1 = acc1 * s[None, :]
        acc2 = acc2 * s[None, :]
        acc3 = acc3 * s[None, :]
    if PARTIAL:  # fp32 partial sums of this split, rows row0.. of its (M, N) slice
        out_ptr += tl.program_id(1).to(tl.int64) * stride_os
    _store_row(out_ptr, row0, M, N, rn, stride_om, stride_on, acc0, b_ptr, stride_b, HAS_BIAS, UPCAST, PARTIAL)
    if BLOCK_M > 1:
        _store_row(out_ptr, row0 + 1, M, N, rn, stride_om, stride_on, acc1, b_ptr, stride_b, HAS_BIAS, UPCAST, PARTIAL)
    if BLOCK_M > 2:
        _store_row(out_ptr, row0 + 2, M, N, rn, stride_om, stride_on, acc2, b_ptr, stride_b, HAS_BIAS, UPCAST, PARTIAL)
        _store_row(out_ptr, row0 + 3, M, N, rn, stride_om, stride_on, acc3, b_ptr, stride_b, HAS_BIAS, UPCAST, PARTIAL)


@triton.jit
def _w4a16_mma_kernel(
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
    GROUPS_PER_BLOCK: tl.constexpr,  # 128 / GROUP for GROUP < 128, else 1
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # write fp32 partial sums of one split (the sum kernel finishes)
    UPCAST: tl.constexpr,  # interpreter: feed tl.dot fp32 tiles (its bf16 dot is wrong)
    PRECISION: tl.constexpr,  # "ieee" for fp32 activations, else unused ("tf32")
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBBLOCKS: tl.constexpr,  # 128-blocks per loop step: BLOCK_K / 128
    GROUP_M: tl.constexpr,
    TILE: tl.constexpr,  # True: one (BLOCK_M, BLOCK_K) × (BLOCK_K, BLOCK_N) dot per step; False: 8 per block, K = 16
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
    if TILE:
        # The whole (16·SUBBLOCKS, BLOCK_N) slab unpacked at once: viewed as (blocks, 1, 16 rows, columns) and shifted
        # by the 8 nibble offsets, element [c, j, r, n] is input 128·(step + c) + 16·j + r, so the (blocks, 8, 16)
        # dims merge into BLOCK_K inputs in their natural order: one dot with K = BLOCK_K against a contiguous x tile.
        # (The sm_90 PTX of this tile: both loads by cp.async through num_stages buffers, no layout conversion in the
        # loop, one wgmma per step; but each thread holds one column's consecutive inputs, and the operand's shared
        # layout is N-major, so storing the dequantised tile takes one 2-byte store per weight. Transposing the
        # unpack did not change that.)
        shifts = (4 * tl.arange(0, 8))[None, :, None, None]
        rs = tl.arange(0, 16 * SUBBLOCKS)
        rk_tile = tl.arange(0, 128 * SUBBLOCKS)
        for step in range(first, last, SUBBLOCKS):
            rows = step * 16 + rs
            slab = tl.load(
                qw_cols + rows[:, None].to(tl.int64) * stride_qk,
                mask=(rows < last * 16)[:, None] & n_ok[None, :],
                other=0,
            )  # (16·SUBBLOCKS, BLOCK_N) int32
            q = (tl.reshape(slab, (SUBBLOCKS, 1, 16, BLOCK_N)) >> shifts) & 0xF  # (SUBBLOCKS, 8, 16, BLOCK_N)
            f = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q
            f = tl.reshape(f, (SUBBLOCKS, GROUPS_PER_BLOCK, 8 // GROUPS_PER_BLOCK, 16, BLOCK_N))
            if GROUP == 0:
                w = (f - zf[None, None, None, None, :]) * s[None, None, None, None, :]
            else:
                if GROUP < 128:  # GROUPS_PER_BLOCK groups in each block
                    g = step * GROUPS_PER_BLOCK + tl.arange(0, SUBBLOCKS * GROUPS_PER_BLOCK)
                else:  # each block inside one group
                    g = ((step + tl.arange(0, SUBBLOCKS)) * 128) // GROUP
                g = tl.minimum(g, (K - 1) // GROUP)  # blocks past K (x masked to 0 there) read the last group
                sg = tl.load(s_ptr + g[:, None] * stride_sg + rn[None, :] * stride_sn, mask=n_ok[None, :], other=0.0)
                zg = tl.load(z_ptr + g[:, None] * stride_zg + rn[None, :] * stride_zn, mask=n_ok[None, :], other=0)
                sg = tl.reshape(sg.to(tl.float32), (SUBBLOCKS, GROUPS_PER_BLOCK, 1, 1, BLOCK_N))
                zg = tl.reshape(zg.to(tl.float32) + 8388608.0, (SUBBLOCKS, GROUPS_PER_BLOCK, 1, 1, BLOCK_N))
                w = (f - zg) * sg  # exact (q − zero) · scale
            w = tl.reshape(w, (128 * SUBBLOCKS, BLOCK_N))
            rk = step * 128 + rk_tile
            xt = tl.load(x_rows + rk[None, :] * stride_xk, mask=m_ok[:, None] & (rk < k_end)[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(xt.to(tl.float32), round_to(w, dtype), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, w.to(dtype), acc, input_precision=PRECISION)
    else:
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
                    xj = tl.load(
                        x_rows + rk[None, :] * stride_xk, mask=m_ok[:, None] & (rk < k_end)[None, :], other=0.0
                    )
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

# Tiles by the number of rows M: (largest M, config); the first entry whose bound M does not exceed applies. Keys:
# - KERNEL: "gemv" (CUDA-core FMA, `_w4a16_gemv_kernel`) or "mma" (tensor cores, `_w4a16_mma_kernel`).
# - BLOCK_M: rows per program (gemv: at most, the schedule takes min(BLOCK_M, next power of two ≥ M)); BLOCK_N:
#   columns per program; BLOCK_K: inputs per loop step, a multiple of 128 (one block of `qweight`).
# - SPLIT_K: 0 picks the split by `FILL`, n ≥ 1 forces n (capped by the loop steps along K); splits > 1 write fp32
#   partial sums that a second launch adds in a fixed order.
# - UNPACK (mma): "tile", one dot with K = BLOCK_K per step; "planes", 8 dots with K = 16 per 128-block (the schedule
#   measured on the H200 on 2026-12-01). GROUP_M (mma): grouped tile order. num_warps, num_stages: Triton's.
# gemv, decode and large are the best of `reports/w4a16/gpu_w4a16.py sweep` on the H200 (2026-12-02; small is a first
# choice, unmeasured). SHIPPED_BEFORE is the schedule measured on 2026-12-01, kept as the sweep's
# baseline and as a setting (`TILES.update(SHIPPED_BEFORE)` restores it).
TILES = Tunables(
    gemv=(1, {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 0, "num_warps": 4,
              "num_stages": 1, "PREFETCH": False}),
    decode=(16, {"KERNEL": "mma", "UNPACK": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0,
                 "GROUP_M": 1, "num_warps": 4, "num_stages": 3}),
    small=(256, {"KERNEL": "mma", "UNPACK": "tile", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1,
                 "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
    large=(None, {"KERNEL": "mma", "UNPACK": "tile", "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1,
                  "GROUP_M": 8, "num_warps": 8, "num_stages": 2}),
)  # fmt: skip
SHIPPED_BEFORE = {
    "gemv": (0, {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": 4,
                 "num_stages": 1}),  # bound 0: never chosen
    "decode": (16, {"KERNEL": "mma", "UNPACK": "planes", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0,
                    "GROUP_M": 1, "num_warps": 4, "num_stages": 3}),
    "small": (256, {"KERNEL": "mma", "UNPACK": "planes", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1,
                    "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
    "large": (None, {"KERNEL": "mma", "UNPACK": "planes", "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128,
                     "SPLIT_K": 1, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
}  # fmt: skip
# SPLIT_K = 0: the smallest power-of-two split giving at least programs_per_sm programs per SM, at most max_split.
FILL = Tunables(programs_per_sm=2, max_split=32)
# Under the Triton interpreter (CPU tensors) a program costs per operation, not per element, so tiles there are as
# wide as numpy handles well: one SmolLM2-135M projection (16 × 576 → 1536, bf16) took 3.9 s with the decode tiles
# and 0.2 s with 2048 columns (2-core CPU, 2026-12-02). The block schedule along K is the GPU's.
INTERPRETER = Tunables(enabled=True, BLOCK_M=64, BLOCK_N=2048)
SUM_BLOCK = 1024  # elements per program of the split sum


def tiles_for(M: int) -> dict[str, int | str]:
    """The tile configuration of `TILES` for M rows."""
    for bound, config in TILES.values():
        if bound is None or bound >= M:
            return config
    raise ValueError("TILES needs a last entry without a bound")


class Schedule(NamedTuple):
    """How one call is launched: the tiles, how many splits of K, and the 128-blocks each split handles."""

    tiles: dict[str, int | str]
    splits: int
    blocks_per_split: int


def schedule(M: int, N: int, K: int, device: torch.device) -> Schedule:
    """The launch of an (M, K) × (K, N) call: a function of the shape and the device only (the public function
    allocates the split-K workspace from it, the launcher launches from it)."""
    tiles = tiles_for(M)
    if tiles.get("KERNEL", "mma") == "gemv":  # no padded rows: M = 1 runs one row per program
        if tiles["BLOCK_M"] not in (1, 2, 4):
            raise ValueError(f"the gemv kernel takes BLOCK_M 1, 2 or 4 rows per program, got {tiles['BLOCK_M']}")
        tiles = dict(tiles, BLOCK_M=min(int(tiles["BLOCK_M"]), pow2(M)))
    if device.type != "cuda" and INTERPRETER["enabled"]:
        if tiles.get("KERNEL", "mma") != "gemv":
            tiles = dict(tiles, BLOCK_M=max(tiles["BLOCK_M"], min(pow2(M), INTERPRETER["BLOCK_M"])))
        tiles = dict(tiles, BLOCK_N=max(tiles["BLOCK_N"], min(pow2(N), INTERPRETER["BLOCK_N"])))
    sub = int(tiles["BLOCK_K"]) // BLOCK
    steps = cdiv(cdiv(K, BLOCK), sub)  # loop steps over all of K
    split = int(tiles["SPLIT_K"])
    if split <= 0:
        programs = cdiv(M, tiles["BLOCK_M"]) * cdiv(N, tiles["BLOCK_N"])
        target = FILL["programs_per_sm"] * (sm_count(device.index or 0) if device.type == "cuda" else 1)
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
    group = 0 if group_count(K, group_size) == 1 else group_size
    args = (
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
    )
    if tiles.get("KERNEL", "mma") == "gemv":
        grid = (cdiv(N, tiles["BLOCK_N"]), plan.splits, cdiv(M, tiles["BLOCK_M"]))
        launchable(_w4a16_gemv_kernel)[grid](
            *args,
            GROUP=group,
            PLANES=min(group, BLOCK) // 16 if group else NIBBLES,
            HAS_BIAS=bias is not None,
            PARTIAL=partial,
            UPCAST=interpreted,
            BLOCK_M=tiles["BLOCK_M"],
            BLOCK_N=tiles["BLOCK_N"],
            SUBBLOCKS=tiles["BLOCK_K"] // BLOCK,
            PREFETCH=bool(tiles.get("PREFETCH", False)),
            num_warps=tiles["num_warps"],
            num_stages=tiles["num_stages"],
        )
    else:
        grid = (cdiv(M, tiles["BLOCK_M"]) * cdiv(N, tiles["BLOCK_N"]), plan.splits)
        launchable(_w4a16_mma_kernel)[grid](
            *args,
            GROUP=group,
            GROUPS_PER_BLOCK=BLOCK // group if 0 < group < BLOCK else 1,
            HAS_BIAS=bias is not None,
            PARTIAL=partial,
            UPCAST=interpreted,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=tiles["BLOCK_M"],
            BLOCK_N=tiles["BLOCK_N"],
            SUBBLOCKS=tiles["BLOCK_K"] // BLOCK,
            GROUP_M=tiles["GROUP_M"],
            TILE=tiles.get("UNPACK", "tile") == "tile",
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
