"""Say in one sentence what limits a phase, so the reader knows which kind of fix to look for first.

The profiler decides the regime (``host-bound``/``gpu-bound``); this module only words it, using the numbers the
summary already holds.  The wording matters because the two regimes call for opposite work: a host-bound step is
paced by the CPU issuing launches, so faster kernels change nothing until there are fewer of them.
"""

from __future__ import annotations

from typing import Any

from .formatting import DASH, as_float, fmt_int, fmt_pct

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


def regime_sentence(phase_name: str, phase: dict[str, Any], device_kind: str) -> str:
    """Describe the phase's regime in plain words (plain text; the caller HTML-escapes it)."""
    if device_kind == "cpu":
        return "CPU run: the aten ops are the timeline; classes are against this CPU's measured roofs."
    regime = phase.get("regime")
    busy = fmt_pct(phase.get("gpu_busy_frac"))
    kernels = fmt_int(phase.get("kernels_per_step"))
    if regime == "host-bound":
        return (
            f"host-bound: the GPU is busy {busy} of each {phase_name} step; the CPU launching {kernels} kernels per "
            "step sets the pace — fusing ops to save launches or capturing CUDA graphs helps more than faster kernels."
        )
    if regime == "gpu-bound":
        sentence = (
            f"gpu-bound: the GPU is busy {busy} of each {phase_name} step, so kernel time sets the pace — "
            "faster or fused kernels pay off directly"
        )
        dominant = _dominant_class(phase)
        if dominant is not None:
            name, share = dominant
            advice = _CLASS_ADVICE.get(name, "see the top-kernels table")
            sentence += f"; {name}-bound kernels take {fmt_pct(share)} of the time, so {advice}"
        return sentence + "."
    if regime:
        return f"{regime}: the GPU is busy {busy} of each {phase_name} step."
    if busy == DASH:
        return "Regime not recorded for this phase."
    return f"Regime not recorded for this phase (the GPU is busy {busy} of each step)."
