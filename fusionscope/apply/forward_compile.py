"""torch.compile beside the fusions for a one-forward workload (a factory model, `path/to/file.py:factory`).

`apply --graphs` sets the fused decode step beside torch.compile, the tool a user would pick instead. A factory model
has no decode step, so `--graphs` does not apply to it, and without this module its fusions were judged against eager
PyTorch only. Here its forward is compiled two ways, both with Inductor's CUDA graphs (`reduce-overhead`, as the
decode peers are):
- **torch.compile**: the unpatched forward;
- **fused + compile**: the forward with the graph-bound fusions rewritten into the graph Inductor compiles
  (`rewrite.compile_fused`: the bundled kernels are `triton_op`s, so Inductor takes them without a graph break).
Each compiled forward replaces the model's `forward` on the instance for its checks and timed passes, and the
instance is restored exactly after (no class is touched). Each is checked on the workload's inputs against the
unpatched eager model with the fusions' rule (`numerics.judge`) before its time counts, then timed with the eager
baseline in the same interleaved rounds (`measure.interleaved`), so the ratios share the host's drift.

`mode="eager"` runs the same path without Inductor (the rewritten graph as is): what a CPU test can afford.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

BASELINE = "eager (unpatched)"
COMPILE = "torch.compile"
FUSED_COMPILE = "fused + compile"


@contextmanager
def forward_replaced(model: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """`model.forward` is `forward` inside, on the instance only; afterwards the instance is as it was (an instance
    attribute `forward` it had is put back, one it did not have is removed)."""
    had = "forward" in vars(model)
    before = vars(model).get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = before
        else:
            del model.forward


def compiled_forwards(model: nn.Module, fused_sites: dict[str, list[str]], mode: str) -> tuple[dict, dict]:
    """{variant: compiled forward} and {variant: why it is missing}; `fused_sites` ({fusion: paths}) are the
    graph-bound fusions fused + compile rewrites (none: no fused + compile)."""
    from fusionscope.apply import rewrite

    forwards: dict[str, Any] = {}
    failed: dict[str, str] = {}
    backend = "eager" if mode == "eager" else "inductor"
    try:
        forwards[COMPILE] = torch.compile(model.forward, backend=backend, mode=None if mode == "eager" else mode,
                                          fullgraph=False, dynamic=False)  # fmt: skip
    except Exception as exc:  # a peer that fails to compile is reported, not fatal
        failed[COMPILE] = f"torch.compile failed: {type(exc).__name__}: {_first_line(exc)}"
    if not fused_sites:
        failed[FUSED_COMPILE] = "no fusion found here binds on the captured graph"
    else:
        try:
            forwards[FUSED_COMPILE] = rewrite.compile_fused(model, fused_sites, mode=mode)[0]
        except Exception as exc:
            failed[FUSED_COMPILE] = f"fused + compile failed: {type(exc).__name__}: {_first_line(exc)}"
    return forwards, failed


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def compare_compiled(workload: Any, fused_sites: dict[str, list[str]], ref: Any, ref32: Any, eager_raw: dict,
                     real_weights: bool, repeats: int, note: Callable[[str], None],
                     mode: str = "reduce-overhead") -> dict:  # fmt: skip
    """The eager forward, torch.compile and fused + compile of `workload` (one forward phase): each compiled
    forward's first calls (compile and capture), its check against the eager reference `ref` (and `ref32`, the fp32
    copy's; `eager_raw`: the eager model's own distance from it), and for those that pass, the forward's wall ms,
    median of `repeats` interleaved rounds beside the eager baseline. Returns `summary["apply"]["compiled"]`."""
    from fusionscope.apply import measure, numerics

    model = workload.module
    note(f"torch.compile ({mode}) of the forward, unpatched and with the fusions rewritten: compiling")
    forwards, failed = compiled_forwards(model, fused_sites, mode)
    rows: dict[str, dict[str, Any]] = {BASELINE: {"passed": True, "reason": "the reference"}}
    for name, forward in forwards.items():
        row = rows[name] = {"fusions": sorted(fused_sites) if name == FUSED_COMPILE else []}
        with forward_replaced(model, forward):
            try:
                t0 = time.perf_counter()
                numerics.forward_reference(model, workload.inputs)  # compiles (and records its CUDA graphs)
                row["first_call_s"] = time.perf_counter() - t0
                test = numerics.forward_reference(model, workload.inputs)  # the steady state is what is checked
            except Exception as exc:
                row.update(passed=False, reason=f"{name} raised {type(exc).__name__}: {_first_line(exc)}")
                continue
        fig, fig32 = numerics.compare(test, ref), numerics.compare(test, ref32)
        ok, why = numerics.judge(fig, fig32, eager_raw, workload.dtype, real_weights)
        row.update(passed=ok, reason=why, numerics=numerics.json_safe(fig))
    for name, why in failed.items():
        rows[name] = {"passed": False, "reason": why}
    timed = {name: forwards.get(name) for name, row in rows.items() if row["passed"]}

    def entering(name: str) -> Callable[[], Any]:
        forward = timed[name]
        return (lambda: nullcontext()) if forward is None else (lambda: forward_replaced(model, forward))

    def on_round(r: int, name: str) -> None:
        note(f"compiled: round {r + 1}/{repeats}: {name}")

    measured = measure.interleaved(workload, {name: entering(name) for name in timed}, repeats, on_round=on_round)
    for name, m in measured.items():
        walls = m.wall_ms.get("forward") or []
        rows[name].update(wall_ms=statistics.median(walls) if walls else None, wall_ms_rounds=walls,
                          peak_mib=m.peak_mib)  # fmt: skip
    base = rows[BASELINE].get("wall_ms")
    for row in rows.values():
        row["speedup_vs_eager"] = base / row["wall_ms"] if base and row.get("wall_ms") else None
    compiled, fused = rows.get(COMPILE, {}).get("wall_ms"), rows.get(FUSED_COMPILE, {}).get("wall_ms")
    return {"mode": mode, "variants": rows,
            "fused_compile_vs_compile": compiled / fused if compiled and fused else None}  # fmt: skip
