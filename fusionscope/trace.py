"""From a trace file to a `Timeline`: DataFrames of aten ops and GPU kernels, each with its step, phase and module.

HTA does the parsing (one rank per file, or a folder of ranks). fusionscope then joins, in one sweep per CPU thread:
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
    sym = np.asarray(symbols, dtype=object)
    df = df.assign(name_s=sym[df["name"].to_numpy()], cat_s=sym[df["cat"].to_numpy()])
    cpu = df[_cpu_events(df, symbols)].sort_values(["tid", "ts", "dur"], ascending=[True, True, False])
    context = _sweep(cpu)
    cpu = cpu.assign(**context)

    ops_mask = cpu["cat_s"] == "cpu_op"
    ops = cpu[ops_mask]
    child_time = ops.groupby("parent_op")["dur"].sum()
    ops = pd.DataFrame(
        {
            "rank": rank,
            "op_id": ops["index"].to_numpy(),
            "parent_op": ops["parent_op"].to_numpy(),
            "name": ops["name_s"].to_numpy(),
            "tid": ops["tid"].to_numpy(),
            "ts_us": ops["ts"].to_numpy(dtype=float),
            "dur_us": ops["dur"].to_numpy(dtype=float),
            "self_us": (ops["dur"] - ops["index"].map(child_time).fillna(0)).clip(lower=0).to_numpy(dtype=float),
            "step": ops["step"].to_numpy(),
            "phase": ops["phase"].to_numpy(),
            "module": ops["module"].to_numpy(),
            "external_id": ops.get("external_id", pd.Series(-1, index=ops.index)).to_numpy(),
            "input_dims": ops["input_dims"].to_numpy() if "input_dims" in ops else None,
            "input_type": ops["input_type"].to_numpy() if "input_type" in ops else None,
            "concrete_inputs": ops["concrete_inputs"].to_numpy() if "concrete_inputs" in ops else None,
        },
        columns=OP_COLUMNS,
    )

    is_step = np.array([isinstance(sym_, str) and sym_.startswith(STEP_PREFIX) for sym_ in symbols] + [False])
    ann = cpu[is_step[cpu["name"].to_numpy()]]  # by symbol id: each distinct name tested once
    steps = pd.DataFrame(
        {
            "rank": rank,
            "step": ann["step"].to_numpy(),
            "phase": ann["phase_inner"].to_numpy(),
            "ts_us": ann["ts"].to_numpy(dtype=float),
            "dur_us": ann["dur"].to_numpy(dtype=float),
        }
    )

    gpu = df[df["cat_s"].isin(GPU_CATS)]
    kernels = _join_kernels(rank, gpu, ops, cpu)
    return ops, kernels, steps


def _cpu_events(df: pd.DataFrame, symbols: list[str]) -> pd.Series:
    """The CPU events the sweep walks: `CPU_CATS`, and the Python tracer's `nn.Module: <Class>_<N>` calls
    (`with_stack=True`) where the trace has no `nn.Module: <path>` ranges of fusionscope's own."""
    cpu = df["cat_s"].isin(CPU_CATS)
    named = np.array([isinstance(s, str) and s.startswith(MODULE_PREFIX) for s in symbols] + [False])
    module_event = named[df["name"].to_numpy()]  # by symbol id: each distinct name tested once
    if (module_event & (df["cat_s"] == "user_annotation").to_numpy()).any():
        return cpu
    return cpu | (module_event & (df["cat_s"] == PYTHON_CAT).to_numpy())


def _sweep(cpu: pd.DataFrame) -> dict[str, np.ndarray]:
    """Innermost enclosing step, phase, module and aten op of every CPU event, one stack walk per thread.

    Events are sorted by (tid, ts, -dur), so a parent precedes its children; each stack entry carries the context its
    children inherit, which makes the walk O(events). Also returns, for step markers, the phase opened inside them.
    """
    n = len(cpu)
    names = cpu["name_s"].tolist()  # Python lists: indexing a numpy array in a loop makes a scalar object each time
    cats = cpu["cat_s"].tolist()
    tids = cpu["tid"].tolist()
    start_array = cpu["ts"].to_numpy(dtype=float)
    ends = (start_array + cpu["dur"].to_numpy(dtype=float)).tolist()
    starts = start_array.tolist()
    idx = cpu["index"].tolist()
    step = [-1] * n
    phase = [""] * n
    module = [""] * n
    parent_op = [-1] * n
    phase_inner = [""] * n
    step_row: dict[tuple[int, int], int] = {}
    stack: list[tuple[float, int, str, str, int]] = []  # (end, step, phase, module, op index)
    current_tid = None
    for i in range(n):
        if tids[i] != current_tid:
            stack.clear()
            current_tid = tids[i]
        while stack and stack[-1][0] <= starts[i]:
            stack.pop()
        s, p, m, op = stack[-1][1:] if stack else (-1, "", "", -1)
        step[i], phase[i], module[i], parent_op[i] = s, p, m, op
        cat = cats[i]
        if cat == "user_annotation":
            name = names[i]
            if name.startswith(STEP_PREFIX):
                s = to_int(name[len(STEP_PREFIX) :], -1)
                step[i] = s
                step_row[(current_tid, s)] = i
            elif name.startswith(PHASE_PREFIX):
                p = name[len(PHASE_PREFIX) :]
                phase[i] = p
                if (current_tid, s) in step_row:
                    phase_inner[step_row[(current_tid, s)]] = p
            elif name.startswith(MODULE_PREFIX):
                m = name[len(MODULE_PREFIX) :]
        elif cat == PYTHON_CAT:  # the Python tracer's module call (`_cpu_events`): its class and instance number
            call = names[i][len(MODULE_PREFIX) :]
            m = f"{m}.{call}" if m else call
        elif cat == "cpu_op":
            op = idx[i]
        if ends[i] > starts[i] or cat != "cuda_runtime":
            stack.append((ends[i], s, p, m, op))
    step = np.array(step, dtype=np.int64)
    parent_op = np.array(parent_op, dtype=np.int64)
    phase, module, phase_inner = (np.array(v, dtype=object) for v in (phase, module, phase_inner))
    return {"step": step, "phase": phase, "module": module, "parent_op": parent_op, "phase_inner": phase_inner}


def _join_kernels(rank: int, gpu: pd.DataFrame, ops: pd.DataFrame, cpu: pd.DataFrame) -> pd.DataFrame:
    if gpu.empty:
        return pd.DataFrame(columns=KERNEL_COLUMNS)
    by_ext = ops[ops["external_id"] >= 0].drop_duplicates("external_id").set_index("external_id")
    ext = gpu["external_id"] if "external_id" in gpu else pd.Series(-1, index=gpu.index)
    op_id = ext.map(by_ext["op_id"])
    # Fallback through the launching runtime call (HTA turns `correlation` into the row index of its partner).
    runtime = cpu.set_index("index")
    launch = gpu["index_correlation"] if "index_correlation" in gpu else pd.Series(-1, index=gpu.index)
    if "correlation" in gpu and "correlation" in runtime:  # HTA's 0 for "no launch in the trace" is also an index
        launch = launch.where(launch.map(runtime["correlation"]) == gpu["correlation"], -1)
    via_launch_op = launch.map(runtime["parent_op"])
    op_id = op_id.fillna(via_launch_op.where(via_launch_op >= 0)).fillna(-1).astype(np.int64)
    op_rows = ops.set_index("op_id")
    has_op = op_id >= 0

    def from_op_or_launch(col: str, default: object) -> pd.Series:
        val = op_id.map(op_rows[col]).where(has_op)
        return val.fillna(launch.map(runtime[col])).fillna(default)

    return pd.DataFrame(
        {
            "rank": rank,
            "kernel_id": gpu["index"].to_numpy(),
            "name": gpu["name_s"].to_numpy(),
            "stream": gpu["stream"].to_numpy(),
            "ts_us": gpu["ts"].to_numpy(dtype=float),
            "dur_us": gpu["dur"].to_numpy(dtype=float),
            "op_id": op_id.to_numpy(),
            "op": op_id.map(op_rows["name"]).fillna("").to_numpy(),
            "step": from_op_or_launch("step", -1).astype(np.int64).to_numpy(),
            "phase": from_op_or_launch("phase", "").to_numpy(),
            "module": from_op_or_launch("module", "").to_numpy(),
            "grid": gpu["grid"].to_numpy() if "grid" in gpu else None,
            "block": gpu["block"].to_numpy() if "block" in gpu else None,
            "registers_per_thread": gpu["registers_per_thread"].to_numpy() if "registers_per_thread" in gpu else -1,
            "shared_memory": gpu["shared_memory"].to_numpy() if "shared_memory" in gpu else -1,
            "bytes_arg": gpu["bytes"].to_numpy() if "bytes" in gpu else -1,
        },
        columns=KERNEL_COLUMNS,
    )
