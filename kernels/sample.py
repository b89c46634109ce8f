"""Sampling pipeline: temperature → top-k → top-p → draw, in one launch with one program per block of rows, or in
two for 1 < top_k <= 64 (the candidates path below).

Hugging Face's `generate()` runs this as a chain of about a dozen kernels per step: upcast the last position's logits
to fp32, divide by the temperature, `topk` + compare + `masked_fill`, `sort` + `softmax` + `cumsum` + compare +
`scatter` + `masked_fill`, `softmax`, `multinomial`. Every one of them reads or writes a full (B, V) fp32 tensor.

Bytes moved per row of width V, logits in a dtype of size s (the HF chain, counted line by line in
`kept_scores_reference`):
    unfused ≈ V·s + 4V (upcast) + 8V (temperature) + 18V (top-k) + 56V (top-p) + 8V (softmax) + 4V (multinomial)
            = (s + 98)·V bytes, in ~13 launches
    fused   = V·s from DRAM + 8 bytes written (the token id), in 1 launch: ≈ 50× fewer DRAM bytes in bf16.
The fused kernel reads its row ~25 times (1 pass for the max, ≤ 11 per threshold search, 1 for Z, 1 for the draw),
but a row is at most a few hundred KiB (V = 128256 in bf16: 250 KiB) and stays in L2, so DRAM sees it once. The price
is latency: one program walks one row in 4096-wide chunks, so a row costs the same however small the batch is.
Measured on an H200 (torch 2.11, triton 3.6; bf16, V = 128256, temperature 0.7, top_k 50, top_p 0.9; GPU time from
CUDA-graph replay, the seed draw included): B = 1: 744 µs fused vs 320 µs for the HF chain (the fused kernel LOSES:
one SM does all the work); B = 64: 777 vs 1312 µs (1.7×); B = 256: 1540 vs 4178 µs (2.7×). top_p alone: 497 µs at
B = 1; greedy (top_k = 1): 14 µs (torch.argmax: 26 µs). Plain bisection (SPLITS = 1) took 1220 µs at B = 1; wider
tiles (8192) or SPLITS = 16 spill registers and ran 3–5× slower. Small batches need a multi-program-per-row variant.

That variant, for 1 < top_k ≤ 64 (HF's default is 50): two launches, `_candidates_kernel` on a (B, ⌈V / 2048⌉)
grid — each program holds its 2048-column slice in registers and keeps that slice's top k (the row's top k is
among the union) — then `_pick_kernel`, one program per row, running the same top-k and top-p searches and the same
race on ⌈V / 2048⌉ · 64 candidates instead of V columns. Where a slice has more tokens tied at its cut-off than
slots, it stores the tied token the race would pick first and counts the rest, which enter the counts and sums by
number. It draws the same Philox numbers per column, so it picks the same tokens as the one-launch kernel (tested
equal in the interpreter, wide tie groups included). Measured there (`reports/bench/`, same settings): B = 1: 47 µs
GPU (16× less than one launch, 7× less than the HF chain); B = 64: 306 µs (2.6× and 4.3× less). It is on by
default (`TWO_STAGE["enabled"]`); `fusionscope bench sample` times the one-launch path beside it as
`fusionscope-1launch`.

How the kernel avoids a sort. Every fp32 value maps to an int32 key that orders like the value (flip the magnitude
bits of negatives). With s = logits / T:
- top-k threshold: the k-th largest s is the largest key t with count(key ≥ t) ≥ k, found by a search over the key
  range [min key, max key] of the row: each pass counts at SPLITS = 8 thresholds at once and keeps the one interval
  of 9 that holds the answer (≤ 11 passes for 2³² keys). Tokens with s ≥ that value are kept — exactly HF's
  `scores < topk(scores, k)[-1]` removal, ties at the k-th value included.
- top-p threshold: HF keeps a token when the ascending cumulative probability up to and including it exceeds 1 − p,
  i.e. when the probability mass of the tokens strictly above it is < p. That mass, F(t) = Σ_{key > t} exp(s − max),
  is non-increasing in t, so the kept set is {key ≥ t*} with t* the smallest key where F(t) < p·Z
  (Z = Σ over the top-k-kept tokens of exp(s − max)); the same 9-way search, summing instead of counting. The max is
  always kept (F = 0 there), which is HF's `min_tokens_to_keep = 1`.
- Up to ties at the cut-off: where HF's sort splits a group of equal values at the top-p boundary, the kernel keeps
  the whole group; fp32 sums in a different order can also move a token whose cumulative probability is within
  ~1e-6 of 1 − p.

The draw, and why it has the right distribution. With E_i ~ Exp(1) independent, the exponential race
argmax_i p_i / E_i returns i with probability p_i / Σ_j p_j: E_i / p_i ~ Exp(p_i), and the minimum of independent
exponentials is attained at i with probability rate_i / Σ rates. Taking logs, the kernel computes
argmax over the kept set of (s_i − log E_i) (the Gumbel-max trick, −log E being a standard Gumbel variable); the
softmax normaliser is a common factor, so this is a draw from softmax(s) restricted to the kept set and renormalised —
the distribution HF's `multinomial` samples. E_i = −log(1 − U_i) with U_i from Philox (`tl.rand(seed, row·V + col)`),
computed with a series near 0 so that small E (the likely winners) keep full relative precision. The seed is drawn on
the device from `generator` (or the default generator), so the same generator state gives the same tokens, whatever
the block sizes.

Scores are s = logits / T computed as torch computes them on each device, so that thresholds see the same fp32 values:
on CUDA torch multiplies by the fp32 reciprocal of T (checked bit-exact on the H200, torch 2.11), on the CPU it divides
(correctly rounded). On the H200 the kept sets matched HF's at V = 128256 and 152064, fp32 and bf16, up to ties.

top_k = 1 is greedy decoding: the kernel returns the exact argmax of the logits (ties → lowest index, like
`torch.argmax`), not a random pick among tied maxima. NaN logits are not supported (HF's chain fails on them too).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, pow2, run
from torch.library import triton_op

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Launch parameters on the GPU: chunk width, warps for a one-row program, thresholds per search pass (SPLITS = 8 cuts
# the 2³² key range in ≤ 11 passes instead of 32). Module-level so that a benchmark can sweep them.
GPU_CONFIG = Tunables(BLOCK_V=4096, num_warps=16, SPLITS=8)
_INTERPRETER_SPLITS = 8
# The two-launch path for small k (see `_candidates_kernel`), on by default since it measured 2.6–16× faster than
# the one-launch kernel on the H200; `bench` times the one-launch path as `fusionscope-1launch`. SLICE: columns per
# stage-1 program; MAX_K: the largest top_k it serves (the stage-2 program holds cdiv(V, SLICE) · next_pow2(k)
# candidates: 63 · 64 = 4032 at V = 128256, k = 50).
TWO_STAGE = Tunables(enabled=True, SLICE=2048, MAX_K=64, num_warps=8)


def kept_scores_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF's warper chain (Temperature → TopK → TopP, `min_tokens_to_keep=1`) on `logits: (B, V)`: fp32 scores, -inf
    where a token is removed. Per row of width V in dtype size s; reads and writes below are bytes."""
    scores = logits.to(torch.float32)  # read V·s, write 4V (generate() upcasts the last position's logits)
    if temperature != 1.0:
        scores = scores / temperature  # read 4V, write 4V
    if top_k != 0:
        k = min(top_k, scores.size(-1))
        kth = torch.topk(scores, k)[0][..., -1, None]  # read 4V, write 12k
        remove = scores < kth  # read 4V, write V
        scores = scores.masked_fill(remove, -math.inf)  # read 5V, write 4V
    if top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False)  # read 4V, write 12V
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # read 4V, write 4V; read 4V, write 4V
        sorted_remove = cumulative <= (1 - top_p)  # read 4V, write V
        sorted_remove[..., -1:] = False  # write 1 (min_tokens_to_keep = 1)
        remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)  # read 9V, write V
        scores = scores.masked_fill(remove, -math.inf)  # read 5V, write 4V
    return scores


def kept_probs_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution HF samples from: softmax of the kept scores, `(B, V)` fp32, 0 where a token is removed."""
    scores = kept_scores_reference(logits, temperature, top_k, top_p)
    return scores.softmax(dim=-1)  # read 4V, write 4V


def sample_reference(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's sampling step on `logits: (B, V)`: returns (tokens (B,) int64, kept (B, V) bool, probs (B, V) fp32)."""
    scores = kept_scores_reference(logits, temperature, top_k, top_p)
    probs = scores.softmax(dim=-1)  # read 4V, write 4V
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)  # read 4V, write 8
    return tokens, scores != -math.inf, probs


@triton.jit
def _n_passes(n, ways):
    """Passes of a `ways`-ary search that shrink a range of n ≥ 1 to 1 (n → ⌈n / ways⌉ per pass); n: int64 scalar."""
    passes = 0
    while n > 1:
        n = (n + ways - 1) // ways
        passes += 1
    return passes


@triton.jit
def _sample_kernel(
    logits_ptr,  # (B, V) logits, fp32/fp16/bf16; row stride stride_b, element stride stride_v (any, even 0)
    seed_ptr,  # (1,) int64: Philox seed for this call, drawn from the generator on the device
    out_ptr,  # (B,) int64 token ids, element stride stride_out
    probs_ptr,  # (B, V) fp32 kept-and-renormalised probabilities, strides stride_pb/stride_pv; only if WRITE_PROBS
    B,
    V,
    stride_b,
    stride_v,
    stride_out,
    stride_pb,
    stride_pv,
    temperature,  # fp32 T
    inv_temperature,  # fp32 1/T as torch's CUDA division computes it
    top_k,  # 1 < top_k < V when HAS_TOP_K
    top_p,  # 0 < top_p < 1 when HAS_TOP_P
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    GREEDY: tl.constexpr,  # top_k == 1: the token is the exact argmax of the logits
    WRITE_PROBS: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    SPLITS: tl.constexpr,  # thresholds per search pass (a power of two): a pass cuts the range into SPLITS + 1
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    lanes = tl.arange(0, BLOCK_V)
    row_ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_b
    NEED_KEPT: tl.constexpr = (not GREEDY) or WRITE_PROBS
    token = tl.zeros((BLOCK_B,), dtype=tl.int64)

    if GREEDY:
        # Exact argmax of the logits, ties → lowest index: each lane keeps its first maximum, then the lowest index
        # among the lanes that hold the row maximum.
        best = tl.full((BLOCK_B, BLOCK_V), -float("inf"), tl.float32)
        best_idx = tl.full((BLOCK_B, BLOCK_V), 2**31 - 1, tl.int32)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            valid = row_mask[:, None] & (cols[None, :] < V)
            x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=-float("inf")).to(tl.float32)
            better = valid & ((x > best) | (best_idx == 2**31 - 1))
            best = tl.where(better, x, best)
            best_idx = tl.where(better, cols[None, :], best_idx)
        row_best = tl.max(best, axis=1)
        token = tl.min(tl.where(best == row_best[:, None], best_idx, 2**31 - 1), axis=1).to(tl.int64)

    if NEED_KEPT:
        # Every pass below reloads its chunk and recomputes s and its key in the same seven lines: a @triton.jit helper
        # would say it once, but costs ~3.5 ms a call under the interpreter, i.e. seconds per test.
        # Pass 1: row maximum of s (the softmax shift) and the key range.
        acc_max = tl.full((BLOCK_B, BLOCK_V), -float("inf"), tl.float32)
        acc_kmin = tl.full((BLOCK_B, BLOCK_V), 2**31 - 1, tl.int32)
        acc_kmax = tl.full((BLOCK_B, BLOCK_V), -(2**31), tl.int32)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            valid = row_mask[:, None] & (cols[None, :] < V)
            x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
            s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
            s = tl.where(s == 0.0, 0.0, s)
            bits = s.to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            acc_max = tl.maximum(acc_max, tl.where(valid, s, -float("inf")))
            acc_kmin = tl.minimum(acc_kmin, tl.where(valid, key, 2**31 - 1))
            acc_kmax = tl.maximum(acc_kmax, tl.where(valid, key, -(2**31)))
        row_max = tl.max(acc_max, axis=1)
        kmin = tl.min(acc_kmin, axis=1).to(tl.int64)
        kmax = tl.max(acc_kmax, axis=1).to(tl.int64)
        kmax = tl.where(row_mask, kmax, kmin)  # padding rows: an empty range
        threshold = kmin  # kept: key >= threshold

        js = (tl.arange(0, SPLITS) + 1).to(tl.int64)  # the SPLITS thresholds of one pass, j = 1..SPLITS
        if HAS_TOP_K:
            # Largest key t with count(key >= t) >= k. Invariant: count(lo) >= k, count(hi + 1) < k. Each pass
            # counts at SPLITS thresholds at once and keeps the one interval of SPLITS + 1 that holds the answer.
            lo = kmin
            hi = kmax
            for _ in range(_n_passes(tl.max(hi - lo + 1, axis=0), SPLITS + 1)):
                step = (hi - lo + 1 + SPLITS) // (SPLITS + 1)
                t = tl.minimum(lo[:, None] + js[None, :] * step[:, None], hi[:, None]).to(tl.int32)
                acc_cnt = tl.zeros((BLOCK_B, SPLITS, BLOCK_V), dtype=tl.int32)
                for start in range(0, V, BLOCK_V):
                    cols = start + lanes
                    valid = row_mask[:, None] & (cols[None, :] < V)
                    x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
                    s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
                    s = tl.where(s == 0.0, 0.0, s)
                    bits = s.to(tl.int32, bitcast=True)
                    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                    acc_cnt += ((key[:, None, :] >= t[:, :, None]) & valid[:, None, :]).to(tl.int32)
                below = tl.sum((tl.sum(acc_cnt, axis=2) >= top_k).to(tl.int64), axis=1)  # thresholds still >= k
                new_lo = tl.minimum(lo + below * step, hi)
                hi = tl.where(below < SPLITS, tl.minimum(lo + (below + 1) * step - 1, hi), hi)
                lo = new_lo
            threshold = lo

        if HAS_TOP_P:
            # Z: the softmax normaliser over the top-k-kept tokens.
            acc_z = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                cols = start + lanes
                valid = row_mask[:, None] & (cols[None, :] < V)
                x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
                s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
                s = tl.where(s == 0.0, 0.0, s)
                bits = s.to(tl.int32, bitcast=True)
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                keep = valid & (key >= threshold[:, None].to(tl.int32))
                acc_z += tl.where(keep, tl.exp(s - row_max[:, None]), 0.0)
            target = top_p * tl.sum(acc_z, axis=1)
            # Smallest key t with F(t) = Σ_{key > t} exp(s − max) < p·Z. Invariant: F(lo) >= p·Z > F(hi).
            lo = threshold - 1
            hi = kmax
            for _ in range(_n_passes(tl.max(hi - lo, axis=0), SPLITS + 1)):  # until hi − lo = 1
                step = (hi - lo + SPLITS) // (SPLITS + 1)
                t = tl.minimum(lo[:, None] + js[None, :] * step[:, None], hi[:, None]).to(tl.int32)
                acc_mass = tl.zeros((BLOCK_B, SPLITS, BLOCK_V), dtype=tl.float32)
                for start in range(0, V, BLOCK_V):
                    cols = start + lanes
                    valid = row_mask[:, None] & (cols[None, :] < V)
                    x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
                    s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
                    s = tl.where(s == 0.0, 0.0, s)
                    bits = s.to(tl.int32, bitcast=True)
                    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                    e = tl.where(valid, tl.exp(s - row_max[:, None]), 0.0)
                    acc_mass += tl.where(key[:, None, :] > t[:, :, None], e[:, None, :], 0.0)
                heavy = tl.sum((tl.sum(acc_mass, axis=2) >= target[:, None]).to(tl.int64), axis=1)
                new_lo = lo + heavy * step
                hi = tl.minimum(lo + (heavy + 1) * step, hi)
                lo = new_lo
            threshold = hi

        if not GREEDY:
            # Exponential race over the kept set: argmax of s − log E, E = −log(1 − U) ~ Exp(1).
            best = tl.full((BLOCK_B, BLOCK_V), -float("inf"), tl.float32)
            best_idx = tl.full((BLOCK_B, BLOCK_V), 2**31 - 1, tl.int32)
            seed = tl.load(seed_ptr)
            for start in range(0, V, BLOCK_V):
                cols = start + lanes
                valid = row_mask[:, None] & (cols[None, :] < V)
                x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
                s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
                s = tl.where(s == 0.0, 0.0, s)
                bits = s.to(tl.int32, bitcast=True)
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                offsets = rows[:, None].to(tl.int64) * V + cols[None, :]
                u = tl.rand(seed, offsets) + 2.3283064e-10  # (x + ½)·2⁻³¹: never 0, still < 1
                series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))
                e = tl.where(u < 0.01, series, -tl.log(1.0 - u))
                race = tl.where(valid & (key >= threshold[:, None].to(tl.int32)), s - tl.log(e), -float("inf"))
                better = race > best
                best = tl.where(better, race, best)
                best_idx = tl.where(better, cols[None, :], best_idx)
            row_best = tl.max(best, axis=1)
            token = tl.min(tl.where(best == row_best[:, None], best_idx, 2**31 - 1), axis=1).to(tl.int64)

        if WRITE_PROBS:
            acc_z = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                cols = start + lanes
                valid = row_mask[:, None] & (cols[None, :] < V)
                x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
                s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
                s = tl.where(s == 0.0, 0.0, s)
                bits = s.to(tl.int32, bitcast=True)
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                keep = valid & (key >= threshold[:, None].to(tl.int32))
                acc_z += tl.where(keep, tl.exp(s - row_max[:, None]), 0.0)
            z = tl.sum(acc_z, axis=1)
            for start in range(0, V, BLOCK_V):
                cols = start + lanes
                valid = row_mask[:, None] & (cols[None, :] < V)
                x = tl.load(row_ptrs + cols[None, :] * stride_v, mask=valid, other=0.0).to(tl.float32)
                s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
                s = tl.where(s == 0.0, 0.0, s)
                bits = s.to(tl.int32, bitcast=True)
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                keep = valid & (key >= threshold[:, None].to(tl.int32))
                p = tl.where(keep, tl.exp(s - row_max[:, None]) / z[:, None], 0.0)
                ptrs = probs_ptr + rows[:, None].to(tl.int64) * stride_pb + cols[None, :].to(tl.int64) * stride_pv
                tl.store(ptrs, p.to(probs_ptr.dtype.element_ty), mask=valid)

    tl.store(out_ptr + rows.to(tl.int64) * stride_out, token, mask=row_mask)


@triton.jit
def _candidates_kernel(
    logits_ptr,  # (B, V) logits; row stride stride_b, element stride stride_v
    seed_ptr,  # (1,) int64 Philox seed (the one the race in `_pick_kernel` uses)
    cand_s_ptr,  # (B, N_SLICES, K_PAD) fp32 scores of each slice's top-k candidates, -inf in unused slots
    cand_i_ptr,  # (B, N_SLICES, K_PAD) int32 their column indices
    cut_s_ptr,  # (B, N_SLICES) fp32 the slice's cut-off score (its k-th largest)
    dropped_ptr,  # (B, N_SLICES) int32 tokens at that score left out of the candidates (a tie group too wide)
    V,
    N_SLICES,
    stride_b,
    stride_v,
    temperature,
    inv_temperature,
    top_k,
    SLICE: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """Stage 1 of the two-launch path: program (row, slice) keeps its slice's top_k scores. Every token of the row's
    top k is among its slice's top k, so the candidates hold the row's top-k set — except where a slice has more
    tokens tied at its cut-off than slots. Then the slot goes to the tied token the race would pick first (the one
    with the smallest exponential draw: tied tokens share their score), and the others are counted, not stored:
    `_pick_kernel` adds them to its counts and sums by that count, so thresholds and the drawn token stay exact."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * SLICE + tl.arange(0, SLICE)
    valid = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_b + cols.to(tl.int64) * stride_v, mask=valid, other=0.0)
    x = x.to(tl.float32)
    s = x * inv_temperature if RECIPROCAL else tl.math.div_rn(x, temperature)
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    k = tl.minimum(top_k, tl.sum(valid.to(tl.int32), axis=0))
    lo = tl.min(tl.where(valid, key, 2**31 - 1), axis=0).to(tl.int64)
    hi = tl.max(tl.where(valid, key, -(2**31)), axis=0).to(tl.int64)
    js = (tl.arange(0, SPLITS) + 1).to(tl.int64)
    # Largest key t with count(key >= t) >= k, as in `_sample_kernel`, on the slice held in registers.
    for _ in range(_n_passes(hi - lo + 1, SPLITS + 1)):
        step = (hi - lo + 1 + SPLITS) // (SPLITS + 1)
        t = tl.minimum(lo + js * step, hi).to(tl.int32)
        count = tl.sum(((key[None, :] >= t[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        below = tl.sum((count >= k).to(tl.int64), axis=0)
        new_lo = tl.minimum(lo + below * step, hi)
        hi = tl.where(below < SPLITS, tl.minimum(lo + (below + 1) * step - 1, hi), hi)
        lo = new_lo
    cut = lo.to(tl.int32)
    above = valid & (key > cut)
    tied = valid & (key == cut)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    n_tied = tl.sum(tied.to(tl.int32), axis=0)
    # the tied token with the smallest draw (the same u as `_pick_kernel`'s race; ties in u → the lowest column)
    u = tl.where(tied, tl.rand(tl.load(seed_ptr), row.to(tl.int64) * V + cols), 2.0)
    first = tl.min(tl.where(u == tl.min(u, axis=0), cols, 2**31 - 1), axis=0)
    lead = tied & (cols == first)
    rest = tied & (cols != first)
    slot = tl.where(above, tl.cumsum(above.to(tl.int32), axis=0) - 1, n_above)
    slot = tl.where(rest, n_above + tl.cumsum(rest.to(tl.int32), axis=0), slot)
    keep = (above | lead | rest) & (slot < K_PAD)
    base = (row.to(tl.int64) * N_SLICES + part) * K_PAD
    tl.store(cand_s_ptr + base + slot, s, mask=keep)
    tl.store(cand_i_ptr + base + slot, cols, mask=keep)
    filled = tl.minimum(n_above + n_tied, K_PAD)
    slots = tl.arange(0, K_PAD)
    tl.store(cand_s_ptr + base + slots, tl.full((K_PAD,), -float("inf"), tl.float32), mask=slots >= filled)
    tl.store(cand_i_ptr + base + slots, tl.zeros((K_PAD,), tl.int32), mask=slots >= filled)
    cut_score = tl.max(tl.where(tied, s, -float("inf")), axis=0)
    tl.store(cut_s_ptr + row.to(tl.int64) * N_SLICES + part, cut_score)
    tl.store(dropped_ptr + row.to(tl.int64) * N_SLICES + part, n_above + n_tied - filled)


@triton.jit
def _pick_kernel(
    cand_s_ptr,  # (B, N_CAND) fp32 candidate scores (-inf: empty slot)
    cand_i_ptr,  # (B, N_CAND) int32 candidate columns
    cut_s_ptr,  # (B, N_SLICES) fp32 each slice's cut-off score
    dropped_ptr,  # (B, N_SLICES) int32 tokens at that score not among the candidates
    seed_ptr,
    out_ptr,
    V,
    N_CAND,
    N_SLICES,
    stride_out,
    top_k,
    top_p,
    HAS_TOP_P: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    SLICES_PAD: tl.constexpr,
):
    """Stage 2: one program per row runs `_sample_kernel`'s top-k and top-p searches and the exponential race on the
    row's candidates instead of the row; tokens a slice counted but did not store enter the counts and sums by
    their number (they share their slice's cut-off score). The race draws the same Philox numbers (offset
    row · V + column) and a stored tied token beats its unstored peers, so with the same seed it picks the
    one-launch kernel's token, up to fp32 summation order in Z."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = row.to(tl.int64) * N_CAND
    s = tl.load(cand_s_ptr + base + offs, mask=offs < N_CAND, other=-float("inf"))
    idx = tl.load(cand_i_ptr + base + offs, mask=offs < N_CAND, other=0)
    valid = s > -float("inf")
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    parts = tl.arange(0, SLICES_PAD)
    in_row = parts < N_SLICES
    dropped = tl.load(dropped_ptr + row.to(tl.int64) * N_SLICES + parts, mask=in_row, other=0)
    cut_s = tl.load(cut_s_ptr + row.to(tl.int64) * N_SLICES + parts, mask=in_row, other=0.0)
    cut_bits = cut_s.to(tl.int32, bitcast=True)
    cut_key = tl.where(cut_bits < 0, cut_bits ^ 0x7FFFFFFF, cut_bits)
    row_max = tl.max(s, axis=0)
    lo = tl.min(tl.where(valid, key, 2**31 - 1), axis=0).to(tl.int64)
    hi = tl.max(tl.where(valid, key, -(2**31)), axis=0).to(tl.int64)
    kmax = hi
    js = (tl.arange(0, SPLITS) + 1).to(tl.int64)
    for _ in range(_n_passes(hi - lo + 1, SPLITS + 1)):
        step = (hi - lo + 1 + SPLITS) // (SPLITS + 1)
        t = tl.minimum(lo + js * step, hi).to(tl.int32)
        count = tl.sum(((key[None, :] >= t[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        count += tl.sum(tl.where(cut_key[None, :] >= t[:, None], dropped[None, :], 0), axis=1)
        below = tl.sum((count >= top_k).to(tl.int64), axis=0)
        new_lo = tl.minimum(lo + below * step, hi)
        hi = tl.where(below < SPLITS, tl.minimum(lo + (below + 1) * step - 1, hi), hi)
        lo = new_lo
    threshold = lo
    if HAS_TOP_P:
        e = tl.where(valid & (key >= threshold.to(tl.int32)), tl.exp(s - row_max), 0.0)
        e_cut = tl.where(cut_key >= threshold.to(tl.int32), dropped.to(tl.float32) * tl.exp(cut_s - row_max), 0.0)
        target = top_p * (tl.sum(e, axis=0) + tl.sum(e_cut, axis=0))
        lo = threshold - 1
        hi = kmax
        for _ in range(_n_passes(hi - lo, SPLITS + 1)):
            step = (hi - lo + SPLITS) // (SPLITS + 1)
            t = tl.minimum(lo + js * step, hi).to(tl.int32)
            mass = tl.sum(tl.where(key[None, :] > t[:, None], e[None, :], 0.0), axis=1)
            mass += tl.sum(tl.where(cut_key[None, :] > t[:, None], e_cut[None, :], 0.0), axis=1)
            heavy = tl.sum((mass >= target).to(tl.int64), axis=0)
            new_lo = lo + heavy * step
            hi = tl.minimum(lo + (heavy + 1) * step, hi)
            lo = new_lo
        threshold = hi
    seed = tl.load(seed_ptr)
    u = tl.rand(seed, row.to(tl.int64) * V + idx) + 2.3283064e-10
    series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))
    draw = tl.where(u < 0.01, series, -tl.log(1.0 - u))
    race = tl.where(valid & (key >= threshold.to(tl.int32)), s - tl.log(draw), -float("inf"))
    best = tl.max(race, axis=0)
    token = tl.min(tl.where(race == best, idx, 2**31 - 1), axis=0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out, token.to(tl.int64))


def _uses_two_stage(V: int, top_k: int, write_probs: bool) -> bool:
    small_k = 1 < top_k <= int(TWO_STAGE["MAX_K"])
    return bool(TWO_STAGE["enabled"]) and small_k and int(TWO_STAGE["SLICE"]) < V and not write_probs


def _launch_two_stage(
    logits: torch.Tensor, seed: torch.Tensor, temperature: float, top_k: int, top_p: float, out: torch.Tensor
) -> None:
    B, V = logits.shape
    slice_, k_pad = int(TWO_STAGE["SLICE"]), max(16, pow2(top_k))
    n_slices = cdiv(V, slice_)
    dev = logits.device
    cand_s = torch.empty((B, n_slices, k_pad), dtype=torch.float32, device=dev)
    cand_i = torch.empty((B, n_slices, k_pad), dtype=torch.int32, device=dev)
    cut_s = torch.empty((B, n_slices), dtype=torch.float32, device=dev)
    dropped = torch.empty((B, n_slices), dtype=torch.int32, device=dev)
    t32 = np.float32(temperature)
    cuda = dev.type == "cuda"
    splits = GPU_CONFIG["SPLITS"] if cuda else _INTERPRETER_SPLITS
    warps = int(TWO_STAGE["num_warps"]) if cuda else 4
    launchable(_candidates_kernel)[(B, n_slices)](
        logits, seed, cand_s, cand_i, cut_s, dropped, V, n_slices, logits.stride(0), logits.stride(1), float(t32),
        float(np.float32(1.0) / t32), top_k, SLICE=slice_, K_PAD=k_pad, SPLITS=splits, RECIPROCAL=cuda,
        num_warps=warps,
    )  # fmt: skip
    n_cand = n_slices * k_pad
    launchable(_pick_kernel)[(B,)](
        cand_s, cand_i, cut_s, dropped, seed, out, V, n_cand, n_slices, out.stride(0), top_k, top_p,
        HAS_TOP_P=top_p < 1.0, SPLITS=splits, BLOCK=pow2(n_cand),
        SLICES_PAD=pow2(n_slices), num_warps=warps,
    )  # fmt: skip


def _launch(
    logits: torch.Tensor,
    seed: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    out: torch.Tensor,
    probs: torch.Tensor | None,
) -> None:
    B, V = logits.shape
    if B == 0:
        return
    if _uses_two_stage(V, top_k, probs is not None):
        _launch_two_stage(logits, seed, temperature, top_k, top_p, out)
        return
    # One program per block of rows. On the GPU a row of V > 4096 gets one program (a 128k vocabulary is walked in
    # chunks of BLOCK_V) and small rows share one. Under the interpreter (CPU tensors) a program costs per operation,
    # not per element (~0.1 ms an op, ~3.5 ms a call of a jit helper such as tl.sum), so tiles there are as large as
    # numpy handles well: up to 8192 columns and 65536 elements, many rows per program. Block sizes change neither the
    # distribution nor the random numbers (indexed by row·V + col), only the fp32 summation order of Z.
    if logits.device.type == "cuda":
        BLOCK_V = min(pow2(V), GPU_CONFIG["BLOCK_V"])
        BLOCK_B = max(1, min(pow2(B), GPU_CONFIG["BLOCK_V"] // BLOCK_V))
        num_warps = GPU_CONFIG["num_warps"] if BLOCK_B * BLOCK_V >= 2048 else 4
    else:
        BLOCK_V = min(pow2(V), 8192)
        BLOCK_B = max(1, min(pow2(B), 65536 // BLOCK_V))
        num_warps = 4
    greedy = top_k == 1
    write_probs = probs is not None
    probs_arg = probs if write_probs else out
    stride_pb, stride_pv = probs.stride() if write_probs else (0, 0)
    t32 = np.float32(temperature)
    inv_t32 = float(np.float32(1.0) / t32)  # fp32 reciprocal, as torch's CUDA `scores / T` computes it
    grid = (cdiv(B, BLOCK_B),)
    launchable(_sample_kernel)[grid](
        logits,
        seed,
        out,
        probs_arg,
        B,
        V,
        logits.stride(0),
        logits.stride(1),
        out.stride(0),
        stride_pb,
        stride_pv,
        float(t32),
        inv_t32,
        max(top_k, 1),
        top_p,
        HAS_TOP_K=1 <= top_k < V,
        HAS_TOP_P=top_p < 1.0,
        GREEDY=greedy,
        WRITE_PROBS=write_probs,
        RECIPROCAL=logits.device.type == "cuda",
        SPLITS=GPU_CONFIG["SPLITS"] if logits.device.type == "cuda" else _INTERPRETER_SPLITS,
        BLOCK_B=BLOCK_B,
        BLOCK_V=BLOCK_V,
        num_warps=num_warps,
    )


def _sample_op(
    logits: torch.Tensor,
    seed: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    out: torch.Tensor,
    probs: torch.Tensor | None,
) -> None:
    _launch(logits, seed, temperature, top_k, top_p, out, probs)


triton_op("fusionscope::sample", mutates_args={"out", "probs"})(_sample_op)


def _check_args(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a (B, V) tensor, got {shape}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be fp32, fp16 or bf16, got {logits.dtype}")
    if logits.size(1) == 0:
        raise ValueError("logits must have at least one column (V >= 1)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a float in (0, 1] (1.0 disables it), got {top_p!r}")


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One int64 Philox seed from `generator` (or the default generator of `device`), left on `device`: no host
    sync, and the same generator state gives the same seed."""
    gen_device = generator.device if generator is not None else device
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator, device=gen_device)
    return seed.to(device, non_blocking=True)


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None = None,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    return_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from HF's Temperature → TopK → TopP distribution, in one or two launches (after a
    one-element seed draw on the device).

    logits: (B, V), fp32/fp16/bf16, any strides. temperature > 0; top_k >= 0 (0 disables; 1 is greedy: exact argmax,
    ties → lowest index); top_p in (0, 1] (1.0 disables). generator: a torch.Generator (any device) or None for the
    default generator of logits' device; one int64 seed is drawn from it per call.
    Returns token ids (B,) int64. With `return_probs=True` also returns the kept-and-renormalised probabilities
    (B, V) fp32 (0 where removed), computed by the same kernel: a debugging path (two more passes and a write).
    out: a (B,) int64 buffer, or (tokens, probs) buffers when return_probs.
    """
    _check_args(logits, temperature, top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    B, V = logits.shape
    if return_probs:
        if out is None:
            out = (None, None)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError("with return_probs=True, out must be a (tokens, probs) tuple")
        tokens, probs = out
        if probs is None:
            probs = torch.empty((B, V), dtype=torch.float32, device=logits.device)
        elif probs.shape != (B, V) or probs.dtype != torch.float32 or probs.device != logits.device:
            raise ValueError(
                f"probs out must be ({B}, {V}) fp32 on {logits.device}, got {tuple(probs.shape)} "
                f"{probs.dtype} on {probs.device}"
            )
    else:
        if isinstance(out, tuple):
            raise ValueError("out must be a tensor unless return_probs=True")
        tokens, probs = out, None
    if tokens is None:
        tokens = torch.empty((B,), dtype=torch.int64, device=logits.device)
    elif tokens.shape != (B,) or tokens.dtype != torch.int64 or tokens.device != logits.device:
        raise ValueError(
            f"out must be ({B},) int64 on {logits.device}, got {tuple(tokens.shape)} {tokens.dtype} on {tokens.device}"
        )
    seed = _draw_seed(generator, logits.device)
    run("sample", _sample_op, logits, seed, float(temperature), int(top_k), float(top_p), tokens, probs)
    return (tokens, probs) if return_probs else tokens
