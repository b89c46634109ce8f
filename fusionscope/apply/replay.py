"""What one replay of a captured decode step runs on the GPU: kernels per step, GPU time, the time between kernels,
and per kernel how far it is from its roof.

A replayed graph launches no aten op, so a profile of a replay holds kernels with nothing to cost them by. The same
step run eagerly launches the same kernels in the same order — the graph captured exactly that call — with their
launching ops and shapes. So the eager step's kernel table (`analysis.kernel_table`, the cost model `profile` uses)
gives each kernel its bytes and FLOPs; its kernels are matched to the replay's by name, in order, and the replay's
durations replace the eager ones before the kernels are classified against the roofs.

Why the time between kernels is its own figure: a graph removes the host, not the GPU's own cost of starting each
kernel. A step of 500 kernels that each leave the GPU idle for ~2 µs between them loses a millisecond that no kernel
duration shows; `gap_us_per_kernel` is that cost, what fewer kernels save under a graph.

Profiling one call and a replay's totals are `fusionscope.gpu_replay`'s (below the roofs, which measure with them
too); what this module adds is the eager step's costed kernels, matched to the replay's and classified.
"""

from __future__ import annotations

import difflib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fusionscope.gpu_replay import GPU_CATS, gpu_events, on_the_critical_path, profile_gpu, replay_figures
from fusionscope.roofline import classify_against

__all__ = ["GPU_CATS", "TOP_ROWS", "aligned", "breakdown", "by_kernel", "gpu_events", "profile_eager_kernels",
           "profile_gpu", "replay_figures", "replay_profile"]  # fmt: skip

TOP_ROWS = 25  # rows of the per-kernel breakdown kept in summary.json (the rest summed as one row)


def profile_eager_kernels(run: Callable[[], Any], model: Any, folder: Path, roofs: dict | None) -> pd.DataFrame:
    """The kernel table of one eager call of `run` (ops with shapes, module ranges), classified against `roofs`:
    the same columns `profile` writes to kernels.csv, in start order."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from fusionscope.analysis import kernel_table
    from fusionscope.capture import module_ranges
    from fusionscope.markers import STEP_PREFIX
    from fusionscope.trace import load_timeline

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with (
        profile(activities=activities, record_shapes=True) as prof,
        module_ranges(model),
        record_function(f"{STEP_PREFIX}0"),
    ):
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path = folder / "eager_step.trace.json"
    prof.export_chrome_trace(str(path))
    kernels = classify_against(kernel_table(load_timeline(path)), roofs)
    return kernels.sort_values("ts_us", kind="stable").reset_index(drop=True)


def aligned(eager: pd.DataFrame, replay: pd.DataFrame) -> pd.DataFrame:
    """`replay`'s events with the launching op, module, bytes, FLOPs and dtype of the eager kernel matched to each
    (by name, in order: the longest common subsequence of the two name lists); `matched` says which found one. A
    kernel the capture chose differently (another cuBLAS algorithm, say) stays unmatched and so unmodeled."""
    out = replay.copy()
    take = ["op", "module", "bytes", "flops", "dtype", "category"]
    for col in take:
        out[col] = np.nan if col in ("bytes", "flops") else None
    out["matched"] = False
    if eager.empty or replay.empty:
        return out
    a, b = list(eager["name"]), list(replay["name"])
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        if not block.size:
            continue
        src = eager.iloc[block.a : block.a + block.size]
        rows = out.index[block.b : block.b + block.size]
        for col in take:
            if col in src.columns:
                out.loc[rows, col] = src[col].to_numpy()
        out.loc[rows, "matched"] = True
    return out


def breakdown(table: pd.DataFrame, roofs: dict | None) -> dict[str, Any]:
    """The replayed step per launching op and kernel name: count, µs per step, share of the step's kernel time,
    achieved GB/s and TFLOP/s and their share of the roofs, and the class; largest first, `TOP_ROWS` kept."""
    if table.empty:
        return {"rows": [], "matched_share": None, "total_us": 0.0}
    costed = classify_against(table.assign(dtype=table["dtype"].where(table["dtype"].notna(), None)), roofs)
    matched_rows = costed["matched"].astype(bool)
    launched = costed["op"].where(costed["op"].notna() & (costed["op"].astype(str) != ""), None)
    # a bundled kernel launched without an aten op around it (the lean eager launch) is named by its kernel alone
    costed["op"] = launched.where(~matched_rows | launched.notna(), "(no aten op)").fillna("(not matched)")
    total = float(costed["dur_us"].sum())
    grouped = costed.groupby(["op", "name"], sort=False, dropna=False).agg(
        count=("dur_us", "size"), us=("dur_us", "sum"), bytes=("bytes", lambda s: s.sum(min_count=1)),
        flops=("flops", lambda s: s.sum(min_count=1)), bound=("bound", lambda s: s.mode().iat[0] if len(s) else ""),
        module=("module", lambda s: _common_module(s)),
        dtype=("dtype", lambda s: s.dropna().mode().iat[0] if s.notna().any() else None),
    )  # fmt: skip
    grouped = grouped.sort_values("us", ascending=False).reset_index()
    copy_gbps = float(roofs["copy_gbps"]) if roofs and roofs.get("copy_gbps") else None
    rows = []
    for rec in grouped.to_dict("records"):
        seconds = rec["us"] / 1e6
        gbps = rec["bytes"] / seconds / 1e9 if seconds and pd.notna(rec["bytes"]) else None
        tflops = rec["flops"] / seconds / 1e12 if seconds and pd.notna(rec["flops"]) else None
        peaks = _peak(roofs, rec["dtype"])
        rows.append({
            "op": rec["op"], "kernel": rec["name"], "module": rec["module"], "count": int(rec["count"]),
            "us": float(rec["us"]), "share": float(rec["us"]) / total if total else None,
            "achieved_gbps": gbps, "frac_bandwidth": gbps / copy_gbps if gbps is not None and copy_gbps else None,
            "achieved_tflops": tflops, "frac_compute": tflops / peaks if tflops is not None and peaks else None,
            "bound": rec["bound"],
        })  # fmt: skip
    kept, rest = rows[:TOP_ROWS], rows[TOP_ROWS:]
    if rest:
        kept.append({"op": f"({len(rest)} more)", "kernel": "", "module": "", "count": sum(r["count"] for r in rest),
                     "us": sum(r["us"] for r in rest), "share": sum(r["share"] or 0.0 for r in rest),
                     "achieved_gbps": None, "frac_bandwidth": None, "achieved_tflops": None, "frac_compute": None,
                     "bound": ""})  # fmt: skip
    matched = float(costed.loc[costed["matched"].astype(bool), "dur_us"].sum()) / total if total else None
    modeled = costed["bytes"].notna()
    weight_gbps = (
        float(costed.loc[modeled, "bytes"].sum()) / (float(costed.loc[modeled, "dur_us"].sum()) / 1e6) / 1e9
        if modeled.any() and costed.loc[modeled, "dur_us"].sum() > 0
        else None
    )
    return {"rows": kept, "matched_share": matched, "total_us": total, "modeled_gbps": weight_gbps}


def _common_module(modules: pd.Series) -> str:
    """The module pattern the rows share (`model.layers.*.mlp`), or the most frequent one."""
    from fusionscope.analysis import module_pattern

    patterns = modules.dropna().map(module_pattern)
    return str(patterns.mode().iat[0]) if len(patterns) else ""


def _peak(roofs: dict | None, dtype: str | None) -> float | None:
    """The peak TFLOP/s of the kernels' dtype (the fp32 one for integer or unknown dtypes), as
    `roofline.classify_against` takes it."""
    tflops = (roofs or {}).get("tflops") or {}
    value = tflops.get(dtype or "") or tflops.get("float32")
    return float(value) if value else None


def replay_profile(replay: Callable[[], Any], eager: Callable[[], Any] | None, model: Any,
                   roofs: dict | None) -> dict[str, Any]:  # fmt: skip
    """Profile one `replay()`; with `eager` (the same step run eagerly), also the per-kernel breakdown. The step's
    state (cache rows, position) is the caller's to put back."""
    with tempfile.TemporaryDirectory(prefix="fusionscope-replay-") as tmp:
        folder = Path(tmp)
        events = profile_gpu(replay, folder)
        out = replay_figures(events)
        events = on_the_critical_path(events)  # per-kernel µs without the overlap PDL's early starts add
        if eager is not None:
            table = aligned(profile_eager_kernels(eager, model, folder, roofs), events)
            out["breakdown"] = breakdown(table, roofs)
        else:
            out["by_kernel"] = by_kernel(events)
    return out


def by_kernel(events: pd.DataFrame) -> list[dict[str, Any]]:
    """A step's GPU work per kernel name: count and µs, largest first, `TOP_ROWS` kept (the rest as one row). For
    the compiled peers, which have no eager step to cost their kernels by: this is what says where their time goes
    when fused + compile and compile alone differ."""
    if events.empty:
        return []
    grouped = events.groupby("name", sort=False)["dur_us"].agg(["size", "sum"]).sort_values("sum", ascending=False)
    total = float(grouped["sum"].sum())
    rows = [{"kernel": str(name), "count": int(n), "us": float(us), "share": float(us) / total if total else None}
            for name, n, us in zip(grouped.index, grouped["size"], grouped["sum"])]  # fmt: skip
    kept, rest = rows[:TOP_ROWS], rows[TOP_ROWS:]
    if rest:
        kept.append({"kernel": f"({len(rest)} more)", "count": sum(r["count"] for r in rest),
                     "us": sum(r["us"] for r in rest), "share": sum(r["share"] or 0.0 for r in rest)})  # fmt: skip
    return kept
