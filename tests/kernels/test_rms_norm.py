"""fusionscope::rms_norm against its fp64 reference and against Hugging Face's LlamaRMSNorm / Gemma2RMSNorm modules,
and its `weight_in_fp32` mode against Olmo2RMSNorm's `(weight * x̂).to(dtype)`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fusionscope.kernels.rms_norm import rms_norm, rms_norm_reference
from fusionscope.kernels.tolerances import assert_close
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from tests.kernels.conftest import SeenOps, device, poisoned, randn

EPS = 1e-6
SHAPES = [(1, 123), (3, 1000), (17, 4097)]  # rows 1, 3, 17; odd and non-power-of-two widths
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


def check(x: torch.Tensor, w: torch.Tensor, offset: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel (into `out` if given) and compare it with the reference computed in fp64 from the same inputs."""
    y = rms_norm(x, w, EPS, offset, out=out)
    if out is not None:
        assert y is out
    expected = rms_norm_reference(x.double(), w.double(), EPS, offset)
    assert y.dtype == (torch.promote_types(x.dtype, w.dtype) if offset == 0.0 else x.dtype)
    assert_close(y, expected, x.dtype)
    return y


@OFFSETS
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_matches_fp64_reference(shape: tuple[int, int], dtype: torch.dtype, offset: float) -> None:
    check(randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype), offset)


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
    x = randn(*shape, dtype=dtype, strided=True)
    check(x, randn(shape[-1], dtype=dtype), offset, out=poisoned(shape, dtype))


@OFFSETS
def test_leading_dims_strided_into_poisoned_out(dtype: torch.dtype, offset: float) -> None:
    """x (2, 3, N) with a last-dim stride of 2, a strided weight, and a NaN-filled out that must be fully written."""
    x = randn(2, 3, 1000, dtype=dtype, strided=True)
    w = randn(1000, dtype=dtype, strided=True)
    check(x, w, offset, out=poisoned(x.shape, dtype))


B, S, H, HK, D = 2, 3, 4, 2, 128  # Qwen3-style per-head q/k norm over D


def _qwen3_q(layout: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    if layout == "contiguous":  # HF Qwen3: q_proj(h).view(B, S, H, D), normed before the transpose
        return randn(B, S, H, D, dtype=dtype, seed=seed)
    if layout == "qkv_slice":  # q as a view into a fused qkv projection: two row dims, no copy
        return randn(B, S, (H + 2 * HK) * D, dtype=dtype, seed=seed)[..., : H * D].view(B, S, H, D)
    return randn(B, S, H, D, dtype=dtype, seed=seed).transpose(1, 2)  # (B, H, S, D): three row dims


@pytest.mark.parametrize("layout", ["contiguous", "qkv_slice", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_qwen3_head_norm(layout: str, dtype: torch.dtype) -> None:
    q = _qwen3_q(layout, dtype)
    if layout == "contiguous":
        assert q.is_contiguous()
    else:
        assert not q.is_contiguous()
    out = None
    if layout == "qkv_slice":  # write into a strided slice of a poisoned fused buffer too
        buf = poisoned((B, S, (H + 2 * HK) * D), dtype)
        out = buf[..., : H * D].view(B, S, H, D)
    y = check(q, randn(D, dtype=dtype), 0.0, out=out)
    if layout == "qkv_slice":
        assert buf[..., H * D :].isnan().all(), "wrote outside the out view"
    hf = LlamaRMSNorm(D, eps=EPS).to(device=device(), dtype=dtype)  # Qwen3RMSNorm is the same module
    with torch.no_grad():
        hf.weight.copy_(randn(D, dtype=dtype, seed=1))
        assert_matches_hf(rms_norm(q, hf.weight, EPS), hf(q))
    assert y.shape == q.shape


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


@pytest.mark.parametrize("shape", [(3, 1000), (B, S, H, D)], ids=_ids)
@pytest.mark.parametrize("module", [LlamaRMSNorm, Gemma2RMSNorm], ids=["llama", "gemma2"])
def test_matches_hf_module(module: type[torch.nn.Module], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, weight, expected = hf_norm(module, shape, dtype, seed=2)
    offset = 1.0 if module is Gemma2RMSNorm else 0.0
    assert_matches_hf(rms_norm(x, weight, EPS, offset), expected)


def hf_norm(module: type[torch.nn.Module], shape: tuple[int, ...], dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x, weight, the Hugging Face norm's output): `module` over the last dim of `shape`, with a random weight."""
    hf = module(shape[-1], eps=EPS).to(device=device(), dtype=dtype)
    x = randn(*shape, dtype=dtype, seed=seed)
    with torch.no_grad():
        hf.weight.copy_(randn(shape[-1], dtype=dtype, seed=seed + 1))
        expected = hf(x)
    return x, hf.weight.detach(), expected


def test_fp32_weight_on_bf16_input_promotes_like_llama() -> None:
    """HF's `weight * h.to(x.dtype)` with an fp32 weight returns fp32: x̂ still rounds to bf16 first."""
    x = randn(3, 1000, dtype=torch.bfloat16, seed=4)
    hf = LlamaRMSNorm(1000, eps=EPS).to(device())
    with torch.no_grad():
        hf.weight.copy_(randn(1000, dtype=torch.float32, seed=5))
        expected = hf(x)
    actual = rms_norm(x, hf.weight.detach(), EPS)
    assert actual.dtype == expected.dtype == torch.float32
    assert (ulps(actual, expected) <= 1).all()


# ------------------------------------------------------------------------------------------- weight_in_fp32 (OLMo-2)


def check_olmo2(
    x: torch.Tensor,
    w: torch.Tensor,
    offset: float = 0.0,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The weight_in_fp32 mode (into `out` if given) against the fp64 reference of OLMo-2's casting: x̂·w unrounded,
    then one rounding, compared at the tolerance of the output dtype."""
    y = rms_norm(x, w, EPS, offset, out=out, weight_in_fp32=True, dtype=dtype)
    if out is not None:
        assert y is out
    assert y.dtype == (dtype or x.dtype) and y.shape == x.shape
    expected = rms_norm_reference(x.double(), w.double(), EPS, offset, weight_in_fp32=True)
    assert expected.dtype == torch.float64
    assert not y.isnan().any(), "an element was left unwritten"
    assert_close(y, expected, y.dtype)
    return y


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_weight_in_fp32_matches_fp64_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    check_olmo2(randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype))


@pytest.mark.parametrize(
    ("shape", "dtype", "w_dtype", "out_dtype", "offset"),
    [
        ((2, 3, 1000), torch.bfloat16, torch.bfloat16, None, 0.0),
        ((2, 3, 1000), torch.float16, torch.float32, None, 0.0),  # an fp32 weight: the result still keeps x's dtype
        ((2, 3, 1000), torch.float32, torch.float32, torch.bfloat16, 0.0),  # fp32 x, one rounding to bf16
        ((2, 3, 1000), torch.bfloat16, torch.bfloat16, None, 1.0),  # with Gemma's offset: (1 + w)·x̂, one rounding
        ((1, 20000), torch.bfloat16, torch.bfloat16, None, 0.0),  # > 16384: the two-pass chunked loop
    ],
    ids=["bf16", "fp16-fp32w", "fp32-to-bf16", "bf16-offset", "20000-bf16-chunked"],
)
def test_weight_in_fp32_strided_into_poisoned_out(
    shape: tuple[int, ...], dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype | None, offset: float
) -> None:
    """Non-contiguous x (last-dim stride 2) and weight, a NaN-filled out that must be fully written."""
    x = randn(*shape, dtype=dtype, strided=True)
    w = randn(shape[-1], dtype=w_dtype, strided=True)
    check_olmo2(x, w, offset, out=poisoned(shape, out_dtype or dtype), dtype=out_dtype)


def test_weight_in_fp32_on_a_transposed_view() -> None:
    """(B, H, S, D) transposed from (B, S, H, D): three row dims, no copy."""
    check_olmo2(_qwen3_q("transposed", torch.bfloat16, seed=6), randn(D, dtype=torch.bfloat16, seed=7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 1000), (2, 5, 123)], ids=_ids)
def test_weight_in_fp32_matches_olmo2_module(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Within 1 ulp of eager `Olmo2RMSNorm` (`(weight * x̂_fp32).to(dtype)`) and bit-exact almost everywhere; the
    Llama casting on the same inputs (x̂ rounded before the weight product) is not, so the check tells them apart."""
    x, weight, expected = hf_norm(Olmo2RMSNorm, shape, dtype, seed=8)
    assert_matches_hf(rms_norm(x, weight, EPS, weight_in_fp32=True), expected)
    llama = rms_norm(x, weight, EPS)
    assert (ulps(llama, expected) == 0).double().mean().item() < 0.99


def test_weight_in_fp32_through_the_registered_op() -> None:
    """Under a dispatch mode (make_fx, the dataflow recorder) the call is `fusionscope::rms_norm` with the mode's
    flag in its schema, and computes the same."""

    x, w = randn(3, 100, dtype=torch.bfloat16, seed=10), randn(100, dtype=torch.bfloat16, seed=11)
    with SeenOps() as seen:
        y = rms_norm(x, w, EPS, weight_in_fp32=True)
    assert "fusionscope.rms_norm.default" in seen.ops
    assert torch.equal(y, rms_norm(x, w, EPS, weight_in_fp32=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.bfloat16}, "needs weight_in_fp32=True"),  # Llama: promote(bf16, fp32)
        ({"weight_in_fp32": True, "dtype": torch.int32}, "fp32/fp16/bf16"),
        ({"weight_in_fp32": True, "out": "fp32"}, "out must be a"),  # default dtype: x's (bf16), not fp32
        ({"weight_in_fp32": True, "dtype": torch.float16, "out": "bf16"}, "out must be a"),
    ],
    ids=["dtype-without-mode", "int-dtype", "out-dtype", "out-not-dtype"],
)
def test_weight_in_fp32_bad_dtypes_raise(kwargs: dict, match: str) -> None:
    x, w = randn(3, 100, dtype=torch.bfloat16), randn(100, dtype=torch.float32)
    if "out" in kwargs:
        kwargs = {**kwargs, "out": poisoned(x.shape, {"fp32": torch.float32, "bf16": torch.bfloat16}[kwargs["out"]])}
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, EPS, **kwargs)


def test_empty_rows() -> None:
    x = randn(0, 64, dtype=torch.float16)
    assert rms_norm(x, randn(64, dtype=torch.float16), EPS).shape == (0, 64)


def test_more_than_three_unmergeable_row_dims_raise() -> None:
    x = randn(2, 3, 4, 5, 8, dtype=torch.float32).permute(3, 2, 1, 0, 4)
    with pytest.raises(ValueError, match="non-mergeable row dims"):
        rms_norm(x, randn(8, dtype=torch.float32), EPS)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: (randn(3, 100, dtype=torch.float16), randn(99, dtype=torch.float16), None), "weight must have shape"),
        (lambda: (randn(3, 100, dtype=torch.float16), randn(1, 100, dtype=torch.float16), None), "weight must have"),
        (
            lambda: (torch.ones(3, 100, dtype=torch.int32, device=device()), randn(100, dtype=torch.float32), None),
            "fp32/fp16/bf16",
        ),
        (lambda: (torch.tensor(1.0, device=device()), randn(1, dtype=torch.float32), None), "at least one dimension"),
        (
            lambda: (
                randn(3, 100, dtype=torch.float16),
                randn(100, dtype=torch.float16),
                poisoned((3, 99), torch.float16),
            ),
            "out must be a",
        ),
        (
            lambda: (
                randn(3, 100, dtype=torch.float16),
                randn(100, dtype=torch.float16),
                poisoned((3, 100), torch.float32),
            ),
            "out must be a",
        ),
    ],
    ids=["weight-length", "weight-2d", "int-x", "scalar-x", "out-shape", "out-dtype"],
)
def test_bad_inputs_raise_value_error(make: Callable[[], tuple], match: str) -> None:
    x, w, out = make()
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, EPS, out=out)


# ---------------------------------------------------------------------------------- residual (a post-norm's add)


def unfused_order(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, offset: float, weight_in_fp32: bool,
                  dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """`r + norm(x)` in the unfused code's rounding order, from an fp64 norm: the norm rounded to the output dtype (as
    the model stores it), then the sum in fp64 (exact for two fp16/bf16 values, as aten's fp32 sum is), rounded once
    to the output dtype."""
    norm = rms_norm_reference(x.double(), w.double(), EPS, offset, weight_in_fp32=weight_in_fp32)
    out_dtype = r.dtype if dtype is None else dtype
    return (r.double() + norm.to(out_dtype).double()).to(out_dtype)


def check_residual(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, offset: float = 0.0,
                   weight_in_fp32: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """The residual operand into a NaN-filled out: against the fp64 reference of the unfused order at the output
    dtype's tolerance, and bit for bit against the unfused code run with this kernel (`r + rms_norm(x)`, the add
    aten's), which only the same two roundings in the same order can match."""
    out = poisoned(x.shape, r.dtype)
    y = rms_norm(x, w, EPS, offset, out=out, weight_in_fp32=weight_in_fp32, dtype=dtype, residual=r)
    assert y is out and y.dtype == r.dtype and not y.isnan().any(), "an element was left unwritten"
    expected = unfused_order(x, w, r, offset, weight_in_fp32, dtype)
    # a sum that cancels keeps its operands' absolute error: the tolerance scales with their magnitude, not the sum's
    assert_close(y, expected, y.dtype, scale=max(1.0, r.abs().max().item(), (expected - r.double()).abs().max().item()))
    assert torch.equal(y, r + rms_norm(x, w, EPS, offset, weight_in_fp32=weight_in_fp32, dtype=dtype))
    return y


MODES = pytest.mark.parametrize(
    ("offset", "weight_in_fp32"), [(0.0, False), (0.0, True), (1.0, False)], ids=["llama", "olmo2", "gemma"]
)


@MODES
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_residual_matches_the_unfused_order(shape: tuple[int, int], dtype: torch.dtype, offset: float,
                                            weight_in_fp32: bool) -> None:  # fmt: skip
    x, w, r = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype), randn(*shape, dtype=dtype, scale=2.0)
    check_residual(x, w, r, offset, weight_in_fp32)


@MODES
def test_residual_strided_x_and_residual(dtype: torch.dtype, offset: float, weight_in_fp32: bool) -> None:
    """x with a last-dim stride of 2, the residual a transposed view (its rows do not merge as x's do), 3 row dims."""
    x = randn(2, 3, 1000, dtype=dtype, strided=True)
    r = randn(3, 2, 1000, dtype=dtype, seed=3).transpose(0, 1)
    assert not x.is_contiguous() and not r.is_contiguous()
    check_residual(x, randn(1000, dtype=dtype, strided=True), r, offset, weight_in_fp32)


@pytest.mark.parametrize("weight_in_fp32", [False, True], ids=["llama", "olmo2"])
def test_residual_on_the_chunked_path(weight_in_fp32: bool) -> None:
    """Rows wider than 16384 loop over chunks: the residual is read chunk by chunk in the second pass."""
    x, r = randn(2, 20000, dtype=torch.bfloat16, strided=True), randn(2, 20000, dtype=torch.bfloat16, strided=True)
    check_residual(x, randn(20000, dtype=torch.bfloat16), r, weight_in_fp32=weight_in_fp32)


def test_residual_with_the_olmo2_output_dtype() -> None:
    """weight_in_fp32 with fp32 x rounded once to bf16 (`dtype=`): the residual is in that output dtype."""
    x, w, r = randn(3, 999, dtype=torch.float32), randn(999, dtype=torch.float32), randn(3, 999, dtype=torch.bfloat16)
    check_residual(x, w, r, weight_in_fp32=True, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_residual_matches_olmo2s_post_norm_and_add(dtype: torch.dtype) -> None:
    """`residual + Olmo2RMSNorm(x)` as the decoder layer computes it: within 1 ulp and bit-exact almost everywhere."""
    x, weight, normed = hf_norm(Olmo2RMSNorm, (2, 5, 123), dtype, seed=12)
    r = randn(2, 5, 123, dtype=dtype, seed=14)
    assert_matches_hf(rms_norm(x, weight, EPS, weight_in_fp32=True, residual=r), r + normed)


def test_residual_through_the_registered_op() -> None:
    """Under a dispatch mode the call is `fusionscope::rms_norm` with the residual in its schema (an optional tensor,
    default None: the plain call's schema is unchanged), and computes the same."""
    schema = torch.ops.fusionscope.rms_norm.default._schema
    assert [(a.name, str(a.type)) for a in schema.arguments][-1] == ("residual", "Optional[Tensor]")
    x, w = randn(3, 100, dtype=torch.bfloat16, seed=15), randn(100, dtype=torch.bfloat16, seed=16)
    r = randn(3, 100, dtype=torch.bfloat16, seed=17)
    with SeenOps() as seen:
        y = rms_norm(x, w, EPS, weight_in_fp32=True, residual=r)
    assert "fusionscope.rms_norm.default" in seen.ops
    assert torch.equal(y, rms_norm(x, w, EPS, weight_in_fp32=True, residual=r))


@pytest.mark.parametrize(
    ("residual", "kwargs", "match"),
    [
        ("shape", {}, "residual must be a"),
        ("dtype", {}, "residual must be a"),  # fp32 residual, bf16 result
        ("promoted", {}, "residual must be a"),  # an fp32 weight: the Llama result is fp32, the residual bf16
        ("list", {}, "residual must be a tensor"),
    ],
    ids=["shape", "dtype", "promoted", "not-a-tensor"],
)
def test_residual_bad_inputs_raise(residual: str, kwargs: dict, match: str) -> None:
    x = randn(3, 100, dtype=torch.bfloat16)
    w = randn(100, dtype=torch.float32 if residual == "promoted" else torch.bfloat16)
    r = {
        "shape": lambda: randn(3, 99, dtype=torch.bfloat16),
        "dtype": lambda: randn(3, 100, dtype=torch.float32),
        "promoted": lambda: randn(3, 100, dtype=torch.bfloat16),
        "list": lambda: [1.0] * 100,
    }[residual]()
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, EPS, residual=r, **kwargs)
