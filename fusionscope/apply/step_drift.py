"""What the captured decode step runs that the profiled step did not: the check on the graph predictions' baseline.

`apply --graphs` predicts the graph alone and fused + graph from the profiled eager decode step (its GPU time, less
what the fusions save, plus the gap roof per kernel). When the profile ran another step than the one captured — the
dynamic cache (`--cache dynamic`, and every run before `--cache` existed) where the graph runs transformers' static
cache — the kernels themselves can differ: at batch 16 on llama-3.1-8b Hugging Face's static-cache attention copied
K and V to every query head (5.2 ms of the graph's 14.1 ms of kernels) and ran cuDNN's attention over the whole
cache, neither of which the profiled step held (2026-12-02, H200: fused + graph's gain 88% above its prediction).
Then every graph prediction starts from the wrong step, and the miss is the baseline's, not the fusions'. The graph
alone's replay is profiled with each kernel's launching op (`apply.replay`), so the two steps compare per launching
op: this module says by how much their kernel time differs and where, so the run names the cause of such a miss
itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

NOTE_SHARE = 0.10  # a step whose kernel time differs from the profiled one's by this share or more gets the note
TOP = 4  # (op, module) rows named in the note
KEYS = ["op", "module"]


def profiled_step(kernels_csv: Path, phase: str = "decode") -> pd.DataFrame | None:
    """Kernel µs and count per step of `phase`, per (launching op, module pattern), on rank 0 of `kernels_csv` (the
    run folder's table); None when the table or the phase is missing."""
    from fusionscope.analysis import module_pattern

    if not kernels_csv.is_file():
        return None
    table = pd.read_csv(kernels_csv, usecols=["rank", "phase", "step", "op", "module", "dur_us"],
                        keep_default_na=False, dtype={"op": str, "module": str, "phase": str})  # fmt: skip
    table = table[(table["phase"] == phase) & (table["rank"].astype(str).isin(["0", "0.0"]))]
    steps = table["step"].nunique()
    if table.empty or not steps:
        return None
    table = table.assign(module=table["module"].map(module_pattern), op=table["op"].replace("", "(no aten op)"))
    grouped = table.groupby(KEYS).agg(us=("dur_us", "sum"), count=("dur_us", "size")).reset_index()
    return grouped.assign(us=grouped["us"] / steps, count=grouped["count"] / steps)


def replayed_step(breakdown: dict) -> pd.DataFrame:
    """A replay's breakdown rows (`apply.replay.breakdown`: per launching op and kernel) summed per (op, module); the
    row that gathers the rest ("(N more)") is left out, its time stays in the step's total."""
    rows = [r for r in breakdown.get("rows") or [] if not (str(r.get("op", "")).startswith("(") and not r["kernel"])]
    if not rows:
        return pd.DataFrame(columns=[*KEYS, "us", "count"])
    frame = pd.DataFrame(rows)[[*KEYS, "us", "count"]].fillna({"module": ""})
    return frame.groupby(KEYS).agg(us=("us", "sum"), count=("count", "sum")).reset_index()


def _per_op(parts: pd.DataFrame) -> pd.DataFrame:
    """(op, module) parts summed per launching op, with the module of the op's largest part: the replay's rows are
    per op and kernel name, each labelled with its most frequent module, so modules compare only loosely."""
    if parts.empty:
        return pd.DataFrame(columns=["op", "us", "count", "module"])
    largest = parts.sort_values("us", ascending=False).drop_duplicates("op").set_index("op")["module"]
    summed = parts.groupby("op").agg(us=("us", "sum"), count=("count", "sum"))
    return summed.assign(module=largest.reindex(summed.index)).reset_index()


def step_drift(profiled: pd.DataFrame | None, breakdown: dict | None) -> dict[str, Any] | None:
    """The replayed step's kernel µs against the profiled step's, in all and per launching op (with the module
    where most of it runs), the largest differences first (`TOP` of them); None without both."""
    if profiled is None or profiled.empty or not breakdown or not breakdown.get("rows"):
        return None
    both = _per_op(profiled).merge(_per_op(replayed_step(breakdown)), on="op", how="outer",
                                   suffixes=("_profile", "_graph"))  # fmt: skip
    both = both.fillna({"us_profile": 0.0, "us_graph": 0.0, "count_profile": 0.0, "count_graph": 0.0})
    both["diff"] = both["us_graph"] - both["us_profile"]
    both = both.reindex(both["diff"].abs().sort_values(ascending=False, kind="stable").index)
    rows = [{"op": r["op"], "module": r["module_graph"] if isinstance(r["module_graph"], str) else r["module_profile"],
             "graph_us": float(r["us_graph"]), "profile_us": float(r["us_profile"]),
             "graph_kernels": float(r["count_graph"]), "profile_kernels": float(r["count_profile"])}
            for r in both.head(TOP).to_dict("records")]  # fmt: skip
    return {"graph_us": float(breakdown.get("total_us") or replayed_step(breakdown)["us"].sum()),
            "profile_us": float(profiled["us"].sum()), "rows": rows}  # fmt: skip


def drift_line(drift: dict[str, Any] | None) -> str:
    """One sentence when the graph's step and the profiled one differ by `NOTE_SHARE` or more; '' otherwise."""
    if not drift or not drift.get("profile_us"):
        return ""
    graph, profile = drift["graph_us"], drift["profile_us"]
    if abs(graph - profile) < NOTE_SHARE * profile:
        return ""
    parts = []
    for row in drift["rows"]:
        diff = (row["graph_us"] - row["profile_us"]) / 1e3
        where = f"{row['op']} (mostly {row['module'] or 'outside any module'})"
        if not row["profile_kernels"]:
            said = f"{row['graph_kernels']:.0f} kernels the profiled step does not run"
        elif not row["graph_kernels"]:
            said = "not in the graph's step"
        else:
            said = f"{row['profile_us'] / 1e3:.2f} → {row['graph_us'] / 1e3:.2f} ms"
        parts.append(f"{where} {diff:+.2f} ms ({said})")
    return (f"the graph alone's step runs {graph / 1e3:.2f} ms of kernels, the profiled eager step the predictions "
            f"start from {profile / 1e3:.2f} ms ({graph / profile - 1:+.0%}): the graph's predictions miss by its "
            f"baseline too; largest differences: {'; '.join(parts)}")  # fmt: skip
