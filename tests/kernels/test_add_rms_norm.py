"""fusionscope::add_rms_norm (and its in-place form) against the fp64 reference and Hugging Face's decoder-layer path:
`hidden_states = residual + hidden_states` in the input dtype, then LlamaRMSNorm / Gemma2RMSNorm."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
from fusionscope.kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference
from fusionscope.kernels.tolerances import assert_close
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.kernels.conftest import device, poisoned, randn

EPS = 1e-6
SHAPES = [(1, 123), (3, 1000), (17, 4097), (2, 3, 4, 128)]  # rows 1, 3, 17; odd widths; Qwen3-style (B, S, H, D)
OFFSETS = pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])


def _ids(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two tensors of one float dtype (+0 and -0 are one point)."""
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    magnitude = 2 ** (8 * a.element_size() - 1) - 1

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(a) - ordered(b)).abs()


def check(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, offset: float, out: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel and compare both results with the fp64 reference; the new residual must also equal the add done
    by torch in the input dtype, bit for bit."""
    y, h = add_rms_norm(x, r, w, EPS, offset, out=out)
    if out is not None:
        assert y is out[0] and h is out[1]
    expected_y, expected_h = add_rms_norm_reference(x.double(), r.double(), w.double(), EPS, offset)
    assert h.dtype == x.dtype and y.dtype == (torch.promote_types(x.dtype, w.dtype) if offset == 0.0 else x.dtype)
    assert torch.equal(h, r + x)
    assert_close(h, expected_h, x.dtype)
    assert_close(y, expected_y, x.dtype)
    return y, h


@OFFSETS
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_matches_fp64_reference(shape: tuple[int, ...], dtype: torch.dtype, offset: float) -> None:
    check(randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype), offset)


@pytest.mark.parametrize(
    ("shape", "dtype", "offset"),
    [
        ((1, 5120), torch.bfloat16, 0.0),
        ((1, 14336), torch.float32, 1.0),
        ((2, 20000), torch.float32, 0.0),  # > 16384: the two-pass chunked loop
        ((1, 20000), torch.bfloat16, 1.0),
    ],
    ids=["5120-bf16", "14336-fp32", "20000-fp32-chunked", "20000-bf16-chunked"],
)
def test_wide_rows_strided_into_poisoned_out(shape: tuple[int, int], dtype: torch.dtype, offset: float) -> None:
    x, r = randn(*shape, dtype=dtype, strided=True), randn(*shape, dtype=dtype, strided=True)
    check(x, r, randn(shape[-1], dtype=dtype), offset, out=(poisoned(shape, dtype), poisoned(shape, dtype)))


@OFFSETS
def test_leading_dims_strided_into_poisoned_out(dtype: torch.dtype, offset: float) -> None:
    """x and residual (2, 3, N) with a last-dim stride of 2 and a strided weight; NaN-filled outs fully written."""
    x, r = randn(2, 3, 1000, dtype=dtype, strided=True), randn(2, 3, 1000, dtype=dtype, strided=True)
    check(
        x, r, randn(1000, dtype=dtype, strided=True), offset, out=(poisoned(x.shape, dtype), poisoned(x.shape, dtype))
    )


def test_out_as_one_tensor_or_partial_tuple() -> None:
    x, r, w = randn(3, 123, dtype=torch.float16), randn(3, 123, dtype=torch.float16), randn(123, dtype=torch.float16)
    expected_y, expected_h = add_rms_norm(x, r, w, EPS)
    out = poisoned(x.shape, x.dtype)
    y, h = add_rms_norm(x, r, w, EPS, out=out)
    assert y is out and torch.equal(y, expected_y) and torch.equal(h, expected_h)
    residual_out = poisoned(x.shape, x.dtype)
    y, h = add_rms_norm(x, r, w, EPS, out=(None, residual_out))
    assert h is residual_out and torch.equal(y, expected_y) and torch.equal(h, expected_h)


@pytest.mark.parametrize(
    ("shape", "dtype", "offset"),
    [
        ((3, 1000), torch.float32, 0.0),
        ((3, 1000), torch.float16, 1.0),
        ((17, 123), torch.bfloat16, 0.0),
        ((2, 3, 4, 128), torch.bfloat16, 1.0),
        ((1, 20000), torch.bfloat16, 0.0),  # chunked: the second pass overwrites what the first read
    ],
    ids=["3x1000-fp32-llama", "3x1000-fp16-gemma", "17x123-bf16-llama", "qwen3-bf16-gemma", "20000-bf16-chunked"],
)
def test_inplace_writes_into_x_and_residual_only(
    shape: tuple[int, ...], dtype: torch.dtype, offset: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's form: out into x, new residual into residual, both strided views of wider buffers whose other
    columns must stay untouched, and no output allocated."""
    x, r, w = (
        randn(*shape, dtype=dtype, strided=True),
        randn(*shape, dtype=dtype, strided=True),
        randn(shape[-1], dtype=dtype),
    )
    expected_y, expected_h = add_rms_norm(x, r, w, EPS, offset)  # the out-of-place kernel, checked above
    x_buf, r_buf = x._base.clone(), r._base.clone()
    x_pointer, r_pointer = x.data_ptr(), r.data_ptr()

    def no_allocation(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("inplace=True allocated an output")

    monkeypatch.setattr(importlib.import_module("fusionscope.kernels.add_rms_norm"), "_empty", no_allocation)
    if device().type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    y, h = add_rms_norm(x, r, w, EPS, offset, inplace=True)
    if device().type == "cuda":
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() == before
    assert y is x and h is r and x.data_ptr() == x_pointer and r.data_ptr() == r_pointer
    # h = x + r is one rounding: bitwise. The norm is compared within the dtype's tolerance: in-place and
    # out-of-place calls are two specialisations of the kernel (different output strides), and the compiler may
    # order the row's sum of squares differently in each (seen on the H200: last-bit differences in some draws)
    assert torch.equal(r, expected_h)
    assert_close(x, expected_y, dtype)
    assert torch.equal(x._base[..., 1::2], x_buf[..., 1::2]) and torch.equal(r._base[..., 1::2], r_buf[..., 1::2])


def assert_matches_hf(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp16/bf16: within 1 ulp of the HF module everywhere and bit-exact almost everywhere (a wrong casting order, e.g.
    one rounding instead of Llama's two, leaves only ~73% of bf16 elements bit-exact). Differences come only from the
    order of the fp32 sum of squares. fp32: at the dtype tolerance."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        assert_close(actual, expected)
        return
    d = ulps(actual, expected)
    assert d.max().item() <= 1, f"{(d > 1).sum().item()} elements differ by more than 1 ulp"
    assert (d == 0).double().mean().item() >= 0.999


@pytest.mark.parametrize("shape", [(3, 1000), (17, 4097)], ids=_ids)
@pytest.mark.parametrize("module", [LlamaRMSNorm, Gemma2RMSNorm], ids=["llama", "gemma2"])
def test_matches_hf_decoder_layer(module: type[torch.nn.Module], shape: tuple[int, int], dtype: torch.dtype) -> None:
    N = shape[-1]
    hf = module(N, eps=EPS).to(device=device(), dtype=dtype)
    x, r = randn(*shape, dtype=dtype, seed=6), randn(*shape, dtype=dtype, seed=7)
    with torch.no_grad():
        hf.weight.copy_(randn(N, dtype=dtype, seed=8))
        hidden_states = r + x  # the decoder layer's residual add
        expected = hf(hidden_states)
    offset = 1.0 if module is Gemma2RMSNorm else 0.0
    y, h = add_rms_norm(x, r, hf.weight.detach(), EPS, offset)
    assert torch.equal(h, hidden_states)
    assert_matches_hf(y, expected)


def test_empty_rows() -> None:
    x = randn(0, 64, dtype=torch.bfloat16)
    y, h = add_rms_norm(x, x.clone(), randn(64, dtype=torch.bfloat16), EPS)
    assert y.shape == h.shape == (0, 64)


def _inputs(n: int = 100, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return randn(3, n, dtype=dtype), randn(3, n, dtype=dtype), randn(n, dtype=dtype)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, r, w: add_rms_norm(x, r, w[:99], EPS), "weight must have shape"),
        (lambda x, r, w: add_rms_norm(x, r.to(torch.bfloat16), w, EPS), "residual must have x's dtype"),
        (lambda x, r, w: add_rms_norm(x, r[:2], w, EPS), "residual must have x's shape"),
        (lambda x, r, w: add_rms_norm(x, r.reshape(3, 1, 100), w, EPS), "residual must have x's shape"),
        (lambda x, r, w: add_rms_norm(x, r, w, EPS, out=(poisoned(x.shape, torch.float32), None)), "out must be a"),
        (lambda x, r, w: add_rms_norm(x, r, w, EPS, out=(None, poisoned((3, 99), x.dtype))), "new_residual_out must"),
        (lambda x, r, w: add_rms_norm(x, r, w, EPS, out=(None, None, None)), "tuple"),
        (lambda x, r, w: add_rms_norm(x, r, w, EPS, out=(x, r), inplace=True), "not both"),
        (lambda x, r, w: add_rms_norm(x, r, w.float(), EPS, inplace=True), "inplace=True writes the output into x"),
    ],
    ids=["weight-length", "residual-dtype", "residual-rows", "residual-rank", "out-dtype", "residual-out-shape",
         "out-3-tuple", "inplace-and-out", "inplace-promoting-weight"],
)  # fmt: skip
def test_bad_inputs_raise_value_error(call: Callable, match: str) -> None:
    x, r, w = _inputs()
    with pytest.raises(ValueError, match=match):
        call(x, r, w)
