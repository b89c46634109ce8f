"""Candidate W4A16 decode kernels in Gluon (Triton 3.6) for sm_90: mma.sync m16n8k16, int4 -> bf16 in the registers
of the tensor cores' operand, no shared memory. Group size 128 only (one group = one 128-input block).

Repacked layout `MmaW4` (an offline repack of `PackedW4`; `model.repack_mma` is its NumPy definition):
    qw: int32 (B, N, 4, 4), B = K / 128, C-contiguous: word qw[b, n, t, u] at int32 offset ((b·N + n)·4 + t)·4 + u.
    Nibble j (bits 4j..4j+3) of qw[b, n, t, u] is q[k, n] with k = 128·b + 32·t + 8·u + 2·(j % 4) + (j // 4).
    So each word holds 8 consecutive inputs of one column, in the nibble order 0, 4, 1, 5, 2, 6, 3, 7 (inputs
    8w + 0..7 at nibbles 0, 4, 1, 5, 2, 6, 3, 7), and one column's 128-block is 64 contiguous bytes (16 words, inputs
    in order); a 128-block of all N columns is N·64 contiguous bytes. Scales (G, N) bf16 and zeros (G, N) uint8 are
    those of `PackedW4`.
How the kernel reads it: lane l of a warp, t = l % 4, loads the 16 bytes qw[b, n, t, 0..3] (inputs 32t..32t+31 of
column n) with one LDG.128. For word u and i in 0..3, `((w >> 4i) & 0x000F000F) | 0x43004300` is the bf16 pair
(128 + q, 128 + q') of inputs 32t + 8u + 2i + {0, 1}, and one `sub.rn.bf16x2` with (128 + z, 128 + z) gives
(q − z, q' − z), exact in bf16. The mma sums over k in its own register order: its "logical" input
k = 32u + 8i + 2t + e (e = the half) of a block sits in the register that feeds slot k of the m16n8k16 operand
(lane t holds k = 2t + {0,1} and 2t + 8 + {0,1} of each 16-input chunk), so x is read at the same permutation:
logical k takes x at physical input p = 32t + 8u + 2i + e, and each lane's x is again 32 contiguous bf16 (four
LDG.128). Every Triton layout step between the loaded words and the mma operand is checked at compile time to be
register-only (`convert_layout(..., assert_trivial=True)`).
The group's scale multiplies the block's fp32 mma sum once per output element (one FFMA); fp32 accumulation.

Kernels:
- `w4a16_swap_kernel` (the candidate): out^T = W^T x^T, the weights as the mma's A operand (16 columns × 16 inputs per
  instruction), the tokens as its n = 8 (M ≤ 8) or 16 (M ≤ 16).
- `w4a16_mma_kernel` (first attempt, kept for the record): x as the A operand (16 rows, M ≤ 16) and the weights as B.
  At M = 1 the rows 1..15 of x are constant zeros and ptxas rebuilds the A register quad with moves before every
  HMMA (see README).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# PTX per bf16x2 register: shift nibble pair i to bits 0-3 / 16-19, AND-OR with the exponent of 128 (one lop3),
# subtract (128 + z) in both halves (one sub.bf16x2): (q[k] - z, q[k+1] - z), exact.
_ASM_PAIR = [
    "{ .reg .b32 t; "
    + ("" if i == 0 else f"shr.u32 t, $1, {4 * i}; ")
    + ("lop3.b32 t, $1, " if i == 0 else "lop3.b32 t, t, ")
    + "0x000F000F, 0x43004300, 0xea; sub.rn.bf16x2 $0, t, $3; }"
    for i in range(4)
]
_ASM0 = gl.constexpr(_ASM_PAIR[0])
_ASM1 = gl.constexpr(_ASM_PAIR[1])
_ASM2 = gl.constexpr(_ASM_PAIR[2])
_ASM3 = gl.constexpr(_ASM_PAIR[3])


@gluon.jit
def _unpack_pair(words, bias, nib: gl.constexpr):
    # words, bias: int32, broadcast over the pair axis; returns bf16 (q - z) for nibbles nib and nib + 4 of each word,
    # low half = nibble nib (input k), high half = nibble nib + 4 (input k + 1). pack=2: one call per bf16x2 register.
    if nib == 0:
        asm: gl.constexpr = _ASM0
    elif nib == 1:
        asm: gl.constexpr = _ASM1
    elif nib == 2:
        asm: gl.constexpr = _ASM2
    else:
        asm: gl.constexpr = _ASM3
    return gl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, bias], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _block_offsets(N, n0, L4: gl.constexpr, BLOCK_N: gl.constexpr):
    # int32 offsets (in words) of the (4 u, 4 t, BLOCK_N) words of block 0 for columns n0..; block b adds b·N·16.
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    u = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    return n[None, None, :] * 16 + (t[None, :, None] * 4 + u[:, None, None])


@gluon.jit
def w4a16_mma_kernel(
    x_ptr,  # (M, K) bf16, contiguous
    qw_ptr,  # MmaW4 int32 (B, N, 4, 4)
    s_ptr,  # (G, N) bf16 scales, G = K / 128
    z_ptr,  # (G, N) uint8 zeros
    out_ptr,  # (splits, M, N) fp32 partial sums
    M,
    N,
    K,
    blocks_per_split,
    BLOCK_N: gl.constexpr,  # columns per program: a multiple of 8 · num_warps
    SUB: gl.constexpr,  # 128-blocks per loop step (their loads issued together)
):
    # Assumes (there is no host launcher here): group size 128, K % (128·SUB) == 0, N % BLOCK_N == 0,
    # blocks_per_split a multiple of SUB: no masks in the loop (a masked load with `other` costs a register zeroing
    # per element).
    num_warps: gl.constexpr = gl.num_warps()
    gl.static_assert(BLOCK_N % (8 * num_warps) == 0)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # Words (u, t, n, e): u in registers (one 16-byte load per column), t = lane % 4, n over lane // 4, warps, then
    # registers; e (the two halves of a bf16x2 register) in registers.
    L4: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[4, 1, 1, 2],
        threads_per_warp=[1, 4, 8, 1],
        warps_per_cta=[1, 1, num_warps, 1],
        order=[3, 0, 1, 2],
    )
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    # x (m, physical input p of the block): p = 32·t + r, r (32 contiguous bf16, four 16-byte loads) in registers,
    # t = lane % 4, m = lane // 4 and m + 8 in a register, every warp the same (the A operand is shared by the warps).
    WB: gl.constexpr = [[0, 0]] * (num_warps.bit_length() - 1)
    XL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=WB,
        block_bases=[],
        shape=[16, 128],
    )

    pid_n = gl.program_id(0)
    n0 = pid_n * BLOCK_N
    first = gl.program_id(1) * blocks_per_split
    last = gl.minimum(first + blocks_per_split, K // 128)

    rm = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
    rp = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
    x_offs = rm[:, None] * K + rp[None, :]
    x_mask = (rm < M)[:, None] & (rp < 128)[None, :]
    w_offs = _block_offsets(N, n0, L4, BLOCK_N)
    ns_ = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))  # columns as the accumulator holds them
    nz_ = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))  # as the B operand does

    acc = gl.zeros([16, BLOCK_N], gl.float32, layout=MMA)
    zero = gl.zeros([16, BLOCK_N], gl.float32, layout=MMA)
    for step in range(first, last, SUB):
        for c in gl.static_range(SUB):
            b = step + c
            words = gl.load(qw_ptr + b.to(gl.int64) * N * 16 + w_offs)  # (u, t, n) int32
            xp = gl.load(x_ptr + b * 128 + x_offs, mask=x_mask, other=0.0)  # (m, p) bf16
            s = gl.load(s_ptr + b * N + ns_).to(gl.float32)
            z = gl.load(z_ptr + b * N + nz_).to(gl.int32)
            # x in the mma's input order: logical k = 32u + 8i + 2t + e is physical p = 32t + 8u + 2i + e.
            x5 = gl.reshape(xp, [16, 4, 4, 4, 2])  # (m, t, u, i, e)
            xa = gl.reshape(gl.permute(x5, (0, 2, 3, 1, 4)), [16, 128])  # (m, u, i, t, e)
            xa = gl.convert_layout(xa, A_L, assert_trivial=True)
            zb = (z * 0x10001) | 0x43004300  # bf16x2 (128 + z, 128 + z)
            w4 = gl.expand_dims(words, 3)  # (u, t, n, 1)
            zb4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(zb, 0), 0), 3)
            w4 = gl.broadcast(w4, gl.full([4, 4, BLOCK_N, 2], 0, gl.int32, layout=L4))[0]
            zb4 = gl.broadcast(zb4, w4)[0]
            p0 = _unpack_pair(w4, zb4, 0)  # (u, t, n, e) bf16: q - z of logical input 32u + 2t + e (+ 8i below)
            p1 = _unpack_pair(w4, zb4, 1)
            p2 = _unpack_pair(w4, zb4, 2)
            p3 = _unpack_pair(w4, zb4, 3)
            j = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # (u, t, n, e, i_lo, i_hi), i = 2·i_hi + i_lo
            j = gl.permute(j, (0, 5, 4, 1, 3, 2))  # (u, i_hi, i_lo, t, e, n): logical k = 32u + 8i + 2t + e
            wb = gl.convert_layout(gl.reshape(j, [128, BLOCK_N]), B_L, assert_trivial=True)
            part = mma_v2(xa, wb, zero)
            acc = acc + part * s[None, :]

    rmo = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    out = out_ptr + (gl.program_id(1) * M).to(gl.int64) * N + rmo[:, None] * N + ns_[None, :]
    gl.store(out, acc, mask=(rmo < M)[:, None] & (ns_ < N)[None, :])


@gluon.constexpr_function
def _swap_word_layout(BLOCK_N, num_warps):
    """Words (u, t, n, e) as the swapped kernel's A operand holds them: e (fastest: the inline asm's pack=2 takes
    the two halves of one bf16x2 register) and u (4 words, one 16-byte load) in registers, t = lane % 4, n bits 0-2 =
    lane // 4, n bit 3 in a register (rows g and g + 8 of the m16 tile), warps over 16-column tiles, then registers
    for further tiles."""
    reps = BLOCK_N // (16 * num_warps)
    regs = [[0, 0, 0, 1], [1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 8, 0]]  # e first: pack=2 pairs the two halves
    regs += [[0, 0, 16 * num_warps * (1 << r), 0] for r in range(reps.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=[[0, 0, 16 * (1 << w), 0] for w in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[4, 4, BLOCK_N, 2],
    )


@gluon.constexpr_function
def _swap_x_layout(MT, num_warps):
    """x (m, physical input p of the block), p = 32·t + r: r (32 contiguous bf16, four 16-byte loads) in registers,
    t = lane % 4, m = lane // 4 (and m + 8 in a register for MT = 16); every warp holds the same."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]] + ([[8, 0]] if MT == 16 else []),
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0] for _ in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[MT, 128],
    )


@gluon.jit
def _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, b, N, w_offs, x_offs, ns_, nz_):
    words = gl.load(qw_ptr + b.to(gl.int64) * N * 16 + w_offs)  # (u, t, n) int32
    xp = gl.load(x_ptr + b * 128 + x_offs)  # (m, p) bf16
    s = gl.load(s_ptr + b * N + ns_)  # bf16, as the accumulator's rows
    z = gl.load(z_ptr + b * N + nz_)  # uint8, as the A operand's rows
    return words, xp, s, z


@gluon.jit
def _swap_block(
    acc,
    zero,
    words,
    xp,
    s,
    z,
    MT: gl.constexpr,
    BLOCK_N: gl.constexpr,
    L4: gl.constexpr,
    A_L: gl.constexpr,
    B_L: gl.constexpr,
):
    """acc + scale · (W^T − z) x^T over one 128-block (one group)."""
    x5 = gl.reshape(xp, [MT, 4, 4, 4, 2])  # (m, t, u, i, e): p = 32t + 8u + 2i + e
    xb = gl.reshape(gl.permute(x5, (2, 3, 1, 4, 0)), [128, MT])  # (u, i, t, e, m): k = 32u + 8i + 2t + e
    xb = gl.convert_layout(xb, B_L, assert_trivial=True)
    zb = (z.to(gl.int32) * 0x10001) | 0x43004300  # bf16x2 (128 + z, 128 + z)
    w4 = gl.expand_dims(words, 3)  # (u, t, n, 1)
    zb4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(zb, 0), 0), 3)
    w4 = gl.broadcast(w4, gl.full([4, 4, BLOCK_N, 2], 0, gl.int32, layout=L4))[0]
    zb4 = gl.broadcast(zb4, w4)[0]
    p0 = _unpack_pair(w4, zb4, 0)  # (u, t, n, e) bf16: q - z of logical input 32u + 2t + e (+ 8i)
    p1 = _unpack_pair(w4, zb4, 1)
    p2 = _unpack_pair(w4, zb4, 2)
    p3 = _unpack_pair(w4, zb4, 3)
    j = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # (u, t, n, e, i_lo, i_hi), i = 2·i_hi + i_lo
    j = gl.permute(j, (2, 0, 5, 4, 1, 3))  # (n, u, i_hi, i_lo, t, e): logical k = 32u + 8i + 2t + e
    wa = gl.convert_layout(gl.reshape(j, [BLOCK_N, 128]), A_L, assert_trivial=True)
    part = mma_v2(wa, xb, zero)  # fp32 sums of x · (q − z) over the block, per (column, token)
    return acc + part * s.to(gl.float32)[:, None]


@gluon.jit
def w4a16_swap_kernel(
    x_ptr,  # (M, K) bf16, contiguous
    qw_ptr,  # MmaW4 int32 (B, N, 4, 4)
    s_ptr,  # (G, N) bf16 scales, G = K / 128
    z_ptr,  # (G, N) uint8 zeros
    out_ptr,  # (splits, M, N) fp32 partial sums
    M,
    N,
    K,
    blocks_per_split,
    BLOCK_N: gl.constexpr,  # output columns per program: a multiple of 16 · num_warps
    MT: gl.constexpr,  # tokens per program: 8 (M ≤ 8) or 16
    SUB: gl.constexpr,  # 128-blocks per loop step
    PREFETCH: gl.constexpr = 0,  # 1 (SUB 1): load block b + 1 before working on block b; 2 (SUB 2): ping-pong
):
    # Swapped operands: out^T (N, M) = W^T (N, K) · x^T (K, M). The weights are the mma's A operand (16 output columns
    # × 16 inputs per m16n8k16), the tokens its n (8 per instruction), so M = 1 wastes 7/8 of the tensor-core work
    # instead of 15/16, and each A register is written by the unpacking op that produces it (no operand moves).
    # Assumes group 128, K % (128·SUB) == 0, N % BLOCK_N == 0, blocks_per_split a multiple of SUB (no masks in the
    # loop). Rows of x past M are read as row M - 1 (their outputs are never stored).
    num_warps: gl.constexpr = gl.num_warps()
    gl.static_assert(BLOCK_N % (16 * num_warps) == 0)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # Words (u, t, n, e) as the A operand holds them: u (4 words, one 16-byte load) and e in registers, t = lane % 4,
    # n bits 0-2 = lane // 4, n bit 3 in a register (rows g and g + 8 of the m16 tile), warps over 16-column tiles,
    # then registers for further tiles.
    L4: gl.constexpr = _swap_word_layout(BLOCK_N, num_warps)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    XL: gl.constexpr = _swap_x_layout(MT, num_warps)

    n0 = gl.program_id(0) * BLOCK_N
    first = gl.program_id(1) * blocks_per_split
    last = gl.minimum(first + blocks_per_split, K // 128)

    rm = gl.arange(0, MT, layout=gl.SliceLayout(1, XL))
    rp = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
    x_offs = gl.minimum(rm, M - 1)[:, None] * K + rp[None, :]
    u = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w_offs = n[None, None, :] * 16 + (t[None, :, None] * 4 + u[:, None, None])
    ns_ = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))  # output columns as the accumulator holds them
    nz_ = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))  # as the A operand does

    acc = gl.zeros([BLOCK_N, MT], gl.float32, layout=MMA)
    zero = gl.zeros([BLOCK_N, MT], gl.float32, layout=MMA)
    if PREFETCH == 2:  # ping-pong: two blocks per step, each block's loads issued one block ahead of its math
        gl.static_assert(SUB == 2)
        words, xp, s, z = _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, first, N, w_offs, x_offs, ns_, nz_)
        for b in range(first, last, 2):
            words1, xp1, s1, z1 = _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, b + 1, N, w_offs, x_offs, ns_, nz_)
            acc = _swap_block(acc, zero, words, xp, s, z, MT, BLOCK_N, L4, A_L, B_L)
            nb = gl.minimum(b + 2, last - 1)  # the last step reloads its own block (in L2/L1): no mask
            words, xp, s, z = _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, nb, N, w_offs, x_offs, ns_, nz_)
            acc = _swap_block(acc, zero, words1, xp1, s1, z1, MT, BLOCK_N, L4, A_L, B_L)
    elif PREFETCH:
        gl.static_assert(SUB == 1)
        words, xp, s, z = _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, first, N, w_offs, x_offs, ns_, nz_)
        for b in range(first, last):
            nb = gl.minimum(b + 1, last - 1)  # the last step reloads its own block (in L2/L1): no mask
            words_n, xp_n, s_n, z_n = _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, nb, N, w_offs, x_offs, ns_, nz_)
            acc = _swap_block(acc, zero, words, xp, s, z, MT, BLOCK_N, L4, A_L, B_L)
            words, xp, s, z = words_n, xp_n, s_n, z_n
    else:
        for step in range(first, last, SUB):
            for c in gl.static_range(SUB):
                words, xp, s, z = _swap_loads(qw_ptr, x_ptr, s_ptr, z_ptr, step + c, N, w_offs, x_offs, ns_, nz_)
                acc = _swap_block(acc, zero, words, xp, s, z, MT, BLOCK_N, L4, A_L, B_L)

    rmo = gl.arange(0, MT, layout=gl.SliceLayout(0, MMA))
    out = out_ptr + (gl.program_id(1) * M).to(gl.int64) * N + rmo[None, :] * N + ns_[:, None]
    gl.store(out, acc, mask=(rmo < M)[None, :] & (ns_ < N)[:, None])
