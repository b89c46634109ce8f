"""Training traces: forward, backward and optimizer told apart (`fusionscope.training`), each with its own figures.

Fixture: `tests/data/traces/train-steps.trace.json.gz`, 2 recorded steps of Linear → GELU → Linear with MSE loss
and AdamW on the CPU (`tests/data/make_trace_fixtures.py`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from fusionscope import training
from fusionscope.analyze import MISSING_PHASES, analyze

TRAIN = Path(__file__).resolve().parent / "data" / "traces" / "train-steps.trace.json.gz"


def raw_ops() -> list[dict]:
    with gzip.open(TRAIN, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op"]


def test_phases_and_their_figures(tmp_path: Path) -> None:
    run = analyze(TRAIN, out=tmp_path / "run", device="cpu")
    s = run.summary
    assert list(s["phases"]) == ["forward", "backward", "optimizer"] and MISSING_PHASES not in s["missing"]
    assert all(ph["steps"] == 2 for ph in s["phases"].values())
    k = run.kernels  # on a CPU trace the ops are the timeline
    assert set(k["phase"]) == {"forward", "backward", "optimizer"}
    backward = k[k["phase"] == "backward"]
    assert (backward["op"] == "aten::mm").sum() == 2 * 3  # dX and dW of the second Linear, dW of the first
    assert (k.loc[k["phase"] == "forward", "op"] == "aten::addmm").sum() == 2 * 2
    optimizer_ops = set(k.loc[k["phase"] == "optimizer", "op"])
    assert any(op.startswith("aten::_foreach") or op in ("aten::add_", "aten::mul_") for op in optimizer_ops)
    ops = raw_ops()  # every op of a step is in exactly one phase
    assert sum(ph["ops_per_step"] for ph in s["phases"].values()) * 2 == len(ops)
    walls = {name: ph["wall_ms_per_step"] for name, ph in s["phases"].items()}
    assert all(w > 0 for w in walls.values())
    steps = [e for e in json.loads(gzip.decompress(TRAIN.read_bytes()))["traceEvents"]
             if str(e.get("name", "")).startswith("ProfilerStep#")]  # fmt: skip
    longest = max(e["dur"] for e in steps) / 1e3
    assert sum(walls.values()) <= longest * 1.001  # the phases' spans fit inside the step
    fused = {(o["fusion"], o["phase"]) for o in s["opportunities"]}
    assert ("linear_act", "forward") in fused  # addmm + GELU of the forward pass


def test_backward_is_the_evaluate_function_ranges() -> None:
    from fusionscope.analyze import parse_rank, parse_trace

    facts, doc = parse_trace(TRAIN)
    parsed = parse_rank(facts, doc)
    ops = parsed.timeline.ops
    phases = training.op_phases(ops, parsed.annotations)
    named = dict(zip(ops["name"], phases))
    assert named["autograd::engine::evaluate_function: AddmmBackward0"] == "backward"
    assert named["MseLossBackward0"] == "backward"
    assert named["aten::mse_loss"] == "forward"  # the loss is computed in the forward pass
    assert not training.is_training(ops[~ops["name"].str.startswith(training.BACKWARD_PREFIX)], None)
