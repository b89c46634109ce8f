"""Simple groupings of the per-kernel table, done once so the figures get a few hundred rows instead of 50k.

The report never re-analyses a run: bound classes, shares and regimes come from the profiler.  What happens here is
only the arithmetic a figure needs — sums per step, a module hierarchy, and per-group totals — so the page stays a
few hundred kilobytes of data even for an 8B model (35 steps × 1,500 kernels).  Ratios are taken of sums (total
FLOPs over total bytes, total FLOPs over total time) because that is what a group of kernels achieved together; a
plain mean of per-kernel ratios would let a thousand 2 µs kernels outvote one 5 ms GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from fusionscope.trace_events import group_rows, value_codes

NO_MODULE = "(no module)"
ROOT_ID = "(all)"

_TEXT_COLUMNS = ("phase", "name", "op", "module", "category", "dtype", "bound")
_NUMBER_COLUMNS = ("rank", "step", "dur_us", "flops", "bytes", "achieved_frac")

# Keys that identify "the same kernel" for the roofline: the module leaf (``down_proj``) separates GEMMs that share a
# kernel name but not a shape, without making one dot per layer.
ROOFLINE_KEYS = ["name", "op", "leaf", "category", "dtype", "bound"]
TABLE_KEYS = ["name", "op"]


def normalise_kernels(kernels: pd.DataFrame | None) -> pd.DataFrame:
    """Return a copy of ``kernels`` with every column the report reads, with usable dtypes.

    kernels.csv is read by pandas without a schema, so an all-empty column arrives as float NaN and a missing one not
    at all; filling text columns with ``""`` and coercing numbers here means the grouping code never has to care.
    """
    frame = pd.DataFrame() if kernels is None else kernels
    wanted = [c for c in (*_TEXT_COLUMNS, *_NUMBER_COLUMNS) if c in frame.columns]
    out = frame[wanted].copy()
    for column in _TEXT_COLUMNS:
        if column in out.columns:
            out[column] = _text(out[column])
        else:
            out[column] = ""
    for column in _NUMBER_COLUMNS:
        if column in out.columns:
            out[column] = pd.to_numeric(out[column], errors="coerce")
        else:
            out[column] = np.nan
    out["rank"] = out["rank"].fillna(0)
    out["step"] = out["step"].fillna(0)
    out["dur_us"] = out["dur_us"].fillna(0.0).clip(lower=0.0)
    out["dtype"] = _per_value(out["dtype"], lambda text: text.removeprefix("torch."))
    out["bound"] = _per_value(out["bound"], lambda bound: bound or "unmodeled")
    out["category"] = _per_value(out["category"], lambda category: category or "other")
    return out


def _text(column: pd.Series) -> pd.Series:
    """The column as strings, "" where missing. A column of strings only (the analysis' own table) is kept as it
    is; one of strings and missing values (names, modules, categories: few distinct values) is converted once per
    distinct value; any other is converted value by value, as `astype(str)` does."""
    if column.dtype == object and pd.api.types.infer_dtype(column.to_numpy(), skipna=False) == "string":
        return column
    codes, uniques = pd.factorize(column.to_numpy(dtype=object, na_value=None), use_na_sentinel=True)
    if all(type(u) is str for u in uniques.tolist()):
        return pd.Series(np.asarray([*uniques.tolist(), ""], dtype=object)[codes], index=column.index, name=column.name)
    return column.astype(object).where(column.notna(), "").astype(str)


def _per_value(column: pd.Series, func: Callable[[str], str]) -> pd.Series:
    """`func` of each value of a column of strings, called once per distinct value."""
    codes, uniques = value_codes(column.to_numpy())
    return pd.Series(np.asarray([func(u) for u in uniques.tolist()], dtype=object)[codes], index=column.index,
                     name=column.name)  # fmt: skip


def phase_order(summary: dict[str, Any], kernels: pd.DataFrame) -> list[str]:
    """List phases in the summary's order, then any phase that only appears in the kernel table."""
    phases = summary.get("phases") or {}
    names = [str(name) for name in phases] if isinstance(phases, dict) else []
    for name in pd.unique(kernels["phase"]):
        if name and name not in names:
            names.append(name)
    return names


def steps_in(frame: pd.DataFrame) -> int:
    """Count profiled steps in one phase's rows: distinct (rank, step) pairs, so totals become per-rank-step."""
    if frame.empty:
        return 1
    return max(1, len(frame[["rank", "step"]].drop_duplicates()))


def time_per_step_by(frame: pd.DataFrame, column: str) -> dict[str, float]:
    """Sum kernel time per value of ``column`` (category or bound) and divide by the step count: µs per step."""
    if frame.empty:
        return {}
    totals = frame.groupby(column, sort=False)["dur_us"].sum() / steps_in(frame)
    return {str(key): float(value) for key, value in totals.items()}


@dataclass
class ModuleTree:
    """Treemap input: parallel lists, one entry per module path prefix, values are µs per step including children."""

    ids: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def module_tree(frame: pd.DataFrame, root_label: str) -> ModuleTree:
    """Build the module hierarchy (``model`` → ``layers`` → ``3`` → ``mlp`` → ``down_proj``) with per-step times.

    Each node's value is its own time plus its descendants', as plotly's ``branchvalues="total"`` wants; that keeps
    time attributed directly to a parent module (e.g. a residual add in ``model.layers.3``) visible instead of lost.
    """
    tree = ModuleTree()
    if frame.empty:
        return tree
    per_module = frame.groupby("module", sort=False)["dur_us"].sum() / steps_in(frame)
    totals: dict[str, float] = {}
    root = ROOT_ID
    for module, value in per_module.items():
        parts = [p for p in str(module).split(".") if p] or [NO_MODULE]
        path = root
        totals[path] = totals.get(path, 0.0) + float(value)
        for part in parts:
            path = f"{path}.{part}" if path != root else part
            totals[path] = totals.get(path, 0.0) + float(value)
    for node, value in totals.items():
        tree.ids.append(node)
        tree.values.append(value)
        if node == root:
            tree.labels.append(root_label)
            tree.parents.append("")
        else:
            parent, _, leaf = node.rpartition(".")
            tree.labels.append(leaf)
            tree.parents.append(parent or root)
    return tree


def _aggregate(frame: pd.DataFrame, keys: list[str], steps: int) -> pd.DataFrame:
    """Sum time, FLOPs and bytes per group and derive per-step and achieved figures from the sums."""
    modeled = frame["flops"].notna() & frame["bytes"].notna()
    has_frac = frame["achieved_frac"].notna()
    work = pd.DataFrame({
        "dur_us": frame["dur_us"],
        "modeled_dur": frame["dur_us"].where(modeled, 0.0),
        "flops": frame["flops"].where(modeled, 0.0),
        "bytes": frame["bytes"].where(modeled, 0.0),
        "frac_dur": frame["dur_us"].where(has_frac, 0.0),
        "frac_x_dur": (frame["achieved_frac"] * frame["dur_us"]).where(has_frac, 0.0),
    })  # fmt: skip
    # Grouped by each row's group number (`trace_events.group_rows`), in the order `groupby(keys, sort=False)`
    # gives, rather than by the key columns, which pandas hashes at every row (kernel names are long).
    group, first = group_rows(frame, keys)
    by_group = work.groupby(group, sort=False)
    labels = frame[keys].iloc[first].reset_index(drop=True)
    groups = pd.concat([labels, by_group.size().rename("calls"), by_group.sum()], axis=1).reset_index(drop=True)
    has_model = groups["modeled_dur"] > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        groups["calls_per_step"] = groups["calls"] / steps
        groups["us_per_step"] = groups["dur_us"] / steps
        groups["us_per_call"] = groups["dur_us"] / groups["calls"]
        groups["intensity"] = (groups["flops"] / groups["bytes"]).where(has_model & (groups["bytes"] > 0))
        groups["tflops"] = (groups["flops"] / groups["modeled_dur"] / 1e6).where(has_model)
        groups["gbps"] = (groups["bytes"] / groups["modeled_dur"] / 1e3).where(has_model)
        groups["frac"] = (groups["frac_x_dur"] / groups["frac_dur"]).where(groups["frac_dur"] > 0)
    return groups


@dataclass
class RooflinePoints:
    """Aggregated roofline dots for one phase, plus what could not be placed on log–log axes and why."""

    points: pd.DataFrame
    zero_flop_calls_per_step: float = 0.0
    zero_flop_us_per_step: float = 0.0
    unmodeled_calls_per_step: float = 0.0
    unmodeled_us_per_step: float = 0.0
    folded_calls_per_step: float = 0.0
    folded_us_per_step: float = 0.0
    dtypes: list[str] = field(default_factory=list)


def roofline_points(frame: pd.DataFrame, max_points: int = 1500) -> RooflinePoints:
    """Group one phase's kernels into roofline dots and count the kernels that cannot be drawn.

    Kernels without a cost model have no intensity; pure copies have zero FLOPs and would sit at minus infinity on a
    log y axis.  Both are reported as counts with their time per step so the figure does not silently hide time.
    Beyond ``max_points`` groups the smallest are folded into a count too, which bounds the page size whatever the
    model (a CPU run of a big model can have thousands of op × module combinations).
    """
    steps = steps_in(frame)
    modeled = frame["flops"].notna() & frame["bytes"].notna()
    placeable = modeled & (frame["flops"] > 0) & (frame["bytes"] > 0) & (frame["dur_us"] > 0)
    zero = modeled & (frame["flops"] <= 0)
    rows = frame[placeable]
    rows = rows.assign(leaf=_per_value(rows["module"], lambda module: module.rpartition(".")[2]))
    points = _aggregate(rows, ROOFLINE_KEYS, steps) if not rows.empty else pd.DataFrame()
    folded = pd.DataFrame()
    if not points.empty:
        points = points.sort_values("us_per_step", ascending=False, ignore_index=True)
        points, folded = points.iloc[:max_points], points.iloc[max_points:]
    dtypes = [d for d in pd.unique(rows["dtype"]) if d] if not rows.empty else []
    return RooflinePoints(
        points=points,
        zero_flop_calls_per_step=float(zero.sum() / steps),
        zero_flop_us_per_step=float(frame.loc[zero, "dur_us"].sum() / steps),
        unmodeled_calls_per_step=float((~modeled).sum() / steps),
        unmodeled_us_per_step=float(frame.loc[~modeled, "dur_us"].sum() / steps),
        folded_calls_per_step=float(folded["calls_per_step"].sum()) if not folded.empty else 0.0,
        folded_us_per_step=float(folded["us_per_step"].sum()) if not folded.empty else 0.0,
        dtypes=dtypes,
    )


def kernel_stats(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (name, op) totals for one phase, indexed by (name, op), to add measured columns to the top-kernels table."""
    if frame.empty:
        return pd.DataFrame()
    return _aggregate(frame, TABLE_KEYS, steps_in(frame)).set_index(TABLE_KEYS)
