"""add_layer_norm against F.layer_norm(x + r) in float64 (at the dtype's tolerance) and against eager in the dtype:
the new residual equals eager's add bit for bit, the output agrees at the dtype's tolerance."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from fusionscope.kernels.add_layer_norm import (
    add_layer_norm,
    add_layer_norm_pair,
    add_layer_norm_pair_reference,
    add_layer_norm_reference,
)
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import device, poisoned, randn

EPS = 1e-5


def _params(n: int, dtype: torch.dtype, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias like a trained LayerNorm's: weight around 1, bias around 0, never zero."""
    weight = 1.0 + randn(n, dtype=torch.float32, scale=0.2)
    bias = randn(n, dtype=torch.float32, scale=0.2) if has_bias else None
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _check(
    x: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    out: torch.Tensor,
    h: torch.Tensor,
    eps: float = EPS,
) -> None:
    """out/h against fp64 F.layer_norm(x + r) at the dtype's tolerance, and h against eager's add exactly."""
    dtype = x.dtype
    h64 = x.double() + r.double()
    out64 = F.layer_norm(h64, (x.shape[-1],), None if w is None else w.double(), None if b is None else b.double(), eps)
    assert_close(h, h64, dtype)
    assert_close(out, out64, dtype)
    out_eager, h_eager = add_layer_norm_reference(x, r, w, b, eps)
    assert torch.equal(h, h_eager)
    assert_close(out, out_eager, dtype)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("m", "n"), [(1, 123), (3, 1000), (17, 768), (3, 4097)])
def test_add_layer_norm(m: int, n: int, has_bias: bool, dtype: torch.dtype) -> None:
    x, r = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype)
    w, b = _params(n, dtype, has_bias)
    out, h = add_layer_norm(x, r, w, b, EPS)
    assert out.shape == h.shape == x.shape and out.dtype == h.dtype == dtype
    _check(x, r, w, b, out, h)


@pytest.mark.parametrize("n", [5120, 16384])
def test_wide_rows(n: int) -> None:
    """A Llama-size width and the widest row one block holds (fp32 only: the interpreter is slow at this width)."""
    x, r = randn(1, n, dtype=torch.float32), randn(1, n, dtype=torch.float32)
    w, b = _params(n, torch.float32, True)
    _check(x, r, w, b, *add_layer_norm(x, r, w, b, EPS))


def test_no_weight_gpt2_shape_bert_eps() -> None:
    """(B, T, C) input, elementwise_affine=False, BERT's eps."""
    x, r = randn(2, 3, 768, dtype=torch.bfloat16), randn(2, 3, 768, dtype=torch.bfloat16)
    _check(x, r, None, None, *add_layer_norm(x, r, None, None, 1e-12), eps=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strided_inputs_and_poisoned_out(dtype: torch.dtype) -> None:
    """x, residual and weight with last-dim stride 2, into NaN-poisoned outputs that are themselves strided."""
    m, n = 3, 1000
    x, r = randn(m, n, dtype=dtype, strided=True), randn(m, n, dtype=dtype, strided=True)
    w, b = randn(n, dtype=dtype, strided=True), randn(n, dtype=dtype)
    out = (poisoned((m, n), dtype), poisoned((m, 2 * n), dtype)[:, ::2])
    result = add_layer_norm(x, r, w, b, EPS, out=out)
    assert result[0] is out[0] and result[1] is out[1]
    _check(x, r, w, b, *result)


def test_transposed_3d_and_collapsible_4d() -> None:
    """(T, B, C) memory seen as (B, T, C): rows that are no view of a 2-D matrix, handled by per-dim strides; and a
    4-D input whose leading dims collapse."""
    dtype = torch.float16
    x = randn(5, 3, 123, dtype=dtype).transpose(0, 1)
    r = randn(3, 5, 123, dtype=dtype)
    w, b = _params(123, dtype, True)
    out = (poisoned(x.shape, dtype), poisoned(x.shape, dtype))
    _check(x, r, w, b, *add_layer_norm(x, r, w, b, EPS, out=out))
    x4, r4 = randn(2, 2, 3, 123, dtype=dtype, strided=True), randn(2, 2, 3, 123, dtype=dtype)
    _check(x4, r4, w, b, *add_layer_norm(x4, r4, w, b, EPS))


def test_in_place() -> None:
    """out=(x, residual): the row is loaded before anything is stored, so updating in place is safe."""
    dtype = torch.bfloat16
    x, r = randn(17, 768, dtype=dtype), randn(17, 768, dtype=dtype)
    w, b = _params(768, dtype, True)
    x0, r0 = x.clone(), r.clone()
    result = add_layer_norm(x, r, w, b, EPS, out=(x, r))
    assert result[0] is x and result[1] is r
    _check(x0, r0, w, b, x, r)


def test_bad_inputs() -> None:
    x, r = randn(3, 64, dtype=torch.float32), randn(3, 64, dtype=torch.float32)
    w = randn(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        add_layer_norm(x, r[:, :32], w, None, EPS)
    with pytest.raises(ValueError, match="share one of"):
        add_layer_norm(x, r.half(), w, None, EPS)
    with pytest.raises(ValueError, match=r"weight must be a floating \(64,\)"):
        add_layer_norm(x, r, w[:32], None, EPS)
    with pytest.raises(ValueError, match="bias must be"):
        add_layer_norm(x, r, w, torch.ones(64, dtype=torch.int64, device=device()), EPS)
    with pytest.raises(ValueError, match="exceeds 16384"):
        wide = randn(1, 16385, dtype=torch.float32)
        add_layer_norm(wide, wide, None, None, EPS)
    with pytest.raises(ValueError, match=r"out\[1\]"):
        add_layer_norm(x, r, w, None, EPS, out=(torch.empty_like(x), torch.empty(3, 64, dtype=torch.float16)))
    with pytest.raises(ValueError, match="cannot be viewed"):
        x4 = randn(2, 3, 4, 64, dtype=torch.float32).transpose(0, 1)
        add_layer_norm(x4, x4, w, None, EPS)


def _check_pair(x: torch.Tensor, r: torch.Tensor, params: tuple[torch.Tensor, ...], got: tuple) -> None:
    """Both outputs against fp64 LayerNorms of x + r and against eager's at the dtype's tolerance; the sum exactly."""
    w, b, w2, b2 = params
    out, out2, h = got
    dtype = x.dtype
    h64 = x.double() + r.double()
    assert_close(h, h64, dtype)
    for got_norm, weight, bias in ((out, w, b), (out2, w2, b2)):
        assert got_norm.shape == x.shape and got_norm.dtype == dtype
        assert_close(got_norm, F.layer_norm(h64, (x.shape[-1],), weight.double(), bias.double(), EPS), dtype)
    eager = add_layer_norm_pair_reference(x, r, w, b, w2, b2, EPS)
    assert torch.equal(h, eager[2])
    assert_close(out, eager[0], dtype)
    assert_close(out2, eager[1], dtype)


@pytest.mark.parametrize(("shape", "strided"), [((1, 123), False), ((3, 1000), True), ((2, 5, 768), False)])
def test_add_layer_norm_pair(shape: tuple[int, ...], strided: bool, dtype: torch.dtype, monkeypatch) -> None:
    """Two LayerNorms of one sum (GPT-NeoX's parallel block), each with its own weight and bias, from one launch:
    odd widths, a strided x, residual and weight, a 3-D batch; the outputs it allocates are NaN-poisoned first."""
    module = sys.modules[add_layer_norm_pair.__module__]
    monkeypatch.setattr(module, "new_output", lambda like: poisoned(tuple(like.shape), like.dtype))
    n = shape[-1]
    x, r = randn(*shape, dtype=dtype, strided=strided), randn(*shape, dtype=dtype, strided=strided)
    w, b = _params(n, dtype, True)
    w2, b2 = _params(n, dtype, True)
    if strided:  # stride 2: every other element of a buffer twice as long
        w2, b2 = randn(n, dtype=dtype, strided=True, scale=0.2), randn(n, dtype=dtype, strided=True, scale=0.2)
        w2.add_(1.0)
        assert w2.stride() == b2.stride() == (2,)
    _check_pair(x, r, (w, b, w2, b2), add_layer_norm_pair(x, r, w, b, w2, b2, EPS))


def test_add_layer_norm_pair_outputs_differ_by_their_own_weights() -> None:
    """The second output is made with the second weight and bias, not the first's (a kernel reusing one pair of
    parameters would pass the single-norm checks)."""
    x, r = randn(2, 96, dtype=torch.float32), randn(2, 96, dtype=torch.float32)
    w, b = _params(96, torch.float32, True)
    out, out2, _ = add_layer_norm_pair(x, r, w, b, -w, b + 1.0, EPS)
    normed = F.layer_norm(x + r, (96,), None, None, EPS)
    assert_close(out2, -normed * w + b + 1.0, torch.float32)
    assert not torch.allclose(out, out2)


def test_add_layer_norm_pair_needs_both_weights_and_biases() -> None:
    x, r = randn(3, 64, dtype=torch.float32), randn(3, 64, dtype=torch.float32)
    w = randn(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="bias2 is required"):
        add_layer_norm_pair(x, r, w, w, w, None, EPS)
    with pytest.raises(ValueError, match=r"weight2 must be a floating \(64,\)"):
        add_layer_norm_pair(x, r, w, w, w[:32], w, EPS)


@pytest.mark.parametrize(("shape", "strided"), [((1, 123), False), ((2, 5, 200), True)])
def test_add_layer_norm_pair_with_an_addend(shape: tuple[int, ...], strided: bool, dtype: torch.dtype,
                                            monkeypatch) -> None:  # fmt: skip
    """GPT-NeoX's `mlp + attention + hidden`: with `addend` the sum is made by both adds, each rounded as eager
    rounds it (the stored residual equal to eager's bit for bit), and the norms read it; strided operands, odd
    widths, NaN-poisoned outputs."""
    module = sys.modules[add_layer_norm_pair.__module__]
    monkeypatch.setattr(module, "new_output", lambda like: poisoned(tuple(like.shape), like.dtype))
    n = shape[-1]
    x, a, r = (randn(*shape, dtype=dtype, strided=strided) for _ in range(3))
    w, b = _params(n, dtype, True)
    w2, b2 = _params(n, dtype, True)
    out, out2, h = add_layer_norm_pair(x, r, w, b, w2, b2, EPS, addend=a)
    eager = add_layer_norm_pair_reference(x, r, w, b, w2, b2, EPS, addend=a)
    assert torch.equal(h, eager[2])
    assert_close(h, x.double() + a.double() + r.double(), dtype)
    h64 = eager[2].double()  # the norms of the stored (rounded) sum, in float64
    for got, weight, bias in ((out, w, b), (out2, w2, b2)):
        assert_close(got, F.layer_norm(h64, (n,), weight.double(), bias.double(), EPS), dtype)
    assert not torch.equal(h, add_layer_norm_pair(x, r, w, b, w2, b2, EPS)[2])  # the addend is not ignored
    with pytest.raises(ValueError, match="same shape"):
        add_layer_norm_pair(x, r, w, b, w2, b2, EPS, addend=a[..., :-1])
