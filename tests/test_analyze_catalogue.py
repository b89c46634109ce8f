"""The fusion catalogue on a trace without tensor identities (`fusionscope.order_graph`: edges from op order, shapes
and module nesting) and with PyTorch's execution trace beside it (`fusionscope.execution_trace`: exact edges).

GIVEN a run whose real dataflow is known — a tiny Llama captured and recorded on this CPU in one process, the
H200 traces fusionscope wrote (whose dataflow-based counts per step are those of the catalogue sample run of the
same model), the execution-trace fixture — WHEN analyze infers the dataflow from the trace alone, THEN it finds the
same groups per fusion and phase, with the same measured time and bytes, and says its basis."""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

import pandas as pd
import pytest
import torch

from fusionscope import analysis, capture, dataflow, models, opportunities, order_graph, trace
from fusionscope.analyze import MISSING_DATAFLOW, analyze, fill_steps_and_phases
from fusionscope.fusions import Graph, find_matches

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
ET_TRACE = DATA / "traces" / "llama-et.trace.json.gz"
SAMPLE_1B = ROOT / "reports" / "samples" / "catalogue" / "llama-3.2-1b" / "summary.json"
ROOFS = {"copy_gbps": 20.0, "tflops": {"float32": 1.0, "bfloat16": 1.0}}


def per_step(matches: list, steps: pd.DataFrame) -> dict[tuple[str, str], float]:
    """Matches per (fusion, phase), per step of the phase."""
    per_phase = steps.groupby("phase").size().to_dict()
    counts = collections.Counter((m.fusion, m.phase) for m in matches)
    return {key: n / per_phase[key[1]] for key, n in counts.items()}


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Llama captured and its dataflow recorded in this process (what `profile` does), joined."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[request.param]
    workload = models.build_workload(models.resolve_model("tiny-llama"), torch.device("cpu"), dtype, batch=1,
                                     prompt_len=8, decode_steps=2)  # fmt: skip
    cap = capture.capture(workload, tmp_path_factory.mktemp(f"capture-{request.param}"), warmup=1)
    nodes = dataflow.record_dataflow(workload)
    timeline = trace.load_timeline(cap.trace_path)
    return {"timeline": timeline, "joined": dataflow.join_dataflow(nodes, timeline.ops), "trace": cap.trace_path}


def test_inferred_edges_match_the_recorded_dataflow(recorded: dict) -> None:
    joined, ops = recorded["joined"], recorded["timeline"].ops
    inferred = order_graph.infer_dataflow(ops, "cpu")
    assert inferred.attrs["basis"] == "op order"
    assert set(joined.loc[joined["op_id"] >= 0, "op_id"]) <= set(inferred["op_id"])  # every recorded node is a node
    by_op = dict(zip(inferred["op_id"], zip(inferred["node"], inferred["inputs"])))
    op_of = dict(zip(inferred["node"], inferred["op_id"]))
    ref_op, ref_step = dict(zip(joined["node"], joined["op_id"])), dict(zip(joined["node"], joined["step"]))
    agree = total = 0
    for step, op, inputs in zip(joined["step"], joined["op_id"], joined["inputs"]):
        if op < 0:
            continue
        # a producer in an earlier step (the KV cache) is a leaf to the inference, which never links across steps
        want = tuple(ref_op[p] if p >= 0 and ref_step[p] == step else -1 for p in inputs)
        got = tuple(op_of[p] if p >= 0 else -1 for p in by_op[op][1])
        agree += want == got
        total += 1
    assert agree / total >= 0.9, (agree, total)


def test_inferred_matches_and_estimates_equal_the_recorded_ones(recorded: dict) -> None:
    timeline = recorded["timeline"]
    kernels = analysis.kernel_table(timeline)
    graphs = {"recorded": recorded["joined"], "inferred": order_graph.infer_dataflow(timeline.ops, "cpu")}
    found = {label: find_matches(Graph(g)) for label, g in graphs.items()}
    assert per_step(found["inferred"], timeline.steps) == per_step(found["recorded"], timeline.steps)
    assert {m.fusion for m in found["recorded"]} >= {"add_rms_norm", "rms_norm", "silu_and_mul", "rope", "qkv"}
    sums = {}
    for label, g in graphs.items():
        est = opportunities.estimate_matches(found[label], g, timeline.ops, kernels, ROOFS)
        sums[label] = est.groupby(["fusion", "phase"])[["t_now_us", "launches_now", "ops_now"]].sum()
    pd.testing.assert_frame_equal(sums["inferred"], sums["recorded"])


def test_analyze_of_a_profile_trace_agrees_with_the_profile_counts(recorded: dict, tmp_path: Path) -> None:
    timeline = recorded["timeline"]
    want = per_step(find_matches(Graph(recorded["joined"])), timeline.steps)
    run = analyze(recorded["trace"], out=tmp_path / "run", device="cpu")
    got = {(o["fusion"], o["phase"]): o["count"] for o in run.summary["opportunities"]}
    assert got == want
    assert {o["basis"] for o in run.summary["opportunities"]} == {"op order"}
    assert {o["confidence"] for o in run.summary["opportunities"]} <= {"medium", "low"}  # lowered, and said why
    assert all(o["reason"].startswith("edges inferred from op order") for o in run.summary["opportunities"])
    assert run.summary["dataflow"] == {
        "basis": "op order",
        "nodes": run.summary["dataflow"]["nodes"],
        "join_rate": None,
    }
    table = pd.read_csv(run.out_dir / "opportunities.csv")
    assert len(table) == len(got) and set(table["basis"]) == {"op order"}


@pytest.mark.parametrize(("name", "layers"), [("tiny-llama-cuda", 2), ("llama-3.2-1b-cuda", 16)])
def test_h200_traces_count_what_the_dataflow_finder_counts(name: str, layers: int, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Per step the dataflow finder counts, for a Llama of L layers with sdpa attention and greedy decoding: 2·L
    add + norm groups (every norm after a residual add, the final one too), 1 lone norm (layer 0's input norm), L
    each of SwiGLU, rope (+ cache write), qkv and gate_up — as the catalogue sample run of llama-3.2-1b shows — and
    in decode steps L decode_attention and 2·L gemv (o_proj, down_proj), plus the LM head where it is at most
    gemv.WIDEST wide (the tiny model's; llama-3.2-1b's 128256 is not)."""
    monkeypatch.setenv("FUSIONSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    sample = json.loads(SAMPLE_1B.read_text())
    reference = {(o["fusion"], o["phase"]): o["count"] for o in sample["opportunities"]}
    assert reference[("add_rms_norm", "decode")] == 32 and reference[("qkv", "prefill")] == 16  # L = 16
    expected = {key: n * layers / 16 if key[0] != "rms_norm" else n for key, n in reference.items()}
    expected[("decode_attention", "decode")] = layers  # one query token's SDPA call per layer (after that sample)
    lm_head = int(name.startswith("tiny"))
    expected[("gemv", "decode")] = 2 * layers + lm_head  # (after that sample)
    run = analyze(DATA / f"{name}.trace.json.gz", out=tmp_path / "run")
    got = {(o["fusion"], o["phase"]): o["count"] for o in run.summary["opportunities"]}
    assert got == expected
    assert run.summary["missing"][1] == MISSING_DATAFLOW
    decode = [o for o in run.summary["opportunities"] if o["phase"] == "decode"]
    assert all(o["t_fused_us"] < o["t_now_us"] and o["speedup_wall"] > 1 for o in decode)
    plan = run.summary["cumulative"]["decode"]
    assert [w["fusion"] for w in plan["waterfall"]] == [o["fusion"] for o in decode]  # medium confidence: accepted
    # the host-bound decode step (what TraceLens, weighing savings against a 95%-idle GPU, offers nothing on):
    # groups counted exactly, the kernels costed, and a wall-time estimate that says the host paces the step
    assert run.summary["cost_coverage"] >= 0.95
    assert run.summary["phases"]["decode"]["regime"] == "host-bound" and plan["paced_by"] == "host"


def test_inferred_groups_never_overlap() -> None:
    timeline, _missing = fill_steps_and_phases(trace.load_timeline(DATA / "llama-3.2-1b-cuda.trace.json.gz"))
    matches = find_matches(Graph(order_graph.infer_dataflow(timeline.ops, timeline.device_kind)))
    nodes = [n for m in matches for n in m.nodes]
    decode_steps = 2
    assert len(nodes) == len(set(nodes)) and len(matches) == 5 * (32 + 1 + 4 * 16) + decode_steps * (16 + 2 * 16)


def test_execution_trace_gives_exact_edges_and_the_same_groups(tmp_path: Path) -> None:
    run = analyze(ET_TRACE, out=tmp_path / "run", device="cpu")  # llama-et.et.json.gz beside it is found
    s = run.summary
    assert s["dataflow"]["basis"] == "execution trace" and s["dataflow"]["join_rate"] == 1.0
    assert s["trace"]["execution_trace"].endswith("llama-et.et.json.gz") and MISSING_DATAFLOW not in s["missing"]
    got = {o["fusion"]: o["count"] for o in s["opportunities"]}
    # per step (the median over the steps that hold one, as `count` is): decode_attention in the 2 decode steps, its
    # one-position query telling them from the prefill in a trace whose steps are one phase
    assert got == {"add_rms_norm": 4, "rms_norm": 1, "silu_and_mul": 2, "rope": 2, "qkv": 2, "gate_up": 2,
                   "decode_attention": 2, "gemv": 5}  # fmt: skip
    assert {o["basis"] for o in s["opportunities"]} == {"execution trace"}
    assert {o["confidence"] for o in s["opportunities"]} == {"high"}
    timeline, _missing = fill_steps_and_phases(trace.load_timeline(ET_TRACE))
    inferred = order_graph.infer_dataflow(timeline.ops, "cpu")
    per_step = collections.Counter((m.fusion, m.step) for m in find_matches(Graph(inferred)))
    order_counts = {f: statistics.median(n for (g, _step), n in per_step.items() if g == f) for f, _step in per_step}
    assert order_counts == got  # the inference agrees with the exact dataflow


def test_bad_execution_trace_is_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fusionscope.cli import app

    (tmp_path / "et.json").write_text('{"schema": "1.1.1"}')
    for path, message in ((tmp_path / "absent.json", "execution trace not found"),
                          (tmp_path / "et.json", "is not a PyTorch execution trace")):  # fmt: skip
        result = CliRunner().invoke(app, ["analyze", str(ET_TRACE), "--execution-trace", str(path), "--out",
                                          str(tmp_path / "run")])  # fmt: skip
        assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output
        assert not (tmp_path / "run").exists()
