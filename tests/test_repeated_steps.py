"""`repeated_steps` gives the table the plain path gives: the dataflow inferred and the catalogue matched on every
step (`order_graph.infer_dataflow` → `find_matches` → `estimate_matches`), row for row and bit for bit, on traces
whose steps repeat one another and differ (a decode's growing KV cache), on CPU traces and on a training trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusionscope import analyze, opportunities, order_graph, repeated_steps
from fusionscope.fusions import Graph, find_matches

DATA = Path(__file__).resolve().parent / "data"
TRACES = [DATA / "llama-3.2-1b-cuda.trace.json.gz", DATA / "tiny-llama-cuda.trace.json.gz",
          *sorted((DATA / "traces").glob("*.trace.json*"))]  # fmt: skip


def timeline_and_kernels(path: Path) -> tuple:
    facts, doc = analyze.parse_trace(path)
    parsed = analyze.parse_rank(facts, doc)
    timeline, _missing = analyze.fill_steps_and_phases(parsed.timeline, parsed.annotations)
    roofs, _ = analyze.resolve_roofs(facts.gpu_name, facts.device_kind, None)
    bandwidth = {"copy_gbps": float("inf"), "tflops": {}} if roofs is None else roofs
    return timeline, analyze.classify(analyze.kernel_table(timeline), roofs), bandwidth


def plain(timeline, kernels: pd.DataFrame, bandwidth: dict) -> tuple[pd.DataFrame, int]:
    nodes = order_graph.infer_dataflow(timeline.ops, timeline.device_kind)
    matches = find_matches(Graph(nodes)) if len(nodes) else []
    if not matches:
        return pd.DataFrame(), len(nodes)
    return opportunities.estimate_matches(matches, nodes, timeline.ops, kernels, bandwidth), len(nodes)


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_same_table_as_the_plain_path(path: Path) -> None:
    timeline, kernels, bandwidth = timeline_and_kernels(path)
    found = repeated_steps.match(timeline.ops, kernels, bandwidth, timeline.device_kind)
    assert found is not None
    expected, count = plain(timeline, kernels, bandwidth)
    assert found[1] == count
    pd.testing.assert_frame_equal(found[0], expected, check_exact=True)


def test_repeated_steps_share_a_signature_and_growing_ones_do_not() -> None:
    """The 1B decode trace: three steps of one op sequence, then two whose KV length differs from all others."""
    timeline, _kernels, _bandwidth = timeline_and_kernels(TRACES[0])
    seg = repeated_steps.segments(timeline.ops)
    assert seg is not None
    assert seg.group.tolist() == [0, 0, 0, 1, 2]
    assert seg.first.tolist() == [0, 3, 4]


def test_times_of_each_step_are_its_own() -> None:
    """A repeat with slower kernels and ops: the same matches, with that step's times, as the plain path has them."""
    timeline, kernels, bandwidth = timeline_and_kernels(TRACES[0])
    seg = repeated_steps.segments(timeline.ops)
    second = int(seg.frame["step"].iat[seg.start[1]])  # a step that repeats the first one's ops
    slow = kernels["step"] == second
    kernels = kernels.assign(dur_us=np.where(slow, kernels["dur_us"] * 3.0 + 1.0, kernels["dur_us"]))
    ops = timeline.ops
    timeline.ops = ops.assign(dur_us=np.where(ops["step"] == second, ops["dur_us"] * 2.0, ops["dur_us"]))
    found, _count = repeated_steps.match(timeline.ops, kernels, bandwidth, timeline.device_kind)
    expected, _count = plain(timeline, kernels, bandwidth)
    pd.testing.assert_frame_equal(found, expected, check_exact=True)
    by_step = found.groupby("step")["t_now_us"].sum()
    assert by_step[second] > by_step.drop(second).max()


def test_an_op_whose_parent_is_in_another_step_is_left_to_the_plain_path() -> None:
    timeline, kernels, bandwidth = timeline_and_kernels(TRACES[0])
    ops = timeline.ops.copy()
    steps = sorted(ops["step"].unique())
    child = ops.index[ops["step"] == steps[1]][5]
    ops.loc[child, "parent_op"] = int(ops.loc[ops["step"] == steps[0], "op_id"].iat[0])
    assert repeated_steps.segments(ops) is None
    assert repeated_steps.match(ops, kernels, bandwidth, timeline.device_kind) is None
