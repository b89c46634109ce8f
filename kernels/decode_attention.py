"""Attention of one new token against a static KV cache, in one launch that reads the valid part of the cache once.

At decode time Hugging Face's sdpa path with a `StaticCache` hands `scaled_dot_product_attention` the whole
(B, KVH, S_max, D) cache: `repeat_kv` first copies K and V to (B, H, S_max, D) (H // KVH copies each), a mask tensor
hides the rows past the current length, and the attention then reads all S_max rows of the copies, valid or not. For
one query token the work is a small, bandwidth-bound read of K and V, so every extra byte is time. Per layer with
caches in a dtype of s bytes and `length` valid rows:

    unfused  ≈ 2·KVH·S_max·D·s (read for repeat_kv) + 2·2·H·S_max·D·s (write the copies, read them again) + the mask
    fused    = 2·B·KVH·length·D·s (K and V rows 0..length-1, each read once) + q and the output

e.g. Llama-3.1-8B (KVH 8, H 32, D 128, bf16) at length 600: 2.4 MB per layer fused.

Schedule. One program per (batch, kv head, split of the positions, block of query heads): it loads the G = H // KVH
query heads that share its kv head once (GQA: query head h reads kv head h // G), then walks its positions in
BLOCK_N-row tiles of K and V with an fp32 online softmax (exp2, scale folded into log2 e). Scores and the weighted sum
come from `tl.dot` with the head block padded to 16 rows, also for a single head (MHA): the padding's wasted tensor-core
work is free here, and the alternative, a broadcast multiply and sum, compiled (Triton 3.6, sm_90, bf16, 64×128 tiles)
to 2067 instructions per tile with 168 registers and warp shuffles for both reductions, against 340 for the dot with
K and V arriving by asynchronous copies. The loop's upper bound is `length`, loaded from device memory inside the
kernel: nothing is read past it, nothing depends on it on the host, so a CUDA graph captured once replays correctly as
`length` grows. `length` is clamped to [0, S_max] (a larger value reads no row out of bounds; 0 gives zeros).

Splits (flash-decoding). With few programs — batch 1, 8 kv heads — one program per kv head would leave most SMs idle
on a long cache, so the positions are cut into SPLITS chunks of a fixed size chosen from S_max, never from `length`
(the launch and the workspace are the same every step). Each program then writes its partial (max, sum, unnormalised
output) to an fp32 workspace of (SPLITS, B, H, D + 2), and a second small kernel combines the partials of each head in
a fixed order (deterministic). A split that starts at or past `length` runs no iteration and writes the neutral
partial (max -inf, sum 0). With SPLITS = 1 the first kernel normalises and writes the output itself: one launch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, cdiv, launchable, pow2, run, sm_count
from fusionscope.kernels.pdl import launch_options, wait_for_previous
from fusionscope.kernels.rounding import round_to
from torch.library import triton_op
from triton.runtime.interpreter import InterpretedFunction

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LENGTH_DTYPES = (torch.int64, torch.int32)
MAX_HEAD_DIM = 256  # a program holds a G×D query block and BLOCK_N×D tiles of K and V in registers
_LOG2E = math.log2(math.e)

# The launch (H200, 2026-12-02, reports/apply/README.md): with one split up to 1024 cached rows, llama-3.1-8b's
# replayed decode step at batch 1 (579 rows, 8 programs) spent 16.8 µs per layer here, while the bench's batch-1 case
# on a 4096-row cache (16 splits of 256 rows, 3 of them with rows to read at length 614) took 9.2 µs, combine
# included: with 8 kv heads one program per head leaves 124 of 132 SMs idle, so short caches split too
# (`single_split_up_to` 0, splits of at least `min_split_len` 64 rows). That rule is not yet timed in a model.
# - BLOCK_N: cache rows per loop step; num_warps, num_stages: Triton's.
# - splits: 0 picks the number of splits by the rule below, n ≥ 1 forces n (fewer when S_max is too short for n
#   chunks of BLOCK_N rows).
# - The rule: one split when the programs already cover the SMs (B·KVH·head blocks ≥ SMs) or S_max ≤
#   single_split_up_to; otherwise enough splits for programs_per_sm programs per SM, each split at least
#   min_split_len positions.
# - max_group: query heads per program at most, 16 at least (a larger G takes several head blocks, each reading K and
#   V).
SCHEDULE = Tunables(
    BLOCK_N=64,
    num_warps=4,
    num_stages=2,
    splits=0,
    single_split_up_to=0,
    programs_per_sm=2,
    min_split_len=64,
    max_group=16,
)
_DOT_ROWS = 16  # the smallest M of a tl.dot


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor | int, scale: float
) -> torch.Tensor:
    """Softmax attention of q (B, H, 1, D) over cache rows 0..length-1 of (B, KVH, S_max, D) K and V, computed in
    float64: kv heads repeated H // KVH times (query head h reads kv head h // (H // KVH)), causal for a query at
    position length - 1 (it sees every valid row). Returns (B, 1, H, D) in q's dtype, the layout Hugging Face's
    `sdpa_attention_forward` returns."""
    n = int(length)
    groups = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :n].to(torch.float64).repeat_interleave(groups, dim=1)
    v = v_cache[:, :, :n].to(torch.float64).repeat_interleave(groups, dim=1)
    scores = (q.to(torch.float64) @ k.transpose(-1, -2)) * scale  # (B, H, 1, n)
    out = scores.softmax(dim=-1) @ v  # (B, H, 1, D)
    return out.transpose(1, 2).contiguous().to(q.dtype)


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # (B, H, 1, D) query, any strides
    k_ptr,  # (B, KVH, S_MAX, D) key cache, any strides
    v_ptr,  # (B, KVH, S_MAX, D) value cache, any strides
    len_ptr,  # (1,) int32/int64: valid cache rows, read here (never on the host)
    out_ptr,  # (B, 1, H, D) output (written when not PARTIAL)
    ws_ptr,  # (SPLITS, B, H, D + 2) fp32 workspace, last dim contiguous (written when PARTIAL)
    KVH,
    G,  # query heads per kv head
    S_MAX,
    D,
    CHUNK,  # positions per split, a multiple of BLOCK_N
    qk_scale,  # softmax scale · log2(e)
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_od,
    stride_ws,
    stride_wb,
    stride_wh,
    BLOCK_G: tl.constexpr,  # query heads per program, padded to at least 16 (tl.dot's smallest M)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two ≥ D, at least 16
    PARTIAL: tl.constexpr,  # SPLITS > 1: write partials to the workspace
    UPCAST: tl.constexpr,  # bf16 in the interpreter: fp32 right after each load (its bf16 arithmetic is wrong)
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for fp32 inputs
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    # grid: (B·KVH, SPLITS, head blocks)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // KVH).to(tl.int64)
    kvh = pid % KVH
    g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < G
    heads = (kvh * G + g).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    length = tl.minimum(tl.maximum(tl.load(len_ptr).to(tl.int32), 0), S_MAX)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, length)  # ≤ lo when the split starts past length: no iteration, a neutral partial
    k_base = k_ptr + b * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b * stride_vb + kvh.to(tl.int64) * stride_vh
    n = tl.arange(0, BLOCK_N)
    # fp32 whatever the launcher passed: Inductor hands a Python float over as fp64, which would turn the loop's
    # running max into fp64 (a Triton compile error under torch.compile)
    qk_scale = tl.cast(qk_scale, tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        n_mask = pos < hi
        tile_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + pos[:, None] * stride_ks + d[None, :] * stride_kd, mask=tile_mask, other=0.0)
        # V's load goes out with K's, before the scores: the two reads overlap instead of V waiting on the softmax
        v = tl.load(v_base + pos[:, None] * stride_vs + d[None, :] * stride_vd, mask=tile_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one valid row
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    mask = g_mask[:, None] & d_mask[None, :]
    if PARTIAL:
        w = ws_ptr + split.to(tl.int64) * stride_ws + b * stride_wb + heads * stride_wh
        tl.store(w[:, None] + d[None, :], acc, mask=mask)
        tl.store(w + D, m_i, mask=g_mask)
        tl.store(w + D + 1, l_i, mask=g_mask)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 (and acc = 0) only when length = 0
        dtype = out_ptr.dtype.element_ty
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, round_to(o, dtype).to(dtype), mask=mask)


@triton.jit
def _decode_attention_combine_kernel(
    ws_ptr,  # (SPLITS, B, H, D + 2) fp32 partials: unnormalised output, max (log2 units), sum
    out_ptr,  # (B, 1, H, D)
    H,
    D,
    SPLITS,
    stride_ws,
    stride_wb,
    stride_wh,
    stride_ob,
    stride_oh,
    stride_od,
    BLOCK_S: tl.constexpr,  # next power of two ≥ SPLITS
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    # grid: (B·H,); one program merges the SPLITS partials of one head, always in the same reduction order
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    w = ws_ptr + s.to(tl.int64) * stride_ws + b * stride_wb + h * stride_wh
    m = tl.load(w + D, mask=s_mask, other=float("-inf"))
    l_s = tl.load(w + D + 1, mask=s_mask, other=0.0)
    acc = tl.load(w[:, None] + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # every partial neutral: length = 0
    weight = tl.math.exp2(m - m_max)  # 0 for neutral partials (max -inf)
    total = tl.sum(weight * l_s, axis=0)
    o = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, round_to(o, dtype).to(dtype), mask=d_mask)


_INTERPRETED = isinstance(_decode_attention_kernel, InterpretedFunction)


class Schedule(NamedTuple):
    """One call's launch: head block, tile and split sizes, all from the shape and the device (never from `length`),
    so that every call of a shape launches the same grid and a CUDA graph can capture it."""

    block_g: int
    head_blocks: int
    block_n: int
    splits: int
    chunk: int  # positions per split, a multiple of block_n


def schedule(batch: int, heads: int, kv_heads: int, s_max: int, device: torch.device) -> Schedule:
    """The launch of a call with these sizes under `SCHEDULE` (the public function sizes the workspace from it, the
    launcher launches from it)."""
    groups = heads // kv_heads
    block_g = max(_DOT_ROWS, min(pow2(groups), pow2(int(SCHEDULE["max_group"]))))
    head_blocks = cdiv(groups, block_g)
    block_n = max(_DOT_ROWS, pow2(int(SCHEDULE["BLOCK_N"])))
    splits = int(SCHEDULE["splits"])
    forced = splits > 0
    if not forced:
        programs = batch * kv_heads * head_blocks
        sms = sm_count(device.index or 0) if device.type == "cuda" else 1
        splits = 1
        if programs < sms and s_max > int(SCHEDULE["single_split_up_to"]):
            wanted = cdiv(int(SCHEDULE["programs_per_sm"]) * sms, programs)
            splits = max(1, min(wanted, s_max // int(SCHEDULE["min_split_len"])))
    # whole tiles per split: a forced count rounds up (at most that many splits); the rule's count rounds down, so
    # that there are at least as many splits as it wanted (rounding up made 580 rows in 9 wanted splits 5 splits of
    # 128 rows)
    per_split = cdiv(s_max, splits)
    rounded_up = forced or splits == 1
    chunk = cdiv(per_split, block_n) * block_n if rounded_up else max(block_n, per_split // block_n * block_n)
    return Schedule(block_g, head_blocks, block_n, cdiv(s_max, chunk), chunk)


def _decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
) -> None:
    b, h, _, d = q.shape
    kvh, s_max = k_cache.shape[1], k_cache.shape[2]
    plan = schedule(b, h, kvh, s_max, q.device)
    partial = workspace is not None
    ws = workspace if partial else out  # a placeholder pointer when there are no partials
    ws_strides = (workspace.stride(0), workspace.stride(1), workspace.stride(2)) if partial else (0, 0, 0)
    block_d = max(_DOT_ROWS, pow2(d))
    upcast = _INTERPRETED and q.dtype == torch.bfloat16  # fp16 runs the GPU's path there too
    launchable(_decode_attention_kernel)[(b * kvh, plan.splits, plan.head_blocks)](
        q, k_cache, v_cache, length, out, ws,
        kvh, h // kvh, s_max, d, plan.chunk, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(3), *k_cache.stride(), *v_cache.stride(),
        out.stride(0), out.stride(2), out.stride(3), *ws_strides,
        BLOCK_G=plan.block_g, BLOCK_N=plan.block_n, BLOCK_D=block_d, PARTIAL=partial,
        UPCAST=upcast, PRECISION="ieee" if upcast or q.dtype == torch.float32 else "tf32",
        num_warps=int(SCHEDULE["num_warps"]), num_stages=int(SCHEDULE["num_stages"]), **launch_options(out),
    )  # fmt: skip
    if partial:
        launchable(_decode_attention_combine_kernel)[(b * h,)](
            workspace, out, h, d, workspace.shape[0], *ws_strides, out.stride(0), out.stride(2), out.stride(3),
            BLOCK_S=pow2(workspace.shape[0]), BLOCK_D=block_d, num_warps=4 if block_d >= 128 else 2,
            **launch_options(out),
        )  # fmt: skip


triton_op("fusionscope::decode_attention", mutates_args={"out", "workspace"})(_decode_attention_op)


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor, out: torch.Tensor | None
) -> None:
    """ValueError naming what disagrees."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be (B, H, 1, D), one query token per sequence; got {tuple(q.shape)}")
    b, h, _, d = q.shape
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported (fp32, fp16, bf16)")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D = {d} is not supported: 1 <= D <= {MAX_HEAD_DIM}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[0] != b or cache.shape[3] != d or cache.shape[2] < 1:
            raise ValueError(f"{name} must be (B={b}, KVH, S_max >= 1, D={d}); got {tuple(cache.shape)}")
        if cache.dtype != q.dtype or cache.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device}; got {cache.dtype} on {cache.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    kvh = k_cache.shape[1]
    if kvh < 1 or h % kvh:
        raise ValueError(f"the query heads H = {h} must be a multiple of the kv heads KVH = {kvh}")
    if not isinstance(length, torch.Tensor) or length.numel() != 1 or length.dtype not in _LENGTH_DTYPES:
        raise ValueError(
            "length must be a 1-element int64 or int32 tensor on q's device (the kernel reads it, so a CUDA graph "
            f"replays with its current value); got {length!r}"
        )
    if length.device != q.device:
        raise ValueError(f"length is on {length.device}, q on {q.device}: it must live on q's device")
    if out is not None and (tuple(out.shape) != (b, 1, h, d) or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(
            f"out must be ({b}, 1, {h}, {d}) {q.dtype} on {q.device}; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over the first `length` rows of a static KV cache.

    q: (B, H, 1, D) fp32/fp16/bf16, any strides (Hugging Face's `(B, 1, H, D)` projection after `.transpose(1, 2)`).
    k_cache, v_cache: (B, KVH, S_max, D) in q's dtype (a `StaticLayer`'s keys and values), any strides; H % KVH == 0,
    query head h reads kv head h // (H // KVH). D: 1 to 256.
    length: a 1-element int64/int32 tensor on q's device, the number of valid cache rows (the query is the token at
    position length - 1 and sees all of them). The kernel reads it: no host sync, and a CUDA graph of the call replays
    correctly after `length` is updated in place. Values outside [0, S_max] are clamped; 0 gives zeros.
    scale: the softmax scale. out: optional (B, 1, H, D) buffer in q's dtype, any strides.
    Returns out, (B, 1, H, D) (fresh: contiguous), so that `out.reshape(B, 1, H * D)` feeds o_proj. Besides the
    output, a call split along the cache (flash-decoding, see the module docstring) allocates a (SPLITS, B, H, D + 2)
    fp32 workspace whose size depends on the shapes only, never on `length`. For inference: no autograd history."""
    _check(q, k_cache, v_cache, length, out)
    b, h, _, d = q.shape
    if out is None:
        out = torch.empty((b, 1, h, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    plan = schedule(b, h, k_cache.shape[1], k_cache.shape[2], q.device)
    workspace = None
    if plan.splits > 1:
        workspace = torch.empty((plan.splits, b, h, d + 2), dtype=torch.float32, device=q.device)
    run("decode_attention", _decode_attention_op, q, k_cache, v_cache, length, float(scale), out, workspace)
    return out
