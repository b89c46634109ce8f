"""Self-contained HTML report for a fusionscope run.

The report draws what the profiler already decided (summary.json) and the per-kernel rows behind it
(kernels.csv); it never re-analyses.  It is a pure function so the CLI owns all file I/O and tests can render
in memory.
"""

from __future__ import annotations

import pandas as pd

from .page import render_page

__all__ = ["render_report"]


def render_report(summary: dict, kernels: pd.DataFrame) -> str:
    """Return the whole HTML document for a run, with plotly.js inlined once so it works offline.

    ``summary`` is the parsed summary.json; ``kernels`` the kernels.csv frame (one row per GPU kernel, or per aten
    op on CPU runs).  Missing phases, empty frames, null GPU fields and NaN cost columns all render as notes or
    dashes rather than errors, because a report of a half-failed run is exactly when the reader needs one.
    """
    return render_page(summary, kernels)
