"""A training step's phases — forward, backward, optimizer — told apart in a trace, so that each gets its own figures.

What the profiler writes: every node autograd's engine runs in the backward pass is an
`autograd::engine::evaluate_function: <Node>` op (on the GPU on the engine's own thread; on the CPU on the thread
that called `backward()`), and everything it runs nests inside one; `torch.optim` wraps `step()` and `zero_grad()`
in `Optimizer.step#<Class>.step` / `Optimizer.zero_grad#<Class>.zero_grad` ranges. So an op is `backward` when it is
or sits inside an evaluate_function op, `optimizer` when it runs inside an Optimizer range of its thread, and
`forward` otherwise (the loss included). A kernel takes its launching op's phase. Each phase's step is the span of
its ops in that ProfilerStep: forward from the step's start to the first backward op (less the `zero_grad` in
it), backward from there to the end of the last backward op, the optimizer the time inside its ranges.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fusionscope.trace import Timeline

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")


def is_training(ops: pd.DataFrame, annotations: pd.DataFrame | None) -> bool:
    """Whether the trace holds a backward pass or an optimizer step."""
    backward = ops["name"].astype(str).str.startswith(BACKWARD_PREFIX).any()
    stepped = annotations is not None and annotations["name"].astype(str).str.startswith("Optimizer.step#").any()
    return bool(backward or stepped)


def op_phases(ops: pd.DataFrame, annotations: pd.DataFrame | None) -> np.ndarray:
    """Each op's phase (module docstring); ops outside every step get ""."""
    order = ops.sort_values(["tid", "ts_us", "dur_us"], ascending=[True, True, False], kind="stable")
    inside: dict[int, bool] = {}
    for op, parent, name in zip(order["op_id"].tolist(), order["parent_op"].tolist(), order["name"].astype(str)):
        inside[op] = name.startswith(BACKWARD_PREFIX) or inside.get(parent, False)
    backward = ops["op_id"].map(inside).fillna(False).to_numpy(dtype=bool)
    optimizer = np.zeros(len(ops), dtype=bool)
    if annotations is not None and len(annotations):
        ranges = annotations[annotations["name"].astype(str).str.startswith(OPTIMIZER_PREFIXES)]
        start, end, tid = ops["ts_us"].to_numpy(float), (ops["ts_us"] + ops["dur_us"]).to_numpy(float), ops["tid"]
        for r in ranges.itertuples(index=False):
            optimizer |= (tid.to_numpy() == r.tid) & (start >= r.ts_us) & (end <= r.ts_us + r.dur_us)
    phase = np.where(backward, BACKWARD, np.where(optimizer, OPTIMIZER, FORWARD)).astype(object)
    phase[ops["step"].to_numpy() < 0] = ""
    return phase


def split_steps(steps: pd.DataFrame, ops: pd.DataFrame, annotations: pd.DataFrame | None) -> pd.DataFrame:
    """One row per (step, phase) that has ops in it: rank, step, phase, ts_us, dur_us (module docstring)."""
    rows = []
    optimizer = (annotations[annotations["name"].astype(str).str.startswith(OPTIMIZER_PREFIXES)]
                 if annotations is not None else pd.DataFrame(columns=["ts_us", "dur_us"]))  # fmt: skip
    for step in steps.itertuples(index=False):
        start, end = float(step.ts_us), float(step.ts_us + step.dur_us)
        mine = ops[ops["step"] == step.step]
        back = mine[mine["phase"] == BACKWARD]
        opt = optimizer[(optimizer["ts_us"] >= start) & (optimizer["ts_us"] < end)]
        stepping = opt[opt["name"].astype(str).str.startswith("Optimizer.step#")]
        back_start = float(back["ts_us"].min()) if len(back) else None
        fwd_end = back_start if back_start is not None else float(stepping["ts_us"].min()) if len(stepping) else end
        in_forward = opt[(opt["ts_us"] >= start) & (opt["ts_us"] < fwd_end)]["dur_us"].sum()  # zero_grad
        spans = {FORWARD: (start, fwd_end - start - float(in_forward))}
        if len(back):
            spans[BACKWARD] = (back_start, float((back["ts_us"] + back["dur_us"]).max()) - back_start)
        if len(opt):
            spans[OPTIMIZER] = (float(opt["ts_us"].min()), float(opt["dur_us"].sum()))
        for phase, (at, dur) in spans.items():
            if (mine["phase"] == phase).any():
                rows.append({"rank": step.rank, "step": step.step, "phase": phase, "ts_us": at, "dur_us": dur})
    return pd.DataFrame(rows, columns=["rank", "step", "phase", "ts_us", "dur_us"])


def steps_by_time(ops: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """Each op's step; an op of another thread than the ProfilerStep ranges' (autograd's engine thread on the GPU)
    takes the step whose range holds its start."""
    step = ops["step"].to_numpy().copy()
    if len(steps):
        order = steps.sort_values("ts_us")
        starts, ends = order["ts_us"].to_numpy(float), (order["ts_us"] + order["dur_us"]).to_numpy(float)
        ts = ops["ts_us"].to_numpy(float)
        at = np.searchsorted(starts, ts, side="right") - 1
        inside = (at >= 0) & (ts < ends[np.clip(at, 0, None)])
        fill = (step < 0) & inside
        step[fill] = order["step"].to_numpy()[at[fill]]
    return step


def split_training(timeline: Timeline, annotations: pd.DataFrame | None) -> Timeline:
    """The timeline with ops, kernels and steps in phases forward, backward and optimizer."""
    ops, kernels = timeline.ops.copy(), timeline.kernels.copy()
    ops["step"] = steps_by_time(ops, timeline.steps)
    ops["phase"] = op_phases(ops, annotations)
    if len(kernels):
        by_op = ops.set_index("op_id")
        known = kernels["op_id"].isin(by_op.index)
        kernels.loc[known, "step"] = kernels.loc[known, "op_id"].map(by_op["step"]).to_numpy()
        kernels["phase"] = kernels["op_id"].map(by_op["phase"]).where(known, FORWARD).to_numpy()
        kernels.loc[kernels["step"] < 0, "phase"] = ""
    steps = split_steps(timeline.steps, ops, annotations)
    return Timeline(device_kind=timeline.device_kind, ops=ops, kernels=kernels, steps=steps)
