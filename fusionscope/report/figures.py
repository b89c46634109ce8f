"""Build the report's plotly figures from already-grouped data.

Figures are returned as ``go.Figure`` objects; turning them into HTML is the page's job, and so is giving those built
on `_base_layout` their template (`TEMPLATE`, `page._figure_html`).  Every string that plotly
will draw (kernel and module names) is HTML-escaped first: plotly renders labels as a small subset of HTML, so a
template kernel name such as ``void cutlass::Kernel<float>`` would otherwise be parsed as a tag and vanish.
Plotly decodes the entities back, so the reader sees the real name.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from fusionscope.kernel_names import short_kernel_name
from fusionscope.roofline.opcost import CATEGORIES

from .formatting import as_float, fmt_num, fmt_pct
from .grouping import ModuleTree, RooflinePoints

BOUND_ORDER = ("compute", "memory", "latency", "unmodeled")
BOUND_COLOURS = {"compute": "#d95f02", "memory": "#1b9e77", "latency": "#7570b3", "unmodeled": "#9e9e9e"}
CATEGORY_ORDER = CATEGORIES  # the roofline's categories, in its order
_CATEGORY_COLOURS = dict(zip(CATEGORY_ORDER, qualitative.Safe, strict=True))
_EXTRA_COLOURS = qualitative.Pastel
_FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
_NAME_CHARS = 90
_MAX_MARKER_PX = 46
TEMPLATE = "plotly_white"  # the look of `_base_layout`'s figures, put into their JSON by `page._figure_html`


def plot_text(value: Any, limit: int | None = None) -> str:
    """Escape a name for plotly's HTML-ish labels, shortening very long template names to keep hovers readable."""
    text = "" if value is None else str(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return html.escape(text, quote=False)


def plot_wrapped(value: Any, width: int = 110, lines: int = 6) -> str:
    """A long name (a kernel's C++ signature) escaped for a plotly hover and broken into lines of `width`
    characters, at most `lines` of them (the rest cut with an ellipsis)."""
    text = "" if value is None else str(value)
    chunks = [text[i : i + width] for i in range(0, len(text), width)] or [""]
    if len(chunks) > lines:
        chunks = [*chunks[: lines - 1], chunks[lines - 1][: width - 1] + "…"]
    return "<br>".join(html.escape(c, quote=False) for c in chunks)


def _base_layout(height: int) -> dict[str, Any]:
    """Shared look: system font, tight margins (titles live in the page, not in the figure); the white template
    (`TEMPLATE`) is the page's to add: set on the figure, plotly copies the whole template into it (15 ms each)."""
    return {
        "height": height,
        "margin": {"l": 60, "r": 20, "t": 20, "b": 50},
        "font": {"family": _FONT, "size": 12},
        "hoverlabel": {"font": {"family": _FONT}},
    }


def _ordered(keys: Iterable[str], order: tuple[str, ...]) -> list[str]:
    """Put known keys in their canonical order so colours and stacking match across phases; unknown keys last."""
    keys = list(keys)
    return [k for k in order if k in keys] + sorted(k for k in keys if k not in order)


def category_colour(category: str, index: int = 0) -> str:
    """Fixed colour per kernel category so the same category looks the same in every phase."""
    return _CATEGORY_COLOURS.get(category, _EXTRA_COLOURS[index % len(_EXTRA_COLOURS)])


def time_breakdown_figure(by_category: Mapping[str, float], by_class: Mapping[str, float]) -> go.Figure:
    """Two stacked horizontal bars for one phase: µs per step split by kernel category and by bound class.

    Both bars partition the same step time, so putting them on one axis shows at a glance which categories make up
    e.g. the memory-bound time, and each phase gets its own axis so a short decode step is not a sliver next to a long
    prefill step.
    """
    fig = go.Figure()
    rows = (
        ("by category", "category", by_category, CATEGORY_ORDER),
        ("by class", "class", by_class, BOUND_ORDER),
    )
    for label, group, values, order in rows:
        clean = {str(k): as_float(v) or 0.0 for k, v in values.items()}
        total = sum(clean.values()) or 1.0
        for index, key in enumerate(_ordered(clean, order)):
            value = clean[key]
            if value <= 0:
                continue
            colour = BOUND_COLOURS.get(key, "#bbbbbb") if group == "class" else category_colour(key, index)
            fig.add_trace(
                go.Bar(
                    x=[value],
                    y=[label],
                    orientation="h",
                    name=plot_text(key),
                    legendgroup=group,
                    legendgrouptitle={"text": group},
                    marker={"color": colour, "line": {"color": "white", "width": 1}},
                    text=[plot_text(key)],
                    textposition="inside",
                    insidetextanchor="middle",
                    customdata=[value / total],
                    hovertemplate=f"{plot_text(key)}: %{{x:,.1f}} µs/step (%{{customdata:.1%}})<extra></extra>",
                )
            )
    # The legend sits to the right, one entry per line; size the figure so it never scrolls.
    fig.update_layout(
        **_base_layout(max(240, 22 * len(fig.data) + 140)),
        barmode="stack",
        uniformtext={"minsize": 9, "mode": "hide"},
        legend={
            "orientation": "v",
            "x": 1.02,
            "y": 1,
            "groupclick": "toggleitem",
            "tracegroupgap": 8,
            "traceorder": "grouped",
        },
        xaxis={"title": {"text": "µs per step"}, "rangemode": "tozero"},
        yaxis={"autorange": "reversed"},
    )
    fig.update_layout(margin={"l": 90, "b": 40})
    return fig


def module_treemap_figure(tree: ModuleTree) -> go.Figure:
    """Treemap of time per step by nn.Module path, so the heavy sub-modules stand out before any kernel name does."""
    fig = go.Figure(
        go.Treemap(
            ids=[plot_text(i) for i in tree.ids],
            labels=[plot_text(label) for label in tree.labels],
            parents=[plot_text(p) for p in tree.parents],
            values=tree.values,
            branchvalues="total",
            maxdepth=5,
            texttemplate="%{label}<br>%{value:,.0f} µs",
            hovertemplate="%{id}<br>%{value:,.1f} µs/step<br>%{percentRoot:.1%} of the phase<extra></extra>",
            marker={"line": {"width": 1, "color": "white"}},
            root={"color": "#eef1f4"},
        )
    )
    fig.update_layout(**_base_layout(460))
    fig.update_layout(margin={"l": 5, "r": 5, "t": 30, "b": 5})
    return fig


def _roof_lines(
    fig: go.Figure,
    gbps: float,
    tflops: Mapping[str, Any],
    dtypes: list[str],
    x_range: tuple[float, float],
    label: str,
    dash: str,
    colour: str,
) -> None:
    """Draw one roof set: a bandwidth slope, a flat ceiling per dtype, each ridge point marked and labelled."""
    x0, x1 = x_range
    peaks = [(d, as_float(tflops.get(d))) for d in dtypes]
    peaks = [(d, p) for d, p in peaks if p is not None and p > 0]
    line = {"color": colour, "width": 2, "dash": dash}
    if not peaks:
        fig.add_trace(
            go.Scatter(
                x=[x0, x1],
                y=[gbps * x0 / 1e3, gbps * x1 / 1e3],
                mode="lines",
                line=line,
                name=f"{label} bandwidth {fmt_num(gbps)} GB/s",
                hoverinfo="name",
            )
        )
        return
    for dtype, peak in peaks:
        ridge = peak * 1e3 / gbps
        fig.add_trace(
            go.Scatter(
                x=[x0, ridge, x1],
                y=[gbps * x0 / 1e3, peak, peak],
                mode="lines",
                line=line,
                name=f"{label} roof · {dtype} {fmt_num(peak)} TFLOP/s · {fmt_num(gbps)} GB/s",
                hovertemplate=f"{label} roof ({dtype}): {fmt_num(gbps)} GB/s, {fmt_num(peak)} TFLOP/s<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[ridge],
                y=[peak],
                mode="markers",
                marker={"symbol": "diamond", "size": 9, "color": colour},
                name=f"{label} ridge · {dtype}",
                showlegend=False,
                hovertemplate=f"{label} ridge ({dtype}): {fmt_num(ridge)} FLOP/B<extra></extra>",
            )
        )


def _x_range(points: RooflinePoints, ridges: list[float]) -> tuple[float, float]:
    """Pick log-x limits covering every dot and every ridge with some margin, so roof lines span the whole plot.

    Without dots the roofs alone would give a one-decade window; the usual 0.01–1000 FLOP/B span keeps the shape
    of the roofline recognisable.
    """
    values = [v for v in ridges if v > 0]
    if points.points.empty:
        values += [0.01, 1000.0]
    else:
        values += [float(v) for v in points.points["intensity"] if v > 0]
    return min(values) / 4, max(values) * 4


def roofline_figure(points: RooflinePoints, roofs: Mapping[str, Any], fallback_dtype: str | None) -> go.Figure | None:
    """Log–log roofline for one phase: aggregated kernels as dots sized by time and coloured by bound class.

    Measured roofs (this machine's copy bandwidth and per-dtype peak) are solid; datasheet roofs, when the summary
    has them, are dashed, so the gap between what the hardware promises and what it measured is visible.
    Returns ``None`` when there is neither a dot nor a roof to draw.
    """
    dtypes = list(points.dtypes) or ([fallback_dtype] if fallback_dtype else [])
    measured_gbps = as_float(roofs.get("copy_gbps"))
    measured_tflops = roofs.get("tflops") or {}
    datasheet = roofs.get("datasheet") or {}
    sheet_gbps = as_float(datasheet.get("gbps")) if isinstance(datasheet, Mapping) else None
    sheet_tflops = (datasheet.get("tflops") or {}) if isinstance(datasheet, Mapping) else {}

    ridges: list[float] = []
    for gbps, tflops in ((measured_gbps, measured_tflops), (sheet_gbps, sheet_tflops)):
        if gbps:
            ridges += [p * 1e3 / gbps for p in (as_float(tflops.get(d)) for d in dtypes) if p]
    has_roof = bool(measured_gbps or sheet_gbps)
    if points.points.empty and not has_roof:
        return None

    x_range = _x_range(points, ridges)
    fig = go.Figure()
    if measured_gbps:
        _roof_lines(fig, measured_gbps, measured_tflops, dtypes, x_range, "measured", "solid", "#37474f")
    if sheet_gbps:
        _roof_lines(fig, sheet_gbps, sheet_tflops, dtypes, x_range, "datasheet", "dash", "#90a4ae")

    frame = points.points
    if not frame.empty:
        sizeref = 2.0 * float(frame["us_per_step"].max()) / (_MAX_MARKER_PX**2)
        for bound in _ordered(frame["bound"].unique(), BOUND_ORDER):
            part = frame[frame["bound"] == bound]
            customdata = list(
                zip(
                    [plot_text(short_kernel_name(n), _NAME_CHARS) for n in part["name"]],
                    [plot_text(o) for o in part["op"]],
                    [plot_text(m) for m in part["leaf"]],
                    [plot_text(c) for c in part["category"]],
                    [plot_text(d) for d in part["dtype"]],
                    part["calls_per_step"].round(2),
                    part["us_per_step"].round(2),
                    [fmt_num(g) for g in part["gbps"]],
                    [fmt_pct(f, 1) for f in part["frac"]],
                    [plot_wrapped(n) for n in part["name"]],
                    strict=True,
                )
            )
            fig.add_trace(
                go.Scatter(
                    x=part["intensity"].round(4),
                    y=part["tflops"].map(lambda v: float(f"{v:.4g}")),
                    mode="markers",
                    name=f"{plot_text(bound)}-bound",
                    marker={
                        "size": part["us_per_step"].round(2),
                        "sizemode": "area",
                        "sizeref": sizeref or 1.0,
                        "sizemin": 4,
                        "color": BOUND_COLOURS.get(bound, "#bbbbbb"),
                        "opacity": 0.75,
                        "line": {"width": 0.5, "color": "white"},
                    },
                    customdata=customdata,
                    hovertemplate=(
                        "<b>%{customdata[0]}</b><br><span style='font-size:10px'>%{customdata[9]}</span><br>"
                        "op %{customdata[1]} · module %{customdata[2]}<br>"
                        "%{customdata[3]} · %{customdata[4]} · " + plot_text(bound) + "-bound<br>"
                        "%{customdata[6]:,.1f} µs/step in %{customdata[5]:,.1f} calls<br>"
                        "%{x:.3g} FLOP/B · %{y:.3g} TFLOP/s · %{customdata[7]} GB/s<br>"
                        "%{customdata[8]} of its roof<extra></extra>"
                    ),
                )
            )
    fig.update_layout(
        **_base_layout(460),
        xaxis={
            "type": "log",
            "title": {"text": "arithmetic intensity (FLOP/byte)"},
            "range": [math.log10(x_range[0]), math.log10(x_range[1])],
            "dtick": 1,
        },
        yaxis={"type": "log", "title": {"text": "achieved TFLOP/s"}, "dtick": 1},
        legend={"orientation": "h", "y": -0.18, "itemsizing": "constant"},
    )
    fig.update_layout(margin={"b": 60})
    return fig
