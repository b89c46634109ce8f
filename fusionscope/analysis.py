"""From a joined Timeline and the device's ceilings to the kernel table and the per-phase summary.

Pure functions over DataFrames: nothing here prints, plots or reads files. The exported trace carries no FLOPs, so
each kernel's bytes and FLOPs come from its launching aten op's recorded shapes (`roofline.op_cost`); an op that
launches several kernels (a split-K GEMM and its reduction) shares its cost among them by duration.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd

from fusionscope import roofline
from fusionscope.gpu_replay import busy_us
from fusionscope.ranks import NCCL_KERNEL_PREFIXES
from fusionscope.trace import Timeline
from fusionscope.trace_events import distinct_objects, first_rows, group_rows, value_codes

HOST_BOUND_BELOW = 0.5  # GPU busy under half of a step's (unprofiled) wall time: the host sets the pace
TOP_KERNELS = 15
CLASSES = ("compute", "memory", "latency", "unmodeled")


def kernel_table(timeline: Timeline) -> pd.DataFrame:
    """One row per GPU kernel (CPU runs: per aten op, timed by its self time) with flops, bytes, dtype, category.
    A timeline of several ranks (whose op ids, event positions in each rank's file, repeat across ranks) is costed
    rank by rank: a join on op ids alone would give a kernel one row per rank holding its op id."""
    ops = timeline.ops
    kernels = timeline.kernels
    if "rank" in ops and "rank" in kernels and not ops["op_id"].is_unique:
        ranks = sorted(set(ops["rank"].tolist()) | set(kernels["rank"].tolist()))
        if len(ranks) > 1:
            return pd.concat([kernel_table(Timeline(timeline.device_kind, ops[ops["rank"] == rank],
                                                    kernels[kernels["rank"] == rank], timeline.steps))
                              for rank in ranks], ignore_index=True)  # fmt: skip
    costs = _op_costs(ops)
    if timeline.device_kind == "cpu":
        costs = _self_costs(costs, ops.set_index("op_id")["parent_op"])
        table = ops[["rank", "op_id", "name", "step", "phase", "module", "ts_us"]].assign(
            op=ops["name"], stream=-1, dur_us=ops["self_us"]
        )
        table = table.join(costs, on="op_id")
        table["category"] = table["category"].fillna("other")  # as on GPUs: collectives have no cost model
        return table.reset_index(drop=True)
    kernels = timeline.kernels.join(costs, on="op_id")
    share = kernels["dur_us"] / kernels.groupby("op_id")["dur_us"].transform("sum").replace(0, np.nan)
    share = share.where(kernels["op_id"] >= 0)
    kernels["flops"] = kernels["flops"] * share
    kernels["bytes"] = kernels["bytes"] * share
    # Runtime copies and memsets outside any modeled op carry their byte count in the trace.
    is_copy = _named(kernels["name"], ("Memcpy", "Memset"))
    from_arg = is_copy & kernels["bytes"].isna() & (kernels["bytes_arg"].fillna(-1) >= 0)
    kernels.loc[from_arg, "bytes"] = kernels.loc[from_arg, "bytes_arg"].astype(float)
    kernels.loc[from_arg, "flops"] = 0.0
    kernels.loc[is_copy & kernels["category"].isna(), "category"] = "copy"
    kernels["category"] = kernels["category"].fillna("other")
    return kernels.drop(columns=["bytes_arg"]).reset_index(drop=True)


def _named(names: pd.Series, prefixes: tuple[str, ...]) -> pd.Series:
    """Which names start with one of the prefixes (False where a name is missing), tested once per distinct name."""
    codes, uniques = value_codes(names.to_numpy())
    known = np.array([isinstance(u, str) and u.startswith(prefixes) for u in uniques] + [False], dtype=bool)
    return pd.Series(known[codes], index=names.index)


def _self_costs(costs: pd.DataFrame, parent: pd.Series, max_depth: int = 32) -> pd.DataFrame:
    """On CPU timelines an op that hands work to child ops (`_to_copy` → `copy_`, `embedding` → `index_select`,
    `mean` → `sum`) would be charged twice; keep for each op its own cost less that of its nearest costed
    descendants, as self time is its duration less its children's."""
    moves = (costs["bytes"] > 0) | (costs["flops"] > 0)
    costed = set(costs.index[moves])
    ancestor = parent.reindex(costs.index).fillna(-1).astype(np.int64)
    for _ in range(max_depth):  # climb until the ancestor is costed or the root is reached
        climb = (ancestor >= 0) & ~ancestor.isin(costed)
        if not climb.any():
            break
        ancestor[climb] = ancestor[climb].map(parent).fillna(-1).astype(np.int64)
    charged = costs[moves & (ancestor >= 0)].groupby(ancestor[moves & (ancestor >= 0)])[["flops", "bytes"]].sum()
    adjusted = costs.copy()
    for col in ("flops", "bytes"):
        less = charged[col].reindex(costs.index).fillna(0.0)
        adjusted[col] = (costs[col] - less).clip(lower=0.0).where(costs[col].notna())
    return adjusted


def _op_costs(ops: pd.DataFrame) -> pd.DataFrame:
    """flops, bytes, category and dtype per op_id, cached per distinct (name, shapes, types, scalars).

    TensorList arguments (`cat`, `stack`) carry no dtype in the trace; they take the trace's dominant float dtype.
    """
    head = ops["input_type"].to_numpy()[:5000]
    seen, first = distinct_objects(head)  # each shared list once
    per_object = np.empty(len(first), dtype=object)
    per_object[:] = [roofline.op_dtype(_as_list(head[i])) for i in first.tolist()]
    dtypes = pd.Series(per_object[seen], dtype=object).dropna()
    default = dtypes.mode().iat[0] if len(dtypes) else "float32"
    cache: dict[tuple, tuple] = {}
    codes, first = _distinct_arguments(ops)
    rows = []
    listed = [ops[c].to_numpy()[first].tolist() for c in ("name", "input_dims", "input_type", "concrete_inputs")]
    for name, dims, types, concrete in zip(*listed):
        key = (name, repr(dims), repr(types), repr(concrete))
        if key not in cache:
            cost = roofline.op_cost(name, _as_list(dims), _as_list(types), _as_list(concrete), default_dtype=default)
            dtype = roofline.op_dtype(_as_list(types))
            cache[key] = (
                (np.nan, np.nan, None, dtype) if cost is None else (cost.flops, cost.bytes, cost.category, dtype)
            )
        rows.append(cache[key])
    distinct = pd.DataFrame(rows, columns=["flops", "bytes", "category", "dtype"])
    return distinct.take(codes).set_axis(ops["op_id"].to_numpy())


def _distinct_arguments(ops: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each op's code among the distinct (name, shapes, types, scalars) objects, by identity (a trace decoded by
    `trace_events` shares equal argument lists, so they are few), and the row of each one's first occurrence: the
    costs are computed per distinct combination, not in a Python loop over every op (0.66 s at 439k ops)."""
    combined, distinct = np.zeros(len(ops), dtype=np.int64), 0
    for column in ("name", "input_dims", "input_type", "concrete_inputs"):
        part, part_first = distinct_objects(ops[column].to_numpy())
        combined, uniques = pd.factorize(combined * len(part_first) + part)  # stays below ops² < 2**63
        distinct = len(uniques)
    return combined, first_rows(combined, distinct)


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else []


def classify(kernels: pd.DataFrame, bandwidth_gbps: float, peak_tflops: dict[str, float]) -> pd.DataFrame:
    return roofline.classify_kernels(kernels, bandwidth_gbps, peak_tflops)


def cost_coverage(kernels: pd.DataFrame) -> float | None:
    """Share of kernel time whose kernel has a bytes/FLOPs model."""
    total = kernels["dur_us"].sum()
    if not total:
        return None
    return float(kernels.loc[kernels["bytes"].notna(), "dur_us"].sum() / total)


def module_pattern(path: str) -> str:
    """`model.layers.3.mlp.down_proj` → `model.layers.*.mlp.down_proj`: one row for the same module in every layer."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path) if isinstance(path, str) else ""


def summarize_phases(
    kernels: pd.DataFrame,
    steps: pd.DataFrame,
    unprofiled_ms: dict[str, list[float]],
    device_kind: str,
    ops_per_step: dict[str, float] | None = None,
) -> dict[str, dict]:
    """Per phase: wall and GPU-busy time per step, kernels per step, host µs per kernel, regime, time by class and
    category, and the top kernels. Figures per step are medians over the phase's profiled steps."""
    phases: dict[str, dict] = {}
    gpu = device_kind == "cuda"
    for phase in dict.fromkeys(steps["phase"]):
        if not phase:
            continue
        ph_steps = steps[steps["phase"] == phase]
        n_steps = len(ph_steps)
        ks = kernels[kernels["phase"] == phase]
        per_step = ks.groupby("step")
        wall_us = ph_steps.set_index("step")["dur_us"]
        summary: dict = {
            "steps": n_steps,
            "wall_ms_per_step": float(wall_us.median() / 1e3),
            "wall_ms_per_step_unprofiled": _median(unprofiled_ms.get(phase, [])),
            "gpu_busy_ms_per_step": None,
            "gpu_busy_frac": None,
            "kernels_per_step": None,
            "ops_per_step": (ops_per_step or {}).get(phase),
            "host_us_per_kernel": None,
            "regime": None,
            "comm_ms_per_step": None,
        }
        if gpu:
            busy = _busy_per_step(ks).reindex(wall_us.index, fill_value=0.0)
            count = per_step.size().reindex(wall_us.index, fill_value=0)
            # The profiler (shapes, module ranges) slows the host, not the kernels: judge the regime and the host
            # cost per kernel against the unprofiled step when there is one (2.4x faster on the H200 for 8B decode).
            real_wall_us = (
                1e3 * summary["wall_ms_per_step_unprofiled"]
                if summary["wall_ms_per_step_unprofiled"]
                else float(wall_us.median())
            )
            frac = float(busy.median() / real_wall_us)
            # communication not hidden behind computation: busy time less the busy time of the other kernels
            compute = ks[~_named(ks["name"], NCCL_KERNEL_PREFIXES)]
            compute_busy = _busy_per_step(compute).reindex(wall_us.index, fill_value=0.0)
            comm = busy - compute_busy
            summary.update(
                gpu_busy_ms_per_step=float(busy.median() / 1e3),
                gpu_busy_frac=frac,
                kernels_per_step=float(count.median()),
                host_us_per_kernel=float(real_wall_us / count.median()) if count.median() else None,
                regime="host-bound" if frac < HOST_BOUND_BELOW else "gpu-bound",
                comm_ms_per_step=float(comm.median() / 1e3),
            )
        by_class = ks.groupby("bound")["dur_us"].sum() / max(n_steps, 1)
        summary["time_by_class_us"] = {c: float(by_class.get(c, 0.0)) for c in CLASSES}
        by_cat = ks.groupby("category")["dur_us"].sum().sort_values(ascending=False) / max(n_steps, 1)
        summary["time_by_category_us"] = {str(k): float(v) for k, v in by_cat.items()}
        summary["top_kernels"] = _top_kernels(ks, n_steps)
        phases[phase] = summary
    return phases


def _busy_per_step(ks: pd.DataFrame) -> pd.Series:
    """`busy_us` of each step's kernels (index: the steps, sorted, as `groupby("step")` gives them), for all steps
    at once: sorted by step then start, a running end per step (`cummax`), a block wherever a start passes it. Each
    step's sum is `busy_us`'s to the last bit: its blocks are the same whatever the order of equal starts (no block
    starts inside a run of them), so its array of block lengths is the same, summed by the same `sum`. A frame per
    step took a quarter of a second at a thousand steps."""
    steps, starts = ks["step"].to_numpy(), ks["ts_us"].to_numpy()
    ends = (ks["ts_us"] + ks["dur_us"]).to_numpy()
    if not len(steps):
        return pd.Series(dtype=float)
    order = np.lexsort((starts, steps))
    steps, starts, ends = steps[order], starts[order], ends[order]
    first = np.r_[True, steps[1:] != steps[:-1]]
    if not np.isfinite(ends).all():  # NaN: `busy_us`'s running maximum and pandas' differ; one call per step
        cuts = np.r_[np.flatnonzero(first), len(steps)].tolist()
        sums = [busy_us(starts[a:b], ends[a:b]) for a, b in itertools.pairwise(cuts)]
        return pd.Series(sums, index=steps[first], dtype=float)
    running = pd.Series(ends).groupby(np.cumsum(first)).cummax().to_numpy()
    block = np.flatnonzero(first | np.r_[False, starts[1:] > running[:-1]])
    lengths = running[np.r_[block[1:] - 1, len(steps) - 1]] - starts[block]
    cuts = np.r_[np.flatnonzero(first[block]), len(block)].tolist()
    sums = [float(lengths[a:b].sum()) for a, b in itertools.pairwise(cuts)]
    return pd.Series(sums, index=steps[first], dtype=float)


def _top_kernels(ks: pd.DataFrame, n_steps: int) -> list[dict]:
    if ks.empty:
        return []
    total = ks["dur_us"].sum() or 1.0
    codes, modules = value_codes(ks["module"].to_numpy())  # each distinct path once; a missing one: ""
    patterns = np.array([module_pattern(m) for m in modules] + [""], dtype=object)[codes]
    sums, place = _kernel_sums(ks)
    top = sums.reset_index(drop=True).sort_values(ascending=False).head(TOP_KERNELS)
    measured = ks[["flops", "bytes", "achieved_frac"]]
    rows = []
    for k, dur in top.items():
        name, op, category, bound = sums.index[k]
        members = np.flatnonzero(place == k)
        g = measured.iloc[members].assign(module_pattern=patterns[members])
        rows.append(
            {
                "name": name,
                "op": op,
                "category": category,
                "bound": bound,
                "calls_per_step": len(g) / max(n_steps, 1),
                "us_per_step": float(dur / max(n_steps, 1)),
                "share": float(dur / total),
                "module": g["module_pattern"].mode().iat[0] if len(g) else "",
                "intensity": _ratio(g["flops"].sum(min_count=1), g["bytes"].sum(min_count=1)),
                "achieved_frac": _finite(g["achieved_frac"].dropna().median())
                if g["achieved_frac"].notna().any()
                else None,
            }
        )
    return rows


TOP_KEYS = ["name", "op", "category", "bound"]  # what makes one row of `top_kernels`


def _kernel_sums(ks: pd.DataFrame) -> tuple[pd.Series, np.ndarray]:
    """`ks.groupby(TOP_KEYS, dropna=False)["dur_us"].sum()` and each row's place in it. Where every key is a string,
    the rows are grouped by their group number (`trace_events.group_rows`) and the groups put in the keys' order:
    pandas would hash every row's kernel name (long), and did for most of the summary's time."""
    if any(pd.api.types.infer_dtype(ks[k].to_numpy(), skipna=False) != "string" for k in TOP_KEYS):
        grouped = ks.groupby(TOP_KEYS, dropna=False)
        return grouped["dur_us"].sum(), grouped.ngroup().to_numpy()
    ids, first = group_rows(ks, TOP_KEYS)
    labels = list(zip(*(ks[k].to_numpy()[first].tolist() for k in TOP_KEYS), strict=True))
    order = sorted(range(len(labels)), key=labels.__getitem__)  # the groups in the keys' order, as groupby sorts
    place = np.empty(len(order), dtype=np.int64)
    place[order] = np.arange(len(order))
    sums = ks["dur_us"].groupby(place[ids]).sum()
    sums.index = pd.MultiIndex.from_tuples([labels[i] for i in order], names=TOP_KEYS)
    return sums, place[ids]


def _ratio(num: float, den: float) -> float | None:
    return _finite(num / den) if den and np.isfinite(den) else None


def _finite(value: float) -> float | None:
    return float(value) if value is not None and np.isfinite(value) else None


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None
