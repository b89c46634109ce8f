"""The kernel ↔ aten op ↔ module join on real CUDA traces from the H200 (tests/data/, recorded by
reports/samples/gpu_profile.sh): tiny-llama (prompt 32, 4 decode steps) and llama-3.2-1b (prompt 64, 2 decode steps),
both bf16, torch 2.11."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusionscope import analysis, trace

DATA = Path(__file__).resolve().parent / "data"
FIXTURES = {
    "tiny-llama": (DATA / "tiny-llama-cuda.trace.json.gz", 2, 4),
    "llama-3.2-1b": (DATA / "llama-3.2-1b-cuda.trace.json.gz", 16, 2),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=list(FIXTURES))
def loaded(request: pytest.FixtureRequest) -> tuple[str, trace.Timeline, int, int]:
    path, layers, decode_steps = FIXTURES[request.param]
    return request.param, trace.load_timeline(path), layers, decode_steps


def raw_kernel_ops(path: Path) -> dict[float, str]:
    """Independently of HTA: kernel start → name of the cpu_op with the kernel's `External id`."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    ops = {e["args"]["External id"]: e["name"] for e in events if e.get("cat") == "cpu_op"}
    return {round(e["ts"], 3): ops.get(e["args"].get("External id"), "") for e in events if e.get("cat") == "kernel"}


def test_steps_and_phases(loaded: tuple) -> None:
    _name, timeline, _layers, decode_steps = loaded
    assert timeline.device_kind == "cuda"
    assert list(timeline.steps["phase"]) == ["prefill"] * 3 + ["decode"] * decode_steps
    assert list(timeline.steps["step"]) == list(range(3 + decode_steps))
    assert set(timeline.kernels["phase"]) == {"prefill", "decode"}


def test_every_kernel_is_joined_to_the_op_with_its_external_id(loaded: tuple) -> None:
    name, timeline, _layers, _steps = loaded
    expected = raw_kernel_ops(FIXTURES[name][0])
    kernels = timeline.kernels[~timeline.kernels["name"].str.startswith(("Memcpy", "Memset"))]
    assert (kernels["op_id"] >= 0).all()
    start0 = min(expected)  # HTA shifts timestamps to start at 0
    offset = start0 - kernels["ts_us"].min() if len(kernels) else 0
    got = {round(ts + offset, 3): op for ts, op in zip(kernels["ts_us"], kernels["op"])}
    matched = [got[ts] == op for ts, op in expected.items() if ts in got]
    assert len(matched) >= 0.99 * len(expected) and all(matched)


def test_gemms_belong_to_their_projection_modules(loaded: tuple) -> None:
    _name, timeline, layers, _steps = loaded
    k = timeline.kernels
    mm = k[(k["op"] == "aten::mm") & (k["phase"] == "decode")]
    per_step = mm.groupby("step")["op_id"].nunique()
    assert (per_step == layers * len(PROJECTIONS) + 1).all()  # 7 projections per layer + lm_head
    expected = {
        f"model.layers.{i}.{'self_attn' if p in PROJECTIONS[:4] else 'mlp'}.{p}"
        for i in range(layers)
        for p in PROJECTIONS
    } | {"lm_head"}
    assert set(mm["module"]) == expected


def test_only_the_sampling_argmax_runs_outside_the_model(loaded: tuple) -> None:
    _name, timeline, _layers, _steps = loaded
    outside = timeline.kernels[timeline.kernels["module"] == ""]
    assert set(outside["op"]) <= {"aten::argmax", ""}


def test_cost_coverage_and_classes(loaded: tuple) -> None:
    _name, timeline, _layers, _steps = loaded
    kernels = analysis.kernel_table(timeline)
    assert analysis.cost_coverage(kernels) >= 0.95
    classified = analysis.classify(kernels, 4200.0, {"bfloat16": 750.0, "float32": 50.0})
    assert set(classified["bound"]) <= {"compute", "memory", "latency", "unmodeled"}
    gemm = classified[(classified["op"] == "aten::mm") & (classified["phase"] == "decode")]
    # batch-1 decode GEMMs read a whole weight matrix per token: ~1 FLOP per byte, memory side of the ridge
    assert gemm["intensity"].between(0.5, 2.0).all()


def test_phase_summary_on_the_h200_trace(loaded: tuple) -> None:
    _name, timeline, _layers, decode_steps = loaded
    kernels = analysis.classify(analysis.kernel_table(timeline), 4200.0, {"bfloat16": 750.0, "float32": 50.0})
    phases = analysis.summarize_phases(kernels, timeline.steps, {}, "cuda")
    decode = phases["decode"]
    assert decode["steps"] == decode_steps
    assert 0 < decode["gpu_busy_ms_per_step"] < decode["wall_ms_per_step"]
    assert decode["regime"] == "host-bound"  # eager HF decode at batch 1 keeps the H200 mostly idle
    per_step = kernels[kernels["phase"] == "decode"].groupby("step").size()
    assert decode["kernels_per_step"] == per_step.median()
    assert decode["top_kernels"][0]["us_per_step"] >= decode["top_kernels"][-1]["us_per_step"]
    # The regime is judged against the unprofiled step when there is one: the profiler slows the host, not the GPU.
    tight = [decode["gpu_busy_ms_per_step"] * 1.2] * decode_steps
    again = analysis.summarize_phases(kernels, timeline.steps, {"decode": tight}, "cuda")["decode"]
    assert again["regime"] == "gpu-bound" and again["gpu_busy_frac"] == pytest.approx(1 / 1.2)


def test_busy_time_counts_overlap_once() -> None:
    starts = np.array([0.0, 5.0, 20.0, 21.0])
    ends = np.array([10.0, 12.0, 22.0, 30.0])
    assert analysis.busy_us(starts, ends) == pytest.approx(12.0 + 10.0)
    assert analysis.busy_us(np.array([]), np.array([])) == 0.0


def test_busy_per_step_is_each_step_group_to_the_bit() -> None:
    """Each step's busy time from slices of one stable sort is what `busy_us` of that step's `groupby` frame gives,
    exactly: unsorted steps, ties in start, overlaps, a step of one kernel, steps with gaps."""
    rng = np.random.default_rng(7)
    n = 3000
    ks = pd.DataFrame({"step": rng.choice([5, -1, 0, 2, 9, 100], n), "ts_us": np.round(rng.random(n) * 500, 1) / 3,
                       "dur_us": rng.random(n) * 7})  # fmt: skip
    ks.loc[0, "step"] = 42  # one kernel alone
    ks.loc[1:200, "dur_us"] = 0.0  # kernels of no length, some starting where others end
    ks.loc[201:400, "ts_us"] = ks.loc[1:200, "ts_us"].to_numpy() + ks.loc[101:300, "dur_us"].to_numpy()
    want = pd.Series({s: analysis.busy_us(g["ts_us"].to_numpy(), (g["ts_us"] + g["dur_us"]).to_numpy())
                      for s, g in ks.groupby("step")}, dtype=float)  # fmt: skip
    got = analysis._busy_per_step(ks)
    assert got.index.tolist() == want.index.tolist()
    assert got.to_numpy().tobytes() == want.to_numpy().tobytes()
    assert analysis._busy_per_step(ks.iloc[:0]).empty
    ks.loc[5, "dur_us"] = np.nan  # a duration no number reads: each step as `busy_us` takes it
    with_nan = pd.Series({s: analysis.busy_us(g["ts_us"].to_numpy(), (g["ts_us"] + g["dur_us"]).to_numpy())
                          for s, g in ks.groupby("step")}, dtype=float)  # fmt: skip
    assert analysis._busy_per_step(ks).to_numpy().tobytes() == with_nan.to_numpy().tobytes()


def test_module_pattern() -> None:
    assert analysis.module_pattern("model.layers.12.mlp.down_proj") == "model.layers.*.mlp.down_proj"
    assert analysis.module_pattern("lm_head") == "lm_head"


def test_unparseable_trace_is_a_usage_error(tmp_path: Path) -> None:
    from fusionscope.errors import UsageError

    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(gzip.compress(b"{not json"))
    with pytest.raises(UsageError):
        trace.load_timeline(bad)
    with pytest.raises(UsageError, match="not found"):
        trace.load_timeline(tmp_path / "absent.json.gz")


def test_cpu_trace_self_times_add_up(tmp_path: Path) -> None:
    """On CPU runs the ops are the timeline: self times partition each top-level op's duration."""
    import torch

    from fusionscope import capture, models

    spec = models.resolve_model(f"{Path(__file__).resolve().parents[1] / 'examples' / 'custom_factory.py'}:make_mlp")
    cap = capture.capture(models.build_workload(spec, torch.device("cpu"), torch.float32), tmp_path)
    timeline = trace.load_timeline(cap.trace_path)
    ops = timeline.ops
    assert timeline.device_kind == "cpu" and len(timeline.kernels) == 0
    assert (ops["self_us"] >= 0).all() and (ops["self_us"] <= ops["dur_us"] + 1e-6).all()
    assert set(ops["phase"]) == {"forward"}
    linear = ops[ops["name"] == "aten::mm"]
    assert set(linear["module"]) == {f"{b}.{p}" for b in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    assert isinstance(ops, pd.DataFrame)


def test_cpu_costs_are_not_charged_twice_to_parent_and_child() -> None:
    """`_to_copy` (cost 10) hands its work to `copy_` (cost 10): the pair moves 10 bytes, not 20."""
    costs = pd.DataFrame(
        {
            "flops": [0.0, 0.0, 0.0, 4.0, np.nan],
            "bytes": [10.0, 10.0, 0.0, 6.0, np.nan],
            "category": ["copy", "copy", "view", "elementwise", None],
            "dtype": None,
        },
        index=[1, 2, 3, 4, 5],
    )
    parent = pd.Series({1: -1, 2: 3, 3: 1, 4: -1, 5: 4})  # 1 → 3 (a view in between) → 2; 4 → 5 (unmodeled)
    adjusted = analysis._self_costs(costs, parent)
    assert adjusted.loc[[1, 2, 4], "bytes"].tolist() == [0.0, 10.0, 6.0]
    assert np.isnan(adjusted.loc[5, "bytes"])
