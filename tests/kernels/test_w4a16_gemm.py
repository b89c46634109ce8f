"""fusionscope::w4a16_gemm against the dequantise-then-matmul reference computed in float64, and the layout it reads.

The kernel never rounds a weight: the tensor cores multiply x by 128 + q (bf16; 1024 + q in fp16), exact, and each
group's fp32 sums get the zero point and the scale once, so the error against float64 is the fp32 accumulation's
(with the ~7-bit cancellation of the 128 offset) plus the output's rounding: fp16/bf16 tolerances are the table's
times sqrt(K / 64) (≥ 1), the same rule as tests/kernels/test_linear_act.py. It is not bit-comparable to the unfused
chain, which rounds every dequantised weight first; it is at least as close to float64 (tested).

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
    CHUNK_ORDER,
    INTERPRETER,
    TILES,
    PackedW4,
    counters,
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

GROUPS = [32, 64, 128, -1]
# (M, K, N): K and N never multiples of the 128-input chunk or of a column tile; M in the decode (≤ 8, ≤ 16), small
# (≤ 64) and large tile classes
SHAPES = [(1, 99, 70), (5, 300, 130), (17, 200, 33), (70, 150, 65)]


@pytest.fixture(autouse=True)
def _gpu_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(INTERPRETER, "enabled", False)


def _module():  # the module: the package's attribute of that name is the function
    return importlib.import_module("fusionscope.kernels.w4a16_gemm")


def _only(monkeypatch: pytest.MonkeyPatch, config: dict) -> None:
    """Every M runs `config` (TILES replaced by one unbounded entry for the test)."""
    monkeypatch.setattr(_module(), "TILES", Tunables(only=(None, dict(config))))


def _tiles(bm: int = 8, bn: int = 64, bk: int = 256, kc: int = 128, split: int = 0, warps: int = 4) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "KC": kc, "SPLIT_K": split, "num_warps": warps,
            "num_stages": 3}  # fmt: skip


# sub-steps of 32, 64, 128 and 256 inputs (one dot each), 1-8 of them per loop step, 8 and 16 rows per program
CONFIGS = {"decode": _tiles(), "kc32": _tiles(bm=16, bn=32, bk=128, kc=32), "kc64": _tiles(bn=128, bk=128, kc=64),
           "kc256": _tiles(bm=16, bn=64, bk=512, kc=256),
           # the CUDA-core decode kernel: 1 and 4 rows per program, one or two 128-input chunks per loop step
           "gemv1": {**_tiles(bm=1, bn=64, bk=256), "GEMV": 1},
           "gemv4": {**_tiles(bm=4, bn=32, bk=128), "GEMV": 1}}  # fmt: skip


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
    """The shipped TILES (every class of M) on fresh inputs, the output poisoned first."""
    p = _packed(K, N, group_size, dtype)
    x = randn(M, K, dtype=dtype)
    out = poisoned((M, N), dtype)
    result = w4a16_gemm(x, *p, out=out)
    assert result is out
    assert_close(result, _expected(x, p), dtype, scale=_scale(dtype, K))


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Each configuration with each group size (the sub-step is min(KC, group)), the dtype rotating; M = 1, 3 and 9.
CONFIG_CASES = [(name, DTYPES[(i + j) % 3], (1, 3, 9)[(i + j) % 3], g) for i, name in enumerate(CONFIGS)
                for j, g in enumerate((32, 64, 128, 256, -1))]  # fmt: skip


@pytest.mark.parametrize(("name", "dtype", "M", "group_size"), CONFIG_CASES,
                         ids=[f"{n}-{_dtype_id(d)}-M{M}-g{g}" for n, d, M, g in CONFIG_CASES])  # fmt: skip
def test_configurations_match_float64(
    name: str, dtype: torch.dtype, M: int, group_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 700 ends inside a chunk and inside a loop step, N = 100 inside a column tile, M inside a row tile; the
    split chosen by FILL (several on the CPU's one 'SM')."""
    _only(monkeypatch, CONFIGS[name])
    K, N = 700, 100
    p = _packed(K, N, group_size, dtype, seed=M)
    x = randn(M, K, dtype=dtype)
    out = poisoned((M, N), dtype)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), dtype, scale=_scale(dtype, K))


@pytest.mark.parametrize(("M", "K", "N", "config"), [(3, 1024, 128, "decode"), (16, 512, 256, "kc64")])
def test_even_shapes_take_the_unmasked_path(M: int, K: int, N: int, config: str, monkeypatch) -> None:
    """K a multiple of the loop step, N of the column tile, splits all full: the kernel compiled without masks on the
    weights or along K (EVEN) gives the same answer."""
    _only(monkeypatch, CONFIGS[config])
    assert schedule(M, N, K, device(), 128).even
    p = _packed(K, N, 128, torch.bfloat16, seed=M)
    x = randn(M, K, dtype=torch.bfloat16)
    out = poisoned((M, N), torch.bfloat16)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), torch.bfloat16, scale=_scale(torch.bfloat16, K))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_closer_to_float64_than_the_unfused_chain(dtype: torch.dtype) -> None:
    """No weight is rounded (128 + q is exact, the scale multiplies fp32 group sums): against the float64 answer the
    kernel is at least as close as the unfused chain, which rounds every dequantised weight to the dtype."""
    M, K, N = 3, 1000, 300
    p = _packed(K, N, 32, dtype, seed=3)
    x = randn(M, K, dtype=dtype, seed=4)
    exact = _expected(x, p)
    fused_err = (w4a16_gemm(x, *p).double() - exact).abs().mean()
    unfused_err = (w4a16_reference(x, *p).double() - exact).abs().mean()
    assert fused_err <= unfused_err


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_zero_points_at_the_extremes(dtype: torch.dtype, config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeros 0 and 15 (and 8) in alternating groups, every q from 0 to 15: (q − z) spans −15..15."""
    _only(monkeypatch, CONFIGS[config])
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
    """Input k = 128·b + CHUNK_ORDER[j][p] of output n is nibble p of qweight[n, 16·b + j], with CHUNK_ORDER[j][p] =
    32·u + 16·i1 + 8·i0 + 2·c + e for j = 4·c + u, p = 4·e + 2·i1 + i0; unpacking inverts packing exactly, the
    padding past K is zeros, and each of a lane's 4 words (one c) holds 32 inputs: 8 pairs (k, k + 1) as nibbles
    (p, p + 4)."""
    N = 5
    q = torch.randint(0, 16, (K, N), generator=_gen(K))
    qweight = pack_w4(q)
    assert qweight.dtype == torch.int32 and qweight.shape == (N, 16 * math.ceil(K / 128))
    order = torch.tensor(CHUNK_ORDER)
    assert sorted(order.flatten().tolist()) == list(range(128))
    assert ((order[:, 4:] - order[:, :4]) == 1).all()  # nibble p + 4 holds the input after nibble p's
    for c in range(4):  # a lane's words: every input 2c + {0, 1} + 8·t of the chunk
        assert sorted(order[4 * c : 4 * c + 4].flatten().tolist()) == sorted(
            2 * c + e + 8 * t for t in range(16) for e in range(2))  # fmt: skip
    for k in {0, K - 1, K // 2, min(K - 1, 17), min(K - 1, 130)}:
        b, r = divmod(k, 128)
        j, p = divmod(int((order.flatten() == r).nonzero()), 8)
        for n in range(N):
            assert (int(qweight[n, 16 * b + j]) >> (4 * p)) & 0xF == int(q[k, n])
    assert torch.equal(unpack_w4(qweight, K), q.to(torch.int32))
    assert torch.equal(pack_w4(unpack_w4(qweight, K)), qweight)
    padded = unpack_w4(qweight, 128 * math.ceil(K / 128))  # every nibble past K is 0
    assert not padded[K:].any()


@pytest.mark.parametrize("group_size", [32, 128, -1], ids=lambda g: f"g{g}")
def test_dequantize_round_trips_the_quantised_levels(group_size: int) -> None:
    """quantize_w4 → pack → unpack and dequantise: exactly the levels (q − zero) · scale it chose, and packing the
    unpacked levels again gives the same words."""
    N, K = 40, 300
    weight = torch.randn(N, K, generator=_gen(21)) * 0.05
    p = quantize_w4(weight, group_size)
    q = unpack_w4(p.qweight, K)
    assert q.min() >= 0 and q.max() <= 15 and torch.equal(pack_w4(q), p.qweight)
    per = K if group_size == -1 else group_size
    by_hand = _by_hand(q, p.zeros.to(torch.int64), p.scales, per)
    assert torch.equal(dequantize_w4(p.qweight, p.scales.double(), p.zeros, p.group_size, K), by_hand)


STRIDED_CASES = [(config, (torch.bfloat16, torch.float16)[i % 2]) for i, config in enumerate(CONFIGS)]


@pytest.mark.parametrize(("config", "dtype"), STRIDED_CASES, ids=[f"{p}-{_dtype_id(d)}" for p, d in STRIDED_CASES])
def test_non_contiguous_inputs(dtype: torch.dtype, config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """x with element stride 2 and leading dims that do not flatten (copied), the packed tensors as strided views of
    wider buffers, out every other column of a wider buffer; each configuration in bf16 or fp16."""
    _only(monkeypatch, CONFIGS[config])
    K, N, g = 200, 45, 64
    p = _packed(K, N, g, dtype, seed=8)
    wide = [torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype, device=t.device) for t in p[:3]]
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
    ("decode", torch.bfloat16),
    ("decode", torch.float32),
    ("kc64", torch.float16),
    ("kc256", torch.bfloat16),
    ("gemv1", torch.bfloat16),
    ("gemv4", torch.float32),
]


@pytest.mark.parametrize(("config", "dtype"), SPLIT_CASES, ids=[f"{p}-{_dtype_id(d)}" for p, d in SPLIT_CASES])
def test_split_k_with_bias(dtype: torch.dtype, config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced split of K in 3 (the last split shorter), the partial sums added by the last split of each tile in a
    fixed order, with the bias: the same answer as unsplit, the same bits on a second call (deterministic whichever
    split finishes last), and every tile counter back at 0 afterwards."""
    M, K, N = 2, 1100, 70
    split = dict(CONFIGS[config], SPLIT_K=3)
    _only(monkeypatch, split)
    plan = schedule(M, N, K, device(), 128)
    assert plan.splits == 3 and not plan.even
    p = _packed(K, N, 128, dtype, seed=9)
    x, bias = randn(M, K, dtype=dtype), randn(N, dtype=dtype)
    expected = _expected(x, p, bias)
    out = poisoned((M, N), dtype)
    assert_close(w4a16_gemm(x, *p, bias=bias, out=out), expected, dtype, scale=_scale(dtype, K))
    assert torch.equal(w4a16_gemm(x, *p, bias=bias), out)
    assert not counters(device()).any()
    _only(monkeypatch, dict(split, SPLIT_K=1))
    assert schedule(M, N, K, device(), 128).splits == 1
    assert_close(w4a16_gemm(x, *p, bias=bias), expected, dtype, scale=_scale(dtype, K))


@pytest.mark.parametrize(("K", "N"), [(4096, 4096), (4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_decode_fills_an_h200(M: int, K: int, N: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 132 SMs the decode schedule launches at least one program per SM on Llama-3-8B's projections, each split
    at least FILL's steps long and all of them full (the unmasked kernel)."""
    monkeypatch.setattr(_module(), "sm_count", lambda _device: 132)
    plan = schedule(M, N, K, torch.device("cuda", 0), 128)
    tiles = plan.tiles
    programs = math.ceil(M / tiles["BLOCK_M"]) * math.ceil(N / tiles["BLOCK_N"]) * plan.splits
    assert programs >= 132 and plan.even
    steps = K // tiles["BLOCK_K"]
    fill = _module().FILL_GEMV if tiles.get("GEMV") else _module().FILL
    assert plan.steps_per_split * plan.splits == steps and plan.steps_per_split >= fill["min_steps"]


def test_shipped_tiles_use_the_cuda_cores_up_to_4_rows_and_the_tensor_cores_above() -> None:
    plans = [schedule(M, 4096, 4096, torch.device("cpu")).tiles for M in (1, 2, 3, 4, 8, 9, 16)]
    assert [bool(t.get("GEMV")) for t in plans] == [True] * 4 + [False] * 3
    assert [t["BLOCK_M"] for t in plans] == [1, 2, 4, 4, 8, 16, 16]
    assert all(config["BLOCK_K"] % config["KC"] == 0 for _, config in TILES.values())


@pytest.mark.parametrize(("M", "K", "N"), [(3, 300, 1100), (70, 99, 130)])
def test_interpreter_tiles_match_reference(M: int, K: int, N: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(INTERPRETER, "enabled", True)
    if device().type != "cuda":
        tiles = schedule(M, N, K, device()).tiles
        assert tiles["BLOCK_N"] >= min(N, 1024) and tiles["BLOCK_M"] >= min(M, 64)
    p = _packed(K, N, 64, torch.bfloat16, seed=10)
    x = randn(M, K, dtype=torch.bfloat16)
    out = poisoned((M, N), torch.bfloat16)
    assert_close(w4a16_gemm(x, *p, out=out), _expected(x, p), torch.bfloat16, scale=_scale(torch.bfloat16, K))


def test_registered_op_matches_the_public_function() -> None:
    p = _packed(99, 40, 32, torch.float32, seed=11)
    x = randn(3, 99, dtype=torch.float32)
    out = poisoned((3, 40), torch.float32)
    torch.ops.fusionscope.w4a16_gemm(x, *p[:3], p.group_size, None, out, None, None)  # no workspace: unsplit
    assert_close(out, _expected(x, p), torch.float32)
    assert_close(w4a16_gemm(x, *p), _expected(x, p), torch.float32)


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
    (lambda p, x: w4a16_gemm(x, p.qweight[:, :-1], p.scales, p.zeros, 32), "qweight must be int32"),
    (lambda p, x: w4a16_gemm(x, p.qweight, p.scales, p.zeros.to(torch.int32), 32), "zeros must be"),
    (lambda p, x: w4a16_gemm(x, *p[:3], 48), "power of two"),
    (lambda p, x: w4a16_gemm(x, *p[:3], 16), "power of two >= 32"),
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
