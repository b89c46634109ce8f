"""The profiled replay of `apply --graphs`: a replay's kernels, busy time and gaps from its trace; the eager step's
costs matched to the replay's kernels by name and order; the per-kernel breakdown against the roofs."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from fusionscope.apply import graphs, replay
from fusionscope.models import build_workload, resolve_model

ROOFS = {"copy_gbps": 1000.0, "tflops": {"bfloat16": 100.0, "float32": 10.0}}


def events(rows: list[tuple[str, str, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["name", "cat", "ts_us", "dur_us"])


def test_replay_figures_count_kernels_and_the_idle_time_between_them() -> None:
    rows = [("a", "kernel", 0.0, 10.0), ("b", "kernel", 13.0, 5.0), ("Memcpy DtoD", "gpu_memcpy", 20.0, 2.0),
            ("c", "kernel", 24.0, 6.0)]  # fmt: skip
    figures = replay.replay_figures(events(rows))
    assert figures["kernels"] == 3 and figures["copies"] == 1
    assert figures["gpu_busy_ms"] == pytest.approx(23e-3) and figures["span_ms"] == pytest.approx(30e-3)
    assert figures["gap_us_per_kernel"] == pytest.approx((30.0 - 23.0) / 3)
    assert replay.replay_figures(events([]))["kernels"] == 0


def test_kernels_started_early_count_only_their_time_past_the_kernel_before() -> None:
    """Under programmatic dependent launch a kernel starts while the one before runs and waits inside it: the
    per-kernel figures keep only what no earlier item covers, so they add up to the busy time."""
    from fusionscope.gpu_replay import busy_us, on_the_critical_path

    rows = [("gemv", "kernel", 0.0, 20.0), ("norm", "kernel", 5.0, 17.0), ("mm", "kernel", 22.0, 30.0),
            ("silu", "kernel", 40.0, 14.0), ("late", "kernel", 60.0, 3.0)]  # fmt: skip
    cut = on_the_critical_path(events(rows))
    assert cut["dur_us"].tolist() == pytest.approx([20.0, 2.0, 30.0, 2.0, 3.0])
    starts = events(rows)["ts_us"].to_numpy()
    ends = starts + events(rows)["dur_us"].to_numpy()
    assert cut["dur_us"].sum() == pytest.approx(busy_us(starts, ends))
    assert on_the_critical_path(events([])).empty


def test_gpu_events_reads_kernels_copies_and_memsets_in_start_order(tmp_path) -> None:
    doc = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 50, "dur": 3},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 90},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 10, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "early", "ts": 20, "dur": 4},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},
    ]}  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    got = replay.gpu_events(path)
    assert list(got["name"]) == ["Memset (Device)", "early", "late"]
    assert list(got["dur_us"]) == [1.0, 4.0, 3.0]


def test_aligned_takes_each_kernels_costs_from_the_eager_kernel_of_the_same_name_and_order() -> None:
    eager = pd.DataFrame({"name": ["gemv", "norm", "gemv", "attn"], "op": ["aten::mm", "fs::norm", "aten::mm", "sdpa"],
                          "module": ["q", "ln", "o", "attn"], "bytes": [100.0, 10.0, 300.0, 50.0],
                          "flops": [200.0, 5.0, 600.0, 70.0], "dtype": ["bfloat16"] * 4,
                          "category": ["gemm", "norm", "gemm", "attention"]})  # fmt: skip
    # the capture launched one kernel the eager step did not (another algorithm's helper) and dropped none
    played = events([("gemv", "kernel", 0, 5), ("norm", "kernel", 6, 1), ("splitk_reduce", "kernel", 8, 1),
                     ("gemv", "kernel", 10, 7), ("attn", "kernel", 18, 2)])  # fmt: skip
    table = replay.aligned(eager, played)
    assert list(table["matched"]) == [True, True, False, True, True]
    assert list(table["bytes"].fillna(-1)) == [100.0, 10.0, -1, 300.0, 50.0]
    assert list(table["module"].fillna("")) == ["q", "ln", "", "o", "attn"]
    assert list(table["dur_us"]) == [5, 1, 1, 7, 2]  # the replay's own durations


def test_breakdown_rates_each_launching_op_against_the_roofs_largest_first() -> None:
    table = pd.DataFrame({"name": ["gemv", "gemv", "norm", "x"], "cat": ["kernel"] * 4, "ts_us": [0, 10, 20, 30],
                          "dur_us": [10.0, 10.0, 2.0, 1.0], "op": ["aten::mm", "aten::mm", "fs::norm", None],
                          "module": ["model.layers.0.mlp", "model.layers.1.mlp", "ln", None],
                          "bytes": [8e6, 8e6, 1e3, float("nan")], "flops": [16e6, 16e6, 2e3, float("nan")],
                          "dtype": ["bfloat16", "bfloat16", "bfloat16", None],
                          "category": ["gemm", "gemm", "norm", None],
                          "matched": [True, True, True, False]})  # fmt: skip
    down = replay.breakdown(table, ROOFS)
    first = down["rows"][0]
    assert first["op"] == "aten::mm" and first["count"] == 2 and first["us"] == 20.0
    assert first["module"] == "model.layers.*.mlp"
    assert first["achieved_gbps"] == pytest.approx(16e6 / 20e-6 / 1e9)  # 800 GB/s
    assert first["frac_bandwidth"] == pytest.approx(0.8)
    assert first["achieved_tflops"] == pytest.approx(32e6 / 20e-6 / 1e12)
    assert [r["op"] for r in down["rows"]] == ["aten::mm", "fs::norm", "(not matched)"]
    assert down["rows"][2]["achieved_gbps"] is None
    assert down["total_us"] == 23.0 and down["matched_share"] == pytest.approx(22 / 23)
    assert sum(r["share"] for r in down["rows"]) == pytest.approx(1.0)


def test_breakdown_keeps_the_largest_rows_and_sums_the_rest() -> None:
    n = replay.TOP_ROWS + 4
    table = pd.DataFrame({"name": [f"k{i}" for i in range(n)], "cat": ["kernel"] * n, "ts_us": range(n),
                          "dur_us": [float(n - i) for i in range(n)], "op": [f"op{i}" for i in range(n)],
                          "module": [""] * n, "bytes": [1e3] * n, "flops": [0.0] * n, "dtype": ["bfloat16"] * n,
                          "category": ["copy"] * n, "matched": [True] * n})  # fmt: skip
    rows = replay.breakdown(table, ROOFS)["rows"]
    assert len(rows) == replay.TOP_ROWS + 1 and rows[-1]["op"] == "(4 more)"
    assert rows[-1]["us"] == pytest.approx(sum(range(1, 5))) and rows[-1]["count"] == 4


def test_by_kernel_sums_a_compiled_steps_kernels_per_name_largest_first(monkeypatch) -> None:
    """A compiled peer's step has no eager twin to cost it by: its kernels are summed per name, largest first, and
    beyond `TOP_ROWS` the rest is one row, so counts and time still add up to the step's."""
    monkeypatch.setattr(replay, "TOP_ROWS", 2)
    events = pd.DataFrame({"name": ["mm", "norm", "mm", "add", "copy", "norm"], "cat": ["kernel"] * 6,
                           "ts_us": [0.0, 5, 6, 9, 10, 12], "dur_us": [4.0, 1, 3, 0.5, 0.25, 1.5]})  # fmt: skip
    rows = replay.by_kernel(events)
    summed = [(r["kernel"], r["count"], r["us"]) for r in rows]
    assert summed == [("mm", 2, 7.0), ("norm", 2, 2.5), ("(2 more)", 2, 0.75)]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert replay.by_kernel(events.iloc[:0]) == []


def test_the_eager_step_of_a_static_decoder_is_costed_op_by_op_on_the_cpu(tmp_path) -> None:
    """On a CPU the eager step's 'kernels' are its ops (self time): the costing path a GPU breakdown takes, run whole;
    the step's state is put back by the caller, as `run_graphs` does by never reusing a profiled decoder."""
    workload = build_workload(resolve_model("tiny-llama"), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=2)  # fmt: skip
    decoder = graphs.StaticDecoder(workload.module, workload.inputs[0], 2)
    decoder.prefill()

    def eager() -> None:
        with torch.inference_mode():
            decoder._body()

    table = replay.profile_eager_kernels(eager, workload.module, tmp_path, ROOFS)
    assert int(decoder.position) == 9  # the step ran once
    gemms = table[table["category"] == "gemm"]
    assert len(gemms) and (gemms["bytes"] > 0).all()
    assert gemms["module"].str.startswith("model.layers.").any() or (gemms["module"] == "lm_head").any()
    as_replay = table.rename(columns={"op": "launching"})[["name", "ts_us", "dur_us"]].assign(cat="kernel")
    down = replay.breakdown(replay.aligned(table, as_replay), ROOFS)
    assert down["matched_share"] == pytest.approx(1.0)
    assert sum(r["us"] for r in down["rows"]) == pytest.approx(down["total_us"])


def test_graph_predictions_add_the_gap_between_kernels_to_the_gpu_time(monkeypatch) -> None:
    """A replayed graph is predicted at the profiled GPU time plus kernels × the measured gap (graph alone), less the
    fusions' saving and with their kernels removed (fused + graph); each beside its measurement with the error."""
    from fusionscope.apply import run

    phase = {"gpu_busy_ms_per_step": 6.0, "ops_per_step": 1000, "wall_ms_per_step": 20.0,
             "wall_ms_per_step_unprofiled": 20.0, "regime": "host-bound", "kernels_per_step": 1500}  # fmt: skip
    opportunity = {"fusion": "add_rms_norm", "phase": "decode", "saved_us": 800.0, "ops_now": 500.0,
                   "launches_now": 576.0, "launches_fused": 64.0, "host_now_us": 5000.0,
                   "module_paths": []}  # fmt: skip
    summary = {"phases": {"decode": phase}, "opportunities": [opportunity],
               "roofs": {"graph_gap_us": 0.5, "fused_call_us": 20.0, "copy_gbps": 4000.0},
               "cumulative": {"decode": {"step_model": {"gpu_us": 6000.0}, "cuda_graph_share": 0.6,
                                         "cuda_graph_share_unfused": 0.7}}}  # fmt: skip

    def measured(*args, **kwargs):
        return {"variants": {graphs.GRAPH: {"ms_per_token": 7.5}, "add_rms_norm + graph": {"ms_per_token": 7.0},
                             graphs.FUSED_GRAPH: {"ms_per_token": 6.0}},
                "fused_vs_graph": 7.5 / 6.0}  # fmt: skip

    monkeypatch.setattr(graphs, "run_graphs", measured)
    timing = {"variants": {run.BASELINE: {"phases": {"decode": {"wall_ms": 30.0}}}}}
    out = run.graph_variants(None, summary, ["add_rms_norm", "sampling"], None, None, None, {}, False, 1,
                             lambda _: None, True, None, timing=timing)  # fmt: skip
    pred = out["predicted"]
    assert pred["graph_ms"] == pytest.approx((6000 + 1500 * 0.5) / 1e3)
    assert pred["fused_graph_ms"] == pytest.approx((6000 - 800 + (1500 - 576 + 64) * 0.5) / 1e3)
    assert pred["fused_graph_vs_graph"] == pytest.approx(pred["graph_ms"] / pred["fused_graph_ms"])
    assert pred["graph_vs_eager"] == pytest.approx(1 / 0.3)
    assert out["variants"][graphs.GRAPH]["error_vs_predicted"] == pytest.approx(7.5 / pred["graph_ms"] - 1)
    assert out["error_fused_vs_graph"] == pytest.approx((7.5 / 6.0) / pred["fused_graph_vs_graph"] - 1)
    assert out["graph_vs_eager"] == pytest.approx(30.0 / 7.5)
    assert out["error_graph_vs_eager"] == pytest.approx((30.0 / 7.5) * 0.3 - 1)


def test_a_bundled_kernel_without_an_aten_op_is_named_apart_from_an_unmatched_one() -> None:
    table = pd.DataFrame({"name": ["_rms_norm_kernel", "mystery"], "cat": ["kernel"] * 2, "ts_us": [0, 5],
                          "dur_us": [3.0, 2.0], "op": ["", None], "module": ["model.norm", None],
                          "bytes": [float("nan")] * 2, "flops": [float("nan")] * 2, "dtype": [None, None],
                          "category": [None, None], "matched": [True, False]})  # fmt: skip
    ops = [r["op"] for r in replay.breakdown(table, ROOFS)["rows"]]
    assert ops == ["(no aten op)", "(not matched)"]
