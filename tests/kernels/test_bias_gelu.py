"""bias_gelu against its float64 reference and against eager `F.gelu(x + b, approximate) + r`, bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from fusionscope.kernels.bias_gelu import bias_gelu, bias_gelu_reference
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import device, poisoned, randn

# (rows, N, approximate): one row, odd counts, odd and non-power-of-two widths, both gelu forms
SHAPES = [(1, 123, "tanh"), (3, 1000, "none"), (17, 4097, "tanh"), (17, 4097, "none")]
# Below h = x + b = -3, eager's own fp32 `1 + erf(h/√2)` (or `1 + tanh(..)`) cancels: 1 + erf(-4/√2) = 6.3e-5 is
# held to 2⁻²⁴ ≈ 6e-8, a 1e-3 relative step, two fp16 ulps. There no two fp32 implementations agree to the ulp
# (CPU's Sleef erff and CUDA's erff differ too), so the bitwise comparison with eager stops there; the float64
# comparison still covers every element.
TAIL = -3.0


def _neighbours(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16/bf16 values one ulp below and above each element (through ±0), by stepping the ordered bit pattern."""
    bits = t.view(torch.int16).to(torch.int32)
    ordered = torch.where(bits < 0, -(bits & 0x7FFF), bits)

    def back(o: torch.Tensor) -> torch.Tensor:
        return torch.where(o < 0, (-o) | 0x8000, o).to(torch.int16).view(t.dtype)

    return back(ordered - 1), back(ordered + 1)


def assert_matches_eager(
    actual: torch.Tensor, act: torch.Tensor, combine: Callable[[torch.Tensor], torch.Tensor], where: torch.Tensor
) -> None:
    """`actual` must be eager's `combine(act)` bit for bit (where `where`), up to one flip of gelu's rounding.

    `x + b` is exact in fp32 and rounded once in both, so the kernel's h is eager's. It then rounds gelu(h) to the
    dtype where eager does, but computes it in its own fp32 arithmetic: where that value lies next to a rounding tie,
    the two can land on adjacent values (1 ulp apart), which the residual add carries into the output (more ulps of
    the output where residual + gelu cancels). That add is exact in fp32 and rounded once in both, so given the same
    gelu it must match exactly. fp32 has no intermediate rounding to match: it is compared at fp32 tolerance.
    """
    expected = combine(act)
    if actual.dtype == torch.float32:
        assert_close(actual, expected)
        return
    lo, hi = _neighbours(act)
    ok = (actual == expected) | (actual == combine(lo)) | (actual == combine(hi)) | ~where
    assert ok.all(), f"{int((~ok).sum())} elements off eager: kernel {actual[~ok][:4]}, eager {expected[~ok][:4]}"
    exact = (actual == expected)[where].double().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} of elements match eager bit for bit"


def _check(
    out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None, approximate: str
) -> None:
    """Compare with float64 (tolerance table) and with the eager expression in the input dtype."""
    expected = bias_gelu_reference(
        x.double(), bias.double(), approximate, None if residual is None else residual.double()
    )
    # With a residual the output is rounded three times, and residual + gelu can cancel: the error is set by |x + b|
    # and |gelu|, up to ~7 here, not by |out| (bf16: (7·1.13 + 7)·2⁻⁹ ≈ 0.03 against atol 0.016), hence 3× the table.
    scale = 3.0 if residual is not None and x.dtype != torch.float32 else 1.0
    assert_close(out, expected, x.dtype, scale=scale)
    h = x + bias
    act = F.gelu(h, approximate=approximate)
    assert_matches_eager(out, act, (lambda a: a) if residual is None else (lambda a: residual + a), where=h >= TAIL)


@pytest.mark.parametrize("with_residual", [False, True], ids=["gelu", "gelu_residual"])
@pytest.mark.parametrize("rows, width, approximate", SHAPES)
def test_matches_reference(rows: int, width: int, approximate: str, with_residual: bool, dtype: torch.dtype) -> None:
    x, bias = randn(rows, width, dtype=dtype), randn(width, dtype=dtype)
    residual = randn(rows, width, dtype=dtype) if with_residual else None
    out = poisoned((rows, width), dtype)
    assert bias_gelu(x, bias, approximate, residual, out=out) is out
    _check(out, x, bias, residual, approximate)


@pytest.mark.parametrize(
    "width, dtype, approximate", [(5120, torch.float16, "none"), (14336, torch.bfloat16, "tanh")], ids=["5120", "14336"]
)
def test_wide_rows(width: int, dtype: torch.dtype, approximate: str) -> None:
    x, bias, residual = randn(3, width, dtype=dtype), randn(width, dtype=dtype), randn(3, width, dtype=dtype)
    out = bias_gelu(x, bias, approximate, residual)
    _check(out, x, bias, residual, approximate)


@pytest.mark.parametrize("with_residual", [False, True], ids=["gelu", "gelu_residual"])
def test_strided_inputs_and_out(with_residual: bool, dtype: torch.dtype) -> None:
    """Last-dim stride 2 for x, bias, residual and out (conftest's strided views)."""
    x, bias = randn(3, 123, dtype=dtype, strided=True), randn(123, dtype=dtype, strided=True)
    residual = randn(3, 123, dtype=dtype, strided=True) if with_residual else None
    out = poisoned((3, 246), dtype)[:, ::2]
    assert bias_gelu(x, bias, "tanh", residual, out=out) is out
    _check(out, x, bias, residual, "tanh")


def test_leading_dims_that_are_not_one_row_view() -> None:
    """x (S, B, N) transposed from (B, S, N), a contiguous residual: the shared leading dims collapse into two."""
    x = randn(3, 5, 1000, dtype=torch.bfloat16).transpose(0, 1)
    bias, residual = randn(1000, dtype=torch.bfloat16), randn(5, 3, 1000, dtype=torch.bfloat16)
    out = bias_gelu(x, bias, "none", residual)
    assert out.shape == (5, 3, 1000)
    _check(out, x, bias, residual, "none")


def test_bad_inputs() -> None:
    x, bias = randn(3, 10, dtype=torch.float16), randn(10, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"bias must be \(10,\)"):
        bias_gelu(x, randn(11, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"bias must be \(10,\)"):
        bias_gelu(x, randn(3, 10, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        bias_gelu(x, bias, residual=randn(3, 11, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must share x's dtype"):
        bias_gelu(x, randn(10, dtype=torch.float32))
    with pytest.raises(ValueError, match="residual must share x's dtype"):
        bias_gelu(x, bias, residual=randn(3, 10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        bias_gelu(x, bias, approximate="fast")
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        bias_gelu(torch.ones(3, 10, dtype=torch.int64, device=device()), bias)
    with pytest.raises(ValueError, match="out must be"):
        bias_gelu(x, bias, out=poisoned((3, 10), torch.float32))
