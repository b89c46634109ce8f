"""The one table of numerical tolerances for the bundled kernels, by dtype.

Tests compare each kernel with its float64 (or float32) reference using these; `fusionscope bench --list` prints them.
A kernel computes in fp32 internally and rounds once at the store, so its error is about one unit in the last place
of the output dtype (bf16: 2⁻⁸ ≈ 0.0039 relative; fp16: 2⁻¹¹ ≈ 0.00049), plus fp32 reduction-order error.
"""

from __future__ import annotations

import torch

# dtype -> (atol, rtol), for outputs of magnitude ~1
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0
) -> None:
    """Compare a kernel's output with its high-precision reference at the tolerance of `dtype` (default: actual's).

    `scale` widens both tolerances for outputs whose magnitude grows with the problem (e.g. long reductions).
    """
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(
        actual.to(torch.float64), expected.to(torch.float64), atol=atol * scale, rtol=rtol * scale, equal_nan=False
    )
