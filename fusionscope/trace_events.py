"""The `Timeline` of a trace document already decoded (`analyze` reads and checks the file once), without HTA's
second read and decode of the same file.

It builds the frame HTA's parser builds — one row per complete event (`dur` and `cat` present, `Trace` dropped),
`index` its position in `traceEvents`, timestamps from the earliest event, the arguments `trace._parser_config`
asks for with HTA's defaults, `index_correlation` linking each launch to its kernel, and, with two or more
`ProfilerStep` ranges, HTA's filter (GPU events whose launch is in the trace) —
and hands it to the same join `trace.load_timeline` uses (`trace._join_rank`), so both give the same tables
(tests/test_analyze_scale.py checks it on every fixture). It also returns the `user_annotation` ranges the join
does not keep (`Optimizer.step#…`), for telling a training step's phases apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fusionscope import trace

# (column, args key, default): what trace._parser_config keeps, with HTA's defaults
ARGS = (("stream", "stream", -1), ("correlation", "correlation", -1), ("input_dims", "Input Dims", "-1"),
        ("input_type", "Input type", "-1"), ("external_id", "External id", -1),
        ("concrete_inputs", "Concrete Inputs", "[]"), ("grid", "grid", "[]"), ("block", "block", "[]"),
        ("registers_per_thread", "registers per thread", -1), ("shared_memory", "shared memory", -1),
        ("bytes", "bytes", -1), ("record_id", "Record function id", -1))  # fmt: skip
INT_ARGS = ("stream", "correlation", "external_id", "registers_per_thread", "shared_memory", "bytes", "record_id")
SYNC_EVENTS = ("Event Sync", "Context Sync")  # on stream -1, yet GPU events to HTA


@dataclass
class Parsed:
    """A rank's timeline, its annotation ranges (name, tid, ts_us, dur_us; timestamps as the timeline's), and each
    op's `Record function id` (op_id → id; what links it to an execution trace)."""

    timeline: trace.Timeline
    annotations: pd.DataFrame
    record_ids: dict[int, int]


def events_frame(events: list) -> pd.DataFrame:
    """HTA's event frame of a trace's `traceEvents` (names and categories as strings, not symbol ids)."""
    rows = [(i, e.get("name"), e.get("cat"), e.get("tid"), e.get("ts"), e.get("dur"), e.get("args"))
            for i, e in enumerate(events)
            if isinstance(e, dict) and e.get("dur") is not None and e.get("cat") not in (None, "Trace")]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["index", "name", "cat", "tid", "ts", "dur", "args"])
    columns: list[list] = [[] for _ in ARGS]
    keys = [(key, default, out.append) for (_column, key, default), out in zip(ARGS, columns)]
    for a in frame.pop("args").tolist():  # one pass over the events' args
        if not isinstance(a, dict):
            a = {}
        for key, default, append in keys:
            append(a.get(key, default))
    for (column, _key, _default), values in zip(ARGS, columns):
        frame[column] = np.asarray(values, dtype=np.int64) if column in INT_ARGS else _objects(values)
    frame["ts"] = frame["ts"].astype(float)
    frame["dur"] = frame["dur"].astype(float)
    if len(frame):
        frame["ts"] -= frame["ts"].min()
    return frame


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _on_gpu(frame: pd.DataFrame) -> pd.Series:
    return ((frame["stream"] >= 0) & (frame["correlation"] >= 0)) | frame["name"].isin(SYNC_EVENTS)


def _keep_traced_steps(frame: pd.DataFrame) -> pd.DataFrame:
    """HTA's filter with two or more ProfilerStep ranges (`include_last_profiler_step=True`): GPU events whose
    launch is a CPU event of the trace, CPU events first after them. (HTA also bounds the CPU events by the last
    step's end, but compares shifted start times with an unshifted end, so that bound keeps every CPU event.)"""
    gpu = _on_gpu(frame)
    cpu = frame[~gpu]
    if cpu.loc[cpu["name"].str.contains("ProfilerStep", na=False, regex=False), "name"].nunique() < 2:
        return frame
    kernels = frame[gpu]
    kernels = kernels[kernels["correlation"].isin(set(cpu["correlation"]))]
    return pd.concat([kernels, cpu], axis=0)


def _index_correlation(frame: pd.DataFrame) -> None:
    """HTA's `index_correlation`: a launch's kernel index and a kernel's launch index (0 for a correlation whose
    partner is not in the trace, -1 for none)."""
    frame["index_correlation"] = np.minimum(frame["correlation"].to_numpy(), 0)
    linked = frame[frame["correlation"] != -1]
    gpu = _on_gpu(linked)
    merged = linked.loc[~gpu, ["index", "correlation"]].merge(linked.loc[gpu, ["index", "correlation"]],
                                                              on="correlation", how="inner")  # fmt: skip
    position = pd.Series(np.arange(len(frame)), index=frame["index"].to_numpy())
    values = frame["index_correlation"].to_numpy().copy()
    values[position[merged["index_x"]].to_numpy()] = merged["index_y"].to_numpy()
    values[position[merged["index_y"]].to_numpy()] = merged["index_x"].to_numpy()
    frame["index_correlation"] = values


def parse_events(events: list, rank: int = 0) -> Parsed:
    """The Timeline of one rank's decoded `traceEvents` (as `trace.load_timeline` builds it from the file), its
    annotation ranges and its ops' record function ids."""
    frame = _keep_traced_steps(events_frame(events))
    _index_correlation(frame)
    symbols = list(dict.fromkeys([*frame["name"].astype(str), *frame["cat"].astype(str)]))
    code = {s: i for i, s in enumerate(symbols)}
    coded = frame.assign(name=frame["name"].astype(str).map(code), cat=frame["cat"].astype(str).map(code))
    ops, kernels, steps = trace._join_rank(rank, coded, symbols)
    annotations = frame.loc[frame["cat"] == "user_annotation", ["name", "tid", "ts", "dur"]]
    annotations = annotations.rename(columns={"ts": "ts_us", "dur": "dur_us"}).reset_index(drop=True)
    record = dict(zip(frame.loc[frame["cat"] == "cpu_op", "index"], frame.loc[frame["cat"] == "cpu_op", "record_id"]))
    timeline = trace.Timeline(device_kind="cuda" if len(kernels) else "cpu", ops=ops, kernels=kernels, steps=steps)
    return Parsed(timeline=timeline, annotations=annotations, record_ids={int(k): int(v) for k, v in record.items()})
