"""silu_and_mul against its float64 reference and against Hugging Face's eager `F.silu(gate) * up`, bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from fusionscope.kernels.silu_and_mul import FLAT, silu_and_mul, silu_and_mul_reference
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import device, poisoned, randn

# (rows, I): one row, odd counts, odd and non-power-of-two widths; 4097 spans three 2048-column programs
SHAPES = [(1, 123), (3, 1000), (17, 4097)]


def _neighbours(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16/bf16 values one ulp below and above each element (through ±0), by stepping the ordered bit pattern."""
    bits = t.view(torch.int16).to(torch.int32)
    ordered = torch.where(bits < 0, -(bits & 0x7FFF), bits)

    def back(o: torch.Tensor) -> torch.Tensor:
        return torch.where(o < 0, (-o) | 0x8000, o).to(torch.int16).view(t.dtype)

    return back(ordered - 1), back(ordered + 1)


def assert_matches_eager(
    actual: torch.Tensor, act: torch.Tensor, combine: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """`actual` must be eager's `combine(act)` bit for bit, up to one flip of the activation's rounding.

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
    ok = (actual == expected) | (actual == combine(lo)) | (actual == combine(hi))
    assert ok.all(), f"{int((~ok).sum())} elements off eager: kernel {actual[~ok][:4]}, eager {expected[~ok][:4]}"
    exact = (actual == expected).double().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} of elements match eager bit for bit"


def _check(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None) -> None:
    """Compare with float64 (tolerance table) and with HF's eager expression in the input dtype."""
    g, u = gate.chunk(2, dim=-1) if up is None else (gate, up)
    assert_close(out, silu_and_mul_reference(gate.double(), None if up is None else up.double()), gate.dtype)
    assert_matches_eager(out, F.silu(g), lambda act: act * u)


@pytest.mark.parametrize("rows, width", SHAPES)
@pytest.mark.parametrize("fused_input", [True, False], ids=["gate_up", "gate_and_up"])
def test_matches_reference(rows: int, width: int, fused_input: bool, dtype: torch.dtype) -> None:
    if fused_input:
        gate, up = randn(rows, 2 * width, dtype=dtype), None
    else:
        gate, up = randn(rows, width, dtype=dtype), randn(rows, width, dtype=dtype)
    out = poisoned((rows, width), dtype)
    assert silu_and_mul(gate, up, out=out) is out
    _check(out, gate, up)


@pytest.mark.parametrize("width, dtype", [(5120, torch.float16), (14336, torch.bfloat16)], ids=["5120", "14336"])
def test_wide_rows(width: int, dtype: torch.dtype) -> None:
    """Llama-3-8B's I = 14336: a 28672-wide gate_up row, seven column programs per row."""
    gate = randn(3, 2 * width, dtype=dtype)
    out = silu_and_mul(gate)
    assert out.shape == (3, width)
    _check(out, gate, None)


def test_halves_of_gate_up_as_two_views(dtype: torch.dtype) -> None:
    """gate and up as the two column halves of one (M, 2I) buffer: row stride 2I, no copy."""
    gate_up = randn(17, 2 * 1000, dtype=dtype)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    out = poisoned((17, 1000), dtype)
    assert silu_and_mul(gate, up, out=out) is out
    _check(out, gate, up)


@pytest.mark.parametrize("fused_input", [True, False], ids=["gate_up", "gate_and_up"])
def test_column_strided_inputs_and_out(fused_input: bool, dtype: torch.dtype) -> None:
    """Last-dim stride 2 everywhere (conftest's strided views), out included."""
    if fused_input:
        gate, up = randn(3, 2 * 123, dtype=dtype, strided=True), None
    else:
        gate, up = randn(3, 123, dtype=dtype, strided=True), randn(3, 123, dtype=dtype, strided=True)
    out = poisoned((3, 246), dtype)[:, ::2]
    assert silu_and_mul(gate, up, out=out) is out
    _check(out, gate, up)


def test_leading_dims_that_are_not_one_row_view() -> None:
    """(S, B, 2I) transposed from (B, S, 2I): its leading dims do not view as rows but collapse into two row dims."""
    gate = randn(3, 5, 2 * 123, dtype=torch.bfloat16).transpose(0, 1)
    out = silu_and_mul(gate)
    assert out.shape == (5, 3, 123)
    _check(out, gate, None)


def test_bad_inputs() -> None:
    gate = randn(3, 10, dtype=torch.float16)
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(randn(3, 11, dtype=torch.float16))
    with pytest.raises(ValueError, match="one shape"):
        silu_and_mul(gate, randn(3, 12, dtype=torch.float16))
    with pytest.raises(ValueError, match="share dtype"):
        silu_and_mul(gate, randn(3, 10, dtype=torch.float32))
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        silu_and_mul(torch.ones(3, 10, dtype=torch.int32, device=device()))
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(gate, out=poisoned((3, 10), torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(gate, out=poisoned((3, 5), torch.float32))
    with pytest.raises(ValueError, match="do not collapse"):
        silu_and_mul(randn(2, 3, 4, 10, dtype=torch.float16).permute(2, 0, 1, 3)[:, :, ::2])


@pytest.mark.parametrize("block", [128, 1024])
def test_contiguous_operands_run_flat_across_row_ends(block: int, dtype: torch.dtype, monkeypatch) -> None:
    """Contiguous gate, up and out take the flat schedule: a block spans row ends and the last one is partial
    (2 × 5 × 333 = 3330 elements); the same values as the row schedule gives for strided copies of the inputs."""
    monkeypatch.setitem(FLAT, "BLOCK", block)
    gate, up = randn(2, 5, 333, dtype=dtype), randn(2, 5, 333, dtype=dtype)
    out = poisoned((2, 5, 333), dtype)
    silu_and_mul(gate, up, out=out)
    _check(out, gate, up)
    strided = poisoned((2, 5, 333), dtype)
    silu_and_mul(gate.transpose(0, 1).contiguous().transpose(0, 1), up, out=strided)  # not contiguous: rows
    assert torch.equal(out, strided)
