"""fusionscope::w4a16_gemm against the dequantise-then-matmul reference computed in float64, and the layout it reads.

The reference dequantises exactly ((q − zero) · scale is exact in float64) and the kernel rounds each dequantised
weight once to the activations' dtype before its dot, as the unfused chain does: the error against float64 is that
rounding plus the output's, so fp16/bf16 tolerances are the table's times sqrt(K / 64) (≥ 1), the random-walk growth
of K rounded products (the same rule as tests/kernels/test_linear_act.py). Against the unfused chain in the same dtype
the kernel differs only in the order of its fp32 accumulation: within one rounding of the output.

Under the interpreter the kernel widens its tiles (`INTERPRETER`); these tests switch that off so that the GPU's
tiles — and their edges — are the ones exercised, except `test_interpreter_tiles_match_reference`.

The packed layouts of GPTQ and AWQ are built here from a known weight with the packing loops those projects write
(AutoGPTQ's `QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear`), not with fusionscope's own packer.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from fusionscope.kernels.dispatch import Tunables
from fusionscope.kernels.tolerances import assert_close
from fusionscope.kernels.w4a16_gemm import (
    INTERPRETER,
    SHIPPED_BEFORE,
    TILES,
    PackedW4,
    dequantize_w4,
    from_awq,
    from_gptq,
    pack_w4,
    quantize_w4,
    schedule,
    unpack_w4,
    w4a16_gemm,
    w4a16_reference,
)

from tests.kernels.conftest import DTYPES, device, poisoned, randn

GROUPS = [16, 32, 64, 128, -1]
# (M, K, N): K and N never multiples of the 128-input block or of a column tile; M in the decode (≤ 16), small (≤ 256)
# and large tile classes
SHAPES = [(1, 99, 70), (5, 300, 130), (17, 200, 33), (300, 150, 65)]


@pytest.fixture(autouse=True)
def _gpu_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(INTERPRETER, "enabled", False)


def _module():  # the module: the package's attribute of that name is the function
    return importlib.import_module("fusionscope.kernels.w4a16_gemm")


def _only(monkeypatch: pytest.MonkeyPatch, config: dict) -> None:
    """Every M runs `config` (TILES replaced by one unbounded entry for the test)."""
    monkeypatch.setattr(_module(), "TILES", Tunables(only=(None, dict(config))))


def _gemv(bn: int = 256, bk: int = 128, prefetch: bool = True, bm: int = 4, split: int = 0) -> dict:
    return {"KERNEL": "gemv", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 1, "PREFETCH": prefetch}  # fmt: skip


def _mma(bm: int = 16, bn: int = 64, bk: int = 256, unpack: str = "tile", split: int = 0) -> dict:
    return {"KERNEL": "mma", "UNPACK": unpack, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
            "GROUP_M": 2, "num_warps": 4, "num_stages": 3}  # fmt: skip


# one of each kernel path: the CUDA-core GEMV, the tensor-core kernel with whole-tile and per-plane unpacking
PATHS = {"gemv": _gemv(), "gemv-steps": _gemv(bn=64, bk=256, prefetch=False, bm=2), "mma-tile": _mma(),
         "mma-planes": _mma(unpack="planes", bk=128)}  # fmt: skip


def _scale(dtype: torch.dtype, K: int) -> float:
    return 1.0 if dtype == torch.float32 else max(1.0, math.sqrt(K / 64))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _packed(K: int, N: int, group_size: int, dtype: torch.dtype, seed: int = 0) -> PackedW4:
    """A random weight at nn.Linear's scale, quantised; on the test device."""
    weight = torch.randn(N, K, generator=_gen(seed)) / K**0.5
    packed = quantize_w4(weight.to(device(), dtype), group_size)
    return packed


def _expected(x: torch.Tensor, p: PackedW4, bias: torch.Tensor | None = None) -> torch.Tensor:
    return w4a16_reference(x.double(), p.qweight, p.scales.double(), p.zeros, p.group_size,
                           None if bias is None else bias.double())  # fmt: skip


def _by_hand(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """w[k, n] = (q[k, n] − zeros[k // g, n]) · scales[k // g, n] in float64, indexed element by element's group."""
    K = q.shape[0]
    g = torch.arange(K) // group_size
    return (q.double() - zeros.double()[g]) * scales.double()[g]


@pytest.mark.parametrize("group_size", GROUPS, ids=lambda g: f"g{g}")
@pytest.mark.parametrize(("M", "K", "N"), SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_float64_reference(M: int, K: int, N: int, group_size: int, dtype: torch.dtype) -> None:
    p = _packed(K, N, group_size, dtype)
    x = randn(M, K, dtype=dtype)
    out = poisoned((M, N), dtype)
    result = w4a16_gemm(x, *p, out=out)
    assert result is out
    assert_close(result, _expected(x, p), dtype, scale=_scale(dtype, K))


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Every group size at M = 1 and at M = 3, the dtype rotating so that each group size meets two dtypes and each dtype
# every M (the dtype changes the loads and the final rounding, not the group logic); M = 5 once. The interpreter costs
# per program and operation: the full product with M = 16 (42 cases) took 30 s, one M = 16 case 11 s at 1 row per
# program.
DECODE_CASES = [(DTYPES[(i + j) % 3], M, g) for j, M in enumerate((1, 3)) for i, g in enumerate((*GROUPS, 256))] + [
    (torch.bfloat16, 5, 32)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "M", "group_size"), DECODE_CASES,
                         ids=[f"{_dtype_id(d)}-M{M}-g{g}" for d, M, g in DECODE_CASES])  # fmt: skip
def test_decode_gemv_matches_float64(
    M: int, group_size: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped CUDA-core GEMV at M = 1, 3 and 5 (several row programs from 3 rows on at 1 or 2 rows a program; at
    4 rows a program, a padded row at 3 and a second program with one live row at 5); K and N are not multiples of the
    block or the tile (N spans several column tiles), the groups include one above 128."""
    _only(monkeypatch, TILES["gemv"][1])
    K, N = 300, 300
    p = _packed(K, N, group_size, dtype, seed=M)
    x = randn(M, K, dtype=dtype)
    assert schedule(M, N, K, device()).tiles["KERNEL"] == "gemv"
    out = poisoned((M, N), dtype)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), dtype, scale=_scale(dtype, K))


GEMV_CASES = [
    (3, _gemv(64, 256, prefetch=False, bm=1)),  # 1 row per program: 3 row programs; 2 blocks per step; 2 column tiles
    (5, _gemv(128, 128, bm=2, split=2)),  # 2 rows per program: the third program has one live row; a forced split
    (3, _gemv(32, 384, prefetch=False)),  # 4 rows per program, one of them padding; 3 blocks per step; 4 column tiles
    (5, _gemv(512, 128)),  # a second 4-row program with one live row; prefetch; a column tile wider than N
    (1, _gemv(512, 128)),  # M = 1: the schedule narrows the program to one row
]


@pytest.mark.parametrize(("M", "config"), GEMV_CASES, ids=[f"M{M}-{config}" for M, config in GEMV_CASES])
def test_gemv_configurations(M: int, config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows per program 1, 2, 4 (M = 5: a last row program with one live row), 1-3 blocks per step with and without
    prefetch, a forced split, and a column tile wider than N; each configuration at the M that reaches its edges
    (all 12 of M × configuration took 17 s in the interpreter)."""
    _only(monkeypatch, config)
    K, N = 700, 100
    p = _packed(K, N, 64, torch.bfloat16, seed=M)
    x = randn(M, K, dtype=torch.bfloat16)
    out = poisoned((M, N), torch.bfloat16)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), torch.bfloat16, scale=_scale(torch.bfloat16, K))


# Every group size with every BLOCK_K (1, 2 and 4 blocks per step), the dtype rotating so that each group size meets
# all three dtypes (one per BLOCK_K) and each BLOCK_K all three: 18 cases of the 54 in the full product.
PREFILL_CASES = [(DTYPES[(i + j) % 3], M, bk, g) for i, (M, bk) in enumerate([(40, 128), (70, 256), (17, 512)])
                 for j, g in enumerate((*GROUPS, 256))]  # fmt: skip


@pytest.mark.parametrize(("dtype", "M", "bk", "group_size"), PREFILL_CASES,
                         ids=[f"{_dtype_id(d)}-M{M}-bk{bk}-g{g}" for d, M, bk, g in PREFILL_CASES])  # fmt: skip
def test_prefill_tile_matches_float64(
    M: int, bk: int, group_size: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensor-core kernel unpacking a whole (BLOCK_K, BLOCK_N) tile per step (one dot with K = BLOCK_K): K = 390
    ends inside a block and inside a step, N = 70 inside a column tile, M inside a row tile."""
    _only(monkeypatch, dict(_mma(bm=32, bn=32, bk=bk, split=1)))
    K, N = 390, 70
    p = _packed(K, N, group_size, dtype, seed=M)
    x = randn(M, K, dtype=dtype)
    out = poisoned((M, N), dtype)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), dtype, scale=_scale(dtype, K))


def test_shipped_tiles_are_gemv_then_tensor_cores() -> None:
    """One row runs the CUDA-core kernel (no 16-row MMA tile for one row: the H200 sweep's best), more rows the
    tensor-core kernel with whole-tile unpacking (the GEMV's one FFMA per row lost from M = 4), K ≥ 128 per dot; the
    schedule measured before stays available."""
    assert [schedule(M, 4096, 4096, torch.device("cpu")).tiles["KERNEL"] for M in (1, 2, 4, 16, 4096)] == [
        "gemv", "mma", "mma", "mma", "mma"]  # fmt: skip
    assert all(config["UNPACK"] == "tile" for bound, config in TILES.values() if config["KERNEL"] == "mma")
    assert all(config["BLOCK_K"] >= 128 for _, config in TILES.values())
    assert {config.get("UNPACK") for _, config in SHIPPED_BEFORE.values()} >= {"planes"}


@pytest.mark.parametrize("unpack", ["tile", "planes"])
@pytest.mark.parametrize(("M", "K", "N"), [(3, 300, 70), (40, 260, 33)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_equals_the_unfused_chain_within_one_rounding(
    M: int, K: int, N: int, dtype: torch.dtype, unpack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor-core kernel: the same bf16/fp16 weights reach the dot in both: only the fp32 accumulation order differs,
    so each output is the unfused one or its neighbour (one unit in the last place), or — where the output nearly
    cancels (|y| ~ 1e-4 from terms ~ 1) — apart by at most what two fp32 orders of K terms can differ,
    K · 2⁻²³ · Σ|x·w| (fresh inputs met that in about 1 fp16 case in 30)."""
    _only(monkeypatch, _mma(unpack=unpack, bk=128 if unpack == "planes" else 256))
    p = _packed(K, N, 32, dtype, seed=3)
    bias = randn(N, dtype=dtype)
    x = randn(M, K, dtype=dtype)
    fused = w4a16_gemm(x, *p, bias=bias).double()
    unfused = w4a16_reference(x, *p, bias=bias).double()
    ulp = 2.0 ** (torch.floor(torch.log2(unfused.abs().clamp_min(1e-30))) - (7 if dtype == torch.bfloat16 else 10))
    weight = dequantize_w4(p.qweight, p.scales, p.zeros, p.group_size, K).double()
    reorder = K * 2.0**-23 * (x.double().abs() @ weight.abs())
    assert ((fused - unfused).abs() <= ulp + reorder).all(), (fused - unfused).abs().max()
    assert (fused != unfused).float().mean() < 0.2  # mostly identical: the dot saw the very same weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_gemv_is_closer_to_float64_than_the_unfused_chain(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV never rounds a weight: it sums x·(q − zero) in fp32 and scales each group's sum once, so against the
    float64 answer it is at least as close as the unfused chain, which rounds every dequantised weight to the dtype."""
    _only(monkeypatch, _gemv())
    M, K, N = 3, 1000, 300
    p = _packed(K, N, 32, dtype, seed=3)
    x = randn(M, K, dtype=dtype, seed=4)
    exact = _expected(x, p)
    fused_err = (w4a16_gemm(x, *p).double() - exact).abs().mean()
    unfused_err = (w4a16_reference(x, *p).double() - exact).abs().mean()
    assert fused_err <= unfused_err


@pytest.mark.parametrize("path", PATHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_zero_points_at_the_extremes(dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeros 0 and 15 (and 8) in alternating groups, every q from 0 to 15: (q − z) spans −15..15."""
    _only(monkeypatch, PATHS[path])
    K, N, g = 160, 37, 32
    q = torch.randint(0, 16, (K, N), generator=_gen(5))
    q[:16] = torch.arange(16)[:, None]  # every value present
    zeros = torch.tensor([0, 15, 8, 15, 0])[:, None].expand(5, N).to(torch.uint8)
    scales = (torch.rand(5, N, generator=_gen(6)) * 0.05 + 0.01).to(dtype)
    p = PackedW4(pack_w4(q).to(device()), scales.to(device()), zeros.to(device()).contiguous(), g)
    by_hand = _by_hand(q, zeros, scales, g)
    assert torch.equal(dequantize_w4(p.qweight, p.scales.double(), p.zeros, g, K).cpu(), by_hand)
    x = randn(4, K, dtype=dtype)
    out = poisoned((4, N), dtype)
    assert_close(w4a16_gemm(x, *p, out=out), x.double().cpu() @ by_hand, dtype, scale=_scale(dtype, K))


@pytest.mark.parametrize("K", [1, 7, 128, 200, 300])
def test_layout_is_the_documented_one(K: int) -> None:
    """Input k = 128·b + 16·j + r of output n is nibble j of qweight[16·b + r, n]; unpacking inverts packing."""
    N = 5
    q = torch.randint(0, 16, (K, N), generator=_gen(K))
    qweight = pack_w4(q)
    assert qweight.dtype == torch.int32 and qweight.shape == (16 * math.ceil(K / 128), N)
    for k in {0, K - 1, K // 2, min(K - 1, 17), min(K - 1, 130)}:
        b, j, r = k // 128, (k % 128) // 16, k % 16
        for n in range(N):
            assert (int(qweight[16 * b + r, n]) >> (4 * j)) & 0xF == int(q[k, n])
    assert torch.equal(unpack_w4(qweight, K), q.to(torch.int32))
    padded = unpack_w4(qweight, 8 * qweight.shape[0])  # every nibble past K is 0
    assert not padded[K:].any()


STRIDED_CASES = [(path, (torch.bfloat16, torch.float16)[i % 2]) for i, path in enumerate(PATHS)]


@pytest.mark.parametrize(("path", "dtype"), STRIDED_CASES, ids=[f"{p}-{_dtype_id(d)}" for p, d in STRIDED_CASES])
def test_non_contiguous_inputs(dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """x with element stride 2 and leading dims that do not flatten (copied), the packed tensors as column-strided
    views of wider buffers, out every other column of a wider buffer; each kernel path in bf16 or fp16."""
    _only(monkeypatch, PATHS[path])
    K, N, g = 200, 45, 64
    p = _packed(K, N, g, dtype, seed=8)
    wide = [torch.zeros(t.shape[0], 2 * N, dtype=t.dtype, device=t.device) for t in p[:3]]
    for buffer, t in zip(wide, p[:3]):
        buffer[:, ::2] = t
    strided = PackedW4(*(b[:, ::2] for b in wide), g)
    assert not any(t.is_contiguous() for t in strided[:3])
    x = randn(5, 3, K, dtype=dtype, strided=True).transpose(0, 1)  # (3, 5, K), leading dims not a row view
    out_wide = poisoned((3, 5, 2 * N), dtype)
    out = out_wide[..., ::2]
    result = w4a16_gemm(x, *strided, out=out)
    assert result is out and torch.isnan(out_wide[..., 1::2]).all()
    assert_close(result, _expected(x, p), dtype, scale=_scale(dtype, K))
    one = w4a16_gemm(x[0, 0], *p)  # 1-D x: (K,) → (N,)
    assert one.shape == (N,)
    assert_close(one, _expected(x[0, 0], p), dtype, scale=_scale(dtype, K))


SPLIT_CASES = [
    ("gemv", torch.bfloat16),
    ("gemv", torch.float32),
    ("gemv-steps", torch.float16),
    ("mma-tile", torch.float32),
    ("mma-tile", torch.bfloat16),
    ("mma-planes", torch.float16),
]


@pytest.mark.parametrize(("path", "dtype"), SPLIT_CASES, ids=[f"{p}-{_dtype_id(d)}" for p, d in SPLIT_CASES])
def test_split_k_with_bias(dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode split along K in 3 (9 blocks of 128 in steps of 2: the last step of the last split holds one block),
    partial sums summed by the second kernel with the bias; and the same call unsplit. Each kernel path, each dtype
    (the split sum's rounding to it), not every pair: 6 of the 12."""
    M, K, N = 2, 1100, 70
    decode = dict(PATHS[path], BLOCK_K=256, SPLIT_K=3)
    _only(monkeypatch, decode)
    plan = schedule(M, N, K, device())
    assert (plan.splits, plan.blocks_per_split) == (3, 4)
    p = _packed(K, N, 128, dtype, seed=9)
    x, bias = randn(M, K, dtype=dtype), randn(N, dtype=dtype)
    expected = _expected(x, p, bias)
    out = poisoned((M, N), dtype)
    assert_close(w4a16_gemm(x, *p, bias=bias, out=out), expected, dtype, scale=_scale(dtype, K))
    _only(monkeypatch, dict(decode, SPLIT_K=1))
    assert schedule(M, N, K, device()).splits == 1
    assert_close(w4a16_gemm(x, *p, bias=bias), expected, dtype, scale=_scale(dtype, K))


@pytest.mark.parametrize(("K", "N"), [(4096, 4096), (4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_decode_fills_an_h200(M: int, K: int, N: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 132 SMs the decode schedule launches at least two programs per SM on Llama-3-8B's projections."""
    mod = importlib.import_module("fusionscope.kernels.w4a16_gemm")  # the module: the package's name is the function
    monkeypatch.setattr(mod, "sm_count", lambda _device: 132)
    plan = schedule(M, N, K, torch.device("cuda", 0))
    tiles = plan.tiles
    programs = math.ceil(M / tiles["BLOCK_M"]) * math.ceil(N / tiles["BLOCK_N"]) * plan.splits
    assert programs >= 2 * 132
    blocks = math.ceil(K / 128)
    assert plan.blocks_per_split * (plan.splits - 1) < blocks <= plan.blocks_per_split * plan.splits


@pytest.mark.parametrize(("M", "K", "N"), [(3, 300, 2100), (70, 99, 130)])
def test_interpreter_tiles_match_reference(M: int, K: int, N: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(INTERPRETER, "enabled", True)
    if device().type != "cuda":
        tiles = schedule(M, N, K, device()).tiles
        assert tiles["BLOCK_N"] >= min(N, 2048) and tiles["BLOCK_M"] >= min(M, 64)
    p = _packed(K, N, 64, torch.bfloat16, seed=10)
    x = randn(M, K, dtype=torch.bfloat16)
    out = poisoned((M, N), torch.bfloat16)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), torch.bfloat16, scale=_scale(torch.bfloat16, K))


def test_registered_op_matches_the_public_function() -> None:
    p = _packed(99, 40, 32, torch.float32, seed=11)
    x = randn(3, 99, dtype=torch.float32)
    out = poisoned((3, 40), torch.float32)
    torch.ops.fusionscope.w4a16_gemm(x, *p[:3], p.group_size, None, out, None)
    assert_close(out, _expected(x, p), torch.float32)
    assert torch.equal(out, w4a16_gemm(x, *p))


def test_empty_rows_give_an_empty_output() -> None:
    p = _packed(64, 24, 32, torch.float32)
    assert w4a16_gemm(torch.empty(0, 64, device=device()), *p).shape == (0, 24)


# ----------------------------------------------------------------------------------------------------- quantize_w4


@pytest.mark.parametrize("group_size", [32, 128, -1], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_quantize_rounds_to_the_nearest_level(group_size: int, dtype: torch.dtype) -> None:
    """Every weight is within half a step (its group's scale) of its dequantised value, zeros lie in 0..15, and the
    scales are stored in the weight's dtype. Slack: the stored scale is the exact one rounded (relative error ≤ eps/2),
    and the top level sits 15 such steps above the zero, so the group's largest weight may miss it by 7.5·eps·scale
    more."""
    N, K = 24, 200
    weight = (torch.randn(N, K, generator=_gen(12)) * 0.1).to(dtype)
    p = quantize_w4(weight, group_size)
    per = K if group_size == -1 else group_size
    assert p.scales.dtype == dtype and p.zeros.dtype == torch.uint8 and p.scales.shape[0] == math.ceil(K / per)
    w = dequantize_w4(p.qweight, p.scales.double(), p.zeros, p.group_size, K)
    step = p.scales.double().repeat_interleave(per, 0)[:K]
    assert ((w - weight.double().t()).abs() <= step * (0.5 + 8 * torch.finfo(dtype).eps)).all()


def test_quantize_symmetric_and_degenerate_groups() -> None:
    weight = torch.randn(8, 64, generator=_gen(13))
    weight[0] = 0.0  # all zeros
    weight[1] = 0.25  # constant
    sym = quantize_w4(weight, 32, symmetric=True)
    assert (sym.zeros == 8).all()
    asym = quantize_w4(weight, 32)
    w = dequantize_w4(asym.qweight, asym.scales.double(), asym.zeros, 32, 64).t()
    assert torch.equal(w[0], torch.zeros(64, dtype=torch.float64)) and (asym.scales[:, 0] == 1).all()
    torch.testing.assert_close(w[1], torch.full((64,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize(("call", "message"), [
    (lambda p, x: w4a16_gemm(x, p.qweight, p.scales.half(), p.zeros, 32), "scales must be"),
    (lambda p, x: w4a16_gemm(x, p.qweight[:-1], p.scales, p.zeros, 32), "qweight must be int32"),
    (lambda p, x: w4a16_gemm(x, p.qweight, p.scales, p.zeros.to(torch.int32), 32), "zeros must be"),
    (lambda p, x: w4a16_gemm(x, *p[:3], 48), "power of two"),
    (lambda p, x: w4a16_gemm(x, *p[:3], 64), "scales must be (2, 24)"),
    (lambda p, x: w4a16_gemm(x.int(), *p), "fp32/fp16/bf16"),
])  # fmt: skip
def test_bad_arguments_are_one_clear_error(call, message: str) -> None:
    p = _packed(100, 24, 32, torch.float32)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(p, randn(2, 100, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------------- conversions


def _known_weight(K: int, N: int, group_size: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """q (K, N) and zeros (G, N) as int64 arrays, zeros 0 and 15 included; fp16 scales (G, N)."""
    rng = np.random.default_rng(14)
    G = K // group_size
    q = rng.integers(0, 16, (K, N))
    zeros = rng.integers(0, 16, (G, N))
    zeros[0, :2] = (0, 15)
    scales = torch.from_numpy(rng.random((G, N)) * 0.02 + 0.001).to(torch.float16)
    return q, zeros, scales


def _gptq_pack(q: np.ndarray, zeros: np.ndarray, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's `QuantLinear.pack` loops (4 bits): input 8·i + j into nibble j of qweight row i; output 8·c + j's
    zero, minus one (its original format), into nibble j of qzeros column c."""
    K, N = q.shape
    qweight = np.zeros((K // 8, N), dtype=np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= q[j].astype(np.uint32) << (4 * (j - i))
        i += 8
        row += 1
    stored = (zeros - zero_offset) & 0xF  # the 4 bits a packer keeps of zero − 1 (0 is stored as 15)
    qzeros = np.zeros((zeros.shape[0], N // 8), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= stored[:, j].astype(np.uint32) << (4 * (j - i))
        i += 8
        col += 1
    return torch.from_numpy(qweight.view(np.int32).copy()), torch.from_numpy(qzeros.view(np.int32).copy())


def _awq_pack(values: np.ndarray) -> torch.Tensor:
    """AutoAWQ's `WQLinear_GEMM.from_linear` loop: along the outputs, output 8·c + order_map[i] into nibble i."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
    return torch.from_numpy(packed.view(np.int32).copy())


@pytest.mark.parametrize("zero_offset", [1, 0], ids=["gptq", "gptq_v2"])
def test_from_gptq_reads_a_gptq_checkpoint(zero_offset: int) -> None:
    K, N, g = 256, 40, 64
    q, zeros, scales = _known_weight(K, N, g)
    qweight, qzeros = _gptq_pack(q, zeros, zero_offset)
    g_idx = torch.arange(K, dtype=torch.int32) // g
    p = from_gptq(qweight, qzeros, scales, g_idx, zero_offset=zero_offset)
    assert p.group_size == g and torch.equal(p.zeros, torch.from_numpy(zeros).to(torch.uint8))
    by_hand = _by_hand(torch.from_numpy(q), torch.from_numpy(zeros), scales, g)
    assert torch.equal(dequantize_w4(p.qweight, p.scales.double(), p.zeros, g, K), by_hand)
    x = randn(3, K, dtype=torch.float16)
    on = PackedW4(*(t.to(device()) for t in p[:3]), g)
    assert_close(w4a16_gemm(x, *on), x.double().cpu() @ by_hand, torch.float16, scale=_scale(torch.float16, K))


def test_from_gptq_refuses_act_order() -> None:
    K, N, g = 128, 16, 32
    q, zeros, scales = _known_weight(K, N, g)
    qweight, qzeros = _gptq_pack(q, zeros, 1)
    act_order = (torch.randperm(K, generator=_gen(15)) // g).to(torch.int32)
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(qweight, qzeros, scales, act_order)


def test_from_awq_reads_an_awq_checkpoint() -> None:
    K, N, g = 256, 48, 128
    q, zeros, scales = _known_weight(K, N, g)
    p = from_awq(_awq_pack(q), _awq_pack(zeros), scales)
    assert p.group_size == g and torch.equal(unpack_w4(p.qweight, K), torch.from_numpy(q).to(torch.int32))
    by_hand = _by_hand(torch.from_numpy(q), torch.from_numpy(zeros), scales, g)
    assert torch.equal(dequantize_w4(p.qweight, p.scales.double(), p.zeros, g, K), by_hand)
    x = randn(2, K, dtype=torch.float16)
    on = PackedW4(*(t.to(device()) for t in p[:3]), g)
    assert_close(w4a16_gemm(x, *on), x.double().cpu() @ by_hand, torch.float16, scale=_scale(torch.float16, K))
