"""One call profiled on the GPU and read back as its work items: what a replayed CUDA graph runs, and how long the
GPU sits idle between its kernels.

A replayed graph launches no aten op, so its profile holds bare kernels, copies and memsets; these helpers time them
without costing them (`apply.replay` sets each beside the eager step's costed kernel). They sit below the roofs on
purpose: `device` measures the idle time between two kernels of a replayed graph (`graph_gap_us`) with them, and
`apply --graphs` profiles its replayed steps with the same code, so the roof and the figure compared against it are
measured one way. Nothing here imports the rest of the package.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(trace_path: Path) -> pd.DataFrame:
    """The GPU work items of a Chrome trace (kernels, copies, memsets), in start order: name, cat, ts_us, dur_us."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    events = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    rows = [(e.get("name", ""), e["cat"], float(e["ts"]), float(e.get("dur", 0.0)))
            for e in events if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_CATS]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["name", "cat", "ts_us", "dur_us"])
    return frame.sort_values("ts_us", kind="stable").reset_index(drop=True)


def busy_us(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of [start, end) intervals: GPU busy time with overlapping streams counted once."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts)
    s, e = starts[order], ends[order]
    running_end = np.maximum.accumulate(e)
    new_block = np.r_[True, s[1:] > running_end[:-1]]
    block_ids = np.cumsum(new_block) - 1
    block_start = s[new_block]
    block_end = pd.Series(running_end).groupby(block_ids).max().to_numpy()
    return float((block_end - block_start).sum())


def replay_figures(events: pd.DataFrame) -> dict[str, Any]:
    """One replay's totals: kernels (and copies/memsets) per step, GPU busy time (the union of their intervals), the
    span from the first start to the last end, and the idle time inside that span per kernel."""
    if events.empty:
        return {"kernels": 0, "copies": 0, "gpu_busy_ms": 0.0, "span_ms": 0.0, "gap_us_per_kernel": None}
    starts = events["ts_us"].to_numpy(dtype=float)
    ends = starts + events["dur_us"].to_numpy(dtype=float)
    busy = busy_us(starts, ends)
    span = float(ends.max() - starts.min())
    items = len(events)
    return {
        "kernels": int((events["cat"] == "kernel").sum()),
        "copies": int((events["cat"] != "kernel").sum()),
        "gpu_busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "gap_us_per_kernel": (span - busy) / max(items - 1, 1),
    }


def on_the_critical_path(events: pd.DataFrame) -> pd.DataFrame:
    """`events` (in start order) with each `dur_us` cut to the part no earlier item covers: from the later of its
    start and the furthest end before it, to its end. Under programmatic dependent launch (`kernels/pdl.py`) a
    kernel starts while the one before runs and waits for it; its profiled duration then holds that wait, and a
    per-kernel table summing raw durations would count the overlap twice. Cut so, the durations of one stream add
    up to its busy time (`busy_us`), and a kernel's time is what the step spends on it."""
    if events.empty:
        return events
    starts = events["ts_us"].to_numpy(dtype=float)
    ends = starts + events["dur_us"].to_numpy(dtype=float)
    before = np.r_[-np.inf, np.maximum.accumulate(ends)[:-1]]
    return events.assign(dur_us=np.clip(ends - np.maximum(starts, before), 0.0, None))


def profile_gpu(run: Callable[[], Any], folder: Path) -> pd.DataFrame:
    """The GPU events of one call of `run` under torch.profiler, after a sync on each side."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    path = folder / "replay.trace.json"
    prof.export_chrome_trace(str(path))
    return gpu_events(path)
