"""Compare two runs (before/after a change): what moved per phase, per category, per fusion and per kernel.

A side is a run folder, or a trace file, which `fusionscope analyze` turns into a run first (in a temporary
folder, removed afterwards). `diff_runs(a, b)` is a pure function over two loaded `Run`s; the CLI prints it, writes
it as diff.json and renders diff.html. Every delta is B − A and every ratio B ÷ A, so "after ÷ before" reads as a
speed-up below 1 for a time. Where both sides are traces, HTA's trace diff (op and kernel counts and durations of
the first step) is added (`hta_trace_diff`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from fusionscope.errors import UsageError
from fusionscope.run_folder import Run, load_run

DIFF_SCHEMA_VERSION = 1
# The per-phase figures compared, in the order they are shown: summary.json's names (see README "summary.json").
PHASE_METRICS = (
    "wall_ms_per_step_unprofiled",
    "wall_ms_per_step",
    "gpu_busy_ms_per_step",
    "kernels_per_step",
    "ops_per_step",
)
# A profiler's Chrome trace, as `profile` writes it or torch.profiler exports it: not a run folder. The JSON files
# fusionscope itself writes are not traces: for those the folder that holds them is what was meant.
TRACE_SUFFIXES = (".json", ".json.gz")
OWN_JSON = ("summary.json", "diff.json", "bench.json")
KERNEL_COLUMNS = ("name", "phase", "dur_us")
HTA_TOP = 20  # HTA trace-diff rows kept: the largest duration changes


def load_pair(a: str | Path, b: str | Path, device: str | None = None) -> tuple[Run, Run]:
    """Load both sides — run folders, or trace files analysed on the spot (`device` as `analyze` takes it) —
    refusing a plain file and a folder that is not a run (UsageError)."""
    return load_side(a, "A", device), load_side(b, "B", device)


def is_trace(path: Path) -> bool:
    return path.is_file() and path.name.endswith(TRACE_SUFFIXES) and path.name not in OWN_JSON


def load_side(path: str | Path, label: str, device: str | None = None) -> Run:
    """One side of a diff: a run folder (`load_diffable`), or a trace file analysed into a temporary run folder
    that is removed once loaded; the Run then names the trace as its path."""
    from fusionscope.analyze import analyze

    path = Path(path)
    if not is_trace(path):
        return load_diffable(path, label)
    scratch = Path(tempfile.mkdtemp(prefix="fusionscope-diff-"))
    try:
        analyze(path, out=scratch / "run", device=device)
        run = load_diffable(scratch / "run", label)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Run(out_dir=path, summary=run.summary, kernels=run.kernels)


def load_diffable(path: str | Path, label: str) -> Run:
    """One side of a diff: a run folder whose summary has phases and whose kernels.csv has name, phase and dur_us."""
    folder = Path(path)
    if folder.is_file():
        raise UsageError(f"{label} ({folder}) is a file, not a run folder or a trace (pass the folder that holds it)")
    run = load_run(folder)
    phases = run.summary.get("phases") if isinstance(run.summary, dict) else None
    if not isinstance(phases, dict) or not all(isinstance(p, dict) for p in phases.values()):
        raise UsageError(f"{folder} is not a fusionscope run folder (its summary.json has no phases)")
    missing = [c for c in KERNEL_COLUMNS if c not in run.kernels.columns]
    if missing:
        raise UsageError(f"{folder} is not a fusionscope run folder (kernels.csv lacks {', '.join(missing)})")
    return run


def diff_runs(a: Run, b: Run) -> dict:
    """Compare run A (before) with run B (after). Returns plain JSON-ready data with stable keys:

    - `schema`: 1.
    - `a`, `b`: `path, model, device, dtype, created, command` of each run.
    - `notes`: one-line remarks, e.g. that A and B profiled different models or devices (not errors).
    - `hta`: HTA's trace diff where both sides are trace files (`hta_trace_diff`), else absent.
    - `phases`: per phase (A's order, then B's new phases), a dict with
      - `present`: `both`, `a_only` or `b_only` (a phase in one run only has `null` on the other side);
      - `steps_a`, `steps_b`: profiled steps;
      - `metrics`: for each of `PHASE_METRICS` a `{a, b, delta, ratio}` (`delta` = b − a, `ratio` = b ÷ a; `null`
        where a side is null, and the ratio also where a is 0);
      - `categories`: kernel category → `{a, b, delta, ratio}` in µs per step (a category missing from a run that
        has the phase counts 0), largest |delta| first;
      - `fusions`: one row per fusion found in either run's `opportunities` for the phase: `fusion, status`
        (`both`, `vanished`: found in A not in B — what applying it did —, `appeared`: found in B only),
        `count_a, count_b` (groups per step), `us_a, us_b` (time now, µs per step), `delta_us`; catalogue order as
        the runs list them;
      - `kernels_appeared`, `kernels_vanished`: kernel names in B's (A's) kernels.csv for the phase and not in the
        other's, each `{name, us_per_step, calls_per_step}`, most time first (empty when the phase is in one run).
    """
    phases_a, phases_b = a.summary["phases"], b.summary["phases"]
    return {
        "schema": DIFF_SCHEMA_VERSION,
        "a": run_facts(a),
        "b": run_facts(b),
        "notes": compare_notes(a.summary, b.summary),
        "phases": {
            name: diff_phase(name, a, b, phases_a.get(name), phases_b.get(name))
            for name in dict.fromkeys([*phases_a, *phases_b])
        },
    }


def diff_paths(a: str | Path, b: str | Path, device: str | None = None) -> dict:
    """`diff_runs` of two run folders or trace files; with two traces, HTA's trace diff as `hta` too."""
    run_a, run_b = load_pair(a, b, device)
    result = diff_runs(run_a, run_b)
    if is_trace(Path(a)) and is_trace(Path(b)):
        result["hta"] = hta_trace_diff(Path(a), Path(b))
    return result


def hta_trace_diff(a: Path, b: Path, top: int = HTA_TOP) -> dict:
    """HTA's `TraceDiff.compare_traces` of two trace files (first rank, first step of each): per op or kernel name
    the counts and total µs in A and B, the `top` largest duration changes. `source`: "hta", or
    "unavailable: <reason>" (HTA logs rather than raises, and fails on traces it cannot step through)."""
    import logging

    from fusionscope.trace import load_hta_trace

    logging.getLogger("hta").setLevel(logging.CRITICAL)
    try:
        from hta.trace_diff import TraceDiff

        table = TraceDiff.compare_traces(load_hta_trace(a), load_hta_trace(b))
    except Exception as exc:  # any HTA failure is a reason in diff.json, never a crash
        return {
            "source": f"unavailable: HTA failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        }
    if table is None or table.empty:
        return {"source": "unavailable: HTA returned no data"}
    table = table.reindex(table["diff_duration"].abs().sort_values(ascending=False).index).head(top)
    columns = {"count_a": "Control_counts", "count_b": "Test_counts", "us_a": "Control_total_duration",
               "us_b": "Test_total_duration", "delta_us": "diff_duration"}  # fmt: skip
    rows = [
        {"name": str(name), **{key: float(row[col]) for key, col in columns.items()}} for name, row in table.iterrows()
    ]
    return {"source": "hta", "rows": rows}


def run_facts(run: Run) -> dict:
    """What identifies a run in a diff's header."""
    model, device = run.summary.get("model") or {}, run.summary.get("device") or {}
    return {
        "path": str(run.out_dir),
        "model": model.get("name"),
        "device": device.get("name"),
        "dtype": model.get("dtype"),
        "created": run.summary.get("created"),
        "command": run.summary.get("command"),
    }


def compare_notes(a: dict, b: dict) -> list[str]:
    """Two different models (or devices, dtypes) may be diffed; say so, since the deltas are not one change's."""
    notes = []
    for key, section, what in (
        ("name", "model", "models"),
        ("name", "device", "devices"),
        ("dtype", "model", "dtypes"),
    ):
        va, vb = (a.get(section) or {}).get(key), (b.get(section) or {}).get(key)
        if va != vb:
            notes.append(f"A and B profiled different {what} ({va} vs {vb}): the deltas are not one change's")
    return notes


def diff_phase(name: str, a: Run, b: Run, pa: dict | None, pb: dict | None) -> dict:
    """One phase of the diff (see `diff_runs`); `pa`/`pb` are the phase's summary entries, None when absent."""
    both = pa is not None and pb is not None
    present = "both" if both else ("a_only" if pa is not None else "b_only")
    pa_, pb_ = pa or {}, pb or {}
    kernels_a = phase_kernels(a, name, pa_) if pa is not None else None
    kernels_b = phase_kernels(b, name, pb_) if pb is not None else None
    return {
        "present": present,
        "steps_a": pa_.get("steps"),
        "steps_b": pb_.get("steps"),
        "metrics": {m: delta(pa_.get(m), pb_.get(m)) for m in PHASE_METRICS},
        "categories": diff_categories(pa, pb),
        "fusions": diff_fusions(name, a.summary, b.summary, pa is not None, pb is not None),
        "kernels_appeared": changed_kernels(kernels_b, kernels_a) if both else [],
        "kernels_vanished": changed_kernels(kernels_a, kernels_b) if both else [],
    }


def delta(a: Any, b: Any) -> dict:
    """`{a, b, delta, ratio}` for two numbers, either of which may be null."""
    fa, fb = number(a), number(b)
    both = fa is not None and fb is not None
    return {
        "a": fa,
        "b": fb,
        "delta": fb - fa if both else None,
        "ratio": fb / fa if both and fa != 0 else None,
    }


def number(value: Any) -> float | None:
    """A summary figure as a float, or None for null, NaN and non-numbers."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if x == x else None


def diff_categories(pa: dict | None, pb: dict | None) -> dict[str, dict]:
    """µs per step by kernel category, A vs B; a category missing from a run that has the phase counts 0."""
    ca = (pa or {}).get("time_by_category_us") or {}
    cb = (pb or {}).get("time_by_category_us") or {}
    rows = {}
    for cat in dict.fromkeys([*ca, *cb]):
        va = ca.get(cat, 0.0) if pa is not None else None
        vb = cb.get(cat, 0.0) if pb is not None else None
        rows[str(cat)] = delta(va, vb)
    return dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]["delta"] or 0.0)))


def fusion_totals(summary: dict, phase: str) -> dict[str, tuple[float, float]]:
    """Per fusion in one phase: (groups per step, µs per step now), summed should a fusion be listed twice."""
    totals: dict[str, tuple[float, float]] = {}
    for opp in summary.get("opportunities") or []:
        if not isinstance(opp, dict) or opp.get("phase") != phase or not opp.get("fusion"):
            continue
        count, us = totals.get(opp["fusion"], (0.0, 0.0))
        totals[opp["fusion"]] = (count + (number(opp.get("count")) or 0.0), us + (number(opp.get("t_now_us")) or 0.0))
    return totals


def diff_fusions(phase: str, sa: dict, sb: dict, in_a: bool, in_b: bool) -> list[dict]:
    """The fusions found in the phase in A vs B. A side without the phase shows null, not a vanished fusion."""
    fa, fb = fusion_totals(sa, phase), fusion_totals(sb, phase)
    rows = []
    for fusion in dict.fromkeys([*fa, *fb]):
        ca, ua = fa.get(fusion, (0.0, 0.0)) if in_a else (None, None)
        cb, ub = fb.get(fusion, (0.0, 0.0)) if in_b else (None, None)
        if in_a and in_b:
            status = "both" if fusion in fa and fusion in fb else ("vanished" if fusion in fa else "appeared")
        else:
            status = "a_only" if in_a else "b_only"
        rows.append({"fusion": fusion, "status": status, "count_a": ca, "count_b": cb, "us_a": ua, "us_b": ub,
                     "delta_us": ub - ua if ua is not None and ub is not None else None})  # fmt: skip
    return rows


def phase_kernels(run: Run, phase: str, info: dict) -> pd.DataFrame:
    """Per kernel name in one phase: `us_per_step` and `calls_per_step`, divided by the phase's profiled steps (the
    summary's count, as `top_kernels` uses; else the distinct steps in kernels.csv)."""
    rows = run.kernels[run.kernels["phase"] == phase]
    steps = number(info.get("steps"))
    if not steps:
        keys = [c for c in ("rank", "step") if c in rows.columns]
        steps = float(len(rows[keys].drop_duplicates())) if keys and not rows.empty else 1.0
    dur = pd.to_numeric(rows["dur_us"], errors="coerce").fillna(0.0)
    grouped = dur.groupby(rows["name"].astype(str))
    return pd.DataFrame({"us_per_step": grouped.sum() / steps, "calls_per_step": grouped.size() / steps})


def changed_kernels(present: pd.DataFrame | None, other: pd.DataFrame | None) -> list[dict]:
    """Kernel names in `present` and not in `other`, most time per step first (then by name, so ties are stable)."""
    if present is None or other is None:
        return []
    only = present.loc[~present.index.isin(other.index)]
    rows = [{"name": str(name), "us_per_step": float(r.us_per_step), "calls_per_step": float(r.calls_per_step)}
            for name, r in only.iterrows()]  # fmt: skip
    return sorted(rows, key=lambda r: (-r["us_per_step"], r["name"]))
