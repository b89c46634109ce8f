"""Say in plain words what limits a phase, so the reader knows which kind of fix to look for first.

Two things carry two names. The phase's *regime* (`host-bound` / `gpu-bound`, summary.json `phases[p].regime`) is
what the profile measured: host-bound when the GPU is busy under half of the unprofiled step. What *paces* the step
(`host` / `gpu`, `cumulative[p].paced_by`) is the step model's `max(T_host, T_gpu)`, the one every estimate uses:
llama-3.1-8b prefill on the H200 is measured gpu-bound (68% busy) and paced by the host (24.1 ms of host work against
16.4 ms of GPU work). The sentence gives the measurement under its name and takes its advice from the step model;
only a run without one (written before `cumulative` held it) gets advice from the measured regime. This module
words what the summary holds; it computes nothing. The two regimes call for opposite work: a host-paced step is set
by the CPU issuing launches, so faster kernels change nothing until there are fewer of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .formatting import DASH, as_float, fmt_int, fmt_pct, fmt_unit

PACER_WORDS = {"host": "the host", "gpu": "the GPU"}
_OLD_REGIME = {"host-bound": "host", "gpu-bound": "gpu"}  # cumulative[p].regime of runs before `paced_by`


def paced_by(plan: Mapping[str, Any] | None) -> str | None:
    """`host` or `gpu` from a phase's cumulative plan (None: no step model, e.g. a CPU run)."""
    plan = plan or {}
    pacer = plan.get("paced_by")
    if pacer in PACER_WORDS:
        return str(pacer)
    return _OLD_REGIME.get(str(plan.get("regime")))


_CLASS_ADVICE = {
    "memory": "fusing ops to move fewer bytes pays most",
    "compute": "faster math (lower precision, better tiles) pays most",
    "latency": "fusing small kernels into fewer, larger ones pays most",
    "unmodeled": "the top-kernels table is the place to look, since they have no cost model yet",
}


def _dominant_class(phase: dict[str, Any]) -> tuple[str, float] | None:
    """Return the bound class holding the most time in this phase and its share, from the summary's own totals."""
    by_class = phase.get("time_by_class_us") or {}
    values = {str(k): as_float(v) or 0.0 for k, v in by_class.items()}
    total = sum(values.values())
    if total <= 0:
        return None
    name = max(values, key=lambda key: values[key])
    return name, values[name] / total


def regime_sentence(phase_name: str, phase: dict[str, Any], device_kind: str,
                    plan: Mapping[str, Any] | None = None) -> str:  # fmt: skip
    """Describe the phase's measured regime and what paces it in the step model (plain text; the caller
    HTML-escapes it). `plan` is the phase's `cumulative` entry."""
    if device_kind == "cpu":
        return "CPU run: the aten ops are the timeline; classes are against this CPU's measured roofs."
    regime = phase.get("regime")
    busy = fmt_pct(phase.get("gpu_busy_frac"))
    kernels = fmt_int(phase.get("kernels_per_step"))
    if regime not in ("host-bound", "gpu-bound"):
        if regime:
            return f"{regime}: the GPU is busy {busy} of each {phase_name} step."
        if busy == DASH:
            return "Regime not recorded for this phase."
        return f"Regime not recorded for this phase (the GPU is busy {busy} of each step)."
    half = "under half" if regime == "host-bound" else "at least half"
    measured = f"{regime} (measured): the GPU is busy {busy} of each {phase_name} step, {half} of it"
    pacer = paced_by(plan)
    if pacer is None:  # no step model in this run's summary: the measured regime is all there is
        return measured + "; " + _advice("host" if regime == "host-bound" else "gpu", phase, kernels)
    step = (plan or {}).get("step_model") or {}
    host, gpu = fmt_unit(_ms(step.get("host_us")), "ms"), fmt_unit(_ms(step.get("gpu_us")), "ms")
    terms = f" ({host} of host work, {gpu} of GPU work per step)" if step else ""
    return f"{measured}. Paced by {PACER_WORDS[pacer]} in the step model{terms}: {_advice(pacer, phase, kernels)}"


def _ms(us: Any) -> float | None:
    value = as_float(us)
    return None if value is None else value / 1e3


def _advice(pacer: str, phase: dict[str, Any], kernels: str) -> str:
    """Which kind of fix pays first when `pacer` sets the step time."""
    if pacer == "host":
        return (
            f"the CPU launching {kernels} kernels per step sets the pace — fusing ops to save launches or capturing "
            "CUDA graphs helps more than faster kernels."
        )
    sentence = "kernel time sets the pace — faster or fused kernels pay off directly"
    dominant = _dominant_class(phase)
    if dominant is not None:
        name, share = dominant
        advice = _CLASS_ADVICE.get(name, "see the top-kernels table")
        sentence += f"; {name}-bound kernels take {fmt_pct(share)} of the time, so {advice}"
    return sentence + "."
