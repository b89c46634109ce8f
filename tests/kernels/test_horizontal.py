"""fuse_linears: one GEMM for Linears that share an input (QKV, gate_up), outputs split as views, weights stored once.
Shapes are Llama's shrunk 64×: q/k/v 4096 → 4096 + 1024 + 1024 becomes 64 → 64 + 16 + 16."""

from __future__ import annotations

import pytest
import torch
from fusionscope.kernels.horizontal import FusedLinear, fuse_linears, horizontal_reference, split_sizes
from fusionscope.kernels.tolerances import assert_close
from torch import nn

from tests.kernels.conftest import DTYPES, device, randn

CASES = {
    "qkv": (64, [64, 16, 16], False),  # Llama: q_proj, k_proj, v_proj without bias
    "qkv_bias": (64, [64, 16, 16], True),  # Qwen2: bias on q/k/v
    "gate_up": (64, [176, 176], False),  # gate_proj, up_proj
    "odd": (37, [5, 123, 1], True),
}


def _linears(in_features: int, outs: list[int], bias: bool, dtype: torch.dtype) -> list[nn.Linear]:
    return [nn.Linear(in_features, n, bias=bias, device=device(), dtype=dtype) for n in outs]


def _storage_bytes(modules: list[nn.Module]) -> int:
    storages = {}
    for module in modules:
        for p in module.parameters():
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_outputs_equal_separate_linears(case: str, dtype: torch.dtype) -> None:
    in_features, outs, bias = CASES[case]
    linears = _linears(in_features, outs, bias, dtype)
    x = randn(3, 5, in_features, dtype=dtype)
    expected = [y.detach().clone() for y in horizontal_reference(x, linears)]
    fused = fuse_linears(linears)
    assert isinstance(fused, FusedLinear) and isinstance(fused, nn.Linear)
    assert fused.split_sizes == outs == split_sizes(linears)
    assert (fused.in_features, fused.out_features) == (in_features, sum(outs))
    with torch.no_grad():
        got = fused(x)
        after = horizontal_reference(x, linears)  # the originals still work, now through views of the fused weight
    assert isinstance(got, tuple) and len(got) == len(outs)
    storage = got[0].untyped_storage().data_ptr()
    for y, y_after, e, n in zip(got, after, expected, outs, strict=True):
        assert y.shape == (3, 5, n)
        assert y.untyped_storage().data_ptr() == storage  # views of one GEMM output
        if dtype == torch.float32 and case != "odd":
            assert torch.equal(y, e)  # each output element summed over K in the same order: bit-identical
        else:
            # fp16/bf16, and outputs of 1 or 5 columns: the separate GEMM takes another path (N = 1 is a GEMV) that
            # orders the K sum differently (measured up to 3.6e-7 in fp32 on the CPU).
            assert_close(y, e, dtype)
        assert torch.equal(y_after, e)


@pytest.mark.parametrize("case", ["qkv", "qkv_bias"])
def test_memory_is_not_doubled(case: str) -> None:
    in_features, outs, bias = CASES[case]
    linears = _linears(in_features, outs, bias, torch.float32)
    before = _storage_bytes(linears)
    fused = fuse_linears(linears)
    assert _storage_bytes([*linears, fused]) == before
    assert _storage_bytes([fused]) == before
    fused_storage = fused.weight.untyped_storage().data_ptr()
    for linear in linears:
        assert linear.weight.untyped_storage().data_ptr() == fused_storage
        if bias:
            assert linear.bias.untyped_storage().data_ptr() == fused.bias.untyped_storage().data_ptr()


def test_parameters_keep_identity_and_requires_grad() -> None:
    linears = _linears(64, [64, 16], True, torch.float32)
    weight = linears[0].weight
    fused = fuse_linears(linears)
    assert linears[0].weight is weight  # the same Parameter object, re-pointed at its rows of the fused weight
    assert fused.weight.requires_grad and fused.bias.requires_grad
    assert torch.equal(fused.weight[:64], weight)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="in_features"):
        fuse_linears([nn.Linear(64, 8), nn.Linear(32, 8)])
    with pytest.raises(ValueError, match="dtypes"):
        fuse_linears([nn.Linear(64, 8), nn.Linear(64, 8, dtype=torch.float16)])
    with pytest.raises(ValueError, match="devices"):
        fuse_linears([nn.Linear(64, 8), nn.Linear(64, 8, device="meta")])
    with pytest.raises(ValueError, match="bias"):
        fuse_linears([nn.Linear(64, 8), nn.Linear(64, 8, bias=False)])
    with pytest.raises(ValueError, match="at least two"):
        fuse_linears([nn.Linear(64, 8)])
    with pytest.raises(ValueError, match=r"nn\.Linear"):
        fuse_linears([nn.Linear(64, 8), nn.Conv1d(64, 8, 1)])
    linear = nn.Linear(64, 8)
    with pytest.raises(ValueError, match="twice"):
        fuse_linears([linear, linear])
