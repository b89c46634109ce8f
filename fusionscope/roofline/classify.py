"""Timed kernels placed against a device's roofs: intensity, achieved rates and their fractions of roof, and the
class each earns, ``compute``, ``memory``, ``latency`` or ``unmodeled``.

`classify` places one kernel, `classify_kernels` a kernel table against a bandwidth and peaks by dtype, and
`classify_against` a table against the roofs as summary.json holds them (or none: a trace that names no device),
which `analyze` and `apply --graphs`'s replayed steps both classify by.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pandas as pd

from fusionscope.roofline.dtypes import _is_int, dtype_name

LATENCY_US = 10.0  # kernels shorter than this are launch/latency bound whatever their arithmetic


LATENCY_FRACTION = 0.4  # ... and so are kernels that reach less than this fraction of both roofs


def _classify_arrays(
    dur_us: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, peak_tflops: np.ndarray, bandwidth_gbps: float
) -> dict[str, np.ndarray]:
    with np.errstate(divide="ignore", invalid="ignore"):
        dur = np.where(dur_us > 0, dur_us, np.nan)
        intensity = np.where(nbytes > 0, flops / nbytes, np.nan)
        achieved_gbps = nbytes / dur / 1e3  # B/µs -> GB/s
        achieved_tflops = flops / dur / 1e6  # FLOP/µs -> TFLOP/s
        compute_only = (nbytes == 0) & (flops > 0)
        attainable = np.where(
            np.isnan(intensity),
            np.where(compute_only, peak_tflops, np.nan),
            np.minimum(peak_tflops, bandwidth_gbps * intensity / 1e3),
        )
        frac_bandwidth = achieved_gbps / bandwidth_gbps
        frac_compute = achieved_tflops / peak_tflops
        modeled = ~np.isnan(flops) & ~np.isnan(nbytes)
        achieved_frac = np.where(flops > 0, achieved_tflops / attainable, frac_bandwidth)
        achieved_frac = np.where(modeled, achieved_frac, np.nan)
        ridge = peak_tflops * 1e3 / bandwidth_gbps  # FLOP/byte where the two roofs meet
        latency = (dur_us < LATENCY_US) | (
            modeled & (frac_bandwidth < LATENCY_FRACTION) & (frac_compute < LATENCY_FRACTION)
        )
        memory = modeled & (intensity < ridge)  # NaN intensity (bytes == 0) compares False -> compute
    bound = np.select([latency, ~modeled, memory], ["latency", "unmodeled", "memory"], "compute").astype(object)
    return {
        "intensity": intensity,
        "achieved_gbps": achieved_gbps,
        "achieved_tflops": achieved_tflops,
        "peak_tflops": np.broadcast_to(peak_tflops, intensity.shape).astype(float),
        "attainable_tflops": attainable,
        "frac_bandwidth": frac_bandwidth,
        "frac_compute": frac_compute,
        "achieved_frac": achieved_frac,
        "bound": bound,
    }


def _as_float(x: Any) -> float:
    try:
        return float("nan") if x is None else float(x)
    except (TypeError, ValueError):
        return float("nan")


def classify(
    dur_us: float, flops: float | None, bytes: float | None, peak_tflops: float, bandwidth_gbps: float
) -> dict[str, Any]:
    """Roofline placement of one kernel.

    Returns ``intensity`` (FLOP/byte), ``achieved_gbps``, ``achieved_tflops``, ``peak_tflops``,
    ``attainable_tflops`` (``min(peak, bandwidth·intensity)``), ``frac_bandwidth``, ``frac_compute``,
    ``achieved_frac`` (achieved / attainable; ``frac_bandwidth`` when the kernel does no FLOPs) and ``bound``
    (``compute`` / ``memory`` / ``latency`` / ``unmodeled``), with the same rules as :func:`classify_kernels`.
    ``flops``/``bytes`` of ``None`` or NaN mean "unmodeled".
    """
    if not bandwidth_gbps or bandwidth_gbps <= 0:
        raise ValueError("bandwidth_gbps must be positive")
    res = _classify_arrays(
        np.array([_as_float(dur_us)]),
        np.array([_as_float(flops)]),
        np.array([_as_float(bytes)]),
        np.array([_as_float(peak_tflops)]),
        float(bandwidth_gbps),
    )
    return {k: (str(v[0]) if k == "bound" else float(v[0])) for k, v in res.items()}


def _peak_for(dtype: Any, table: dict[str, float], fallback: float) -> float:
    if not isinstance(dtype, str):
        return fallback
    name = dtype if dtype in table else (dtype_name(dtype) or dtype)
    if name == "bool" or _is_int(name):
        return fallback
    return float(table.get(name, fallback))


def classify_kernels(
    kernels: pd.DataFrame, bandwidth_gbps: float, peak_tflops_by_dtype: dict[str, float]
) -> pd.DataFrame:
    """Vectorised :func:`classify` over a kernel table.

    ``kernels`` needs ``dur_us``, ``flops``, ``bytes`` (NaN = unmodeled) and ``dtype`` (canonical name, None/NaN if
    unknown). The peak for a row is ``peak_tflops_by_dtype[dtype]``; integer, bool, unknown and missing dtypes use
    the ``"float32"`` entry. Returns a copy with the columns ``intensity``, ``achieved_gbps``, ``achieved_tflops``,
    ``peak_tflops``, ``attainable_tflops``, ``frac_bandwidth``, ``frac_compute``, ``achieved_frac`` and ``bound``:

    * ``latency``: shorter than 10 µs, or modeled and under 40% of both roofs;
    * ``unmodeled``: otherwise, when flops or bytes is NaN;
    * ``memory``: intensity below the ridge point ``peak_tflops·1000 / bandwidth_gbps`` FLOP/byte;
    * ``compute``: otherwise (including bytes == 0 with flops > 0).
    """
    if not bandwidth_gbps or bandwidth_gbps <= 0:
        raise ValueError("bandwidth_gbps must be positive")
    if "float32" not in peak_tflops_by_dtype:
        raise ValueError("peak_tflops_by_dtype needs a 'float32' entry (the fallback peak)")
    fallback = float(peak_tflops_by_dtype["float32"])
    out = kernels.copy()
    n = len(out)
    if "dtype" in out.columns:
        codes, uniques = pd.factorize(out["dtype"], use_na_sentinel=True)
        peaks_u = np.array([_peak_for(u, peak_tflops_by_dtype, fallback) for u in uniques] + [fallback], dtype=float)
        peak = peaks_u[codes]  # code -1 (None/NaN) picks the appended fallback
    else:
        peak = np.full(n, fallback)

    def col(name: str) -> np.ndarray:
        return pd.to_numeric(out[name], errors="coerce").to_numpy(dtype=float, na_value=np.nan)

    res = _classify_arrays(col("dur_us"), col("flops"), col("bytes"), peak, float(bandwidth_gbps))
    for k, v in res.items():
        out[k] = v
    return out


TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"  # torch's environment switch that turns TF32 matmuls on
NO_ROOF_COLUMNS = ("peak_tflops", "attainable_tflops", "frac_bandwidth", "frac_compute", "achieved_frac")


def peak_tflops(roofs: dict) -> dict[str, float]:
    """Peaks by dtype as `DeviceCeilings.peak_tflops` gives them: fp32 kernels on TF32 only where this process
    enabled TF32 matmuls (a trace does not record whether its program did)."""
    peaks = {k: float(v) for k, v in (roofs.get("tflops") or {}).items() if v}
    if peaks.get("tf32") and tf32_matmuls():
        peaks["float32"] = peaks["tf32"]
    return peaks


def tf32_matmuls() -> bool:
    """Whether this process enabled TF32 matmuls (`torch.backends.cuda.matmul.allow_tf32`). Where torch is not
    imported (`analyze`, to which its import would add a second) nothing enabled them but torch's environment
    override, `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE`; where that is set, torch is asked."""
    if "torch" not in sys.modules and TF32_OVERRIDE not in os.environ:
        return False
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32)


def classify_against(kernels: pd.DataFrame, roofs: dict | None) -> pd.DataFrame:
    """`classify_kernels` against the roofs (summary.json's `roofs`: `copy_gbps`, `tflops`); without roofs only the
    10 µs rule is known, so a kernel is `latency` under it and `unmodeled` otherwise, and the fractions of roof are NaN
    (intensity and achieved rates stay)."""
    if roofs is not None:
        return classify_kernels(kernels, float(roofs["copy_gbps"]), peak_tflops(roofs))
    out = classify_kernels(kernels, 1.0, {"float32": 1.0})
    for col in NO_ROOF_COLUMNS:
        out[col] = np.nan
    short = pd.to_numeric(out["dur_us"], errors="coerce") < LATENCY_US
    out["bound"] = np.where(short, "latency", "unmodeled").astype(object)
    return out
