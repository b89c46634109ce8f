"""Rounding fp32 to a narrower dtype inside a kernel, the same on the GPU and in the Triton interpreter.

Kernels that reproduce eager PyTorch's rounding order (round after each op, as each aten op stores its result) need
round-to-nearest-even. Compiled, `x.to(tl.bfloat16)` is `cvt.rn`, exactly that. The interpreter (triton 3.9) truncates
fp32 → bf16 instead, so there bf16 is rounded on the bits. Only there: on the H200 the integer path cost bias_gelu 26%
of its throughput (8192 × 14336 bf16: 2.70 against 3.66 TB/s).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ROUND_BF16_BY_HAND = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype` (to nearest, ties to even), kept in fp32."""
    if ROUND_BF16_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)
