"""From catalogue matches to what each fusion is worth: bytes, launches and time now vs fused, per phase, and the
end-to-end speedup through the regime-aware Amdahl model (`fusionscope.amdahl`).

Time now is measured: the kernels of the group's ops in the timed pass (a node owns the kernels of its op and of the
ops nested inside it, `dataflow.op_owners`). Fused time is analytic: max(bytes / copy bandwidth, FLOPs / peak) plus
a floor for one launch on the GPU (the 5th percentile of the run's kernel durations: what the shortest kernels cost
here). Fused bytes are counted on the dataflow: every tensor entering the group read once, every tensor leaving it
— the intended outputs and any intermediate read outside the group — written once. The group is the match's nodes
and what its kernel's binding takes too (`Match.bound`: a static cache's writes, a partial rotary's re-join); time
now also holds the nodes its replacement leaves without a reader (`Match.dropped`: a mask only the attention read),
whose outputs are not charged as read. An in-place row write into a buffer (`index_copy_(cache, dim, slots, rows)`,
a static KV cache's update) moves its rows, not the buffer: its destination is not charged as read, and its output
is charged at the rows' size (`ROW_WRITES`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import NamedTuple

import numpy as np
import pandas as pd

from fusionscope import amdahl
from fusionscope.dataflow_nodes import op_owners
from fusionscope.fusions import Match

ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
                 "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip
COLUMNS = ["fusion", "phase", "count", "module_paths", "t_now_us", "t_fused_us", "saved_us", "bytes_now", "bytes_fused",
           "launches_now", "launches_fused", "speedup_gpu", "speedup_wall", "confidence", "reason", "micro_now_us",
           "micro_fused_us", "micro_note"]  # fmt: skip


DATAFLOW = "dataflow"  # an opportunity's basis when the finder ran on recorded tensor identities (`profile`)
PER_STEP = (
    "t_now_us",
    "t_fused_us",
    "bytes_now",
    "bytes_fused",
    "launches_now",
    "launches_fused",
    "ops_now",
    "host_now_us",
)


def _tensor_bytes(shape: tuple, dtype: str) -> int:
    return math.prod(shape) * ELEMENT_BYTES.get(str(dtype), 4)


# in-place row writes → the input holding the rows written (input 0 is the buffer written into)
ROW_WRITES = {"aten::index_copy_": 2}


def fused_bytes(nodes: dict[str, dict], match: Match, outputs: set[int]) -> int:
    """Bytes a fused kernel must move for `match` (its nodes and what its binding takes too, `Match.replaced`): external
    inputs once each, except those only dropped nodes made, intended and escaping outputs once.
    `nodes` maps a column name to {node id: value} (see `node_columns`)."""
    group, unread = set(match.replaced), _unread(nodes, match)
    seen: set[tuple] = set()
    total = 0
    for n in match.replaced:
        rows = ROW_WRITES.get(nodes["name"][n])
        for i, (producer, shape, dtype) in enumerate(
            zip(nodes["inputs"][n], nodes["input_shapes"][n], nodes["input_dtypes"][n])
        ):
            if producer in group or producer in unread or (rows is not None and i == 0):
                continue
            key = (producer, tuple(shape)) if producer >= 0 else (n, i)
            if key not in seen:
                seen.add(key)
                total += _tensor_bytes(tuple(shape), dtype)
    for n in outputs | set(match.escaping):
        rows = ROW_WRITES.get(nodes["name"][n])
        if rows is not None and len(nodes["input_shapes"][n]) > rows:
            total += _tensor_bytes(tuple(nodes["input_shapes"][n][rows]), nodes["input_dtypes"][n][rows])
            continue
        total += sum(_tensor_bytes(tuple(s), d) for s, d in zip(nodes["output_shapes"][n], nodes["output_dtypes"][n]))
    return total


def _unread(nodes: dict[str, dict], match: Match) -> set[int]:
    """The dropped nodes whose outputs the fused kernel does not read: those computing something, and views of them. A
    dropped view of anything else (a Linear's `t` of its weight, which the kernel reads untransposed) still hands
    over bytes the kernel reads."""
    dropped, is_view, inputs = set(match.dropped), nodes["is_view"], nodes["inputs"]
    unread = set()
    for n in match.dropped:
        source = n
        while source in dropped and is_view[source] and inputs[source]:
            source = inputs[source][0]
        if source in dropped and not is_view[source]:
            unread.add(n)
    return unread


def _group_outputs(consumers: dict[int, tuple], match: Match) -> set[int]:
    """Nodes of the group (with what its binding takes too) whose output leaves it (read outside, or read by nobody: a
    model output)."""
    group = set(match.replaced)
    return {n for n in match.replaced if not consumers[n] or not set(consumers[n]) <= group}


_NODE_COLUMNS = ("name", "inputs", "input_shapes", "input_dtypes", "output_shapes", "output_dtypes", "consumers",
                 "op_id", "is_view")  # fmt: skip


class HostSpans:
    """The host time a group of ops costs in the profiled step: the durations of its outermost ops plus the gaps
    between two of them that nothing else runs in (the Python of a module's forward between its ops, which a fused
    forward removes too). Gaps with a foreign op inside stay: that op and its Python are not the group's.

    Why not ops × the phase's mean host cost per op: the mean spreads over the ops all the host time spent outside
    them — module calls, cache updates, the decoder layer's own Python; 48% of the profiled decode step of
    tests/data/llama-3.2-1b-cuda.trace.json.gz (H200) — and a norm's cheap elementwise ops cost less than the mean."""

    def __init__(self, ops: pd.DataFrame, owner: pd.Series) -> None:
        ordered = ops.sort_values(["tid", "ts_us", "dur_us"], ascending=[True, True, False], kind="stable")
        ids = ordered["op_id"].tolist()
        self._position = dict(zip(ids, range(len(ids))))
        self._ts = dict(zip(ids, ordered["ts_us"].tolist()))
        self._dur = dict(zip(ids, ordered["dur_us"].tolist()))
        self._parent = dict(zip(ids, ordered["parent_op"].tolist()))
        self._by_node: dict[int, list[int]] = {}
        for op_id, node in owner.items():
            if node >= 0 and op_id in self._position:
                self._by_node.setdefault(int(node), []).append(int(op_id))

    def group_us(self, nodes: list[int]) -> float:
        outer, gaps = self.terms(nodes)
        total = sum(self._dur[op] for op in outer)
        for a, b in gaps:
            total += max(self._ts[b] - self._ts[a] - self._dur[a], 0.0)
        return float(total)

    def terms(self, nodes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """What `group_us` sums: the group's outermost ops in order (their durations), and the pairs of consecutive
        ones with nothing foreign between them (the gap from the first's end to the second's start). They depend on
        the ops' order and nesting alone, not on their times, so a step that repeats another's ops has the same terms
        (`repeated_steps`)."""
        members = {op for n in nodes for op in self._by_node.get(n, ())}
        if not members:
            return [], []
        positions = sorted(self._position[op] for op in members)
        outer = sorted((op for op in members if self._parent[op] not in members), key=self._position.get)
        gaps = []
        for a, b in itertools.pairwise(outer):
            pa, pb = self._position[a], self._position[b]
            inside = bisect.bisect_right(positions, pb) - bisect.bisect_left(positions, pa)
            if inside == pb - pa + 1:  # nothing foreign between them
                gaps.append((a, b))
        return outer, gaps


def node_columns(joined: pd.DataFrame) -> dict[str, dict]:
    """{column: {node id: value}} of the dataflow columns the estimates read."""
    ids = joined["node"].tolist()
    return {col: dict(zip(ids, joined[col].tolist())) for col in _NODE_COLUMNS}


def kernel_sums(kernels: pd.DataFrame, owner: pd.Series) -> pd.DataFrame:
    """Per node (index; -1 for kernels no node owns), the summed duration, bytes, FLOPs and count of its kernels
    (`owner`: op_id → node, `dataflow.op_owners`); NaN where none of its kernels has the figure."""
    return (
        kernels[["dur_us", "bytes", "flops"]]  # not a copy of every column
        .assign(node=kernels["op_id"].map(owner).fillna(-1).astype(np.int64), launches=1)
        .groupby("node")[["dur_us", "bytes", "flops", "launches"]]
        .sum(min_count=1)
    )


def estimate_matches(matches: list[Match], joined: pd.DataFrame, ops: pd.DataFrame, kernels: pd.DataFrame,
                     roofs: dict) -> pd.DataFrame:  # fmt: skip
    """One row per match: measured time, bytes and launches of its kernels now, and the analytic fused figures.

    Kernel figures are summed per node once, then per match from dictionaries: the cost is linear in nodes and
    matches (about 40k nodes a second on the 2-core CPU), not in matches × kernels.
    """
    nodes = node_columns(joined)
    owner = op_owners(joined, ops)
    per_node = kernel_sums(kernels, owner)
    node_sums = {col: per_node[col].to_dict() for col in per_node.columns}
    ops_per_node = ops["op_id"].map(owner).value_counts().to_dict()
    host = HostSpans(ops, owner)
    floor_us = float(kernels["dur_us"].quantile(0.05)) if len(kernels) else 0.0
    bandwidth = float(roofs["copy_gbps"]) * 1e3  # bytes per µs
    peaks = {k: v for k, v in (roofs.get("tflops") or {}).items() if v}
    rows = []
    for match in matches:

        def total(col: str, match: Match = match) -> float:
            values = (node_sums[col].get(n) for n in match.counted)
            return float(sum(v for v in values if v is not None and v == v))

        fixed = fixed_figures(match, nodes, peaks)
        flops = total("flops")
        rows.append({
            "fusion": match.fusion, "phase": match.phase, "step": match.step, "module": match.anchor_module,
            "t_now_us": total("dur_us"), "bytes_now": total("bytes"), "launches_now": int(total("launches")),
            "t_fused_us": max(fixed.bytes_fused / bandwidth, flops / (fixed.peak * 1e6)) + floor_us,
            "bytes_fused": fixed.bytes_fused, "launches_fused": 1,
            "ops_now": int(sum(ops_per_node.get(n, 0) for n in match.counted)),
            "host_now_us": host.group_us(list(match.counted)),
            "escaping": len(match.escaping), "unjoined": fixed.unjoined, "rejected": match.rejected,
        })  # fmt: skip
    return pd.DataFrame(rows)


class FixedFigures(NamedTuple):
    """A match's figures that follow from its nodes' shapes and dtypes alone, not from the times of its kernels: the
    same for every step that repeats the match's ops (`repeated_steps`)."""

    bytes_fused: int
    peak: float  # TFLOP/s of the dtype the group computes in
    unjoined: int  # nodes (views aside) not joined to a timed op


def fixed_figures(match: Match, nodes: dict[str, dict], peaks: dict[str, float]) -> FixedFigures:
    """`match`'s `FixedFigures`; `nodes` maps a column name to {node id: value} (`node_columns`), `peaks` the roofs'
    nonzero TFLOP/s by dtype."""
    outputs = _group_outputs(nodes["consumers"], match) - set(match.escaping)
    dtypes = nodes["input_dtypes"][match.nodes[0]]
    peak = peaks.get(str(dtypes[0]) if dtypes else "") or peaks.get("float32") or 1.0
    unjoined = sum(int(nodes["op_id"][n]) < 0 for n in match.nodes if not nodes["is_view"][n])
    return FixedFigures(fused_bytes(nodes, match, outputs), peak, unjoined)


def _confidence(group: pd.DataFrame) -> tuple[str, str]:
    if group["rejected"].astype(bool).any():
        return "low", str(group.loc[group["rejected"].astype(bool), "rejected"].iat[0])
    reasons = []
    if group["escaping"].sum():
        reasons.append("an intermediate is read outside the group: its write is charged to the fused kernel")
    if group["unjoined"].sum():
        reasons.append(f"{int(group['unjoined'].sum())} node(s) not joined to the timed pass: time now undercounted")
    if reasons:
        return "medium", "; ".join(reasons)
    return "high", "measured kernels of every op in the group; fused time from the measured roofs"


def summarize_opportunities(per_match: pd.DataFrame, phases: dict[str, dict], roofs: dict) -> tuple[list[dict], dict]:
    """Per (fusion, phase): per-step figures and end-to-end speedups; and per phase the cumulative plan (all
    accepted fusions together, in catalogue order, as a waterfall) — for every phase with a step model or, on CPU
    runs, a wall time, even one without matches."""
    opportunities: list[dict] = []
    cumulative: dict[str, dict] = {}
    by_phase = dict(tuple(per_match.groupby("phase", sort=False))) if not per_match.empty else {}
    for phase in dict.fromkeys([*by_phase, *phases]):
        rows, plan = _summarize_phase(phase, by_phase.get(phase), phases.get(phase, {}), roofs)
        opportunities += rows
        if plan is not None:
            cumulative[phase] = plan
    return opportunities, cumulative


def _summarize_phase(phase: str, in_phase: pd.DataFrame | None, figures: dict,
                     roofs: dict) -> tuple[list[dict], dict | None]:  # fmt: skip
    """One phase's opportunity rows and its cumulative plan (None without a step model or a wall time).

    On GPU runs the plan puts the accepted fusions' savings together through the step model; a CUDA graph is then
    worth its share of the *fused* step (`cuda_graph_share`), what is left of the host time once the fusions removed
    their ops — `cuda_graph_share_unfused` is what a graph alone would remove. On CPU runs the ops are the timeline
    and run one after another, so the profiled step is their sum and a saving shortens it one for one; there is no
    GPU speedup, no step model and no graph."""
    model = amdahl.step_model(figures, roofs)
    cpu_wall = None if model is not None or not figures.get("wall_ms_per_step") else 1e3 * figures["wall_ms_per_step"]
    rows: list[dict] = []
    saved_gpu = saved_ops = added = saved_host = 0.0
    waterfall = []
    groups = in_phase.groupby("fusion", sort=False) if in_phase is not None else ()
    for fusion, group in groups:
        # per step: sum over the step's matches, then the median over the phase's steps (one slow step — a
        # first call, a page fault — must not set the figure)
        by_step = group.groupby("step")[list(PER_STEP)].sum()
        per_step = {k: float(by_step[k].median()) for k in PER_STEP}
        saved = max(per_step["t_now_us"] - per_step["t_fused_us"], 0.0)
        confidence, reason = _confidence(group)
        row = {"fusion": fusion, "phase": phase, "count": float(group.groupby("step").size().median()),
               "module_paths": sorted(set(group["module"])), **per_step, "saved_us": saved,
               "speedup_gpu": None, "speedup_wall": None, "confidence": confidence, "reason": reason}  # fmt: skip
        accepted = confidence != "low"
        if accepted:
            saved_gpu += saved
            saved_ops += per_step["ops_now"]
            saved_host += per_step["host_now_us"]
            added += per_step["launches_fused"]
        if cpu_wall is not None:
            row.update(speedup_wall=cpu_wall / max(cpu_wall - saved, 1e-9))
            if accepted:
                waterfall.append({"fusion": fusion, "speedup_gpu": None,
                                  "speedup_wall": cpu_wall / max(cpu_wall - saved_gpu, 1e-9)})  # fmt: skip
        if model is not None:
            gain = amdahl.speedup(
                model, saved, per_step["ops_now"], per_step["launches_fused"], per_step["host_now_us"]
            )
            row.update(speedup_gpu=gain.gpu, speedup_wall=gain.wall)
            if accepted:
                total = amdahl.speedup(model, saved_gpu, saved_ops, added, saved_host)
                waterfall.append({"fusion": fusion, "speedup_gpu": total.gpu, "speedup_wall": total.wall})
        rows.append(row)
    if model is not None:
        after = amdahl.fused(model, saved_gpu, saved_ops, added, saved_host)
        plan = {"waterfall": waterfall, "paced_by": model.paced_by, "fused_paced_by": after.paced_by,
                "cuda_graph_share": amdahl.cuda_graph_share(after),
                "cuda_graph_share_unfused": amdahl.cuda_graph_share(model),
                "step_model": model.figures(), "fused_step_model": after.figures()}  # fmt: skip
    elif cpu_wall is not None:
        plan = {"waterfall": waterfall, "paced_by": None, "fused_paced_by": None, "cuda_graph_share": None,
                "cuda_graph_share_unfused": None, "step_model": None, "fused_step_model": None}  # fmt: skip
    else:
        plan = None
    return rows, plan


def opportunities_table(opportunities: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(opportunities, columns=[*COLUMNS, "ops_now", "host_now_us", "basis"])
    table["basis"] = table["basis"].fillna(DATAFLOW)
    table["module_paths"] = table["module_paths"].map(lambda paths: " ".join(paths) if isinstance(paths, list) else "")
    return table
