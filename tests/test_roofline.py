"""Tests for fusionscope.roofline: hand-counted op costs, the roofline classifier, and coverage of a real trace."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pandas as pd
import pytest
import torch

from fusionscope.roofline import (
    CATEGORIES,
    OpCost,
    classify,
    classify_kernels,
    dtype_name,
    element_size,
    op_cost,
    op_dtype,
)

BF16, FP32, FP16, I64 = "c10::BFloat16", "float", "c10::Half", "long int"


def cost(name: str, dims: list, types: list, concrete: list | None = None, **kw: str) -> OpCost:
    c = op_cost(name, dims, types, concrete if concrete is not None else [""] * len(dims), **kw)
    assert c is not None, f"{name} unmodeled"
    assert c.category in CATEGORIES
    return c


# --- dtypes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trace", "canonical", "size"),
    [
        ("float", "float32", 4),
        ("double", "float64", 8),
        ("c10::BFloat16", "bfloat16", 2),
        ("c10::Half", "float16", 2),
        ("long int", "int64", 8),
        ("int", "int32", 4),
        ("short int", "int16", 2),
        ("bool", "bool", 1),
        ("unsigned char", "uint8", 1),
        ("signed char", "int8", 1),
        ("c10::Float8_e4m3fn", "float8_e4m3fn", 1),
        ("c10::Float8_e5m2", "float8_e5m2", 1),
        ("c10::complex<float>", "complex64", 8),
    ],
)
def test_dtype_name_and_size(trace: str, canonical: str, size: int) -> None:
    assert dtype_name(trace) == canonical
    assert dtype_name(canonical) == canonical  # idempotent
    assert element_size(canonical) == size
    assert element_size(trace) == size


@pytest.mark.parametrize("not_a_tensor", ["Scalar", "ScalarList", "TensorList", "", "GenericList", None])
def test_dtype_name_non_tensors(not_a_tensor: str) -> None:
    assert dtype_name(not_a_tensor) is None  # type: ignore[arg-type]


def test_element_size_unknown_raises() -> None:
    with pytest.raises(ValueError):
        element_size("float13")


def test_op_dtype() -> None:
    assert op_dtype([I64, "Scalar", BF16, FP32]) == "bfloat16"
    assert op_dtype(["TensorList", "Scalar"]) is None
    assert op_dtype([I64, "bool"]) is None
    assert op_dtype(None) is None  # type: ignore[arg-type]


# --- GEMM ------------------------------------------------------------------------------------------------------------


def test_mm_bf16() -> None:
    c = cost("aten::mm", [[5, 123], [123, 7]], [BF16, BF16])
    assert c == OpCost(2 * 5 * 123 * 7, (5 * 123 + 123 * 7 + 5 * 7) * 2, "gemm")


def test_addmm_reads_bias() -> None:
    c = cost(
        "aten::addmm", [[7], [5, 123], [123, 7], [], []], [FP32, FP32, FP32, "Scalar", "Scalar"], ["", "", "", "1", "1"]
    )
    assert c == OpCost(2 * 5 * 123 * 7, (7 + 5 * 123 + 123 * 7 + 5 * 7) * 4, "gemm")


def test_bmm_and_baddbmm() -> None:
    c = cost("aten::bmm", [[4, 5, 6], [4, 6, 7]], [FP16, FP16])
    assert c == OpCost(2 * 4 * 5 * 6 * 7, (4 * 5 * 6 + 4 * 6 * 7 + 4 * 5 * 7) * 2, "gemm")
    c = cost("aten::baddbmm", [[4, 5, 7], [4, 5, 6], [4, 6, 7], [], []], [FP32, FP32, FP32, "Scalar", "Scalar"])
    assert c == OpCost(2 * 4 * 5 * 6 * 7, (2 * 4 * 5 * 7 + 4 * 5 * 6 + 4 * 6 * 7) * 4, "gemm")


def test_composites_are_free() -> None:
    """Ops decomposed by the dispatcher (CompositeImplicitAutograd) own no kernel: their children carry the cost."""
    names = (
        "linear",
        "matmul",
        "scaled_dot_product_attention",
        "to",
        "contiguous",
        "softmax",
        "layer_norm",
        "rms_norm",
    )
    for name in names:
        assert op_cost(f"aten::{name}", [[32, 256], [256], []], [BF16, BF16, ""], ["", "", ""]) == OpCost(0, 0, "view")


# --- elementwise -----------------------------------------------------------------------------------------------------


def test_broadcasting_add() -> None:
    c = cost("aten::add", [[1, 32, 256], [256], []], [FP32, FP32, "Scalar"], ["", "", "1"])
    assert c == OpCost(32 * 256, (32 * 256 + 256 + 32 * 256) * 4, "elementwise")


def test_inplace_mul_writes_into_self() -> None:
    c = cost("aten::mul_", [[32, 256], []], [FP32, "Scalar"], ["", "0.5"])
    assert c == OpCost(32 * 256, 2 * 32 * 256 * 4, "elementwise")
    c = cost("aten::mul_", [[32, 256], [256]], [BF16, BF16])
    assert c.bytes == (32 * 256 + 256 + 32 * 256) * 2
    assert op_cost("aten::mul_", [[256], [32, 256]], [BF16, BF16], ["", ""]) is None  # self cannot hold the result


def test_elementwise_output_dtype() -> None:
    # a comparison writes bool
    assert cost("aten::gt", [[4, 64], []], [FP32, "Scalar"], ["", "0"]).bytes == 4 * 64 * 4 + 4 * 64
    # a half tensor times a wrapped Python float (0-dim double) stays half
    assert cost("aten::mul", [[1, 4, 32, 32], []], [FP16, "double"]).bytes == 4096 * 2 + 8 + 4096 * 2
    # where(cond, bf16, 0-dim) writes bf16; the bool condition is read
    c = cost("aten::where", [[1, 1, 32, 32], [1, 4, 32, 32], []], ["bool", BF16, "Scalar"], ["", "", "-65504."])
    assert c.bytes == 1024 + 4096 * 2 + 4096 * 2
    # transcendental ops cost more FLOPs than an add
    assert cost("aten::exp", [[10]], [FP32]).flops > cost("aten::add", [[10], [10]], [FP32, FP32]).flops


def test_copy_cast() -> None:
    c = cost("aten::copy_", [[1, 32, 64], [1, 32, 64], []], [FP32, BF16, "Scalar"], ["", "", "False"])
    assert c == OpCost(0, 2048 * 4 + 2048 * 2, "copy")
    c = cost("aten::_to_copy", [[1, 32, 256], [], [], [], [], [], []], [FP32, "Scalar", "", "", "", "Scalar", ""])
    assert c.bytes == 8192 * 4 + 8192 * 4  # no dtype code: same dtype
    c = op_cost("aten::_to_copy", [[8192], [], []], [FP32, "Scalar", ""], ["", "15", ""])  # 15 = bfloat16
    assert c is not None and c.bytes == 8192 * 4 + 8192 * 2


def test_cat_tensorlist() -> None:
    dims = [[[1, 2, 32, 64], [1, 2, 1, 64]], []]
    n = 2 * 32 * 64 + 2 * 64
    assert cost("aten::cat", dims, ["TensorList", "Scalar"], ["", "-2"]) == OpCost(0, 2 * n * 4, "copy")
    assert cost("aten::cat", dims, ["TensorList", "Scalar"], ["", "-2"], default_dtype="bfloat16").bytes == 2 * n * 2
    assert cost("aten::stack", [[[4, 64], [4, 64]], []], ["TensorList", "Scalar"], ["", "0"]).bytes == 2 * 512 * 4


def test_fills_and_factories_write_only() -> None:
    assert cost("aten::fill_", [[32, 1], []], [FP32, "Scalar"], ["", "0."]) == OpCost(0, 32 * 4, "copy")
    assert cost("aten::zero_", [[4, 3]], [I64]).bytes == 12 * 8
    assert (
        cost(
            "aten::ones", [[], [], [], [], []], ["ScalarList", "", "", "", "Scalar"], ["[64]", "", "", "", "False"]
        ).bytes
        == 256
    )
    full = cost(
        "aten::full", [[]] * 6, ["ScalarList", "Scalar", "Scalar", "", "", ""], ["[2, 2]", "3.", "15", "", "", ""]
    )
    assert full.bytes == 4 * 2
    arange = cost("aten::arange", [[], [], [], [], []], ["Scalar", "", "", "", "Scalar"], ["16", "", "", "", "False"])
    assert arange.bytes == 16 * 8
    assert (
        cost("aten::arange", [[], [], [], [0]], ["Scalar", "Scalar", "Scalar", I64], ["0", "64", "4", ""]).bytes
        == 16 * 8
    )


def test_local_scalar_dense() -> None:
    assert cost("aten::_local_scalar_dense", [[]], [FP32]) == OpCost(0, 8, "copy")


# --- gathers -----------------------------------------------------------------------------------------------------


def test_embedding_reads_only_gathered_rows() -> None:
    c = cost("aten::embedding", [[1000, 256], [1, 32], [], [], []], [FP32, I64, "Scalar", "Scalar", "Scalar"])
    assert c == OpCost(0, 32 * 8 + 32 * 256 * 4 + 32 * 256 * 4, "embedding")
    c = cost("aten::index_select", [[1000, 256], [], [32]], [BF16, "Scalar", I64], ["", "0", ""])
    assert c == OpCost(0, 32 * 8 + 32 * 256 * 2 + 32 * 256 * 2, "embedding")
    # more ids than rows: the table is read at most once
    c = cost("aten::embedding", [[10, 4], [100], [], [], []], [FP32, I64, "Scalar", "Scalar", "Scalar"])
    assert c.bytes == 100 * 8 + 10 * 4 * 4 + 100 * 4 * 4


def test_gather_and_topk_and_sort() -> None:
    assert cost(
        "aten::gather", [[4, 64], [], [4, 3], []], [FP32, "Scalar", I64, "Scalar"], ["", "1", "", "False"]
    ).bytes == (12 * 8 + 12 * 4 + 12 * 4)
    c = cost("aten::topk", [[4, 1000], [], [], [], []], [FP32] + ["Scalar"] * 4, ["", "50", "-1", "True", "True"])
    assert c == OpCost(0, 4000 * 4 + 4 * 50 * (4 + 8), "sampling")
    c = cost("aten::sort", [[4, 64], [], [], []], [FP32, "Scalar", "Scalar", "Scalar"], ["", "False", "-1", "True"])
    assert c == OpCost(0, 256 * 4 + 256 * (4 + 8), "sampling")
    c = cost("aten::multinomial", [[4, 64], [], [], []], [FP32, "Scalar", "Scalar", ""], ["", "1", "False", ""])
    assert c.category == "sampling" and c.bytes == 256 * 4 + 4 * 8
    assert cost("aten::cumsum", [[4, 64], [], []], [FP32, "Scalar", ""], ["", "-1", ""]).category == "sampling"


# --- attention -------------------------------------------------------------------------------------------------------


def _sdpa_cudnn(q: list[int], kv: list[int], causal: bool) -> OpCost:
    dims = [q, kv, kv, [], [], [], [], [], []]
    types = [BF16, BF16, BF16, "", "Scalar", "Scalar", "Scalar", "Scalar", ""]
    concrete = ["", "", "", "", "True", "0.", str(causal), "False", ""]
    return cost("aten::_scaled_dot_product_cudnn_attention", dims, types, concrete)


def test_attention_causal_gqa_prefill() -> None:
    b, hq, hk, s, d = 2, 8, 2, 128, 64
    c = _sdpa_cudnn([b, hq, s, d], [b, hk, s, d], causal=True)
    pairs = s * s - s * (s - 1) / 2
    assert c.category == "attention"
    assert c.flops == 2 * b * hq * pairs * (d + d)
    assert c.bytes == (2 * b * hq * s * d + 2 * b * hk * s * d) * 2  # q + out, k + v
    full = _sdpa_cudnn([b, hq, s, d], [b, hk, s, d], causal=False)
    assert full.flops == 2 * b * hq * s * s * 2 * d and full.bytes == c.bytes

    # flash attention: is_causal is argument 4
    dims = [[b, hq, s, d], [b, hk, s, d], [b, hk, s, d], [], [], [], []]
    types = [BF16, BF16, BF16, "Scalar", "Scalar", "Scalar", ""]
    flash = cost("aten::_scaled_dot_product_flash_attention", dims, types, ["", "", "", "0.", "True", "False", ""])
    assert flash == c


def test_attention_decode_bottom_right() -> None:
    hq, hk, skv, d = 8, 2, 300, 64
    c = _sdpa_cudnn([1, hq, 1, d], [1, hk, skv, d], causal=True)  # one query sees every key
    assert c.flops == 2 * hq * skv * 2 * d
    assert c.bytes == (2 * hq * d + 2 * hk * skv * d) * 2
    # (B, S, H, D) layout of _flash_attention_forward, is_causal at position 8
    dims = [[1, 1, hq, d], [1, skv, hk, d], [1, skv, hk, d], [], [], [], [], [], [], [], []]
    types = [BF16, BF16, BF16, "", "", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", ""]
    concrete = ["", "", "", "", "", "1", str(skv), "0.", "True", "False", ""]
    assert cost("aten::_flash_attention_forward", dims, types, concrete) == c


def test_efficient_attention_mask_types() -> None:
    sq, skv, h, d = 4, 10, 2, 16
    dims = [[1, sq, h, d], [1, skv, h, d], [1, skv, h, d]] + [[]] * 8
    types = [FP16] * 3 + ["", "", "", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar"]

    def flops(mask_type: int) -> float:
        concrete = ["", "", "", "", "", "", str(sq), str(skv), "0.", str(mask_type), "False"]
        return cost("aten::_efficient_attention_forward", dims, types, concrete).flops

    per_pair = 2 * h * 2 * d
    assert flops(0) == per_pair * sq * skv
    assert flops(1) == per_pair * sq * (sq + 1) / 2  # top-left: query i sees keys 0..i
    assert flops(2) == per_pair * (sq * skv - sq * (sq - 1) / 2)  # bottom-right


# --- norms, softmax, reductions --------------------------------------------------------------------------------------


def test_layer_norm_with_bias() -> None:
    dims = [[2, 16, 128], [], [128], [128], []]
    types = [FP32, "ScalarList", FP32, FP32, "Scalar"]
    c = cost("aten::native_layer_norm", dims, types, ["", "[128]", "", "", "1e-05"])
    n = 2 * 16 * 128
    assert c.category == "norm"
    assert c.bytes == (2 * n + 2 * 128) * 4
    assert c.flops == pytest.approx(8 * n)
    no_affine = cost("aten::native_layer_norm", [[2, 16, 128], [], [], [], []], [FP32, "ScalarList", "", "", "Scalar"])
    assert no_affine.bytes == 2 * n * 4


def test_fused_rms_norm() -> None:
    c = cost(
        "aten::_fused_rms_norm", [[4, 64], [], [64], []], [BF16, "ScalarList", BF16, "Scalar"], ["", "[64]", "", "1e-6"]
    )
    assert c == OpCost(4 * 256, (2 * 256 + 64) * 2, "norm")


def test_mean_last_dim_keepdim() -> None:
    c = cost("aten::mean", [[1, 32, 256], [], [], []], [FP32, "ScalarList", "Scalar", ""], ["", "[-1]", "True", ""])
    assert c == OpCost(32 * 256, (32 * 256 + 32) * 4, "reduction")
    # no dim: a full reduction writes one element
    assert cost("aten::sum", [[4, 64], []], [FP32, ""]).bytes == 256 * 4 + 4
    c = cost("aten::argmax", [[4, 1000], [], []], [FP32, "Scalar", "Scalar"], ["", "-1", "False"])
    assert c.bytes == 4000 * 4 + 4 * 8


def test_softmax() -> None:
    c = cost("aten::_softmax", [[1, 4, 16, 16], [], []], [FP32, "Scalar", "Scalar"], ["", "-1", "False"])
    assert c == OpCost(5 * 1024, 2 * 1024 * 4, "softmax")
    c = cost("aten::_softmax", [[1024], [], []], [FP16, "Scalar", "Scalar"], ["", "-1", "True"])  # half_to_float
    assert c.bytes == 1024 * 2 + 1024 * 4


# --- coverage and robustness -----------------------------------------------------------------------------------------


def test_views_are_free() -> None:
    for name in ("aten::view", "aten::transpose", "aten::empty", "aten::item", "aten::detach_", "detach_"):
        assert op_cost(name, [[32, 256], []], [FP32, "ScalarList"], ["", "[1, 32, 256]"]) == OpCost(0, 0, "view")


def test_unknown_op_is_none() -> None:
    assert op_cost("aten::frobnicate", [[4, 4]], [FP32], [""]) is None
    assert op_cost("aten::nonzero", [[4, 4]], [FP32], [""]) is None  # data-dependent output size


@pytest.mark.parametrize(
    ("name", "dims", "types"),
    [
        ("aten::mm", [[5, 123], [124, 7]], [FP32, FP32]),  # inner dims differ
        ("aten::mm", [[5, 123, 1], [123, 7]], [FP32, FP32]),  # not 2-D
        ("aten::mm", [[5, 123]], [FP32]),  # missing operand
        ("aten::mm", [[5, "x"], [123, 7]], [FP32, FP32]),
        ("aten::mm", [[5, -1], [-1, 7]], [FP32, FP32]),
        ("aten::add", [[3, 4], [5, 4]], [FP32, FP32]),  # does not broadcast
        ("aten::add", None, None),
        ("aten::add", "garbage", [FP32]),
        ("aten::add", [[3.5]], [FP32]),
        ("aten::cat", [[3, 4], []], ["TensorList", "Scalar"]),
        ("aten::embedding", [[1000], [32]], [FP32, I64]),
        ("aten::_scaled_dot_product_flash_attention", [[1, 2, 3], [1, 2, 3], [1, 2, 3]], [FP32] * 3),
        ("aten::topk", [[4, 10], [], []], [FP32, "Scalar", "Scalar"]),  # k missing
    ],
)
def test_malformed_inputs_give_none(name: str, dims: list, types: list) -> None:
    assert op_cost(name, dims, types, ["", "", "", ""]) is None


def test_missing_concrete_inputs_degrade() -> None:
    # without Concrete Inputs the reduced dims are unknown: a full reduction (one output element) is assumed
    c = op_cost("aten::mean", [[4, 10], [], [], []], [FP32, "ScalarList", "Scalar", ""], None)
    assert c == OpCost(40, 40 * 4 + 4, "reduction")


def test_llama_trace_fully_covered(tmp_path) -> None:
    """Every aten op of a tiny Llama's prefill + decode step (CPU, fp32, SDPA) gets a cost model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=1000,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt, step = torch.randint(0, 1000, (1, 32)), torch.randint(0, 1000, (1, 1))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = model(prompt, use_cache=True)
        model(step, past_key_values=out.past_key_values, use_cache=True)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "cpu_op"]
    assert events
    misses: dict[str, int] = {}
    categories: set[str] = set()
    for e in events:
        args = e.get("args", {})
        c = op_cost(e["name"], args.get("Input Dims"), args.get("Input type"), args.get("Concrete Inputs"))
        if c is None:
            misses[e["name"]] = misses.get(e["name"], 0) + 1
        else:
            categories.add(c.category)
    assert not misses, f"ops without a cost model: {misses}"
    assert {"gemm", "attention", "elementwise", "embedding", "view"} <= categories


# --- classification --------------------------------------------------------------------------------------------------

BW = 1000.0  # GB/s
PEAKS = {"float32": 100.0, "bfloat16": 400.0}  # TFLOP/s -> ridge points 100 and 400 FLOP/byte


def _kernels(rows: list[tuple[float, float, float, str | None]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["dur_us", "flops", "bytes", "dtype"])


def test_classify_kernels_bounds() -> None:
    df = _kernels(
        [
            (100.0, 8e8, 8e7, "float32"),  # 800 GB/s at 10 FLOP/B: memory bound, 80% of the bandwidth roof
            (100.0, 3.2e10, 1e6, "bfloat16"),  # 320 TFLOP/s at 32000 FLOP/B: compute bound, 80% of peak
            (5.0, 8e8, 8e7, "float32"),  # too short
            (1000.0, 1e6, 1e6, "float32"),  # long but under 40% of both roofs
            (100.0, np.nan, np.nan, None),  # no cost model
            (5.0, np.nan, np.nan, None),  # short and unmodeled: latency wins
            (100.0, 5e10, 0.0, "bfloat16"),  # no bytes: compute
        ]
    )
    out = classify_kernels(df, BW, PEAKS)
    assert list(out["bound"]) == ["memory", "compute", "latency", "latency", "unmodeled", "latency", "compute"]
    assert "intensity" not in df.columns  # input untouched
    mem, comp = out.iloc[0], out.iloc[1]
    assert mem.intensity == pytest.approx(10.0)
    assert mem.achieved_gbps == pytest.approx(800.0)
    assert mem.achieved_tflops == pytest.approx(8.0)
    assert mem.attainable_tflops == pytest.approx(10.0)
    assert mem.frac_bandwidth == pytest.approx(0.8)
    assert mem.achieved_frac == pytest.approx(0.8)
    assert comp.peak_tflops == 400.0
    assert comp.attainable_tflops == pytest.approx(400.0)
    assert comp.frac_compute == pytest.approx(0.8)
    assert comp.achieved_frac == pytest.approx(0.8)
    assert math.isnan(out.iloc[4].intensity) and math.isnan(out.iloc[4].achieved_frac)
    assert math.isnan(out.iloc[6].intensity) and out.iloc[6].attainable_tflops == 400.0


def test_classify_ridge_boundary_and_dtype_fallback() -> None:
    ridge = PEAKS["float32"] * 1000 / BW  # 100 FLOP/byte
    nbytes = 4e7  # 800 GB/s over 50 µs
    df = _kernels(
        [
            (50.0, ridge * nbytes, nbytes, "float32"),
            (50.0, 0.99 * ridge * nbytes, nbytes, "float32"),
            (50.0, ridge * nbytes, nbytes, "int64"),  # integer dtypes use the float32 peak
            (50.0, ridge * nbytes, nbytes, None),
            (50.0, ridge * nbytes, nbytes, "float8_e4m3fn"),  # missing from the table: float32 peak
            (50.0, 0.0, nbytes, "bfloat16"),  # pure data movement: achieved_frac is the bandwidth fraction
        ]
    )
    out = classify_kernels(df, BW, PEAKS)
    assert list(out["bound"]) == ["compute", "memory", "compute", "compute", "compute", "memory"]
    assert list(out["peak_tflops"][:5]) == [100.0] * 5
    assert out.iloc[5].achieved_frac == pytest.approx(0.8)


def test_classify_scalar_matches_frame() -> None:
    d = classify(100.0, 8e8, 8e7, 100.0, BW)
    assert d["bound"] == "memory"
    assert d["frac_bandwidth"] == pytest.approx(0.8)
    assert classify(100.0, None, None, 100.0, BW)["bound"] == "unmodeled"
    assert classify(9.9, 8e8, 8e7, 100.0, BW)["bound"] == "latency"


def test_classify_kernels_is_fast() -> None:
    n = 100_000
    rng = np.random.default_rng(0)
    df = pd.DataFrame(
        {
            "dur_us": rng.uniform(1, 1000, n),
            "flops": rng.uniform(0, 1e10, n),
            "bytes": rng.uniform(0, 1e8, n),
            "dtype": rng.choice(np.array(["bfloat16", "float32", "int64", None], dtype=object), n),
        }
    )
    df.loc[::7, "flops"] = np.nan
    start = time.perf_counter()
    out = classify_kernels(df, BW, PEAKS)
    assert time.perf_counter() - start < 1.0
    assert set(out["bound"]) <= {"compute", "memory", "latency", "unmodeled"}


def test_a_graph_gap_that_cannot_be_measured_says_why_and_leaves_the_term_out() -> None:
    """The idle time between replayed kernels needs CUDA graphs; where it cannot be measured the roof is None (the
    step model then adds no idle time) and a warning names the reason, rather than the term vanishing silently."""
    from fusionscope.device import _graph_gap_us

    with pytest.warns(UserWarning, match="idle time between replayed kernels was not measured"):
        assert _graph_gap_us(torch.device("cpu")) is None
