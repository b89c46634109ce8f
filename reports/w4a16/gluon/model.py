"""NumPy model of what `w4a16_swap_kernel` (and `w4a16_mma_kernel`) compute, checked against a float64 reference.

Run: /tmp/t36/bin/python reports/w4a16/gluon/model.py   (numpy only; no GPU, no torch)

What is modelled bit for bit: the repack `PackedW4` -> `MmaW4`, the unpacking of each word by the kernel's PTX
(`shr`, `lop3 (w & 0x000F000F) | 0x43004300`, `sub.rn.bf16x2` of (128 + z, 128 + z)) on uint32/uint16 bit patterns,
the operand order of the mma (logical k = 32u + 8i + 2t + e within a block, x read at physical input
p = 32t + 8u + 2i + e), the per-block scale applied to the fp32 block sum by one fma, the split-K partial sums added
in split order, and the final rounding to bf16. What is not bit for bit: the tensor core's internal summation of a
k16 chunk. It is modelled as exact products (bf16 x bf16 is exact in fp32) summed in float64 and rounded once to fp32
per chunk, then added to the fp32 running sum of the block in chunk order; the hardware's order and rounding inside
HMMA are not documented, so the model bounds the arithmetic, it does not reproduce the GPU's last bits.
"""

from __future__ import annotations

import numpy as np

rng = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------- bf16 helpers
def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------- layouts
def pack_w4(q: np.ndarray) -> np.ndarray:
    """PackedW4 (kernels/w4a16_gemm.py): qweight[16b + r, n] nibble j = q[128b + 16j + r, n]."""
    K, N = q.shape
    B = -(-K // 128)
    pad = np.zeros((B * 128, N), np.uint32)
    pad[:K] = q
    planes = pad.reshape(B, 8, 16, N)  # [b, j, r, n]
    words = np.zeros((B, 16, N), np.uint32)
    for j in range(8):
        words |= planes[:, j] << np.uint32(4 * j)
    return words.reshape(B * 16, N).view(np.int32)


def unpack_w4(qweight: np.ndarray, K: int) -> np.ndarray:
    rows, N = qweight.shape
    w = qweight.view(np.uint32).reshape(rows // 16, 1, 16, N)
    q = (w >> (4 * np.arange(8, dtype=np.uint32)).reshape(1, 8, 1, 1)) & 0xF  # [b, j, r, n]
    return q.reshape(-1, N)[:K]


def repack_mma(qweight: np.ndarray, K: int) -> np.ndarray:
    """PackedW4 -> MmaW4: int32 (B, N, 4, 4); word [b, n, t, u] nibble j = q[128b + 32t + 8u + 2(j % 4) + j // 4, n]."""
    q = unpack_w4(qweight, K)
    N = q.shape[1]
    B = -(-K // 128)
    pad = np.zeros((B * 128, N), np.uint32)
    pad[:K] = q
    # input 128b + 32t + 8u + 2i + e  ->  [b, t, u, i, e, n]
    p = pad.reshape(B, 4, 4, 4, 2, N)
    out = np.zeros((B, N, 4, 4), np.uint32)
    for i in range(4):
        for e in range(2):
            out |= np.transpose(p[:, :, :, i, e, :], (0, 3, 1, 2)) << np.uint32(4 * (i + 4 * e))
    return out.view(np.int32)


# ---------------------------------------------------------------------------------------------- the kernel's ops
def unpack_pair(words: np.ndarray, zb: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
    """The PTX of `_unpack_pair`: returns (low, high) bf16 bit patterns of sub.rn.bf16x2(lop3(w >> 4i), zb)."""
    t = (words.view(np.uint32) >> np.uint32(4 * i)) & np.uint32(0x000F000F) | np.uint32(0x43004300)
    out = []
    for half in (0, 16):
        a = bf16_bits_to_f32(((t >> half) & 0xFFFF).astype(np.uint16))
        b = bf16_bits_to_f32(((zb >> half) & 0xFFFF).astype(np.uint16))
        out.append(to_bf16_bits(a - b))  # fp32 difference of two bf16s is exact here, rounded once: sub.rn.bf16x2
    return out[0], out[1]


def model_kernel(
    x: np.ndarray, qw_mma: np.ndarray, scales_bits: np.ndarray, zeros: np.ndarray, splits: int, permute_x: bool = True
):
    """x: (M, K) bf16 bits; qw_mma: (B, N, 4, 4) int32; scales: (G, N) bf16 bits; zeros (G, N) uint8.
    Returns the (M, N) bf16 bits the kernel + split-sum would write, and the fp32 sum before that rounding.
    permute_x=False reads x in logical order (a deliberately wrong model, to show the check catches a wrong map)."""
    M = x.shape[0]
    B, N = qw_mma.shape[:2]
    per = -(-B // splits)
    xf = bf16_bits_to_f32(x)
    partial = np.zeros((splits, M, N), np.float32)
    for sp in range(splits):
        acc = np.zeros((M, N), np.float32)
        for b in range(sp * per, min((sp + 1) * per, B)):
            zb = (zeros[b].astype(np.uint32) * 0x10001) | 0x43004300  # (N,)
            w_logical = np.zeros((128, N), np.float32)  # the A operand, logical k = 32u + 8i + 2t + e
            for t in range(4):
                for u in range(4):
                    wd = qw_mma[b, :, t, u]
                    for i in range(4):
                        lo, hi = unpack_pair(wd, zb, i)
                        w_logical[32 * u + 8 * i + 2 * t + 0] = bf16_bits_to_f32(lo)
                        w_logical[32 * u + 8 * i + 2 * t + 1] = bf16_bits_to_f32(hi)
            # x as the B operand: logical k holds physical p = 32t + 8u + 2i + e
            k = np.arange(128)
            u_, i_, t_, e_ = k >> 5, (k >> 3) & 3, (k >> 1) & 3, k & 1
            phys = 32 * t_ + 8 * u_ + 2 * i_ + e_ if permute_x else k
            x_logical = xf[:, 128 * b + phys]  # (M, 128)
            part = np.zeros((M, N), np.float32)
            for c in range(8):  # k16 chunks in order: exact products, one rounding per chunk (see docstring)
                sl = slice(16 * c, 16 * c + 16)
                chunk = x_logical[:, sl].astype(np.float64) @ w_logical[sl].astype(np.float64)
                part = (part.astype(np.float64) + chunk.astype(np.float32)).astype(np.float32)
            s = bf16_bits_to_f32(scales_bits[b])
            acc = (acc.astype(np.float64) + part.astype(np.float64) * s.astype(np.float64)).astype(np.float32)  # fma
        partial[sp] = acc
    total = partial[0].copy()
    for sp in range(1, splits):
        total = total + partial[sp]
    return to_bf16_bits(total), total


def check(K, N, M, splits, zero_mode="random"):
    q = rng.integers(0, 16, size=(K, N), dtype=np.uint32)
    G = K // 128
    zeros = rng.integers(0, 16, size=(G, N)).astype(np.uint8) if zero_mode == "random" else np.full((G, N), 8, np.uint8)
    scales = to_bf16_bits(rng.uniform(0.5, 2.0, size=(G, N)).astype(np.float32) * 0.01)
    x = to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    qweight = pack_w4(q)
    assert np.array_equal(unpack_w4(qweight, K), q)
    qw_mma = repack_mma(qweight, K)
    # the layout's definition, checked element by element on a few words
    for b, n, t, u in [(0, 0, 0, 0), (G - 1, N - 1, 3, 3), (1 % G, 5 % N, 2, 1)]:
        w = int(qw_mma[b, n, t, u]) & 0xFFFFFFFF
        for j in range(8):
            assert (w >> 4 * j) & 0xF == q[128 * b + 32 * t + 8 * u + 2 * (j % 4) + j // 4, n]
    bits, total = model_kernel(x, qw_mma, scales, zeros, splits)
    out = bf16_bits_to_f32(bits).astype(np.float64)
    w64 = (q.astype(np.float64) - np.repeat(zeros, 128, axis=0)) * np.repeat(bf16_bits_to_f32(scales), 128, axis=0)
    ref = bf16_bits_to_f32(x).astype(np.float64) @ w64
    err = np.abs(out - ref)
    scale = np.abs(bf16_bits_to_f32(x).astype(np.float64)) @ np.abs(w64)
    ulp = np.maximum(np.abs(ref), 1e-30) * 2.0**-8  # one bf16 ulp at most (2^-8 relative)
    within = bool(np.all(err <= ulp + 1e-6 * scale))
    wrong = bf16_bits_to_f32(model_kernel(x, qw_mma, scales, zeros, splits, permute_x=False)[0]).astype(np.float64)
    return {
        "K": K,
        "N": N,
        "M": M,
        "splits": splits,
        "zeros": zero_mode,
        "fp32_sum_max_err_over_sum_abs": float((np.abs(total - ref) / scale).max()),
        "wrong_x_order_max_err_over_sum_abs": float((np.abs(wrong - ref) / scale).max()),
        "max_abs_err": float(err.max()),
        "max_err_over_bf16_ulp": float((err / ulp).max()),
        "max_err_over_sum_abs": float((err / scale).max()),
        "within_1ulp_plus_1e-6": within,
    }


if __name__ == "__main__":
    import json
    import os

    rows = [check(1024, 256, 1, 4), check(1024, 256, 3, 2), check(512, 128, 16, 1), check(2048, 64, 1, 8, "symmetric")]
    for r in rows:
        print(r)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
    assert all(r["within_1ulp_plus_1e-6"] for r in rows)
    print("model: all checks passed")
