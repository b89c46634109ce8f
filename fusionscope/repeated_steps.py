"""The fusion catalogue on a trace whose steps repeat: the dataflow inferred and the catalogue matched once per
distinct op sequence, then mapped onto every step that repeats it, with each step's own times.

`order_graph.infer_dataflow` infers each (step, thread) segment on its own: nothing flows between segments, and
what it infers of one is a function of that segment's ops alone — their order, names, recorded arguments, module
paths, phases and nesting. The matchers (`fusions.find_matches`) only follow edges, so a match never spans two
segments either. Decode and training loops run the same ops step after step, so most segments repeat one
another. Here each segment gets a signature — the sequence, over all its ops in execution order, of (name, input
dims, input types, concrete inputs, module, phase, its parent's place in the segment) — and the inference and the
matchers run on one segment per distinct signature. Each match is then mapped onto every segment with the same
signature by the place of its nodes, and what depends on the step's times (the time, bytes, FLOPs and launches of
its kernels, the host time of its ops: `opportunities.estimate_matches`'s figures) is summed from that segment's
own kernels and ops, vectorised. What follows from shapes alone (`opportunities.fixed_figures`) is taken from the
representative match.

The result is the table `estimate_matches` gives on the whole dataflow, row for row and bit for bit
(`tests/test_repeated_steps.py`). A trace where an op's parent lies in another segment (a range spanning two
steps) is left to the plain path (`match` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fusionscope import dataflow_nodes, opportunities, order_graph
from fusionscope.fusions import Graph, Match, find_matches
from fusionscope.trace_events import distinct_objects, value_codes

ORDER = ["step", "tid", "ts_us", "dur_us"]  # the order `order_graph.node_ops` walks a segment's ops in
ASCENDING = [True, True, True, False]
CONTENT = ("input_dims", "input_type", "concrete_inputs")  # argument lists: compared by their text
LABELS = ("name", "module", "phase")  # strings: compared by value
MATCH_COLUMNS = ["fusion", "phase", "step", "module", "t_now_us", "bytes_now", "launches_now", "t_fused_us",
                 "bytes_fused", "launches_fused", "ops_now", "host_now_us", "escaping", "unjoined",
                 "rejected"]  # fmt: skip


@dataclass(frozen=True)
class Segments:
    """A timeline's ops with a step, in (step, thread, time) order, cut into segments (one step's ops on one
    thread) and grouped by signature.

    `frame` holds the ops in that order; segment s is rows `start[s]:start[s + 1]`; `group[s]` the signature it
    shares with the segments of the same group; `first[g]` the first segment of group g (its representative)."""

    frame: pd.DataFrame
    start: np.ndarray  # one more entry than segments: the end of the last
    group: np.ndarray
    first: np.ndarray

    @property
    def count(self) -> int:
        return len(self.group)

    def segment_of(self, rows: np.ndarray) -> np.ndarray:
        """The segment of each of these rows of `frame`."""
        return np.searchsorted(self.start, rows, side="right") - 1

    def local(self, rows: np.ndarray) -> np.ndarray:
        """Rows of `frame` as places in their segment."""
        return rows - self.start[self.segment_of(rows)]


def segments(ops: pd.DataFrame) -> Segments | None:
    """The ops of a one-rank timeline cut into segments and grouped by signature (module docstring); None where an
    op's parent lies outside its segment (or several ranks are given)."""
    if "rank" in ops and ops["rank"].nunique() > 1:
        return None
    stepped = ops["step"].to_numpy() >= 0
    frame = ops if stepped.all() else ops[stepped]
    if not _in_order([frame[c].to_numpy() for c in ORDER], ASCENDING):
        frame = frame.sort_values(ORDER, ascending=ASCENDING, kind="stable")
    if not frame.index.equals(pd.RangeIndex(len(frame))):
        frame = frame.reset_index(drop=True)
    n = len(frame)
    step, tid = frame["step"].to_numpy(), frame["tid"].to_numpy()
    cut = np.flatnonzero((step[1:] != step[:-1]) | (tid[1:] != tid[:-1])) + 1 if n else np.zeros(0, np.int64)
    start = np.concatenate([[0], cut, [n]]).astype(np.int64) if n else np.zeros(1, np.int64)
    segment = np.repeat(np.arange(len(start) - 1), np.diff(start))
    parent = _parents(ops, frame)
    if parent is None:
        return None
    has_parent = parent >= 0
    if (segment[parent[has_parent]] != segment[has_parent]).any():
        return None
    local_parent = np.where(has_parent, parent - start[segment] if n else parent, -1)
    keys = np.column_stack([*(_text_codes(frame[c].to_numpy()) if c in frame else np.zeros(n, np.int64)
                              for c in CONTENT),
                            *(value_codes(frame[c].to_numpy())[0] for c in LABELS),
                            local_parent]).astype(np.int64)  # fmt: skip
    groups: dict[bytes, int] = {}
    group = np.empty(len(start) - 1, dtype=np.int64)
    first = []
    for s in range(len(start) - 1):
        signature = keys[start[s] : start[s + 1]].tobytes()
        g = groups.setdefault(signature, len(groups))
        if g == len(first):
            first.append(s)
        group[s] = g
    return Segments(frame, start, group, np.asarray(first, dtype=np.int64))


def _in_order(columns: list[np.ndarray], ascending: list[bool]) -> bool:
    """Whether the rows are already in the order a stable sort by these columns gives (then it is skipped: the join
    leaves the ops of a one-thread trace in that order, and at a million events the filter, sort and copy took a
    sixth of a second). NaN compares neither way: such rows are left to the sort."""
    if not len(columns[0]):
        return True
    before, tie = np.zeros(len(columns[0]) - 1, dtype=bool), np.ones(len(columns[0]) - 1, dtype=bool)
    for values, up in zip(columns, ascending, strict=True):
        a, b = values[:-1], values[1:]
        before |= tie & ((a < b) if up else (a > b))
        tie &= a == b
    return bool((before | tie).all())


def _parents(ops: pd.DataFrame, frame: pd.DataFrame) -> np.ndarray | None:
    """Each row's parent op as a row of `frame` (-1: none, or the parent has no step); None when an op without a
    step has a parent with one (nothing could then map that parent's segment alone)."""
    rows = pd.Index(frame["op_id"].to_numpy())
    if not rows.is_unique:
        return None
    parent = rows.get_indexer(frame["parent_op"].to_numpy())
    stepless = ops[ops["step"] < 0]
    if len(stepless) and (rows.get_indexer(stepless["parent_op"].to_numpy()) >= 0).any():
        return None
    parent_ids = frame["parent_op"].to_numpy()
    outside = (parent < 0) & (parent_ids >= 0) & np.isin(parent_ids, ops["op_id"].to_numpy())
    return None if outside.any() else parent


def _text_codes(values: np.ndarray) -> np.ndarray:
    """One code per distinct text (`repr`) of the values: each distinct object is written out once (`trace_events`
    shares one object per distinct argument list, so a 1M-event trace has a few hundred)."""
    codes, first = distinct_objects(values)
    texts = np.array([repr(values[i]) for i in first.tolist()], dtype=object)
    return pd.factorize(texts)[0][codes] if len(values) else codes


@dataclass(frozen=True)
class Template:
    """A representative match, as places in its segment: its nodes, and the terms of its host time
    (`opportunities.HostSpans.terms`: outermost ops, and gaps between two of them as (op, next op))."""

    match: Match
    nodes: np.ndarray
    outer: np.ndarray
    gaps: np.ndarray  # (k, 2)
    fixed: opportunities.FixedFigures


def match(ops: pd.DataFrame, kernels: pd.DataFrame, roofs: dict, device_kind: str) -> tuple[pd.DataFrame, int] | None:
    """`estimate_matches` of `find_matches` on `order_graph.infer_dataflow(ops)`, and the node count, inferred and
    matched once per distinct segment (module docstring); None where the ops do not allow it (`segments`).
    `roofs` as `estimate_matches` takes them (`copy_gbps`, `tflops`)."""
    seg = segments(ops)
    if seg is None:
        return None
    rep_rows = [np.arange(seg.start[s], seg.start[s + 1]) for s in seg.first.tolist()]
    rep_ops = seg.frame.iloc[np.concatenate(rep_rows) if rep_rows else np.zeros(0, np.int64)]
    nodes = order_graph.infer_dataflow(rep_ops, device_kind)
    if not len(nodes):
        return pd.DataFrame(), 0
    row_of_op = pd.Index(seg.frame["op_id"].to_numpy())
    node_segment = seg.segment_of(row_of_op.get_indexer(nodes["op_id"].to_numpy()))
    starts = np.flatnonzero(np.concatenate([[True], node_segment[1:] != node_segment[:-1]]))
    node_place = np.arange(len(nodes)) - np.repeat(starts, np.diff(np.append(starts, len(nodes))))
    counts = np.bincount(seg.group[node_segment], minlength=len(seg.first))[seg.group]  # nodes per segment
    base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # each segment's first node
    owner_rep = dataflow_nodes.op_owners(nodes, rep_ops)
    owner = _owners(seg, owner_rep, row_of_op, node_place, nodes, base)
    matches = find_matches(Graph(nodes))
    if not matches:
        return pd.DataFrame(), int(counts.sum())
    templates = _templates(matches, nodes, rep_ops, owner_rep, seg, row_of_op, node_place, node_segment, roofs)
    return _estimate(templates, seg, owner, base, int(counts.sum()), kernels, roofs), int(counts.sum())


def _owners(seg: Segments, owner_rep: pd.Series, row_of_op: pd.Index, node_place: np.ndarray, nodes: pd.DataFrame,
            base: np.ndarray) -> np.ndarray:  # fmt: skip
    """The node (numbered over all segments) that owns each row of `seg.frame`, -1 for none: the representative's
    owner at the same place, in the segment's own numbering."""
    rep_local = np.full(len(seg.frame), -1, dtype=np.int64)  # representative rows: the owner's place among its nodes
    rows = row_of_op.get_indexer(owner_rep.index.to_numpy())
    owned = owner_rep.to_numpy()
    keep = (rows >= 0) & (owned >= 0)
    rep_local[rows[keep]] = node_place[pd.Index(nodes["node"].to_numpy()).get_indexer(owned[keep])]
    segment = seg.segment_of(np.arange(len(seg.frame)))
    rep_row = seg.start[seg.first[seg.group[segment]]] + (np.arange(len(seg.frame)) - seg.start[segment])
    local = rep_local[rep_row]
    return np.where(local >= 0, local + base[segment], -1)


def _templates(matches: list[Match], nodes: pd.DataFrame, rep_ops: pd.DataFrame, owner_rep: pd.Series, seg: Segments,
               row_of_op: pd.Index, node_place: np.ndarray, node_segment: np.ndarray,
               roofs: dict) -> list[tuple[str, int, Template]]:  # fmt: skip
    """Each representative match as (fusion, group, `Template`), in `find_matches`' order."""
    columns = opportunities.node_columns(nodes)
    peaks = {k: v for k, v in (roofs.get("tflops") or {}).items() if v}
    host = opportunities.HostSpans(rep_ops, owner_rep)
    terms = [host.terms(list(m.counted)) for m in matches]
    # each kind of place looked up once for all matches: an index look-up per match cost more than the match
    places = _looked_up(pd.Index(nodes["node"].to_numpy()), [list(m.counted) for m in matches])
    outer_rows = _looked_up(row_of_op, [outer for outer, _gaps in terms])
    gap_rows = _looked_up(row_of_op, [[op for pair in gaps for op in pair] for _outer, gaps in terms])
    out = []
    for m, at, outer, gaps in zip(matches, places, outer_rows, gap_rows, strict=True):
        template = Template(m, node_place[at], seg.local(outer), seg.local(gaps).reshape(-1, 2),
                            opportunities.fixed_figures(m, columns, peaks))  # fmt: skip
        out.append((m.fusion, int(seg.group[node_segment[at[0]]]), template))
    return out


def _looked_up(index: pd.Index, keys: list[list[int]]) -> list[np.ndarray]:
    """`index.get_indexer(k)` of each list of keys, in one look-up."""
    if not keys:
        return []
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    found = index.get_indexer([key for part in keys for key in part]) if lengths.sum() else np.zeros(0, np.int64)
    return np.split(found.astype(np.int64), np.cumsum(lengths)[:-1])


def _estimate(templates: list[tuple[str, int, Template]], seg: Segments, owner: np.ndarray, base: np.ndarray,
              node_total: int, kernels: pd.DataFrame, roofs: dict) -> pd.DataFrame:  # fmt: skip
    """`estimate_matches`' table: each template mapped onto every segment of its group, in the order
    `find_matches` gives on the whole dataflow (by catalogue entry, then by segment, then as the entry found them)."""
    by_entry: dict[str, dict[int, list[int]]] = {}
    for t, (fusion, group, _template) in enumerate(templates):
        by_entry.setdefault(fusion, {}).setdefault(group, []).append(t)
    picked, where = [], []  # the template and the segment of each row
    for per_group in by_entry.values():
        for s, g in enumerate(seg.group.tolist()):
            for t in per_group.get(g, ()):
                picked.append(t)
                where.append(s)
    rows = len(picked)
    chosen = [templates[t][2] for t in picked]
    where_a = np.asarray(where, dtype=np.int64)

    per_node = opportunities.kernel_sums(kernels, pd.Series(owner, index=seg.frame["op_id"].to_numpy()))
    sums = {}
    for col in ("dur_us", "bytes", "flops", "launches"):  # NaN (no kernel has the figure) adds nothing, as 0
        known = per_node[col]
        known = known[(known.index >= 0) & known.notna()]
        sums[col] = np.zeros(node_total, dtype=np.float64)
        sums[col][known.index.to_numpy()] = known.to_numpy(dtype=np.float64)
    ops_per_node = np.bincount(owner[owner >= 0], minlength=node_total).astype(np.float64)

    row, node = _flat([c.nodes for c in chosen], base[where_a])

    def total(values: np.ndarray) -> np.ndarray:
        """Per row, its nodes' values added one by one in the match's node order, as `estimate_matches` adds."""
        return np.bincount(row, weights=values[node], minlength=rows)

    flops = total(sums["flops"])
    fixed_bytes = np.array([c.fixed.bytes_fused for c in chosen], dtype=np.int64)
    peak = np.array([c.fixed.peak for c in chosen], dtype=np.float64)
    floor_us = float(kernels["dur_us"].quantile(0.05)) if len(kernels) else 0.0
    memory, compute = fixed_bytes / (float(roofs["copy_gbps"]) * 1e3), flops / (peak * 1e6)
    return pd.DataFrame({
        "fusion": [c.match.fusion for c in chosen], "phase": [c.match.phase for c in chosen],
        "step": seg.frame["step"].to_numpy()[seg.start[where_a]].astype(np.int64),
        "module": [c.match.anchor_module for c in chosen], "t_now_us": total(sums["dur_us"]),
        "bytes_now": total(sums["bytes"]), "launches_now": total(sums["launches"]).astype(np.int64),
        "t_fused_us": np.where(compute > memory, compute, memory) + floor_us, "bytes_fused": fixed_bytes,
        "launches_fused": np.ones(rows, dtype=np.int64), "ops_now": total(ops_per_node).astype(np.int64),
        "host_now_us": _host(chosen, seg, where_a),
        "escaping": np.array([len(c.match.escaping) for c in chosen], dtype=np.int64),
        "unjoined": np.array([c.fixed.unjoined for c in chosen], dtype=np.int64),
        "rejected": [c.match.rejected for c in chosen],
    }, columns=MATCH_COLUMNS)  # fmt: skip


def _flat(parts: list[np.ndarray], offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, value + that row's offset) for every entry of every row's part, row by row in order."""
    lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    row = np.repeat(np.arange(len(parts)), lengths)
    values = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return row, values + np.repeat(offsets, lengths)


def _host(chosen: list[Template], seg: Segments, where: np.ndarray) -> np.ndarray:
    """`HostSpans.group_us` of every row: its outermost ops' durations, then each gap between two with nothing
    foreign between them (never below 0), added in that order, from the row's own segment's times."""
    ts, dur = seg.frame["ts_us"].to_numpy(dtype=float), seg.frame["dur_us"].to_numpy(dtype=float)
    offsets = seg.start[where]
    outer_row, outer = _flat([c.outer for c in chosen], offsets)
    gap_row, first = _flat([c.gaps[:, 0] for c in chosen], offsets)
    _same, second = _flat([c.gaps[:, 1] for c in chosen], offsets)
    gap = ts[second] - ts[first] - dur[first]
    gap = np.where(gap < 0.0, 0.0, gap)  # max(gap, 0.0), as group_us takes it
    term_row = np.concatenate([outer_row, gap_row])  # a row's durations, then its gaps: one bincount, in that order
    order = np.argsort(term_row, kind="stable")
    values = np.concatenate([dur[outer], gap])
    return np.bincount(term_row[order], weights=values[order], minlength=len(chosen))
