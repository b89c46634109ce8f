"""`trace._sweep` computes with array operations what a stack walk over each thread's events gives: checked against
that walk, written out plainly here, on random events that nest, overlap partly, tie, last no time, repeat step
numbers and mix fusionscope's module ranges with the Python tracer's module calls."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fusionscope import trace
from fusionscope.markers import MODULE_PREFIX, PHASE_PREFIX, STEP_PREFIX
from fusionscope.trace_fields import to_int


def stack_walk(cpu: dict[str, np.ndarray]) -> dict[str, list]:
    """The walk: events sorted by (tid, ts, -dur); each inherits the context of the stack's top after popping every
    event that ended by its start, and is pushed (but a runtime call of no length) with the context it sets."""
    n = len(cpu["index"])
    out = {"step": [-1] * n, "phase": [""] * n, "module": [""] * n, "parent_op": [-1] * n, "phase_inner": [""] * n}
    step_row: dict[tuple[int, int], int] = {}
    stack: list[tuple[float, int, str, str, int]] = []
    current_tid = None
    for i in range(n):
        tid, start, end = cpu["tid"][i], float(cpu["ts"][i]), float(cpu["ts"][i]) + float(cpu["dur"][i])
        name, cat = cpu["name"][i], cpu["cat"][i]
        if tid != current_tid:
            stack.clear()
            current_tid = tid
        while stack and stack[-1][0] <= start:
            stack.pop()
        s, p, m, op = stack[-1][1:] if stack else (-1, "", "", -1)
        out["step"][i], out["phase"][i], out["module"][i], out["parent_op"][i] = s, p, m, op
        if cat == "user_annotation":
            if name.startswith(STEP_PREFIX):
                s = to_int(name[len(STEP_PREFIX) :], -1)
                out["step"][i] = s
                step_row[(tid, s)] = i
            elif name.startswith(PHASE_PREFIX):
                p = name[len(PHASE_PREFIX) :]
                out["phase"][i] = p
                if (tid, s) in step_row:
                    out["phase_inner"][step_row[(tid, s)]] = p
            elif name.startswith(MODULE_PREFIX):
                m = name[len(MODULE_PREFIX) :]
        elif cat == trace.PYTHON_CAT:
            call = name[len(MODULE_PREFIX) :]
            m = f"{m}.{call}" if m else call
        elif cat == "cpu_op":
            op = int(cpu["index"][i])
        if end > start or cat != "cuda_runtime":
            stack.append((end, s, p, m, op))
    return out


KINDS = [
    ("user_annotation", f"{STEP_PREFIX}{{k}}"),
    ("user_annotation", f"{STEP_PREFIX}x"),
    ("user_annotation", f"{PHASE_PREFIX}prefill"),
    ("user_annotation", f"{PHASE_PREFIX}decode"),
    ("user_annotation", f"{MODULE_PREFIX}model.layers.{{k}}"),
    ("user_annotation", "Optimizer.step#AdamW.step"),
    (trace.PYTHON_CAT, f"{MODULE_PREFIX}LlamaMLP_{{k}}"),
    ("cpu_op", "aten::mm"),
    ("cpu_op", "aten::add"),
    ("cuda_runtime", "cudaLaunchKernel"),
    ("cuda_driver", "cuLaunchKernel"),
]


def random_events(seed: int, n: int) -> dict[str, np.ndarray]:
    """`n` CPU events on three threads: nested ranges, partial overlaps, equal starts, runtime calls of no length."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, len(KINDS), n)
    ts = rng.integers(0, n, n).astype(float) / 4
    dur = np.where(rng.random(n) < 0.1, 0.0, rng.exponential(3.0, n).round(2))
    dur[rng.random(n) < 0.02] = n / 8  # a few long ranges that enclose many
    frame = pd.DataFrame({"index": rng.permutation(n), "tid": rng.integers(1, 4, n), "ts": ts, "dur": dur})
    frame["cat"] = [KINDS[k][0] for k in kinds]
    frame["name"] = [KINDS[k][1].format(k=int(rng.integers(0, 3))) for k in kinds]
    frame = frame.sort_values(["tid", "ts", "dur"], ascending=[True, True, False], kind="stable")
    return {c: frame[c].to_numpy(dtype=object if c in ("cat", "name") else None) for c in frame.columns}


@pytest.mark.parametrize("seed", range(12))
def test_sweep_is_the_stack_walk(seed: int) -> None:
    cpu = random_events(seed, [0, 1, 5, 50, 400, 3000][seed % 6])
    got = trace._sweep(cpu, trace.Labels.of(cpu["name"]), trace.Labels.of(cpu["cat"]))
    want = stack_walk(cpu)
    for column, values in want.items():
        assert got[column].tolist() == values, column
