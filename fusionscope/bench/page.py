"""The bench results as one self-contained HTML page: per kernel, GPU time and % of copy bandwidth per variant and
shape, host cost and time per call, and the full table. Draws only; every figure comes from the result rows."""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

VARIANT_COLOURS = {
    "eager": "#9e9e9e",
    "compile": "#5c6bc0",
    "torch": "#26a69a",
    "liger": "#ffa726",
    "fusionscope": "#d81b60",
    "fusionscope-1launch": "#8e24aa",
}


def kernel_figure(rows: pd.DataFrame, kernel: str) -> go.Figure:
    data = rows[rows["kernel"] == kernel]
    fig = make_subplots(
        rows=1,
        cols=4,
        subplot_titles=(
            "GPU time per call (µs, CUDA-graph replay)",
            "% of measured copy bandwidth",
            "host µs per call",
            "µs per call, back to back (host and GPU)",
        ),
    )
    for variant, group in data.groupby("variant", sort=False):
        colour = VARIANT_COLOURS.get(str(variant))
        for col, metric in enumerate(("gpu_us", "pct_copy_bw", "host_us", "call_us"), start=1):
            fig.add_trace(
                go.Bar(
                    name=str(variant),
                    x=group["case"],
                    y=group.get(metric),
                    marker_color=colour,
                    legendgroup=str(variant),
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=3)
    fig.update_yaxes(type="log", row=1, col=4)
    fig.update_layout(title=kernel, barmode="group", height=380, margin={"t": 60, "b": 40, "l": 50, "r": 20})
    return fig


def render_bench_page(rows: pd.DataFrame, meta: dict) -> str:
    parts = [
        f"<h1>fusionscope bench — {html.escape(str(meta.get('device')))}</h1>",
        f"<p>{html.escape(meta.get('date', ''))} · dtype {html.escape(str(meta.get('dtype')))} · "
        + " · ".join(f"{html.escape(k)} {html.escape(str(v))}" for k, v in meta.get("versions", {}).items())
        + "</p>",
        f"<p>measured copy bandwidth {meta['roofs']['copy_gbps']:.0f} GB/s; GB/s counts the minimal traffic "
        "(each input read once, each output written once) over the CUDA-graph GPU time.</p>",
    ]
    for kernel in dict.fromkeys(rows["kernel"]):
        parts.append(kernel_figure(rows, kernel).to_html(full_html=False, include_plotlyjs=False))
    parts.append(rows.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="—", classes="results"))
    style = (
        "body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;"
        "font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fusionscope bench</title><style>{style}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>{''.join(parts)}</body></html>"
    )
