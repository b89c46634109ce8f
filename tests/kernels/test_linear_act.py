"""fusionscope::linear_act against `act(F.linear(x, W, b))` computed in float64: every activation, with and without
bias, fp32/fp16/bf16, both backends (Triton under the interpreter; torch's fused epilogue op, which on the CPU runs
torch's CPU implementation), strided inputs and outputs, NaN-poisoned out buffers.

Weights are drawn at nn.Linear's scale (std K^-1/2) so outputs are O(1). fp16/bf16 tolerances are the table's times
sqrt(K / 64) (≥ 1; 1.25 at K = 100): the fp32 accumulation of K products errs like a random walk, ∝ sqrt(K), and the
table is calibrated for one rounding of an O(1) value. Measured on the CPU the worst error was 0.38 (bf16) and 0.19
(fp16) of the unscaled tolerance, so the factor is headroom for the GPU's accumulation orders, not a need here.
"""

from __future__ import annotations

import math

import pytest
import torch
from fusionscope.kernels.linear_act import (
    ACTIVATIONS,
    TRITON_TILES,
    fit_shared_memory,
    linear_act,
    linear_act_reference,
    linear_act_unfused,
    triton_tiles,
)
from fusionscope.kernels.tolerances import assert_close

from tests.kernels.conftest import DTYPES, device, poisoned, randn

SHAPES = [(1, 64, 48), (5, 96, 130), (33, 100, 130), (33, 64, 48)]  # (M, K, N): tails in every dim


def _scale(dtype: torch.dtype, K: int) -> float:
    return 1.0 if dtype == torch.float32 else max(1.0, math.sqrt(K / 64))


def _inputs(M: int, K: int, N: int, dtype: torch.dtype, has_bias: bool, strided: bool = False):
    x = randn(M, K, dtype=dtype, strided=strided)
    weight = randn(N, K, dtype=dtype, scale=K**-0.5)
    bias = randn(N, dtype=dtype) if has_bias else None
    return x, weight, bias


def _expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return linear_act_reference(x.double(), weight.double(), None if bias is None else bias.double(), activation)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(("M", "K", "N"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_matches_reference(M: int, K: int, N: int, activation: str, has_bias: bool, dtype: torch.dtype) -> None:
    x, weight, bias = _inputs(M, K, N, dtype, has_bias)
    out = poisoned((M, N), dtype)
    result = linear_act(x, weight, bias, activation, out=out, backend="triton")
    assert result is out
    assert_close(result, _expected(x, weight, bias, activation), dtype, scale=_scale(dtype, K))


def _rows_in_each_tile_class() -> list[tuple[str, int]]:
    """(entry of TRITON_TILES, a row count it serves): each bound itself, and one row past the last bound."""
    rows, last = [], 0
    for name, (bound, _) in TRITON_TILES.items():
        rows.append((name, bound if bound is not None else last + 1))
        last = bound or last
    return rows


@pytest.mark.parametrize(("tiles", "M"), _rows_in_each_tile_class())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_tile_configuration_matches_reference(tiles: str, M: int, dtype: torch.dtype) -> None:
    assert triton_tiles(M) is TRITON_TILES[tiles][1]
    x, weight, bias = _inputs(M, 72, 130, dtype, has_bias=True, strided=True)
    out = poisoned((M, 130), dtype)
    result = linear_act(x, weight, bias, "silu", out=out, backend="triton")
    assert_close(result, _expected(x, weight, bias, "silu"), dtype, scale=_scale(dtype, 72))


@pytest.mark.parametrize(("activation", "has_bias"), [("relu", True), ("gelu", True), ("none", True), ("none", False)])
@pytest.mark.parametrize(("M", "K", "N"), SHAPES[1:3])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_torch_epilogue_matches_reference(
    M: int, K: int, N: int, activation: str, has_bias: bool, dtype: torch.dtype
) -> None:
    """On the CPU, torch._addmm_activation(use_gelu=True) is the exact erf GELU (on CUDA it is the tanh one)."""
    if device().type == "cuda" and activation == "gelu":
        activation = "gelu_tanh"
    x, weight, bias = _inputs(M, K, N, dtype, has_bias)
    out = poisoned((M, N), dtype)
    result = linear_act(x, weight, bias, activation, out=out, backend="cublaslt")
    assert result is out
    # The CPU op rounds the GEMM to the dtype before the activation (two roundings): within the same tolerance.
    assert_close(result, _expected(x, weight, bias, activation), dtype, scale=_scale(dtype, K))


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_strided_leading_dims_and_strided_out(activation: str, dtype: torch.dtype) -> None:
    """x: (3, 11, 100) with element stride 2; weight a column-strided view; out: every other column of a wider
    buffer. Nothing is copied: the kernel reads and writes through the strides."""
    x = randn(3, 11, 100, dtype=dtype, strided=True)
    weight = randn(130, 100, dtype=dtype, scale=0.1, strided=True)
    bias = randn(260, dtype=dtype)[::2]
    wide = poisoned((3, 11, 260), dtype)
    out = wide[..., ::2]
    result = linear_act(x, weight, bias, activation, out=out)
    assert result is out and result.data_ptr() == wide.data_ptr()
    assert_close(result, _expected(x, weight, bias, activation), dtype, scale=_scale(dtype, 100))
    assert torch.isnan(wide[..., 1::2]).all()  # the gaps are untouched


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_unfused_chain_and_default_out(activation: str) -> None:
    x, weight, bias = _inputs(5, 96, 48, torch.float32, True)
    expected = _expected(x, weight, bias, activation)
    assert_close(linear_act_unfused(x, weight, bias, activation), expected, torch.float32)
    assert_close(linear_act_reference(x, weight, bias, activation), expected, torch.float32)
    result = linear_act(x[0], weight, bias, activation)  # 1-D x: (K,) -> (N,)
    assert result.shape == (48,)
    assert_close(result, expected[0], torch.float32)


def test_bad_inputs() -> None:
    x, weight, bias = _inputs(5, 64, 48, torch.float32, True)
    with pytest.raises(ValueError, match="activation"):
        linear_act(x, weight, bias, "tanh")
    with pytest.raises(ValueError, match="backend"):
        linear_act(x, weight, bias, "relu", backend="cutlass")
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        linear_act(x, weight[:, :32], bias, "relu")
    with pytest.raises(ValueError, match="bias"):
        linear_act(x, weight, bias[:10], "relu")
    with pytest.raises(ValueError, match="dtype"):
        linear_act(x, weight.half(), bias, "relu")
    with pytest.raises(ValueError, match="out"):
        linear_act(x, weight, bias, "relu", out=torch.empty(5, 47, device=device()))
    with pytest.raises(ValueError, match="without a copy"):
        linear_act(randn(4, 6, 64, dtype=torch.float32).transpose(0, 1), weight, bias, "relu")
    with pytest.raises(ValueError, match="cublaslt"):
        linear_act(x, weight, bias, "silu", backend="cublaslt")
    with pytest.raises(ValueError, match="needs a bias"):
        linear_act(x, weight, None, "relu", backend="cublaslt")


def test_the_epilogue_skips_the_registered_op_only_in_plain_eager_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain eager call on the cuBLASLt path is one torch op already: it must not pay for the registered op's
    dispatch. Under a dispatch mode (what tracing uses) the call goes through `run`, so the op stays visible."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    module = importlib.import_module("fusionscope.kernels.linear_act")
    through_run: list[str] = []
    real_run = module.run
    monkeypatch.setattr(module, "run", lambda name, *args: (through_run.append(name), real_run(name, *args)))

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, weight, bias = _inputs(3, 64, 48, torch.float32, has_bias=True)
    expected = _expected(x, weight, bias, "relu")  # relu: the one activation both devices' epilogues compute
    assert_close(linear_act(x, weight, bias, "relu", backend="cublaslt"), expected, torch.float32)
    assert through_run == []
    with Passthrough():
        traced = linear_act(x, weight, bias, "relu", backend="cublaslt")
    assert through_run == ["linear_act"]
    assert_close(traced, expected, torch.float32)


H200_SHARED_MEMORY = 232448  # bytes a program may use there, as Triton reported it


def _buffers(tiles: dict[str, int], element_size: int) -> int:
    return (tiles["num_stages"] - 1) * (tiles["BLOCK_M"] + tiles["BLOCK_N"]) * tiles["BLOCK_K"] * element_size


def test_tiles_fit_shared_memory() -> None:
    """On the H200 the tiles run as measured (fp32 with the halved K step the launcher applies); on a GPU with
    ~99 KiB per program (sm_86/sm_89) each is cut down until its buffers fit, keeping at least two stages."""
    large_fp32 = {**TRITON_TILES["large"][1], "BLOCK_K": TRITON_TILES["large"][1]["BLOCK_K"] // 2}
    assert _buffers({**large_fp32, "BLOCK_K": 64}, 4) == 294912  # the 288 KiB Triton refused on the H200
    for _, tiles in TRITON_TILES.values():
        for size, config in ((2, tiles), (4, {**tiles, "BLOCK_K": tiles["BLOCK_K"] // 2})):
            assert fit_shared_memory(config, size, H200_SHARED_MEMORY) == config
            fitted = fit_shared_memory(config, size, 101376)
            assert _buffers(fitted, size) <= 101376 and fitted["num_stages"] >= 2
            assert {k: v for k, v in fitted.items() if k not in ("num_stages", "BLOCK_K")} == {
                k: v for k, v in config.items() if k not in ("num_stages", "BLOCK_K")
            }
    assert _buffers(large_fp32, 4) > 101376  # the case above does cut something
    large = TRITON_TILES["large"][1]  # stages go first: 3 stages of the bf16 tile fit in 99 KiB with its K step
    assert fit_shared_memory(large, 2, 101376) == {**large, "num_stages": 3}


@pytest.mark.parametrize("shape", [(64,), (2, 3, 64)], ids=["1d", "3d"])
def test_the_epilogue_path_keeps_the_leading_dims(shape: tuple[int, ...]) -> None:
    f32 = torch.float32
    x, weight, bias = randn(*shape, dtype=f32), randn(48, 64, dtype=f32, scale=0.125), randn(48, dtype=f32)
    result = linear_act(x, weight, bias, "relu", backend="cublaslt")
    assert result.shape == (*shape[:-1], 48)
    assert_close(result, _expected(x, weight, bias, "relu"), torch.float32)


@pytest.mark.parametrize("backend", ["cublaslt", "triton"])
def test_results_carry_no_autograd_history(backend: str) -> None:
    """Inference kernels: a weight that requires grad (an nn.Linear's) gives a plain result on every path, and an
    `out=` buffer is written, not refused."""
    x, weight, bias = _inputs(3, 64, 48, torch.float32, has_bias=True)
    weight.requires_grad_()
    result = linear_act(x, weight, bias, "relu", backend=backend)
    assert not result.requires_grad and result.grad_fn is None
    out = poisoned((3, 48), torch.float32)
    assert linear_act(x, weight, bias, "relu", backend=backend, out=out) is out
    assert_close(out, _expected(x, weight.detach(), bias, "relu"), torch.float32)
