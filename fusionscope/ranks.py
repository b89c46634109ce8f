"""Cross-rank figures of a multi-rank trace: step time per rank, the straggler of each step, and communication
against computation, as pure functions over each rank's intervals.

Communication is what a collective occupies: on GPU traces the NCCL kernels (`ncclKernel*`, `ncclDevKernel*`)
against every other kernel; on CPU-only traces (gloo) the collective ops and ranges (`c10d::*`, `gloo:*`, `nccl:*`,
`record_param_comms`) against every other aten op, as CPU time. A blocking collective makes every rank leave the step
when the slowest one arrives, so step times come out nearly equal; the rank the others wait for is the one with the
most time *outside* communication. That is the straggler here, and its excess is over the median rank of that step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median

from fusionscope.markers import STEP_PREFIX
from fusionscope.trace_fields import to_float

NCCL_KERNEL_PREFIXES = ("ncclKernel", "ncclDevKernel")
CPU_COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
CPU_EVENT_CATS = ("cpu_op", "user_annotation")

Interval = tuple[float, float]  # (start µs, end µs)


@dataclass(frozen=True)
class RankIntervals:
    """One rank's timeline reduced to what cross-rank figures need; `source` says what counts as communication."""

    rank: int
    source: str  # "kernels" (GPU: NCCL kernels vs other kernels) or "cpu ops" (collective ops vs other ops)
    steps: dict[int, Interval] = field(default_factory=dict)  # ProfilerStep#N windows; one window without markers
    compute: list[Interval] = field(default_factory=list)
    comm: list[Interval] = field(default_factory=list)


def is_collective(name: str, cat: str) -> bool:
    """Whether an event is communication: an NCCL kernel on the GPU, a collective op or range on the CPU."""
    if cat == "kernel":
        return name.startswith(NCCL_KERNEL_PREFIXES)
    return name.startswith(CPU_COLLECTIVE_PREFIXES)


def rank_intervals(rank: int, events: Iterable[dict]) -> RankIntervals:
    """Split a trace's complete events ("ph": "X") into step windows, computation and communication. Kernels
    decide when there are any (GPU trace); otherwise CPU ops and ranges do. A trace without step markers is one
    step, 0, spanning its timed events."""
    timed = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]
    gpu = any(e.get("cat") == "kernel" for e in timed)
    steps: dict[int, Interval] = {}
    compute: list[Interval] = []
    comm: list[Interval] = []
    for e in timed:
        name, cat = str(e.get("name", "")), e.get("cat")
        start, length = to_float(e["ts"]), to_float(e["dur"])
        if not (math.isfinite(start) and math.isfinite(length)):
            continue
        span = (start, start + length)
        if cat == "user_annotation" and name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            steps[int(name[len(STEP_PREFIX) :])] = span
        elif (cat == "kernel") if gpu else (cat in CPU_EVENT_CATS):
            if is_collective(name, cat):
                comm.append(span)
            elif cat != "user_annotation":  # other ranges (record_function) are not work of their own
                compute.append(span)
    if not steps and (compute or comm):
        spans = compute + comm
        steps[0] = (min(s for s, _ in spans), max(e for _, e in spans))
    return RankIntervals(rank=rank, source="kernels" if gpu else "cpu ops", steps=steps, compute=compute, comm=comm)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted disjoint ones, so nested or overlapping events count once."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def clip(merged: list[Interval], window: Interval) -> list[Interval]:
    """The parts of disjoint intervals inside a window."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two sorted disjoint interval lists (a two-pointer walk)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def step_figures(ri: RankIntervals) -> dict[int, dict[str, float]]:
    """Per step of one rank: its wall time and, inside it, computation, communication and their overlap, in ms.
    Computation is counted outside communication (`compute_ms` + `comm_ms` never exceed the busy time)."""
    compute, comm = merge(ri.compute), merge(ri.comm)
    out: dict[int, dict[str, float]] = {}
    for step, window in sorted(ri.steps.items()):
        cp, cm = clip(compute, window), clip(comm, window)
        overlap = total(intersect(cp, cm))
        out[step] = {
            "step_ms": (window[1] - window[0]) / 1e3,
            "compute_ms": (total(cp) - overlap) / 1e3,
            "comm_ms": total(cm) / 1e3,
            "overlap_ms": overlap / 1e3,
        }
    return out


def straggler(by_rank: dict[int, float]) -> dict:
    """The rank with the most time outside communication in one step, and its excess over the median rank."""
    slowest = max(sorted(by_rank), key=lambda r: by_rank[r])
    mid = median(by_rank.values())
    excess = by_rank[slowest] - mid
    return {"rank": slowest, "excess_ms": excess, "excess_pct": 100.0 * excess / mid if mid > 0 else None}


def cross_rank(per_rank: dict[int, dict[int, dict[str, float]]], source: str) -> dict:
    """summary.json's cross-rank figures from `step_figures` of every rank: per step (those all ranks recorded) the
    step time and computation per rank and the straggler; per rank the totals of computation, communication and
    overlap; and the rank that straggles in most steps with its mean excess."""
    ranks = sorted(per_rank)
    common = sorted(set.intersection(*(set(per_rank[r]) for r in ranks))) if ranks else []
    steps = []
    for step in common:
        compute = {r: per_rank[r][step]["compute_ms"] for r in ranks}
        steps.append({
            "step": step,
            "step_ms": {str(r): per_rank[r][step]["step_ms"] for r in ranks},
            "compute_ms": {str(r): compute[r] for r in ranks},
            "straggler": straggler(compute),
        })  # fmt: skip
    comm = {}
    for r in ranks:
        sums = {k: sum(f[k] for f in per_rank[r].values()) for k in ("compute_ms", "comm_ms", "overlap_ms")}
        sums["overlap_pct_of_comm"] = 100.0 * sums["overlap_ms"] / sums["comm_ms"] if sums["comm_ms"] > 0 else None
        comm[str(r)] = sums
    return {
        "ranks": ranks,
        "steps": steps,
        "straggler": overall_straggler(steps),
        "communication": {"source": source, "per_rank": comm},
    }


def overall_straggler(steps: list[dict]) -> dict | None:
    """The rank that straggles in the most steps (ties: the lower rank), with its mean excess in those steps."""
    if not steps:
        return None
    counts = Counter(s["straggler"]["rank"] for s in steps)
    rank = min(counts, key=lambda r: (-counts[r], r))
    mine = [s["straggler"] for s in steps if s["straggler"]["rank"] == rank]
    pcts = [m["excess_pct"] for m in mine if m["excess_pct"] is not None]
    return {
        "rank": rank,
        "steps": len(mine),
        "of_steps": len(steps),
        "mean_excess_ms": sum(m["excess_ms"] for m in mine) / len(mine),
        "mean_excess_pct": sum(pcts) / len(pcts) if pcts else None,
    }
