"""gelu_and_mul against its float64 reference and against Hugging Face's eager `F.gelu(gate, approximate) * up`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from fusionscope.kernels.gelu_and_mul import gelu_and_mul, gelu_and_mul_reference
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import device, poisoned, randn

# (rows, I, gate_up given as one (rows, 2I) tensor): one row, odd counts, odd and non-power-of-two widths
SHAPES = [
    pytest.param(1, 123, True, id="1x123-gate_up"),
    pytest.param(3, 1000, False, id="3x1000-gate_and_up"),
    pytest.param(17, 4097, True, id="17x4097-gate_up"),
]
APPROXIMATE = ["none", "tanh"]
# Below x = -3, eager's own fp32 `1 + erf(x/√2)` (or `1 + tanh(..)`) cancels: 1 + erf(-4/√2) = 6.3e-5 is held to
# 2⁻²⁴ ≈ 6e-8, a 1e-3 relative step, two fp16 ulps. There no two fp32 implementations agree to the ulp (CPU's
# Sleef erff and CUDA's erff differ too), so the bitwise comparison with eager stops there; the float64 comparison
# still covers every element.
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
    """`actual` must be eager's `combine(act)` bit for bit (where `where`), up to one flip of the activation's rounding.

    The kernel rounds the activation to the dtype where eager does, but computes it in its own fp32 arithmetic: where
    that value lies next to a rounding tie, the two can land on adjacent values (1 ulp apart), and the product then
    differs by up to 2 ulps. The product itself is exact in fp32 and rounded once in both, so given the same
    activation it must match exactly. fp32 has no intermediate rounding to match: it is compared at fp32 tolerance.
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


def _check(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, approximate: str) -> None:
    """Compare with float64 (tolerance table) and with HF's eager expression in the input dtype."""
    g, u = gate.chunk(2, dim=-1) if up is None else (gate, up)
    expected = gelu_and_mul_reference(gate.double(), None if up is None else up.double(), approximate)
    assert_close(out, expected, gate.dtype)
    act = F.gelu(g, approximate=approximate)
    assert_matches_eager(out, act, lambda a: a * u, where=g >= TAIL)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("rows, width, fused_input", SHAPES)
def test_matches_reference(rows: int, width: int, fused_input: bool, approximate: str, dtype: torch.dtype) -> None:
    if fused_input:
        gate, up = randn(rows, 2 * width, dtype=dtype), None
    else:
        gate, up = randn(rows, width, dtype=dtype), randn(rows, width, dtype=dtype)
    out = poisoned((rows, width), dtype)
    assert gelu_and_mul(gate, up, approximate=approximate, out=out) is out
    _check(out, gate, up, approximate)


@pytest.mark.parametrize(
    "width, dtype, approximate", [(5120, torch.float16, "none"), (14336, torch.bfloat16, "tanh")], ids=["5120", "14336"]
)
def test_wide_rows(width: int, dtype: torch.dtype, approximate: str) -> None:
    """A 28672-wide gate_up row (I = 14336) takes seven column programs per row."""
    gate = randn(3, 2 * width, dtype=dtype)
    out = gelu_and_mul(gate, approximate=approximate)
    assert out.shape == (3, width)
    _check(out, gate, None, approximate)


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_halves_of_gate_up_as_two_views(approximate: str, dtype: torch.dtype) -> None:
    """gate and up as the two column halves of one (M, 2I) buffer: row stride 2I, no copy."""
    gate_up = randn(17, 2 * 1000, dtype=dtype)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    out = poisoned((17, 1000), dtype)
    assert gelu_and_mul(gate, up, approximate=approximate, out=out) is out
    _check(out, gate, up, approximate)


@pytest.mark.parametrize("fused_input", [True, False], ids=["gate_up", "gate_and_up"])
def test_column_strided_inputs_and_out(fused_input: bool, dtype: torch.dtype) -> None:
    """Last-dim stride 2 everywhere (conftest's strided views), out included."""
    if fused_input:
        gate, up = randn(3, 2 * 123, dtype=dtype, strided=True), None
    else:
        gate, up = randn(3, 123, dtype=dtype, strided=True), randn(3, 123, dtype=dtype, strided=True)
    out = poisoned((3, 246), dtype)[:, ::2]
    assert gelu_and_mul(gate, up, approximate="tanh", out=out) is out
    _check(out, gate, up, "tanh")


def test_leading_dims_that_are_not_one_row_view() -> None:
    """(S, B, 2I) transposed from (B, S, 2I): its leading dims do not view as rows but collapse into two row dims."""
    gate = randn(3, 5, 2 * 123, dtype=torch.float16).transpose(0, 1)
    out = gelu_and_mul(gate)
    assert out.shape == (5, 3, 123)
    _check(out, gate, None, "none")


def test_bad_inputs() -> None:
    gate = randn(3, 10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be even"):
        gelu_and_mul(randn(3, 11, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one shape"):
        gelu_and_mul(gate, randn(3, 12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="share dtype"):
        gelu_and_mul(gate, randn(3, 10, dtype=torch.float16))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        gelu_and_mul(gate, approximate="erf")
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        gelu_and_mul(torch.ones(3, 10, dtype=torch.float64, device=device()))
    with pytest.raises(ValueError, match="out must be"):
        gelu_and_mul(gate, out=poisoned((3, 10), torch.bfloat16))
    with pytest.raises(ValueError, match="do not collapse"):
        gelu_and_mul(randn(2, 3, 4, 10, dtype=torch.bfloat16).permute(2, 0, 1, 3)[:, :, ::2])
