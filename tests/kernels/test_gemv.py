"""fusionscope::gemv against `F.linear` computed in float64: one row of x, with and without bias, fp32/fp16/bf16, odd
and non-power-of-two sizes (tails in K and N), strided x and W, NaN-poisoned outputs; what it hands to F.linear
(several rows, outputs wider than WIDEST, mixed dtypes) is F.linear's answer exactly.

Weights at nn.Linear's scale (std K^-1/2), so outputs are O(1); fp16/bf16 tolerances widen by sqrt(K / 64), as in
test_linear_act: the fp32 sum of K products errs like a random walk."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fusionscope.kernels.gemv import TILES, WIDEST, _gemv_op, gemv, gemv_reference, interpreter_tiles, schedule, takes
from fusionscope.kernels.tolerances import assert_close

from fusionscope.fusions import gemv as gemv_fusion
from tests.kernels.conftest import device, poisoned, randn

SHAPES = [(64, 8), (100, 37), (200, 130), (517, 19)]  # (K, N): tails in both (several steps of K: the forced test)


def _scale(dtype: torch.dtype, K: int) -> float:
    return 1.0 if dtype == torch.float32 else max(1.0, math.sqrt(K / 64))


@pytest.mark.parametrize(("K", "N"), SHAPES)
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_gemv_matches_float64(K: int, N: int, has_bias: bool, dtype: torch.dtype) -> None:
    x = randn(1, 1, K, dtype=dtype)
    weight = randn(N, K, dtype=dtype, scale=K**-0.5)
    bias = randn(N, dtype=dtype) if has_bias else None
    assert takes(x, weight)
    out = gemv(x, weight, bias)
    assert out.shape == (1, 1, N) and out.dtype == dtype
    assert_close(out, gemv_reference(x, weight, bias), scale=_scale(dtype, K))


@pytest.mark.parametrize(("K", "N"), [(100, 37), (517, 19)])
def test_gemv_reads_strided_operands_into_a_poisoned_output(K: int, N: int, dtype: torch.dtype) -> None:
    """x with a stride of 2 along K, W a column slice of a wider buffer (row stride ≠ K) and every other row of
    another, bias strided: the launcher passes every stride; every output element is written (NaN otherwise)."""
    x = randn(1, K, dtype=dtype, strided=True)
    weight = randn(2 * N, K + 5, dtype=dtype, scale=K**-0.5)[::2, 3 : K + 3]
    bias = randn(N, dtype=dtype, strided=True)
    assert not weight.is_contiguous() and weight.stride() == (2 * (K + 5), 1)
    out = poisoned((N,), dtype)
    _gemv_op(x.reshape(K), weight, bias, out, False)
    assert not out.isnan().any()
    assert_close(out, gemv_reference(x, weight, bias).reshape(N), scale=_scale(dtype, K))
    transposed = randn(K, N, dtype=dtype, scale=K**-0.5).t()  # W read across its rows: stride (1, N)
    assert_close(gemv(x, transposed), gemv_reference(x, transposed), scale=_scale(dtype, K))


def test_more_rows_wider_outputs_and_mixed_dtypes_are_f_linear() -> None:
    x = randn(3, 40, dtype=torch.float32)
    weight = randn(24, 40, dtype=torch.float32)
    assert not takes(x, weight)
    assert torch.equal(gemv(x, weight), F.linear(x, weight))
    one = x[:1]
    wide = randn(WIDEST + 1, 40, dtype=torch.float32)
    assert not takes(one, wide)
    assert torch.equal(gemv(one, wide), F.linear(one, wide))
    half = weight.half()
    assert not takes(one, half)


def test_bad_bias_and_width_are_one_line_errors() -> None:
    x = randn(1, 40, dtype=torch.float32)
    weight = randn(24, 40, dtype=torch.float32)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, weight, randn(23, dtype=torch.float32))
    with pytest.raises(ValueError, match="inputs"):
        gemv(randn(1, 41, dtype=torch.float32), weight)


def test_schedules_and_the_finder_agree_on_the_widest_output() -> None:
    """The finder matches exactly the widths the kernel serves; a forced schedule (the sweep's) is used as given."""
    assert gemv_fusion.WIDEST == WIDEST
    if device().type == "cuda":
        assert schedule(WIDEST, 4096) == TILES["wide"] and schedule(64, 64) == TILES["narrow"]
    for prefetch in (1, 0):  # several programs and steps of K, each way of loading W
        TILES["force"] = (2, 32, 1, prefetch)
        try:
            x = randn(1, 70, dtype=torch.float32)
            weight = randn(9, 70, dtype=torch.float32, scale=70**-0.5)
            assert schedule(9, 70) == (2, 32, 1, prefetch)
            assert_close(gemv(x, weight), gemv_reference(x, weight))
        finally:
            TILES["force"] = None


@pytest.mark.parametrize(("N", "K"), [(9, 70), (576, 576), (576, 1536), (1536, 576), (4096, 14336)])
def test_interpreter_tiles_fit_tritons_block_limit_and_pad_less_than_the_largest(N: int, K: int) -> None:
    block_n, block_k = interpreter_tiles(N, K)
    assert block_n * block_k <= 1 << 20 and block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0
    assert 16 <= block_n <= max(16, 1 << (N - 1).bit_length()) and 16 <= block_k <= max(16, 1 << (K - 1).bit_length())
    padded = math.ceil(N / block_n) * block_n * math.ceil(K / block_k) * block_k
    largest = math.ceil(N / 1024) * 1024 * math.ceil(K / 1024) * 1024
    assert padded <= largest
