"""fusionscope::gemv_gated: a GLU's silu_and_mul / gelu_and_mul folded into the down_proj GEMV's loop. Against
`gemv_gated_reference` (float64, x not rounded) at the dtype's tolerance, and bit for bit against the pair it replaces,
`gemv(silu_and_mul(gate, up), W, b)` (or gelu_and_mul): x is computed and rounded as the GLU kernel writes it and
summed in the GEMV's order. Odd sizes (tails in K and N), gate and up as the two halves of one gate_up row and as
strided views, a strided weight, NaN-poisoned outputs, forced schedules (several programs and steps of K, each way
of loading W); what it hands to F.linear is F.linear of eager torch's x."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fusionscope.kernels.gelu_and_mul import gelu_and_mul
from fusionscope.kernels.gemv import (
    TILES,
    WIDEST,
    _gemv_gated_op,
    gemv,
    gemv_gated,
    gemv_gated_reference,
    glu_in_dtype,
    takes,
)
from fusionscope.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference
from fusionscope.kernels.tolerances import assert_close
from torch.fx.experimental.proxy_tensor import make_fx

from tests.kernels.conftest import SeenOps, poisoned, randn

ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]
SHAPES = [(40, 24), (517, 19)]  # (K = I, N): tails in both


def _scale(dtype: torch.dtype, K: int) -> float:
    return 1.0 if dtype == torch.float32 else max(1.0, math.sqrt(K / 64))


def unfolded(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str) -> torch.Tensor:  # fmt: skip
    """What the rewrite replaces: the GLU kernel, then the GEMV on its output."""
    if activation == "silu":
        x = silu_and_mul(gate, up)
    else:
        x = gelu_and_mul(gate, up, "tanh" if activation == "gelu_tanh" else "none")
    return gemv(x, weight, bias)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(("K", "N"), SHAPES)
def test_matches_float64_and_the_unfolded_pair_bit_for_bit(K: int, N: int, activation: str,
                                                           dtype: torch.dtype) -> None:  # fmt: skip
    """gate and up the two halves of one (1, 1, 2K) gate_up output (views); a bias on the odd shape."""
    h = randn(1, 1, 2 * K, dtype=dtype)
    gate, up = h[..., :K], h[..., K:]
    weight = randn(N, K, dtype=dtype, scale=K**-0.5)
    bias = randn(N, dtype=dtype) if K % 2 else None
    assert takes(gate, weight)
    out = gemv_gated(gate, up, weight, bias, activation)
    assert out.shape == (1, 1, N) and out.dtype == dtype
    assert torch.equal(out, unfolded(gate, up, weight, bias, activation))
    assert_close(out, gemv_gated_reference(gate, up, weight, bias, activation), scale=2 * _scale(dtype, K))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_strided_operands_into_a_poisoned_output(activation: str, dtype: torch.dtype) -> None:
    """gate and up with a stride of 2 (each its own), W a column slice of a wider buffer (row stride ≠ K), bias
    strided: the launcher passes every stride; every output element is written (NaN otherwise)."""
    K, N = 45, 21
    gate, up = randn(1, K, dtype=dtype, strided=True), randn(1, K, dtype=dtype, strided=True)
    weight = randn(N, K + 7, dtype=dtype, scale=K**-0.5)[:, 2 : K + 2]
    bias = randn(N, dtype=dtype, strided=True)
    out = poisoned((N,), dtype)
    _gemv_gated_op(gate.reshape(K), up.reshape(K), weight, bias, out, False, activation)
    assert not out.isnan().any()
    assert torch.equal(out, unfolded(gate, up, weight, bias, activation).reshape(N))
    assert_close(out, gemv_gated_reference(gate, up, weight, bias, activation).reshape(N), scale=2 * _scale(dtype, K))


@pytest.mark.parametrize("prefetch", [1, 0], ids=["prefetch", "no-prefetch"])
def test_forced_schedules_sum_as_the_plain_gemv(prefetch: int) -> None:
    """Several programs and steps of K, each way of loading W: the same sums in the same order as the plain GEMV."""
    TILES["force"] = (2, 32, 1, prefetch)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            h = randn(1, 140, dtype=dtype)
            gate, up = h[:, :70], h[:, 70:]
            weight = randn(9, 70, dtype=dtype, scale=70**-0.5)
            out = gemv_gated(gate, up, weight)
            assert torch.equal(out, unfolded(gate, up, weight, None, "silu"))
            assert_close(out, gemv_gated_reference(gate, up, weight), scale=2 * _scale(dtype, 70))
    finally:
        TILES["force"] = None


def test_what_gemv_leaves_to_f_linear_is_f_linear_of_eager_glu() -> None:
    """Several rows, or more than WIDEST outputs: F.linear of x as eager torch computes and rounds it."""
    gate, up = randn(3, 40, dtype=torch.bfloat16), randn(3, 40, dtype=torch.bfloat16)
    weight = randn(24, 40, dtype=torch.bfloat16)
    assert not takes(gate, weight)
    assert torch.equal(gemv_gated(gate, up, weight), F.linear(silu_and_mul_reference(gate, up), weight))
    one, up_one = gate[:1, :8], up[:1, :8]
    wide = randn(WIDEST + 1, 8, dtype=torch.bfloat16)
    assert not takes(one, wide)
    got = gemv_gated(one, up_one, wide, activation="gelu")
    assert torch.equal(got, F.linear(glu_in_dtype(one, up_one, "gelu"), wide))
    assert torch.equal(glu_in_dtype(one, up_one, "gelu"), F.gelu(one) * up_one)


def test_bad_operands_are_one_line_errors() -> None:
    gate, up = randn(1, 40, dtype=torch.float32), randn(1, 40, dtype=torch.float32)
    weight = randn(24, 40, dtype=torch.float32)
    with pytest.raises(ValueError, match="activation must be"):
        gemv_gated(gate, up, weight, activation="relu")
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        gemv_gated(gate, up[:, :39], weight)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        gemv_gated(gate, up.half(), weight)
    with pytest.raises(ValueError, match="bias must be"):
        gemv_gated(gate, up, weight, randn(23, dtype=torch.float32))
    with pytest.raises(ValueError, match="inputs"):
        gemv_gated(randn(1, 41, dtype=torch.float32), randn(1, 41, dtype=torch.float32), weight)


def test_the_registered_op_is_what_dispatch_modes_and_tracing_see() -> None:
    """Under a dispatch mode the call is `fusionscope::gemv_gated`, and make_fx records it as one opaque op (what
    torch.compile's tracing goes through on a GPU; fake tensors cannot run the interpreter's launch, for any kernel
    of the package), computing the same."""
    h = randn(1, 80, dtype=torch.float32)
    weight = randn(24, 40, dtype=torch.float32, scale=40**-0.5)

    def fn(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemv_gated(h[:, :40], h[:, 40:], weight)

    want = fn(h, weight)
    with SeenOps() as seen:
        got = fn(h, weight)
    assert "fusionscope.gemv_gated.default" in seen.ops
    assert torch.equal(got, want)
    traced = make_fx(fn)(h, weight)
    ops = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert ops.count("fusionscope.gemv_gated.default") == 1 and not any("silu" in op for op in ops), ops
    assert torch.equal(traced(h, weight), want)
