"""From a trace file to a `Timeline`: DataFrames of aten ops and GPU kernels, each with its step, phase and module.

HTA does the parsing here (one rank per file, or a folder of ranks; `trace_events` decodes one file itself, faster,
into the same columns, and `profile` and `analyze` load that way). fusionscope then joins, in one sweep per CPU thread:
every CPU event inherits the innermost enclosing `ProfilerStep#N`, `fusionscope.phase:<name>` and
`nn.Module: <path>` ranges (in a trace without those, captured elsewhere with `with_stack=True`, the Python tracer's
`nn.Module: <Class>_<N>` calls, joined into a path: `LlamaModel_0.LlamaDecoderLayer_1.LlamaMLP_1`) and its innermost
enclosing aten op; every GPU kernel is joined to its launching aten op by
`External id` (equal to the innermost `cpu_op`'s), and to step/phase/module through that op — or, for kernels launched
outside any aten op (Triton through `cuLaunchKernel`), through the runtime call that launched it (`correlation`).
On CPU-only traces there are no kernels: the aten ops are the timeline, each with its self time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fusionscope.errors import UsageError
from fusionscope.markers import MODULE_PREFIX, PHASE_PREFIX, STEP_PREFIX
from fusionscope.trace_fields import to_int

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
PYTHON_CAT = "python_function"  # with_stack=True: Python frames, and `nn.Module: <Class>_<N>` for each module call
OP_COLUMNS = [
    "rank",
    "op_id",
    "parent_op",
    "name",
    "tid",
    "ts_us",
    "dur_us",
    "self_us",
    "step",
    "phase",
    "module",
    "external_id",
    "input_dims",
    "input_type",
    "concrete_inputs",
]
KERNEL_COLUMNS = [
    "rank",
    "kernel_id",
    "name",
    "stream",
    "ts_us",
    "dur_us",
    "op_id",
    "op",
    "step",
    "phase",
    "module",
    "grid",
    "block",
    "registers_per_thread",
    "shared_memory",
    "bytes_arg",
]


CPU_COLUMNS = ("index", "name", "cat", "tid", "ts", "dur", "correlation")  # what the sweep and the launch join read
OP_ARGUMENTS = ("external_id", "input_dims", "input_type", "concrete_inputs")  # what only the ops table reads


Tables = tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]  # ops, kernels, steps


@dataclass
class Timeline:
    """One trace, joined. `kernels` is empty on CPU runs (`device_kind == "cpu"`)."""

    device_kind: str
    ops: pd.DataFrame
    kernels: pd.DataFrame
    steps: pd.DataFrame  # rank, step, phase, ts_us, dur_us


def _parser_config():
    from hta.configs.parser_config import AVAILABLE_ARGS, ParserConfig

    cfg = ParserConfig.get_default_cfg().clone()
    extra = [
        "index::external_id",
        "cpu_op::concrete_inputs",
        "threads::grid",
        "threads::block",
        "threads::registers",
        "kernel::shared_memory",
        "data::bytes",
    ]
    cfg.set_args(ParserConfig.get_minimum_args() + ParserConfig.ARGS_INPUT_SHAPE + [AVAILABLE_ARGS[k] for k in extra])
    return cfg


def load_hta_trace(path: Path):
    """Parse one trace file or a folder of rank traces with HTA; returns HTA's `Trace` object.

    HTA rounds timestamps to whole microseconds unless told not to; decode kernels last 2–10 µs, so that rounding
    would cost up to half of a kernel's duration. HTA needs absolute paths (a relative .json.gz failed validation).
    """
    from hta.common.trace import Trace

    os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")
    logging.getLogger("hta").setLevel(logging.ERROR)
    path = Path(path).resolve()
    if not path.exists():
        raise UsageError(f"trace not found: {path}")
    try:
        if path.is_dir():
            trace = Trace(trace_dir=str(path), parser_config=_parser_config())
        else:
            trace = Trace(
                trace_files={_rank_of(path): str(path)}, trace_dir=str(path.parent), parser_config=_parser_config()
            )
        trace.load_traces(include_last_profiler_step=True, use_multiprocessing=False, use_memory_profiling=False)
    except (ValueError, OSError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"cannot parse trace {path}: {reason}") from None
    return trace


def _rank_of(path: Path) -> int:
    import gzip
    import re

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        head = f.read(1 << 16)
    m = re.search(r'"distributedInfo": \{"rank": (\d+)', head)
    return int(m.group(1)) if m else 0


def load_timeline(path: Path) -> Timeline:
    """Load and join a trace (see module docstring). Several ranks are concatenated with a `rank` column."""
    trace = load_hta_trace(path)
    parts = [_join_rank(rank, trace.get_trace(rank), trace.symbol_table.sym_table) for rank in sorted(trace.traces)]
    ops = pd.concat([p[0] for p in parts], ignore_index=True)
    kernels = pd.concat([p[1] for p in parts], ignore_index=True)
    steps = pd.concat([p[2] for p in parts], ignore_index=True)
    return Timeline(device_kind="cuda" if len(kernels) else "cpu", ops=ops, kernels=kernels, steps=steps)


def _join_rank(rank: int, df: pd.DataFrame, symbols: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """`join_columns` of HTA's frame of one rank (names and categories as ids into `symbols`)."""
    sym = np.asarray(symbols, dtype=object)
    columns = {c: df[c].to_numpy() for c in df.columns}
    columns["name"], columns["cat"] = sym[columns["name"]], sym[columns["cat"]]
    return join_columns(rank, columns)


def join_columns(rank: int, cols: dict[str, np.ndarray], labels: tuple[Labels, Labels] | None = None) -> Tables:
    """The ops, kernels and steps of one rank's events, given as columns of HTA's frame (`index`, `name`, `cat` as
    strings, `tid`, `ts`, `dur`, its argument columns and `index_correlation`): the sweep over the CPU events
    (`_sweep`), then each kernel joined to its op (`_join_kernels`). Numpy arrays throughout, indexed by position:
    a frame would be copied whole at every step, and at a million events each copy of its object columns costs
    more than the join. `labels`: the `Labels` of `name` and `cat`, where the caller has them."""
    names, cats = labels or (Labels.of(cols["name"]), Labels.of(cols["cat"]))
    cpu_rows = np.flatnonzero(_cpu_events(names, cats))
    cpu_rows = cpu_rows[_walk_order(cols["tid"][cpu_rows], cols["ts"][cpu_rows], cols["dur"][cpu_rows])]
    cpu = {k: cols[k][cpu_rows] for k in CPU_COLUMNS if k in cols}
    cpu_names, cpu_cats = names.take(cpu_rows), cats.take(cpu_rows)
    cpu.update(_sweep(cpu, cpu_names, cpu_cats))
    op_rows = np.flatnonzero(cpu_cats.isin(("cpu_op",)))
    op = {k: v[op_rows] for k, v in cpu.items()}
    op.update({k: cols[k][cpu_rows[op_rows]] for k in OP_ARGUMENTS if k in cols})
    dur = pd.Series(op["dur"])
    child_time = dur.groupby(op["parent_op"]).sum()
    self_us = (dur - pd.Series(op["index"]).map(child_time).fillna(0)).clip(lower=0).to_numpy(dtype=float)
    no_ids = np.full(len(op_rows), -1, dtype=np.int64)
    ops = _table(
        rank,
        op,
        OP_COLUMNS,
        parent_op=op["parent_op"],
        tid=op["tid"],
        self_us=self_us,
        step=op["step"],
        phase=op["phase"],
        module=op["module"],
        external_id=op.get("external_id", no_ids),
        input_dims=op.get("input_dims"),
        input_type=op.get("input_type"),
        concrete_inputs=op.get("concrete_inputs"),
    )

    is_step = cpu_names.startswith(STEP_PREFIX)
    steps = pd.DataFrame(
        {
            "rank": rank,
            "step": cpu["step"][is_step],
            "phase": cpu["phase_inner"][is_step],
            "ts_us": cpu["ts"][is_step].astype(float),
            "dur_us": cpu["dur"][is_step].astype(float),
        }
    )

    gpu_rows = np.flatnonzero(cats.isin(GPU_CATS))
    gpu = {k: v[gpu_rows] for k, v in cols.items() if k not in OP_ARGUMENTS}
    kernels = _join_kernels(rank, gpu, op, cpu)
    return ops, kernels, steps


def _walk_order(tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """`np.lexsort((-dur, ts, tid))`: the events by thread, start and longest first, ties in file order (stable, as
    pandas sorts). Sorted by start alone first, which is fast on a trace's nearly sorted starts (a fortieth of
    the lexsort's time at a million events), then by thread; only the runs of equal thread and start are then
    sorted by duration. Starts with a NaN (which the lexsort takes as equal) are left to the lexsort."""
    if ts.dtype.kind == "f" and np.isnan(ts).any():
        return np.lexsort((-dur, ts, tid))
    order = np.argsort(ts, kind="stable")
    if len(tid) and (tid != tid[0]).any():
        order = order[np.argsort(tid[order], kind="stable")]
    tid_o, ts_o = tid[order], ts[order]
    same = np.flatnonzero((tid_o[1:] == tid_o[:-1]) & (ts_o[1:] == ts_o[:-1]))  # row k + 1 ties with row k
    if not len(same):
        return order
    tied = np.unique(np.concatenate([same, same + 1]))
    run = np.cumsum(np.r_[True, ~np.isin(tied[1:] - 1, same)])  # a new run where a row ties with none before
    order[tied] = order[tied][np.lexsort((-dur[order[tied]], run))]
    return order


def _table(rank: int, rows: dict[str, np.ndarray], columns: list[str], **named: object) -> pd.DataFrame:
    """The ops or kernels table of `rows` (one event each): its rank, its id (the event's `index`, the second
    column), name, start and duration in µs as floats, and the `named` columns; in the order of `columns`. The
    arrays are its own, so they are not copied into blocks (at a million events that copy took 0.3 s)."""
    times = {"ts_us": rows["ts"].astype(float), "dur_us": rows["dur"].astype(float)}
    return pd.DataFrame({"rank": rank, columns[1]: rows["index"], "name": rows["name"], **times, **named},
                        columns=columns, copy=False)  # fmt: skip


@dataclass(frozen=True)
class Labels:
    """A column of strings with few distinct values (names, categories) as codes into them: each test of a value is
    made once per distinct value, not once per event, and the column is hashed once for all tests."""

    codes: np.ndarray  # -1 for a missing value
    uniques: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray) -> Labels:
        codes, uniques = pd.factorize(values)
        return cls(codes, np.asarray(uniques, dtype=object))

    def isin(self, wanted: tuple[str, ...]) -> np.ndarray:
        return self.map(lambda u: u in wanted, False, bool)

    def startswith(self, prefix: str) -> np.ndarray:
        return self.map(lambda u: isinstance(u, str) and u.startswith(prefix), False, bool)

    def map(self, func: Callable[[object], object], missing: object, dtype: type = object) -> np.ndarray:
        """`func` of every value, called once per distinct value; `missing` where a value is missing."""
        out = np.empty(len(self.uniques) + 1, dtype=dtype)
        out[:-1] = [func(u) for u in self.uniques.tolist()]
        out[-1] = missing
        return out[self.codes]

    def take(self, rows: np.ndarray) -> Labels:
        return Labels(self.codes[rows], self.uniques)


def _cpu_events(names: Labels, cats: Labels) -> np.ndarray:
    """The CPU events the sweep walks: `CPU_CATS`, and the Python tracer's `nn.Module: <Class>_<N>` calls
    (`with_stack=True`) where the trace has no `nn.Module: <path>` ranges of fusionscope's own."""
    cpu = cats.isin(CPU_CATS)
    module_event = names.startswith(MODULE_PREFIX)
    if (module_event & cats.isin(("user_annotation",))).any():
        return cpu
    return cpu | (module_event & cats.isin((PYTHON_CAT,)))


def _sweep(cpu: dict[str, np.ndarray], names: Labels, cats: Labels) -> dict[str, np.ndarray]:
    """Innermost enclosing step, phase, module and aten op of every CPU event (columns `tid`, `ts`, `dur`, `index`,
    sorted by (tid, ts, -dur), so a parent precedes its children; `names` and `cats` their `Labels`). Also returns,
    for step markers, the phase opened inside them.

    This is a stack walk per thread — each event, but a runtime call of no length, is pushed after popping every
    event that ended by its start; it inherits the context of the stack's top — computed with array operations,
    as a Python loop over a million events costs a second: an event popped ended before every later event starts,
    so the top is the latest earlier event of the thread that ends after this one starts (`_enclosing`), and the
    context an event inherits is that of its nearest enclosing step, phase, module or op (`_nearest_above`).
    """
    start = cpu["ts"].astype(float)
    end = start + cpu["dur"].astype(float)
    pushed = (end > start) | ~cats.isin(("cuda_runtime",))
    parent = _enclosing(start, np.where(pushed, end, -np.inf), np.asarray(cpu["tid"]))
    annotation = cats.isin(("user_annotation",))
    is_step = annotation & names.startswith(STEP_PREFIX)
    is_phase = annotation & ~is_step & names.startswith(PHASE_PREFIX)
    is_python = cats.isin((PYTHON_CAT,))  # the Python tracer's module call (`_cpu_events`): its class and number
    sets_module = (annotation & ~is_step & ~is_phase & names.startswith(MODULE_PREFIX)) | is_python
    own_step = names.map(lambda u: to_int(u[len(STEP_PREFIX) :], -1) if isinstance(u, str) else -1, -1, np.int64)
    own_phase = np.where(is_phase, names.map(_suffix(PHASE_PREFIX), ""), "").astype(object)
    own_module = np.where(sets_module, names.map(_suffix(MODULE_PREFIX), ""), "").astype(object)

    above = _nearest_above(parent, is_step)
    step = np.where(is_step, own_step, np.where(above >= 0, own_step[above], -1))
    above = _nearest_above(parent, is_phase)
    phase = np.where(is_phase, own_phase, np.where(above >= 0, own_phase[above], "")).astype(object)
    above = _nearest_above(parent, sets_module)
    for i in np.flatnonzero(is_python).tolist():  # a module path: the enclosing module's, dot, this call
        outer = own_module[above[i]] if above[i] >= 0 else ""
        own_module[i] = f"{outer}.{own_module[i]}" if outer else own_module[i]
    module = np.where(above >= 0, own_module[above], "").astype(object)
    above = _nearest_above(parent, cats.isin(("cpu_op",)))
    parent_op = np.where(above >= 0, cpu["index"][above], -1).astype(np.int64)
    return {"step": step.astype(np.int64), "phase": phase, "module": module, "parent_op": parent_op,
            "phase_inner": _phase_inner(np.asarray(cpu["tid"]), step, phase, is_step, is_phase)}  # fmt: skip


def _suffix(prefix: str) -> Callable[[object], object]:
    return lambda u: u[len(prefix) :] if isinstance(u, str) else ""


def _enclosing(start: np.ndarray, end: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """For each event (sorted by thread, then start), the latest earlier event of its thread with `end` after its
    start, -1 for none: found for all at once by descending a table of the largest end in each run of 2^k events
    (each event skips back over every run that ends by its start, the longest first)."""
    n = len(start)
    if not n:
        return np.zeros(0, dtype=np.int64)
    rows = np.arange(n)
    first = np.flatnonzero(np.r_[True, tid[1:] != tid[:-1]])
    lo = first[np.searchsorted(first, rows, side="right") - 1]  # the thread's first event
    table = [end]  # table[k][p]: the largest end of events p .. p + 2^k - 1
    longest = int(np.diff(np.r_[first, n]).max())
    while 2 ** len(table) <= longest:
        width = 2 ** (len(table) - 1)
        table.append(np.maximum(table[-1][:-width], table[-1][width:]))
    parent = np.full(n, -1, dtype=np.int64)
    prev_encloses = np.r_[False, (end[:-1] > start[1:]) & (tid[1:] == tid[:-1])]  # most often, the answer
    parent[prev_encloses] = rows[prev_encloses] - 1
    todo = np.flatnonzero(~prev_encloses & (rows > lo))
    pos, low, at = todo.copy(), lo[todo], start[todo]  # events pos .. row - 1 all end by the row's start
    for k in reversed(range(len(table))):
        back = pos - 2**k
        skip = (back >= low) & (table[k][np.maximum(back, 0)] <= at)
        pos = np.where(skip, back, pos)
    parent[todo] = np.where(pos > low, pos - 1, -1)
    return parent


def _nearest_above(parent: np.ndarray, flag: np.ndarray) -> np.ndarray:
    """Each event's nearest enclosing event (`parent`, its parent, …) with `flag`, -1 for none: every event's
    pointer up the tree doubles its reach each round, so the rounds are the log of the nesting depth."""
    hop = np.where(flag, np.arange(len(parent)), parent)  # a flagged event points at itself
    todo = np.flatnonzero(hop >= 0)
    todo = todo[~flag[hop[todo]]]
    while len(todo):
        hop[todo] = hop[hop[todo]]
        todo = todo[hop[todo] >= 0]
        todo = todo[~flag[hop[todo]]]
    return np.where(parent >= 0, hop[np.maximum(parent, 0)], -1)


def _phase_inner(tid: np.ndarray, step: np.ndarray, phase: np.ndarray, is_step: np.ndarray,
                 is_phase: np.ndarray) -> np.ndarray:  # fmt: skip
    """For each step marker, the phase last opened inside a step of its thread and number, in the walk's order
    ("" for other events)."""
    inner = np.empty(len(tid), dtype=object)
    inner.fill("")
    step_row: dict[tuple[int, int], int] = {}
    for i in np.flatnonzero(is_step | is_phase).tolist():
        key = (tid[i], step[i])
        if is_step[i]:
            step_row[key] = i
        elif key in step_row:
            inner[step_row[key]] = phase[i]
    return inner


def _join_kernels(rank: int, gpu: dict[str, np.ndarray], op: dict[str, np.ndarray],
                  cpu: dict[str, np.ndarray]) -> pd.DataFrame:  # fmt: skip
    """Each GPU event joined to its op: the op whose `External id` it carries (the first such op), else the op
    around the runtime call that launched it (`index_correlation`, where that call's `correlation` is the
    kernel's: HTA's 0 for "no launch in the trace" is also an index); step, phase and module from that op, else
    from the launching call. Columns `gpu`, `op` (the ops) and `cpu` (every CPU event) as in `join_columns`."""
    n = len(gpu["index"])
    if not n:
        return pd.DataFrame(columns=KERNEL_COLUMNS)
    missing = np.full(n, -1, dtype=np.int64)
    op_ext = op.get("external_id", np.full(len(op["index"]), -1, dtype=np.int64))
    with_ext = op_ext >= 0
    by_ext = pd.Index(op_ext[with_ext])
    first = ~by_ext.duplicated()
    by_ext, ext_op = by_ext[first], op["index"][with_ext][first]
    found = by_ext.get_indexer(gpu.get("external_id", missing))
    op_id = _take(ext_op, found, -1)
    launch = _places(cpu["index"], gpu.get("index_correlation", missing))
    if "correlation" in gpu and "correlation" in cpu:
        launch = np.where(_take(cpu["correlation"], launch, None) == gpu["correlation"], launch, -1)
    via_launch = _take(cpu["parent_op"], launch, -1)
    op_id = np.where((op_id < 0) & (via_launch >= 0), via_launch, op_id).astype(np.int64)
    at = _places(op["index"], op_id)  # -1: no op

    def from_op_or_launch(col: str, default: object) -> np.ndarray:
        return np.where(at >= 0, _take(op[col], at, default), _take(cpu[col], launch, default))

    return _table(
        rank,
        gpu,
        KERNEL_COLUMNS,
        stream=gpu["stream"],
        op_id=op_id,
        op=_take(op["name"], at, "").astype(object),
        step=from_op_or_launch("step", -1).astype(np.int64),
        phase=from_op_or_launch("phase", "").astype(object),
        module=from_op_or_launch("module", "").astype(object),
        grid=gpu.get("grid"),
        block=gpu.get("block"),
        registers_per_thread=gpu.get("registers_per_thread", -1),
        shared_memory=gpu.get("shared_memory", -1),
        bytes_arg=gpu.get("bytes", -1),
    )


def _places(keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """`pd.Index(keys).get_indexer(wanted)` for keys that are event indexes (distinct integers from 0, below a few
    times their count): looked up in a table from key to place rather than hashed (half the time). Other keys,
    and keys that repeat (which get_indexer refuses), are left to pandas."""
    top = int(keys.max()) + 1 if len(keys) else 0
    if keys.dtype.kind not in "iu" or (len(keys) and keys.min() < 0) or top > 4 * len(keys) + 1024:
        return pd.Index(keys).get_indexer(wanted)
    place = np.full(top + 1, -1, dtype=np.int64)  # the last slot: every wanted key outside 0 .. top - 1
    place[keys] = np.arange(len(keys))
    if not (place[keys] == np.arange(len(keys))).all():
        return pd.Index(keys).get_indexer(wanted)
    return place[np.where((wanted >= 0) & (wanted < top), wanted, top)]


def _take(values: np.ndarray, at: np.ndarray, default: object) -> np.ndarray:
    """values[at], with `default` where `at` is -1 (and everywhere when `values` is empty)."""
    if not len(values):
        return np.full(len(at), default, dtype=object if not isinstance(default, int) else np.int64)
    picked = values[np.maximum(at, 0)]
    return np.where(at >= 0, picked, default)
