"""W4A16: a GEMM whose int4 weights are dequantised in registers on the way into the tensor cores, never written out.

A weight-only quantised Linear run as people write it in PyTorch unpacks the int4 weight with shifts and masks,
casts it, subtracts the zero point, multiplies by the scale — each op a kernel writing a full K×N temporary — and
only then calls cuBLAS on a bf16 weight it has just written (`w4a16_reference` is that chain, op by op). Per call,
x: (M, K), K×N weights, activations of s bytes, group size g:
    unfused ≈ 38.5·K·N bytes in bf16 (the int32 shift and mask temporaries, the expanded scales and zeros, the casts,
              the subtract and multiply, the GEMM reading the weight back), 19× the bf16 GEMM's 2·K·N
    fused   = K·N·0.5 + (K/g)·N·(s + 1) + (M·K + M·N)·s ≈ 0.523·K·N bytes in bf16 at g = 128
At decode sizes (M ≤ 16) the weight read is the whole cost: the kernel is a weight-streaming problem whose floor is
0.523·K·N bytes at the memory bandwidth, and what keeps it off that floor is instructions per weight.

## The packed layout, `PackedW4` (made once: `quantize_w4`, `from_gptq`, `from_awq` all call `pack_w4`)
- `qweight`: int32 (N, 16·⌈K/128⌉), one row per output. K is cut into chunks of 128 inputs, 16 words each. Word
  16·b + j (j = 4·c + u, c and u in 0..3) of row n holds the 8 inputs k = 128·b + 32·u + 16·i1 + 8·i0 + 2·c + e of
  output n, input (e, i1, i0) in nibble p = 4·e + 2·i1 + i0, i.e. bits 4p..4p+3 (`CHUNK_ORDER[j, p]` is that k − 128·b).
  Nibbles past K are 0. `pack_w4` / `unpack_w4` convert from / to q (K, N) and invert each other exactly.
- `scales`: (G, N) in the activations' dtype, G = ⌈K/g⌉; `zeros`: uint8 (G, N), each in 0..15.
- w[k, n] = (q[k, n] − zeros[k // g, n]) · scales[k // g, n]; the GEMM is out = x @ w (+ bias), w the transpose of
  nn.Linear's (N, K) weight. Symmetric quantisation is zeros = 8.
- g is a power of two ≥ 32 (32 consecutive inputs of a row come from the same 4 words: see below) or ≥ K (one group per
  output channel; -1 says so). Any K ≥ 1 and N ≥ 1: K is padded with zero nibbles to the chunk, N is masked.
- Bytes per weight: 0.5 + (s + 1)/g — 0.5234 at g = 128 in bf16.

Why this order. The kernel computes outᵀ = wᵀ · xᵀ on the tensor cores with the weights as the left operand, which
Hopper's wgmma (and mma.sync) take from registers: a thread's share of a (64, 16) left tile is rows r and r + 8,
inputs 2c + {0, 1} and 2c + 8 + {0, 1} (c = lane % 4), bf16 pairs (k, k + 1) packed in one 32-bit register. In the
order above, the 4 words a lane loads for a row and a chunk (u = 0..3, contiguous: one 16-byte load) hold exactly
its 32 inputs of that chunk, and nibbles p and p + 4 of a word are such a pair (e = 0 in the low half-word, e = 1 in
the high one). So the unpacked tile is, register for register, the dot's operand: the Triton code below
(`_unpack`: shifts, masks, `join`, `reshape`, `permute`) compiles for sm_90 with no layout conversion and no shared
memory between the load and the wgmma (the loads themselves go through shared memory by cp.async, pipelined).

## Conversion: two weights per AND-OR, the zero point and the scale per group, not per weight
`((word >> 4i) & 0x000F000F) | 0x43004300` is two bf16 values 128 + q (nibbles i and i + 4): 0x4300 is bf16 128.0,
whose mantissa's last bit is worth 1, so OR-ing q into it gives 128 + q exactly. One SHF and one LOP3 per two weights
(none of the shifts for i = 0); no int → float conversion. fp16 activations use 0x6400 (1024.0, 10-bit mantissa). The
tensor cores multiply these (128 + q) by x, accumulating in fp32 per group of inputs, and the zero point and the
scale apply to that group's sum, once per output and row of x:
    Σ_k x_k · w_k = s · (Σ_k x_k · (128 + q_k) − (128 + z) · Σ_k x_k)           (over one group's inputs)
so each weight costs 1/2 SHF + 1/2 LOP3 + its share of the wgmma. Σ_k x_k is summed from the x tile the step loads.
The products are exact in fp32 (8-bit × 8-bit significands) and the subtraction cancels about 7 bits (10 in fp16) of
the fp32 sums: the result is well within the output dtype's rounding of the float64 answer (tests check it); it is
not bit-comparable to the unfused chain, which rounds every dequantised weight to bf16 first.
fp32 activations: the same (128 + q) in bf16, widened, minus 128 + zero per weight (exact in fp32, no cancellation),
and an IEEE fp32 dot (slow: a correctness path).
Compiled for sm_90 here (Triton 3.9 and its ptxas, no GPU): BLOCK_N 128, 256 inputs per step, 4 warps, 8 rows:
~2.0 SASS instructions per weight in the loop (0.9 of them the conversion, the rest the x tile, its sum, the group's
scaling of the accumulator, addresses and the pipeline), against 5.7–7.8 for the CUDA-core GEMV it replaces. At
132 SMs issuing 4 warp-instructions per clock at 1.98 GHz, 4096 × 14336 weights take 3.6 µs of issue against
~7 µs for their 30.8 MB at 4.4 TB/s: bound by bytes, if issue runs at half its peak or better.

## Schedule (`TILES`, by M; nothing chosen at call time that a CUDA graph could not capture)
- Tensor cores for every M: the rows of x are the dot's N dimension (wgmma n = 8 or 16 at decode, padded rows of x
  read as 0), BLOCK_N outputs per program (the dot's M, 64 per warpgroup).
- Each step loads BLOCK_K inputs in CHUNKS sub-steps of KC = min(KC, g) inputs: one dot, one Σx and one scaling per
  sub-step (a sub-step never straddles a group).
- Split-K (SPLIT_K = 0: the smallest split dividing the steps that gives `FILL` programs per SM): each split stores
  its fp32 partial sums to a workspace the public function allocates with the output, and the last split of a tile
  to arrive (an atomic counter per tile, which it resets) adds the splits in a fixed order, adds the bias and rounds:
  deterministic, and no second kernel. The counters are one zeroed int32 buffer per device, allocated once and kept
  (`counters`); a call captured into a CUDA graph before any eager call on its device runs unsplit. Two calls running
  at the same time on different streams must not share a device's counters (they would, with split-K).
- The measured choice is in `reports/w4a16/`; `gpu_w4a16.py` times the candidates.
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

CHUNK = 128  # inputs per chunk of a `qweight` row
WORDS = 16  # int32 words per chunk and row
NIBBLES = 8
MIN_GROUP = 32  # the smallest group: a lane's 4 words hold 32 consecutive inputs of a chunk in nibble pairs
# Bit patterns: OR-ing a nibble q into the low 4 bits of each 16-bit half gives two values BASE + q.
MAGIC = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PackedW4(NamedTuple):
    """Int4 weights in the layout above: `w4a16_gemm(x, *packed)` takes them as they are."""

    qweight: torch.Tensor  # int32 (N, 16·⌈K/128⌉)
    scales: torch.Tensor  # (G, N), the activations' dtype
    zeros: torch.Tensor  # uint8 (G, N), 0..15
    group_size: int  # inputs per group; ≥ K: one group per output channel


# ---------------------------------------------------------------------------------------------- layout, plain torch

# Word j = 4·c + u of a chunk, nibble p = 4·e + 2·i1 + i0 → its input within the chunk, 32·u + 16·i1 + 8·i0 + 2·c + e.
CHUNK_ORDER = [[32 * (j % 4) + 16 * ((p >> 1) & 1) + 8 * (p & 1) + 2 * (j // 4) + (p >> 2) for p in range(NIBBLES)]
               for j in range(WORDS)]  # fmt: skip
# The dims of a chunk's nibbles as (c, u, e, i1, i0) ↔ as inputs (u, i1, i0, c, e), each a permutation of the other.
_TO_INPUTS = (0, 2, 4, 5, 1, 3)  # (chunk, c, u, e, i1, i0) → (chunk, u, i1, i0, c, e)
_TO_WORDS = (0, 4, 1, 5, 2, 3)  # (chunk, u, i1, i0, c, e) → (chunk, c, u, e, i1, i0)


def group_count(K: int, group_size: int) -> int:
    """G, the rows of `scales` and `zeros`: ⌈K / g⌉ (1 for per-channel, g ≥ K)."""
    return 1 if group_size >= K else cdiv(K, group_size)


def check_group_size(group_size: int, K: int) -> int:
    """The group size as the kernel takes it: a power of two ≥ 32, or ≥ K (per channel); -1 means per channel and
    becomes K. ValueError otherwise: a group must not split the 32 inputs a lane's words hold in one chunk."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size == -1:
        return K
    if group_size >= K or (group_size >= MIN_GROUP and group_size & (group_size - 1) == 0):
        return group_size
    raise ValueError(f"group_size must be a power of two >= {MIN_GROUP}, or >= K = {K} (per channel; -1), got "
                     f"{group_size}: the packed layout keeps 32 consecutive inputs in one lane's words")  # fmt: skip


def packed_words(K: int) -> int:
    """Columns of `qweight` for K inputs: 16 per chunk of 128."""
    return WORDS * cdiv(K, CHUNK)


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """q: (K, N) integers in 0..15 → `qweight` (N, 16·⌈K/128⌉) int32 in the layout of the module docstring."""
    K, N = q.shape
    chunks = cdiv(K, CHUNK)
    padded = torch.zeros(N, chunks * CHUNK, dtype=torch.int64, device=q.device)
    padded[:, :K] = q.t().to(torch.int64)
    nibbles = padded.view(N, chunks, 4, 2, 2, 4, 2).permute(0, *(1 + d for d in _TO_WORDS))  # (n, b, c, u, e, i1, i0)
    nibbles = nibbles.reshape(N, chunks, WORDS, NIBBLES)
    shifts = 4 * torch.arange(NIBBLES, device=q.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)  # disjoint bits: the sum is the OR, in int64 (nibble 7 reaches bit 31)
    words = torch.where(words >= 2**31, words - 2**32, words)  # as two's-complement int32
    return words.reshape(N, chunks * WORDS).to(torch.int32)


def unpack_w4(qweight: torch.Tensor, K: int) -> torch.Tensor:
    """`qweight` → q: (K, N) int32 in 0..15, in plain PyTorch: shift and mask each word's 8 nibbles, put them in input
    order (a permute of the chunk's dims), drop the padding."""
    N, words = qweight.shape
    chunks = words // WORDS
    shifts = 4 * torch.arange(NIBBLES, device=qweight.device, dtype=torch.int32)
    q = (qweight.reshape(N, chunks, WORDS, 1) >> shifts) & 0xF  # (n, b, j, p)
    q = q.reshape(N, chunks, 4, 4, 2, 2, 2).permute(0, *(1 + d for d in _TO_INPUTS))  # (n, b, u, i1, i0, c, e)
    return q.reshape(N, chunks * CHUNK)[:, :K].t()


def dequantize_w4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, K: int
) -> torch.Tensor:
    """w: (K, N) in the scales' dtype, w[k, n] = (q[k, n] − zeros[k // g, n]) · scales[k // g, n] — written op by op
    as a quantised Linear's forward writes it (each line a kernel and a K×N temporary on the GPU)."""
    group_size = check_group_size(group_size, K)
    per = min(group_size, K)
    q = unpack_w4(qweight, K)  # shift, mask, reorder: read K·N/2, write int32 K×N temporaries
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
    gets scale 1. group_size: a power of two ≥ 32, or -1 / ≥ K for one group per output channel."""
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
    """A 4-bit GPTQ checkpoint's tensors → `PackedW4` (repacked once, here). qweight: int32 (K/8, N), input 8·i + j of
    output n in nibble j of qweight[i, n]; qzeros: int32 (G, N/8), output 8·c + j's zero in nibble j of qzeros[g, c];
    scales: (G, N).

    zero_offset: GPTQ's original format (AutoGPTQ, transformers' GPTQ checkpoints) stores zero − 1 and its kernels add
    1 back, modulo 16; `zero_offset=0` reads the later "gptq_v2" format, which stores the zero itself.
    g_idx: (K,) group of each input; only the plain order k // g is accepted. Act-order checkpoints (desc_act=True)
    permute the groups along K, which this layout does not hold: ValueError. Group sizes below 32: ValueError."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError("from_gptq takes int32 qweight (K/8, N) and qzeros (G, N/8), as 4-bit GPTQ stores them")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    G = scales.shape[0]
    if scales.shape != (G, N) or qzeros.shape != (G, cdiv(N, 8)) or K % G:
        raise ValueError(f"GPTQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")  # fmt: skip
    group_size = check_group_size(K // G, K)
    if g_idx is not None:
        plain = torch.arange(K, device=g_idx.device) // group_size
        if g_idx.shape != (K,) or not torch.equal(g_idx.to(plain.dtype), plain):
            raise ValueError(
                "act-order GPTQ (g_idx permutes the groups along K, desc_act=True) is not supported: "
                "the packed layout holds groups of consecutive inputs; re-quantise without act-order"
            )
    q = _unpack_int32(qweight.t(), tuple(range(8))).t()  # (K, N)
    zeros = (_unpack_int32(qzeros, tuple(range(8)))[:, :N] + zero_offset) & 0xF
    return PackedW4(pack_w4(q), scales, zeros.to(torch.uint8), group_size)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs output 8·c + AWQ_ORDER[i] into nibble i of word c


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> PackedW4:
    """A 4-bit AWQ (GEMM format) checkpoint's tensors → `PackedW4` (repacked once, here). qweight: int32 (K, N/8)
    packed along the outputs, output 8·c + AWQ_ORDER[i] of input k in nibble i of qweight[k, c]; qzeros: int32
    (G, N/8) packed the same way; scales: (G, N). The zeros are stored as they are (no offset)."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError("from_awq takes int32 qweight (K, N/8) and qzeros (G, N/8), as 4-bit AWQ stores them")
    K, N = qweight.shape[0], scales.shape[1]
    G = scales.shape[0]
    if qweight.shape[1] * 8 != N or qzeros.shape != (G, N // 8) or K % G:
        raise ValueError(f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")  # fmt: skip
    group_size = check_group_size(K // G, K)
    inverse = tuple(AWQ_ORDER.index(i) for i in range(8))  # nibble that holds output 8·c + i
    q = _unpack_int32(qweight, inverse)  # (K, N)
    zeros = _unpack_int32(qzeros, inverse)
    return PackedW4(pack_w4(q), scales, zeros.to(torch.uint8), group_size)


# ----------------------------------------------------------------------------------------------------------- kernel


@triton.jit
def _pair(p, WDT: tl.constexpr):
    """(…) int32, two 16-bit values per word → (…, 2) in WDT: the low half-word, then the high one."""
    lo = p.to(tl.int16).to(WDT, bitcast=True)
    hi = (p >> 16).to(tl.int16).to(WDT, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _unpack(w, WDT: tl.constexpr, MAGIC: tl.constexpr, U: tl.constexpr):
    """(BLOCK_N, 4·U·S) int32 words of one sub-step (column 4·U·s + U·c + u: chunk s, lane group c, word u) →
    (BLOCK_N, 32·U·S) in WDT, each value BASE + q, in input order (32·u + 16·i1 + 8·i0 + 2·c + e within a chunk)."""
    BN: tl.constexpr = w.shape[0]
    S: tl.constexpr = w.shape[1] // (4 * U)
    t0 = _pair((w & 0x000F000F) | MAGIC, WDT)  # nibbles 0 and 4: (i1, i0) = (0, 0), e = 0 and 1
    t1 = _pair(((w >> 4) & 0x000F000F) | MAGIC, WDT)
    t2 = _pair(((w >> 8) & 0x000F000F) | MAGIC, WDT)
    t3 = _pair(((w >> 12) & 0x000F000F) | MAGIC, WDT)
    v = tl.join(tl.join(t0, t1), tl.join(t2, t3))  # (n, word, e, i0, i1)
    v = tl.reshape(v, (BN, S, 4, U, 2, 2, 2))  # (n, s, c, u, e, i0, i1)
    v = tl.permute(v, (0, 1, 3, 6, 5, 2, 4))  # (n, s, u, i1, i0, c, e)
    return tl.reshape(v, (BN, 32 * U * S))


@triton.jit
def _store_out(out_ptr, b_ptr, acc, rn, rm, M, N, stride_om, stride_on, stride_b, HAS_BIAS: tl.constexpr,
               UPCAST: tl.constexpr):  # fmt: skip
    """acc: (BLOCK_N, BLOCK_M) fp32, out[rm, rn] = acc (+ bias), rounded once to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    if UPCAST:  # the interpreter truncates fp32 → bf16: round to nearest by hand (`rounding`)
        acc = round_to(acc, out_ptr.dtype.element_ty)
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    offsets = rm[None, :].to(tl.int64) * stride_om + rn[:, None] * stride_on
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4a16_kernel(
    x_ptr,  # (M, K) activations; strides stride_xm, stride_xk
    qw_ptr,  # (N, 16·⌈K/128⌉) int32 packed weights; strides stride_qn, stride_qw
    s_ptr,  # (G, N) scales in x's dtype; strides stride_sg, stride_sn
    z_ptr,  # (G, N) uint8 zero points; strides stride_zg, stride_zn
    b_ptr,  # (N,) bias, stride stride_b; read only if HAS_BIAS
    out_ptr,  # (M, N) output; strides stride_om, stride_on
    ws_ptr,  # SPLIT: (splits, M, N) fp32 partial sums, contiguous; else unused
    cnt_ptr,  # SPLIT: int32 counters, one per (row tile, column tile), 0 between calls; else unused
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qw,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_b,
    stride_om,
    stride_on,
    steps_per_split,  # loop steps (BLOCK_K inputs each) per split
    GROUP: tl.constexpr,  # group size (a power of two ≥ 32); 0: one group per output channel
    KC: tl.constexpr,  # inputs per sub-step: one dot, one Σx, one scaling; a power of two ≥ 32 dividing GROUP
    CHUNKS: tl.constexpr,  # sub-steps per loop step
    BASE: tl.constexpr,  # 128.0 (bf16) or 1024.0 (fp16): the value MAGIC's half-words stand for
    MAGIC: tl.constexpr,
    WDT: tl.constexpr,  # the weights' dtype in the dot: bf16, or fp16 for fp16 activations
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # more than one split of K: partial sums, the last split of a tile finishes
    EVEN: tl.constexpr,  # N % BLOCK_N == 0, K % BLOCK_K == 0 and every split full: no masks on the weights or K
    UPCAST: tl.constexpr,  # the interpreter: an fp32 IEEE dot on the same values (its 16-bit dot is not exact)
    EXACT_ZERO: tl.constexpr,  # fp32 activations: subtract the zero from each weight, exact in fp32, no Σx
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    U: tl.constexpr = min(KC, 128) // 32  # words per lane group and chunk in a sub-step
    WCOLS: tl.constexpr = KC // 8  # words per row in a sub-step
    rj = tl.arange(0, WCOLS)
    cols = (rj // (4 * U)) * 16 + ((rj // U) % 4) * 4 + rj % U  # sub-step column → word within its chunks
    if U == 4:  # whole chunks: the words are contiguous, and Triton must see it to load 16 bytes at a time
        cols = rj
    w_rows = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + cols[None, :] * stride_qw
    rk = tl.arange(0, KC)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
    n_words = tl.cdiv(K, 128) * 16

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GROUP == 0:  # one group: its scales and zeros once, for the whole of K
        s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn * stride_zn, mask=n_ok, other=0).to(tl.float32) + BASE
    first = pid_k * steps_per_split
    last = min(first + steps_per_split, tl.cdiv(K, KC * CHUNKS))
    for step in tl.range(first, last, num_stages=STAGES):
        for c in tl.static_range(CHUNKS):
            k0 = (step * CHUNKS + c) * KC
            word0 = (k0 // 128) * 16 + (k0 % 128) // 32
            if EVEN:
                w = tl.load(w_rows + word0 * stride_qw)
                xk = tl.load(x_rows + k0 * stride_xk, mask=m_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + word0 * stride_qw, mask=n_ok[:, None] & (word0 + cols < n_words)[None, :],
                            other=0)  # fmt: skip
                xk = tl.load(x_rows + k0 * stride_xk, mask=m_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
            wt = _unpack(w, WDT, MAGIC, U)  # (BLOCK_N, KC): BASE + q
            if GROUP != 0:
                g = min(k0, K - 1) // GROUP
                s = tl.load(s_ptr + g * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * stride_zg + rn * stride_zn, mask=n_ok, other=0).to(tl.float32) + BASE
            if EXACT_ZERO:  # fp32 activations: (BASE + q) − (BASE + zero) in fp32, exact, then an IEEE fp32 dot
                part = tl.dot(wt.to(tl.float32) - z[:, None], tl.trans(xk.to(tl.float32)), input_precision="ieee")
            elif UPCAST:  # the interpreter: its bf16/fp16 dot is not exact; the same values in fp32 are
                part = tl.dot(wt.to(tl.float32), tl.trans(xk.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(wt, tl.trans(xk))
            if not EXACT_ZERO:  # Σ x·(BASE + q) − (BASE + zero)·Σ x
                part -= z[:, None] * tl.sum(xk.to(tl.float32), axis=1)[None, :]
            if GROUP == 0:
                acc += part
            else:
                acc += part * s[:, None]
    if GROUP == 0:  # the one scale per column, applied once
        acc = acc * s[:, None]

    _finish(acc, rn, rm, M, N, out_ptr, b_ptr, ws_ptr, cnt_ptr, stride_om, stride_on, stride_b, HAS_BIAS, SPLIT,
            UPCAST)  # fmt: skip


@triton.jit
def _finish(acc, rn, rm, M, N, out_ptr, b_ptr, ws_ptr, cnt_ptr, stride_om, stride_on, stride_b, HAS_BIAS: tl.constexpr,
            SPLIT: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """acc: (BLOCK_N, BLOCK_M) fp32 sums of this program's split of K. Unsplit: stored (+ bias), rounded once. Split:
    stored to the workspace; the last split of the tile to arrive (an atomic counter per tile, which it resets) adds
    the splits in split order (deterministic) and stores the output."""
    if SPLIT:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        splits = tl.num_programs(2)
        mn = M * N
        tile = rm[None, :].to(tl.int64) * N + rn[:, None]
        mask = (rn < N)[:, None] & (rm < M)[None, :]
        tl.store(ws_ptr + pid_k.to(tl.int64) * mn + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the release below
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last split of this tile: sum all of them in split order
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for other in range(0, splits):
                total += tl.load(ws_ptr + other * mn + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
            _store_out(out_ptr, b_ptr, total, rn, rm, M, N, stride_om, stride_on, stride_b, HAS_BIAS, UPCAST)
    else:
        _store_out(out_ptr, b_ptr, acc, rn, rm, M, N, stride_om, stride_on, stride_b, HAS_BIAS, UPCAST)


@triton.jit
def _per_column(v, GROUP: tl.constexpr):
    """A group's value as (BLOCK_N, 16) or (BLOCK_N, 1), broadcasting over a chunk's 16 word columns."""
    if GROUP != 0 and GROUP < 128:
        return v
    else:
        return v[:, None]


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # (M, K) activations; strides stride_xm, stride_xk
    qw_ptr,  # (N, 16·⌈K/128⌉) int32 packed weights; strides stride_qn, stride_qw
    s_ptr,  # (G, N) scales in x's dtype; strides stride_sg, stride_sn
    z_ptr,  # (G, N) uint8 zero points; strides stride_zg, stride_zn
    b_ptr,  # (N,) bias, stride stride_b; read only if HAS_BIAS
    out_ptr,  # (M, N) output; strides stride_om, stride_on
    ws_ptr,  # SPLIT: (splits, M, N) fp32 partial sums, contiguous; else unused
    cnt_ptr,  # SPLIT: int32 counters, one per (row tile, column tile), 0 between calls; else unused
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qw,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_b,
    stride_om,
    stride_on,
    steps_per_split,  # loop steps (CHUNKS chunks of 128 inputs each) per split
    GROUP: tl.constexpr,  # group size (a power of two ≥ 32); 0: one group per output channel
    CHUNKS: tl.constexpr,  # 128-input chunks per loop step
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0, K % (128·CHUNKS) == 0 and every split full: no masks
    UPCAST: tl.constexpr,  # the interpreter: round the output by hand
    EXACT_ZERO: tl.constexpr,  # fp32 activations: subtract the zero from each weight (exact), no Σx cancellation
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The decode path (M ≤ 16) on the CUDA cores: no layout conversion, no shared memory between the load and the
    math. A program holds a (BLOCK_N, 16)-word tile of a chunk (16 bytes per lane and row) and keeps its sums per
    word column, (BLOCK_M, BLOCK_N, 16) in fp32, reducing across the columns once at the end. Per word: four
    SHF + LOP3 make four bf16 pairs 128 + q (`0x43004300`, whatever x's dtype), each half widened to fp32 by one
    shift or AND; the matching x values are gathered once per chunk and shared by every output of the program."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    rj = tl.arange(0, 16)
    k_of_word = 32 * (rj % 4) + 2 * (rj // 4)  # input of nibble 0 of word j within its chunk (CHUNK_ORDER[j][0])
    w_rows = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + rj[None, :] * stride_qw
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    n_words = tl.cdiv(K, 128) * 16

    acc = tl.zeros((BLOCK_M, BLOCK_N, 16), dtype=tl.float32)
    if GROUP == 0:
        s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn * stride_zn, mask=n_ok, other=0).to(tl.float32) + 128.0
    first = pid_k * steps_per_split
    last = min(first + steps_per_split, tl.cdiv(K, 128 * CHUNKS))
    for step in tl.range(first, last, num_stages=STAGES):
        for c in tl.static_range(CHUNKS):
            chunk = step * CHUNKS + c
            k_word = chunk * 128 + k_of_word  # (16,)
            if EVEN:
                w = tl.load(w_rows + chunk * 16 * stride_qw)
            else:
                w = tl.load(w_rows + chunk * 16 * stride_qw, mask=n_ok[:, None] & (chunk * 16 + rj < n_words)[None, :],
                            other=0)  # fmt: skip
            part = tl.zeros((BLOCK_M, BLOCK_N, 16), dtype=tl.float32)
            x_sum = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
            if GROUP != 0:
                if GROUP < 128:  # a word's 32 inputs share a group; the 4 words of a lane group do not
                    g = (chunk * 128 + 32 * (rj % 4)) // GROUP
                    s_at = s_ptr + g[None, :] * stride_sg + rn[:, None] * stride_sn
                    z_at = z_ptr + g[None, :] * stride_zg + rn[:, None] * stride_zn
                    ok = n_ok[:, None] & (chunk * 128 + 32 * (rj % 4) < K)[None, :]  # past K: no group
                    s = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)  # (BLOCK_N, 16)
                    z = tl.load(z_at, mask=ok, other=0).to(tl.float32) + 128.0
                else:
                    g = chunk * 128 // GROUP
                    s = tl.load(s_ptr + g * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
                    z = tl.load(z_ptr + g * stride_zg + rn * stride_zn, mask=n_ok, other=0).to(tl.float32) + 128.0
            for i in tl.static_range(4):
                pair = ((w >> (4 * i)) & 0x000F000F) | 0x43004300  # nibbles i and i + 4: bf16 128 + q each
                lo = (pair << 16).to(tl.float32, bitcast=True)
                hi = (pair & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
                if EXACT_ZERO:
                    lo = lo - _per_column(z, GROUP)
                    hi = hi - _per_column(z, GROUP)
                k_lo = k_word + 16 * (i // 2) + 8 * (i % 2)  # nibble p = i: e = 0, i1 = i // 2, i0 = i % 2
                if EVEN:
                    x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)
                    x_hi = tl.load(x_rows + (k_lo + 1)[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)
                else:
                    x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=m_ok[:, None] & (k_lo < K)[None, :],
                                   other=0.0)  # fmt: skip
                    x_hi = tl.load(x_rows + (k_lo + 1)[None, :] * stride_xk,
                                   mask=m_ok[:, None] & (k_lo + 1 < K)[None, :], other=0.0)  # fmt: skip
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
                part += lo[None, :, :] * x_lo[:, None, :]  # two statements: two FFMA, not FMUL + FFMA + FADD
                part += hi[None, :, :] * x_hi[:, None, :]
                if not EXACT_ZERO:
                    x_sum += x_lo + x_hi
            if not EXACT_ZERO:  # Σ x·(128 + q) − (128 + zero)·Σ x, per word column
                part -= _per_column(z, GROUP)[None, :, :] * x_sum[:, None, :]
            if GROUP == 0:
                acc += part
            else:
                acc += part * _per_column(s, GROUP)[None, :, :]
    sums = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)
    if GROUP == 0:
        sums = sums * s[None, :]
    _finish(tl.trans(sums), rn, rm, M, N, out_ptr, b_ptr, ws_ptr, cnt_ptr, stride_om, stride_on, stride_b, HAS_BIAS,
            SPLIT, UPCAST)  # fmt: skip


# --------------------------------------------------------------------------------------------------------- schedule

# Tiles by the number of rows M: (largest M, config); the first entry whose bound M does not exceed applies. Keys:
# - BLOCK_M: rows of x per program (the dot's N: 8 or 16 at decode, padded rows read as 0); BLOCK_N: outputs per
#   program (the dot's M; 64 per 4 warps); BLOCK_K: inputs per loop step, a multiple of KC; KC: inputs per sub-step
#   (one dot and one scaling; min(KC, group size) is used); SPLIT_K: 0 picks the split by `FILL`, n ≥ 1 asks for n
#   (at most the steps; the last split shorter where n does not divide them); num_warps, num_stages: Triton's.
# First choices from the sm_90 instruction counts in the docstring; `reports/w4a16/gpu_w4a16.py` times them.
TILES = Tunables(
    gemv1=(1, {"GEMV": 1, "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 128, "KC": 128, "SPLIT_K": 0, "num_warps": 8,
               "num_stages": 2}),
    gemv2=(2, {"GEMV": 1, "BLOCK_M": 2, "BLOCK_N": 256, "BLOCK_K": 128, "KC": 128, "SPLIT_K": 0, "num_warps": 8,
               "num_stages": 2}),
    gemv4=(4, {"GEMV": 1, "BLOCK_M": 4, "BLOCK_N": 64, "BLOCK_K": 256, "KC": 128, "SPLIT_K": 0, "num_warps": 4,
               "num_stages": 2}),
    decode8=(8, {"BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 256, "KC": 128, "SPLIT_K": 0, "num_warps": 4,
                 "num_stages": 3}),
    decode16=(16, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "KC": 128, "SPLIT_K": 0, "num_warps": 4,
                   "num_stages": 3}),
    small=(64, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "KC": 128, "SPLIT_K": 0, "num_warps": 4,
                "num_stages": 3}),
    large=(None, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "KC": 128, "SPLIT_K": 1, "num_warps": 8,
                  "num_stages": 3}),
)  # fmt: skip
# SPLIT_K = 0: the smallest split dividing the steps that gives at least programs_per_sm programs per SM, at most
# max_split, keeping min_steps loop steps per split (the pipeline needs a few to overlap loads with work).
FILL = Tunables(programs_per_sm=1, max_split=32, min_steps=2)
# The CUDA-core decode kernel keeps few bytes in flight per program: more programs per SM hide the loads' latency.
FILL_GEMV = Tunables(programs_per_sm=4, max_split=32, min_steps=1)
# Under the Triton interpreter (CPU tensors) a program costs per operation, not per element, so tiles there are as
# wide as numpy handles well. The sub-step structure along K is the GPU's.
INTERPRETER = Tunables(enabled=True, BLOCK_M=64, BLOCK_N=1024)
COUNTERS = 1 << 16  # split-K tile counters per device (256 KiB): a call needing more runs unsplit
_counters: dict[torch.device, torch.Tensor] = {}  # allocated once per device and never freed (graphs hold them)


def tiles_for(M: int) -> dict[str, int]:
    """The tile configuration of `TILES` for M rows."""
    for bound, config in TILES.values():
        if bound is None or bound >= M:
            return config
    raise ValueError("TILES needs a last entry without a bound")


class Schedule(NamedTuple):
    """How one call is launched: the tiles (with KC and CHUNKS as used), the splits of K, loop steps per split, and
    whether every tile and split is full (no masks)."""

    tiles: dict[str, int]
    splits: int
    steps_per_split: int
    even: bool


def schedule(M: int, N: int, K: int, device: torch.device, group_size: int = 128, split_ok: bool = True) -> Schedule:
    """The launch of an (M, K) × (K, N) call at this group size: a function of the shape, the group size and the
    device only (the public function allocates the split-K workspace from it, the launcher launches from it).
    split_ok=False: no counters on this device yet (a CUDA graph capture before any eager call), unsplit."""
    tiles = dict(tiles_for(M))
    if device.type != "cuda" and INTERPRETER["enabled"]:
        tiles["BLOCK_M"] = max(tiles["BLOCK_M"], min(pow2(M), INTERPRETER["BLOCK_M"]))
        tiles["BLOCK_N"] = max(tiles["BLOCK_N"], min(pow2(N), INTERPRETER["BLOCK_N"]))
    group = 0 if group_count(K, group_size) == 1 else group_size
    gemv = bool(tiles.get("GEMV"))
    kc = CHUNK if gemv else min(int(tiles["KC"]), group) if group else int(tiles["KC"])
    block_k = max(int(tiles["BLOCK_K"]), kc)
    tiles.update(KC=kc, BLOCK_K=block_k, CHUNKS=block_k // kc)
    steps = cdiv(K, block_k)
    tiles_mn = cdiv(M, tiles["BLOCK_M"]) * cdiv(N, tiles["BLOCK_N"])
    fill = FILL_GEMV if gemv else FILL
    divisors = [d for d in range(1, min(steps, fill["max_split"]) + 1) if steps % d == 0]
    want = int(tiles["SPLIT_K"])
    if not split_ok or tiles_mn > COUNTERS:
        split = 1
    elif want <= 0:
        target = fill["programs_per_sm"] * (sm_count(device.index or 0) if device.type == "cuda" else 1)
        fits = [d for d in divisors if steps // d >= fill["min_steps"]] or [1]
        split = next((d for d in fits if tiles_mn * d >= target), fits[-1])
    else:
        split = min(want, steps)
    per = cdiv(steps, split)
    split = cdiv(steps, per)  # no empty split
    even = N % tiles["BLOCK_N"] == 0 and K % block_k == 0 and steps % per == 0
    return Schedule(tiles, split, per, even)


def counters(device: torch.device) -> torch.Tensor | None:
    """This device's split-K counters (zeroed once, reset by the kernel after each use); allocated on first use
    outside a CUDA graph capture, None inside one until then."""
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
    tile_counters: torch.Tensor | None,
) -> None:
    M, K = x.shape
    N = qweight.shape[0]
    plan = schedule(M, N, K, x.device, group_size, split_ok=workspace is not None or tile_counters is not None)
    tiles = plan.tiles
    split = workspace is not None
    if split != (plan.splits > 1):
        raise ValueError(f"the workspace ({None if workspace is None else tuple(workspace.shape)}) does not match "
                         f"the schedule's {plan.splits} splits")  # fmt: skip
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    wdt = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
    magic, base = MAGIC[wdt]
    grid = (cdiv(N, tiles["BLOCK_N"]), cdiv(M, tiles["BLOCK_M"]), plan.splits)
    if tiles.get("GEMV"):
        _launch_gemv(grid, plan, x, qweight, scales, zeros, group_size, bias, out, workspace, tile_counters)
        return
    launchable(_w4a16_kernel)[grid](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        out,
        workspace if split else out,
        tile_counters if split else out,
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
        out.stride(0),
        out.stride(1),
        plan.steps_per_split,
        GROUP=0 if group_count(K, group_size) == 1 else group_size,
        KC=tiles["KC"],
        CHUNKS=tiles["CHUNKS"],
        BASE=base,
        MAGIC=magic,
        WDT=tl.float16 if wdt == torch.float16 else tl.bfloat16,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        EVEN=plan.even,
        UPCAST=interpreted,
        EXACT_ZERO=x.dtype == torch.float32,
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_N=tiles["BLOCK_N"],
        STAGES=tiles["num_stages"],
        num_warps=tiles["num_warps"],
    )


def _launch_gemv(
    grid: tuple[int, int, int],
    plan: Schedule,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
    tile_counters: torch.Tensor | None,
) -> None:
    M, K = x.shape
    split = workspace is not None
    tiles = plan.tiles
    launchable(_w4a16_gemv_kernel)[grid](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        out,
        workspace if split else out,
        tile_counters if split else out,
        M,
        qweight.shape[0],
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
        out.stride(0),
        out.stride(1),
        plan.steps_per_split,
        GROUP=0 if group_count(K, group_size) == 1 else group_size,
        CHUNKS=tiles["CHUNKS"],
        HAS_BIAS=bias is not None,
        SPLIT=split,
        EVEN=plan.even,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        EXACT_ZERO=x.dtype == torch.float32,
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_N=tiles["BLOCK_N"],
        STAGES=tiles["num_stages"],
        num_warps=tiles["num_warps"],
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
    tile_counters: torch.Tensor | None,
) -> None:
    _launch(x, qweight, scales, zeros, group_size, bias, out, workspace, tile_counters)


triton_op("fusionscope::w4a16_gemm", mutates_args={"out", "workspace", "tile_counters"})(_w4a16_op)


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
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[1] != packed_words(K):
        raise ValueError(f"qweight must be int32 (N, {packed_words(K)}) for K = {K} (16 words per 128 inputs, "
                         f"`pack_w4`'s layout), got {tuple(qweight.shape)} {qweight.dtype}")  # fmt: skip
    N, G = qweight.shape[0], group_count(K, group_size)
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
    output, a call split along K allocates its (splits, M, N) fp32 workspace: a fixed size per shape, so a CUDA graph
    can capture the call. For inference: the result carries no autograd history."""
    group_size = _check(x, qweight, scales, zeros, group_size, bias)
    K, N = x.shape[-1], qweight.shape[0]
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
    tile_counters = counters(x.device)
    splits = schedule(M, N, K, x.device, group_size, split_ok=tile_counters is not None).splits
    workspace = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else None
    run("w4a16_gemm", _w4a16_op, x2d, qweight, scales, zeros, group_size, bias, out2d, workspace,
        tile_counters if splits > 1 else None)  # fmt: skip
    return out
