"""Measure a model variant on the run's workload: wall time per step unprofiled, GPU time and kernels per step from one
profiled pass, and peak memory.

The host's speed drifts during a run (an empty Triton launch measured 10–22 µs in different calls on the H200 host),
so `apply` interleaves variants round by round (`interleaved`), rather than timing each in a block, and reverses the
order every other round (A B C, C B A, ...) so a drift that is steady over a round favours no position. A speedup
is the ratio of the fastest rounds (`fastest_speedup`): the H200 host runs in slow spells of several seconds (a
llama-3.1-8b decode step at 28–30 ms in one round, 48–55 ms in the next, for the same variant, 2026-12-01), which
only ever add time, so a variant's fastest round is the one least disturbed, and neither a median of three nor
each round's own ratio (its baseline ran seconds apart) is safe from them. GPU time comes
from a profiled pass (kernel durations are not slowed by the profiler; the host is, so the profiled pass never gives
wall time).
"""

from __future__ import annotations

import gc
import gzip
import json
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fusionscope import capture
from fusionscope.gpu_replay import busy_us
from fusionscope.models import Workload

# Trace categories of the host calls that launch kernels: the runtime API (aten's kernels) and the driver API
# (`cuLaunchKernel`, how Triton launches).
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
Variant = Callable[[], AbstractContextManager[Any]]  # enters the variant's patch (a no-op for the baseline)


@dataclass
class Measurement:
    """One variant's figures per phase. `wall_ms` holds one median per round (the spread is across rounds)."""

    wall_ms: dict[str, list[float]] = field(default_factory=dict)
    gpu_ms: dict[str, float | None] = field(default_factory=dict)
    kernels: dict[str, float | None] = field(default_factory=dict)
    peak_mib: float | None = None

    def wall(self, phase: str) -> float | None:
        values = self.wall_ms.get(phase) or []
        return statistics.median(values) if values else None

    def spread(self, phase: str) -> tuple[float, float] | None:
        values = self.wall_ms.get(phase) or []
        return (min(values), max(values)) if values else None


def fastest_speedup(baseline: Measurement, variant: Measurement, phase: str) -> float | None:
    """The baseline's fastest round ÷ the variant's fastest round (see the module docstring for why not medians)."""
    base, var = baseline.wall_ms.get(phase) or [], variant.wall_ms.get(phase) or []
    return min(base) / min(var) if base and var and min(var) > 0 else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(workload: Workload, variants: dict[str, Variant], repeats: int, sampler: Any = None,
                on_round: Callable[[int, str], None] | None = None) -> dict[str, Measurement]:  # fmt: skip
    """Time every variant `repeats` times, round by round (A B C, C B A, A B C, ...), one timed pass per variant per
    round; each pass's per-step medians per phase. Peak memory is the highest seen in any of the variant's passes."""
    results = {name: Measurement() for name in variants}
    cuda = workload.device.type == "cuda"
    for r in range(repeats):
        order = list(variants.items())
        for name, enter in order if r % 2 == 0 else order[::-1]:
            if on_round:
                on_round(r, name)
            with enter():
                gc.collect()  # not inside the timed pass: a full collection there would land on one variant
                if cuda:
                    _sync(workload.device)
                    torch.cuda.reset_peak_memory_stats(workload.device)
                times = capture.timed_pass(workload, sampler)
                if cuda:
                    peak = torch.cuda.max_memory_allocated(workload.device) / 2**20
                    results[name].peak_mib = max(results[name].peak_mib or 0.0, peak)
            for phase, values in times.items():
                results[name].wall_ms.setdefault(phase, []).append(statistics.median(values))
    return results


def gpu_figures(workload: Workload, folder: Path, name: str, sampler: Any = None) -> dict[str, dict[str, float]]:
    """GPU busy ms and kernels per step, per phase (medians over the phase's steps), from one profiled pass. The
    trace is read here without HTA (a few seconds for an 8B pass): kernels are assigned to the step whose range
    holds the runtime call that launched them."""
    path, _steps = capture.profiled_pass(workload, folder, sampler, name=name, detail=False)
    try:
        return step_figures(path)
    finally:
        path.unlink(missing_ok=True)


def step_figures(path: Path) -> dict[str, dict[str, float]]:
    """{phase: {"gpu_ms": busy ms per step, "kernels": kernels per step}} from a Chrome trace written by
    `capture.profiled_pass`."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        events = json.load(f).get("traceEvents", [])
    steps, phases = [], []
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X":
            continue
        if name.startswith(capture.STEP_PREFIX):
            steps.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        elif name.startswith(capture.PHASE_PREFIX):
            phases.append((float(e["ts"]), name.removeprefix(capture.PHASE_PREFIX)))
    steps.sort()
    phases.sort()
    launch_ts = {e["args"]["correlation"]: float(e["ts"]) for e in events
                 if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}  # fmt: skip
    starts = np.array([s for s, _ in steps])
    ends = np.array([e for _, e in steps])
    phase_of = [next((p for ts, p in phases if s <= ts <= e), "") for s, e in steps]
    per_step: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        if ts is None:
            continue
        i = int(np.searchsorted(starts, ts, side="right")) - 1
        if i >= 0 and ts <= ends[i]:
            per_step.setdefault(i, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    figures: dict[str, dict[str, list[float]]] = {}
    for i, phase in enumerate(phase_of):
        spans = per_step.get(i, [])
        busy = busy_us(np.array([s for s, _ in spans]), np.array([e for _, e in spans])) if spans else 0.0
        row = figures.setdefault(phase, {"gpu_ms": [], "kernels": []})
        row["gpu_ms"].append(busy / 1e3)
        row["kernels"].append(float(len(spans)))
    return {phase: {k: float(statistics.median(v)) for k, v in row.items()} for phase, row in figures.items() if phase}


def measured_variants(names: list[str], enter: Callable[[str], AbstractContextManager[Any]]) -> dict[str, Variant]:
    """{name: zero-argument context factory} for `interleaved`."""

    def factory(name: str) -> Variant:
        return lambda: enter(name)

    return {name: factory(name) for name in names}
