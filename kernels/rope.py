"""Rotary position embedding (Hugging Face's rotate_half layout) for q and k in one launch, and the same rotation
fused with the static KV-cache write of k and v.

Why: eager `apply_rotary_pos_emb` is a chain of small elementwise kernels per tensor (mul, neg, cat, mul, add: five
launches for q, five for k, plus a cat each for partial rotary), each reading and writing the whole tensor. At decode
(S = 1) they are pure launch overhead; at prefill they are memory traffic. Here one program rotates a block of heads of
one token: it loads cos/sin for that token once, both halves of each head, and writes the result once.

Bytes, with element size s, n = numel of one of q or k (n_r = n·Dr/D its rotated part), C = B·S·Dr (cos or sin):
  unfused, per tensor (HF eager):
    x * cos                  read (n_r + C)·s, write n_r·s
    x[..., :h], x[..., h:]   views, 0
    -x2                      read n_r/2·s, write n_r/2·s
    cat((-x2, x1))           read n_r·s, write n_r·s
    rotate_half(x) * sin     read (n_r + C)·s, write n_r·s
    add                      read 2·n_r·s, write n_r·s
    = (10·n_r + 2·C)·s, plus (read n + write n)·s for the final cat when Dr < D (partial rotary)
  rope unfused   = Σ over x in (q, k) of the above            ≈ (10·(n_q + n_k) + 4·C)·s  (full rotary)
  rope fused     = read (n_q + n_k + 2·C)·s, write (n_q + n_k)·s  = (2·(n_q + n_k) + 2·C)·s
  → ~5x fewer bytes (full rotary; ~3x with Dr = 0.4·D, where eager's cat adds 2·n), 1 launch instead of 10 (12 partial).
  rope_and_cache unfused = rope unfused + StaticCache's index_copy_ of k_rot and v: + (2·n_k + 2·n_k)·s
                           (DynamicCache's torch.cat instead reads and rewrites the whole cache each step)
  rope_and_cache fused   = read (n_q + n_k + n_v + 2·C)·s, write (n_q + n_k + n_v)·s, n_v = n_k
  → saves the k_rot round trip (2·n_k·s) on top of rope's saving, and 2 more launches.
For a memory-bound kernel time ∝ bytes, so prefill rope should run ~4-5x faster; decode is launch-bound and saves
the launches (9 of 10, or 11 of 12 with the cache copies).

Numerics: eager rounds each product and the sum to the dtype; the kernel does the same (products in fp32, rounded to
the dtype, added in fp32, rounded), so results equal HF's (bit for bit in the interpreter and, in the tests, on an
H200). Two things keep it so: on CUDA the products use libdevice's mul_rn, which the compiler never contracts into an
FMA with the add (it otherwise does, for fp32 and, after narrowing to half, for fp16, and near-cancelling products
then differ by many ulps); and bf16 rounding is integer round-to-nearest-even, because Triton's interpreter truncates
fp32→bf16 casts.

Measured on an H200 (bf16, B=4, S=2048, 32/8 heads, D=128, q/k as HF's transposed views, CUDA-graph timing):
rope 68 us fused vs 596 us eager (8.8x), rope_and_cache 78 us vs 663 us; at decode (S=1) 2.4 us vs 19.9 us of GPU
time, where the host cost of an eager call decides: rope 44–51 us a call through the replayed launch (`dispatch`),
HF's eager rope 92–144 us (reports/bench/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import cdiv, launchable, new_output, pow2, run
from fusionscope.kernels.pdl import launch_options, wait_for_previous
from fusionscope.kernels.rounding import round_to
from torch.library import triton_op
from triton.language.extra import libdevice

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]  # view
    x2 = x[..., x.shape[-1] // 2 :]  # view
    return torch.cat((-x2, x1), dim=-1)  # neg: read n/2·s, write n/2·s; cat: read n·s, write n·s


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotation of x (B, H, S, D) by cos/sin already unsqueezed to (B, 1, S, Dr), with the partial-rotary split."""
    dr = cos.shape[-1]
    if cos.dtype != x.dtype:  # fp32 tables: computed in fp32 by type promotion, rounded once (HF's `.to(x.dtype)`)
        return _rotate(x.float(), cos, sin).to(x.dtype)
    x_rot, x_pass = x[..., :dr], x[..., dr:]  # views
    x_cos = x_rot * cos  # read (n_r + C)·s, write n_r·s
    x_half = _rotate_half(x_rot)  # read 1.5·n_r·s, write 1.5·n_r·s
    x_sin = x_half * sin  # read (n_r + C)·s, write n_r·s
    x_embed = x_cos + x_sin  # read 2·n_r·s, write n_r·s
    if dr == x.shape[-1]:
        return x_embed
    return torch.cat((x_embed, x_pass), dim=-1)  # partial rotary only: read n·s, write n·s


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's `apply_rotary_pos_emb` (unsqueeze_dim=1), with Phi/GPT-NeoX's partial-rotary split when
    cos.shape[-1] < D. q: (B, Hq, S, D), k: (B, Hk, S, D), cos/sin: (B or 1, S, Dr) or (S, Dr)."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)  # views
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # views: (B, 1, S, Dr)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)  # (10·n_r + 2·C)·s each, see the module docstring


def rope_and_cache_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    advance: bool = False,
) -> torch.Tensor:
    """HF's rotation followed by StaticCache.update: rotates q and k, writes k_rot and v into the caches at
    `positions` IN PLACE (as the model does), and returns q_rot; with `advance`, then `positions.add_(S)` (the
    counter). Pass clones of the caches to keep the originals."""
    q_rot, k_rot = rope_reference(q, k, cos, sin)  # see rope_reference
    counter = positions
    if positions.dim() == 0:  # the first token's slot (StaticLayer: arange(S) + its write counter)
        positions = positions + torch.arange(k.shape[2], device=positions.device)
    k_cache.index_copy_(2, positions, k_rot)  # read n_k·s, write n_k·s
    v_cache.index_copy_(2, positions, v)  # read n_k·s, write n_k·s
    if advance:
        counter.add_(k.shape[2])
    return q_rot


@triton.jit
def _mul(a, b, MUL_RN: tl.constexpr):
    """a·b rounded to fp32 as its own operation. The compiler contracts `a*b - c*d` into an FMA (and, for fp16, first
    narrows the products to half and contracts those), which skips the rounding of the product that eager performs:
    near-cancelling products then differ from HF by many ulps. libdevice's mul_rn is never contracted. The interpreter
    has no libdevice and never contracts, so it multiplies plainly (MUL_RN is False there)."""
    return libdevice.mul_rn(a, b) if MUL_RN else a * b


@triton.jit
def _rotate_heads(
    x_ptr,  # token base of the input: x[b, 0, s, 0]; head stride stride_xh, element stride stride_xd
    o_ptr,  # token base of the output (same layout rules, its own strides)
    head0,  # first head of this program's block
    H,  # number of heads of x
    stride_xh,
    stride_xd,
    stride_oh,
    stride_od,
    c1,  # cos[..., :HALF] of this token, fp32, shape (1, BLOCK_HALF)
    c2,  # cos[..., HALF:Dr]
    s1,  # sin[..., :HALF]
    s2,  # sin[..., HALF:Dr]
    HALF,  # Dr // 2
    PASS,  # D - Dr: trailing dims copied unchanged
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,
    MUL_RN: tl.constexpr,
    WIDE: tl.constexpr,  # fp32 cos/sin with fp16/bf16 x: products and sum in fp32, rounded once at the store
):
    dtype = o_ptr.dtype.element_ty
    step = tl.float32 if WIDE else dtype  # the dtype eager rounds each product and the sum to (type promotion)
    h = head0 + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (d < HALF)
    x_row = x_ptr + h * stride_xh
    o_row = o_ptr + h * stride_oh
    # every load happens before any store, so o may alias x (in-place rotation)
    x1 = tl.load(x_row + d * stride_xd, mask=mask).to(tl.float32)
    x2 = tl.load(x_row + (d + HALF) * stride_xd, mask=mask).to(tl.float32)
    if HAS_PASS:
        dp = tl.arange(0, BLOCK_PASS)[None, :]
        mask_p = (h < H) & (dp < PASS)
        xp = tl.load(x_row + (dp + 2 * HALF) * stride_xd, mask=mask_p).to(tl.float32)
    # HF order: (x * cos) + (rotate_half(x) * sin), each product and the sum rounded to the dtype they promote to
    o1 = round_to(round_to(_mul(x1, c1, MUL_RN), step) - round_to(_mul(x2, s1, MUL_RN), step), step)
    o2 = round_to(round_to(_mul(x2, c2, MUL_RN), step) + round_to(_mul(x1, s2, MUL_RN), step), step)
    tl.store(o_row + d * stride_od, o1.to(dtype), mask=mask)
    tl.store(o_row + (d + HALF) * stride_od, o2.to(dtype), mask=mask)
    if HAS_PASS:
        tl.store(o_row + (dp + 2 * HALF) * stride_od, xp.to(dtype), mask=mask_p)


@triton.jit
def _copy_heads(
    x_ptr,  # token base of the input x[b, 0, s, 0]
    o_ptr,  # token base of the output
    head0,
    H,
    D,
    stride_xh,
    stride_xd,
    stride_oh,
    stride_od,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = head0 + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + h * stride_xh + d * stride_xd, mask=mask).to(tl.float32)
    tl.store(o_ptr + h * stride_oh + d * stride_od, x.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_cos_sin(
    cos_ptr,  # cos[b, s, 0] of this token; element stride stride_cd
    sin_ptr,  # sin[b, s, 0]
    stride_cd,
    stride_sd,
    HALF,
    BLOCK_HALF: tl.constexpr,
):
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    c1 = tl.load(cos_ptr + d * stride_cd, mask=mask).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + (d + HALF) * stride_cd, mask=mask).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + d * stride_sd, mask=mask).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + (d + HALF) * stride_sd, mask=mask).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def _rope_kernel(
    q_ptr,  # (B, HQ, S, D) query, strides stride_q{b,h,s,d} (any: HF's transposed views included)
    k_ptr,  # (B, HK, S, D) key
    cos_ptr,  # (B or 1, S, Dr) cos; stride_cb = 0 when broadcast over the batch
    sin_ptr,  # (B or 1, S, Dr) sin
    qo_ptr,  # (B, HQ, S, D) rotated query (may be q itself)
    ko_ptr,  # (B, HK, S, D) rotated key (may be k itself)
    S,
    HQ,
    HK,
    HALF,  # Dr // 2
    PASS,  # D - Dr
    N_QBLOCKS,  # cdiv(HQ, BLOCK_H): program_id(1) below this rotates q heads, at or above it k heads
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sd,
    stride_qob,
    stride_qoh,
    stride_qos,
    stride_qod,
    stride_kob,
    stride_koh,
    stride_kos,
    stride_kod,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,
    MUL_RN: tl.constexpr,  # True when compiled for CUDA (see _mul)
    WIDE: tl.constexpr,  # fp32 cos/sin with fp16/bf16 q and k (see _rotate_heads)
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    # grid: (B·S tokens, head blocks of q then of k)
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    c1, c2, s1, s2 = _load_cos_sin(
        cos_ptr + b * stride_cb + s * stride_cs, sin_ptr + b * stride_sb + s * stride_ss, stride_cd, stride_sd, HALF,
        BLOCK_HALF,
    )  # fmt: skip
    if hb < N_QBLOCKS:
        _rotate_heads(
            q_ptr + b * stride_qb + s * stride_qs, qo_ptr + b * stride_qob + s * stride_qos, hb * BLOCK_H, HQ,
            stride_qh, stride_qd, stride_qoh, stride_qod, c1, c2, s1, s2, HALF, PASS,
            BLOCK_H, BLOCK_HALF, BLOCK_PASS, HAS_PASS, MUL_RN, WIDE,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr + b * stride_kb + s * stride_ks, ko_ptr + b * stride_kob + s * stride_kos, (hb - N_QBLOCKS) * BLOCK_H,
            HK, stride_kh, stride_kd, stride_koh, stride_kod, c1, c2, s1, s2, HALF, PASS,
            BLOCK_H, BLOCK_HALF, BLOCK_PASS, HAS_PASS, MUL_RN, WIDE,
        )  # fmt: skip


@triton.jit
def _slot(pos_ptr, s, stride_pos, TICKETS, S, FROM_START: tl.constexpr, ADVANCE: tl.constexpr):
    """Token s's cache slot. With ADVANCE the counter at pos_ptr is also advanced by S, in the launch that reads it
    (a static cache's `counter.add_(S)` was a launch of its own per layer and step): each of the TICKETS programs that
    reads it takes it with one atomic add of a ticket (1 << 32) and gets the slot from the low bits, and the program
    that draws the last ticket adds S and takes the tickets back out. All those atomics hit one address, so they have
    one order consistent with each program's own (coherence): every other program's read comes before the last
    ticket, and the last program's correction after its own; no fence is needed. The counter stays below 2**32.
    (The ticket is a literal: Inductor copies a user kernel's jit helpers, not the globals they read.)"""
    if ADVANCE:
        drawn = tl.atomic_add(pos_ptr, 4294967296, sem="relaxed")  # 1 << 32: a ticket
        if drawn // 4294967296 == TICKETS - 1:
            tl.atomic_add(pos_ptr, S - TICKETS.to(tl.int64) * 4294967296, sem="relaxed")
        pos = drawn % 4294967296 + s
    else:
        pos = tl.load(pos_ptr + s * stride_pos).to(tl.int64) + (s if FROM_START else 0)
    return pos


@triton.jit
def _rope_and_cache_kernel(
    q_ptr,  # (B, HQ, S, D) query, any strides
    k_ptr,  # (B, HK, S, D) new keys
    v_ptr,  # (B, HK, S, D) new values
    cos_ptr,  # (B or 1, S, Dr)
    sin_ptr,  # (B or 1, S, Dr)
    pos_ptr,  # (S,) int32/int64 cache slot of each new token, or with FROM_START one: the first token's (slot + s)
    qo_ptr,  # (B, HQ, S, D) rotated query (may be q itself)
    kc_ptr,  # (B, HK, S_MAX, D) key cache: rotated k written at slots pos
    vc_ptr,  # (B, HK, S_MAX, D) value cache: v written at slots pos
    S,
    S_MAX,
    HQ,
    HK,
    D,
    HALF,
    PASS,
    N_QBLOCKS,  # program_id(1) in [0, N_QBLOCKS): q heads; [N_QBLOCKS, N_QBLOCKS + N_KBLOCKS): k; then v
    N_KBLOCKS,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sd,
    stride_pos,
    stride_qob,
    stride_qoh,
    stride_qos,
    stride_qod,
    stride_kcb,
    stride_kch,
    stride_kcs,
    stride_kcd,
    stride_vcb,
    stride_vch,
    stride_vcs,
    stride_vcd,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,
    MUL_RN: tl.constexpr,  # True when compiled for CUDA (see _mul)
    WIDE: tl.constexpr,  # fp32 cos/sin with fp16/bf16 q and k (see _rotate_heads)
    BLOCK_D: tl.constexpr,
    FROM_START: tl.constexpr,  # pos_ptr holds the first token's slot; token s goes to slot + s (a slot outside
    # [0, S_MAX) is not written, either way)
    ADVANCE: tl.constexpr = False,  # with FROM_START: pos_ptr (int64) is a write counter, advanced by S here
    PDL: tl.constexpr = False,  # `pdl`: wait for the kernel before, then let the next one start
):
    wait_for_previous(PDL)  # launched to overlap the kernel before (`pdl`)
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    if hb < N_QBLOCKS + N_KBLOCKS:
        c1, c2, s1, s2 = _load_cos_sin(
            cos_ptr + b * stride_cb + s * stride_cs, sin_ptr + b * stride_sb + s * stride_ss, stride_cd, stride_sd,
            HALF, BLOCK_HALF,
        )  # fmt: skip
        if hb < N_QBLOCKS:
            _rotate_heads(
                q_ptr + b * stride_qb + s * stride_qs, qo_ptr + b * stride_qob + s * stride_qos, hb * BLOCK_H, HQ,
                stride_qh, stride_qd, stride_qoh, stride_qod, c1, c2, s1, s2, HALF, PASS,
                BLOCK_H, BLOCK_HALF, BLOCK_PASS, HAS_PASS, MUL_RN, WIDE,
            )  # fmt: skip
        else:
            pos = _slot(pos_ptr, s, stride_pos, tl.num_programs(0) * 2 * N_KBLOCKS, S, FROM_START, ADVANCE)
            if (pos >= 0) & (pos < S_MAX):
                _rotate_heads(
                    k_ptr + b * stride_kb + s * stride_ks, kc_ptr + b * stride_kcb + pos * stride_kcs,
                    (hb - N_QBLOCKS) * BLOCK_H, HK, stride_kh, stride_kd, stride_kch, stride_kcd, c1, c2, s1, s2,
                    HALF, PASS, BLOCK_H, BLOCK_HALF, BLOCK_PASS, HAS_PASS, MUL_RN, WIDE,
                )  # fmt: skip
    else:
        pos = _slot(pos_ptr, s, stride_pos, tl.num_programs(0) * 2 * N_KBLOCKS, S, FROM_START, ADVANCE)
        if (pos >= 0) & (pos < S_MAX):
            _copy_heads(
                v_ptr + b * stride_vb + s * stride_vs, vc_ptr + b * stride_vcb + pos * stride_vcs,
                (hb - N_QBLOCKS - N_KBLOCKS) * BLOCK_H, HK, D, stride_vh, stride_vd, stride_vch, stride_vcd,
                BLOCK_H, BLOCK_D,
            )  # fmt: skip


def _blocks(hq: int, hk: int, d: int, dr: int, device: torch.device) -> dict[str, int | bool]:
    """Tile sizes: a block of heads × the half width, about 512 elements of each half per program (8 heads of
    D = 128). Measured on an H200 (bf16, B=4, S=2048, 32/8 heads, D=128): 8 heads × 4 warps ran at 2.56 TB/s, 16 at
    2.50, 32 at 2.08 (fewer, fatter programs, and k blocks mostly masked)."""
    block_half = pow2(dr // 2)
    block_h = min(pow2(max(hq, hk)), max(1, 512 // block_half))
    return {
        "BLOCK_H": block_h,
        "BLOCK_HALF": block_half,
        "BLOCK_PASS": pow2(max(d - dr, 1)),
        "HAS_PASS": d > dr,
        "MUL_RN": device.type == "cuda" and torch.version.hip is None,
    }


def _num_warps(block_h: int, block_half: int) -> int:
    return 4 if block_h * block_half >= 512 else 2 if block_h * block_half >= 128 else 1


def _cos_sin_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, dim) strides of cos/sin; batch stride 0 when cos is (S, Dr) or (1, S, Dr): shared by the batch."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1), t.stride(2)


def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor
) -> None:
    b, hq, s, d = q.shape
    hk = k.shape[1]
    dr = cos.shape[-1]
    meta = _blocks(hq, hk, d, dr, q.device)
    meta["WIDE"] = cos.dtype == torch.float32 and q.dtype != torch.float32
    n_qblocks = cdiv(hq, meta["BLOCK_H"])
    grid = (b * s, n_qblocks + cdiv(hk, meta["BLOCK_H"]))
    launchable(_rope_kernel)[grid](
        q, k, cos, sin, q_out, k_out,
        s, hq, hk, dr // 2, d - dr, n_qblocks,
        *q.stride(), *k.stride(), *_cos_sin_strides(cos), *_cos_sin_strides(sin), *q_out.stride(), *k_out.stride(),
        **meta, num_warps=_num_warps(meta["BLOCK_H"], meta["BLOCK_HALF"]), **launch_options(q_out),
    )  # fmt: skip


triton_op("fusionscope::rope", mutates_args={"q_out", "k_out"})(_rope_op)


def _launch_rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    advance: bool,
) -> None:
    b, hq, s, d = q.shape
    hk = k.shape[1]
    dr = cos.shape[-1]
    meta = _blocks(hq, hk, d, dr, q.device)
    meta["WIDE"] = cos.dtype == torch.float32 and q.dtype != torch.float32
    n_qblocks = cdiv(hq, meta["BLOCK_H"])
    n_kblocks = cdiv(hk, meta["BLOCK_H"])
    grid = (b * s, n_qblocks + 2 * n_kblocks)
    launchable(_rope_and_cache_kernel)[grid](
        q, k, v, cos, sin, positions, q_out, k_cache, v_cache,
        s, k_cache.shape[2], hq, hk, d, dr // 2, d - dr, n_qblocks, n_kblocks,
        *q.stride(), *k.stride(), *v.stride(), *_cos_sin_strides(cos), *_cos_sin_strides(sin),
        positions.stride(0) if positions.dim() else 0, *q_out.stride(), *k_cache.stride(), *v_cache.stride(),
        **meta, BLOCK_D=pow2(d), FROM_START=positions.dim() == 0, ADVANCE=advance,
        num_warps=_num_warps(meta["BLOCK_H"], meta["BLOCK_HALF"]), **launch_options(q_out),
    )  # fmt: skip


def _rope_and_cache_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    _launch_rope_and_cache(q, k, v, cos, sin, positions, q_out, k_cache, v_cache, False)


def _rope_and_cache_advance_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    counter: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """`rope_and_cache` from a 0-d int64 write counter, which the kernel advances by S (`_slot`)."""
    _launch_rope_and_cache(q, k, v, cos, sin, counter, q_out, k_cache, v_cache, True)


triton_op("fusionscope::rope_and_cache", mutates_args={"q_out", "k_cache", "v_cache"})(_rope_and_cache_op)
triton_op("fusionscope::rope_and_cache_advance", mutates_args={"counter", "q_out", "k_cache", "v_cache"})(
    _rope_and_cache_advance_op
)


def _check_rope_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, S, D); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, sequence and head dim")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.dim() not in (2, 3) or cos.shape[-2] != s or (cos.dim() == 3 and cos.shape[0] not in (1, b)):
        raise ValueError(f"cos/sin must be (B, S, Dr), (1, S, Dr) or (S, Dr) with B={b}, S={s}; got {tuple(cos.shape)}")
    dr = cos.shape[-1]
    if dr % 2 or dr == 0 or dr > d:
        raise ValueError(f"the rotary dim Dr = cos.shape[-1] = {dr} must be even, positive and at most D = {d}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported (fp32, fp16, bf16)")
    if k.dtype != q.dtype:
        raise ValueError(f"k has dtype {k.dtype}, q has {q.dtype}: q and k must share the activations' dtype")
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, torch.float32):
        raise ValueError(f"cos/sin have dtypes {cos.dtype}/{sin.dtype}: both must be q's ({q.dtype}) or fp32")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_out(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}; got {tuple(t.shape)} {t.dtype} on "
            f"{t.device}"
        )


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by cos/sin as HF's `apply_rotary_pos_emb` does (rotate_half layout), in one launch.

    q: (B, Hq, S, D), k: (B, Hk, S, D), any strides (HF's `view(...).transpose(1, 2)` views included), fp32/fp16/bf16.
    cos, sin: (B, S, Dr), (1, S, Dr) or (S, Dr) in q's dtype, as the model's rotary embedding returns them, or in fp32
    with fp16/bf16 q and k (OLMo-2 keeps fp32 tables): then, as eager's type promotion does, the products and the sum
    are fp32 and the result is rounded once to q's dtype (what HF's `.to(q.dtype)` after the rotation gives); Dr even,
    Dr <= D. When Dr < D only the first Dr dims are rotated (partial rotary, Phi/GPT-NeoX) and the rest are copied.
    out: optional (q_out, k_out) shaped like q and k; may be (q, k) itself for an in-place rotation.
    Returns (q_out, k_out); freshly allocated outputs are contiguous.
    """
    _check_rope_inputs(q, k, cos, sin)
    if out is None:
        out = (
            new_output(q),
            new_output(k),
        )
    if len(out) != 2:
        raise ValueError("out must be a tuple (q_out, k_out)")
    _check_out("out[0]", out[0], q)
    _check_out("out[1]", out[1], k)
    run("rope", _rope_op, q, k, cos, sin, out[0], out[1])
    return out[0], out[1]


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    advance: bool = False,
) -> torch.Tensor:
    """Rotate q (returned) and k, and write the rotated k and the unrotated v into a static KV cache, in one launch.

    q: (B, Hq, S, D); k, v: (B, Hk, S, D); any strides; cos/sin as for `rope`.
    k_cache, v_cache: (B, Hk, S_max, D) in q's dtype, any strides, written in place:
    `k_cache[:, :, positions] = rope(k)`, `v_cache[:, :, positions] = v`; every other slot is left untouched.
    positions: (S,) int64 or int32 cache slots of the S new tokens, shared by the batch, on q's device; or a 0-d one,
    the first token's slot (token s goes to slot + s), read by the kernel on the device: a static cache's write
    counter as it stands before the step (so no slots tensor is made per layer and step). Slots must be distinct and
    in [0, S_max): checked here when positions is a CPU tensor (no device sync); on the GPU the check would cost a
    sync, so an out-of-range slot is instead skipped by the kernel (never written out of bounds).
    out: optional (B, Hq, S, D) buffer for the rotated q (may be q itself). Returns it.
    advance: with a 0-d int64 `positions` (the counter), also advance it by S in the same launch, as the cache's own
    `counter.add_(S)` after the write would (one launch less per layer and step).
    """
    _check_rope_inputs(q, k, cos, sin)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype}")
    b, hk, s, d = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[:2] != (b, hk) or cache.shape[3] != d:
            raise ValueError(f"{name} must be (B={b}, Hk={hk}, S_max, D={d}); got {tuple(cache.shape)}")
        if cache.dtype != k.dtype or cache.device != k.device:
            raise ValueError(f"{name} must be {k.dtype} on {k.device}; got {cache.dtype} on {cache.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    shape_ok = positions.dim() == 0 or (positions.dim() == 1 and positions.shape[0] == s)
    if not shape_ok or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be (S={s},) or 0-d, int64 or int32; got {tuple(positions.shape)} "
                         f"{positions.dtype}")  # fmt: skip
    if positions.device != q.device:
        raise ValueError(f"positions is on {positions.device}, q on {q.device}")
    if advance and (positions.dim() != 0 or positions.dtype != torch.int64):
        raise ValueError(f"advance needs a 0-d int64 counter as positions; got {tuple(positions.shape)} "
                         f"{positions.dtype}")  # fmt: skip
    if positions.device.type == "cpu" and not torch.compiler.is_compiling():
        s_max = k_cache.shape[2]
        slots = positions + torch.arange(s) if positions.dim() == 0 else positions
        if s and (int(slots.min()) < 0 or int(slots.max()) >= s_max):
            raise ValueError(f"positions must lie in [0, S_max={s_max}); got {slots.tolist()}")
        if slots.unique().numel() != s:
            raise ValueError(f"positions must be distinct; got {slots.tolist()}")
    if out is None:
        out = new_output(q)
    _check_out("out", out, q)
    if advance:
        run("rope_and_cache_advance", _rope_and_cache_advance_op, q, k, v, cos, sin, positions, out, k_cache, v_cache)
    else:
        run("rope_and_cache", _rope_and_cache_op, q, k, v, cos, sin, positions, out, k_cache, v_cache)
    return out
