"""The self-contained HTML page of a diff (`fusionscope diff A B`): the data `fusionscope.diff.diff_runs` returns,
drawn as tables and one chart (per phase ms/step, A vs B).

Like the run report it must open with no network, so plotly.js is inlined once in <head> (page.py's copy) and every
value from the runs is HTML-escaped here.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from . import assets
from .figures import TEMPLATE, _base_layout, plot_text
from .formatting import DASH, as_float, fmt_count, fmt_num, fmt_signed_pct, kernel_html, phase_slugs
from .page import _empty, _esc, _figure_html, _mapping, _plotly_js, _section

METRIC_LABELS = {
    "wall_ms_per_step_unprofiled": "wall ms/step (unprofiled)",
    "wall_ms_per_step": "wall ms/step (profiled)",
    "gpu_busy_ms_per_step": "GPU busy ms/step",
    "kernels_per_step": "kernels/step",
    "ops_per_step": "aten ops/step",
}
PRESENT_WORDS = {"both": "", "a_only": "only in A", "b_only": "only in B"}
FUSION_WORDS = {"both": "in both", "vanished": "vanished in B", "appeared": "appeared in B",
                "a_only": "phase only in A", "b_only": "phase only in B"}  # fmt: skip
TOP_CHANGED = 15  # kernels listed per phase and direction; diff.json holds them all


def fmt_ratio(value: Any) -> str:
    number = as_float(value)
    return DASH if number is None else f"{number:.3f}×"


def fmt_delta(value: Any) -> str:
    number = as_float(value)
    if number is None:
        return DASH
    return ("+" if number > 0 else "−" if number < 0 else "") + fmt_num(abs(number))


def _cell(text: str, sort_key: Any = None, numeric: bool = False) -> str:
    """One table cell: `text` already escaped; `sort_key` what the page's sort script compares."""
    key = "" if sort_key is None else html.escape(str(sort_key), quote=True)
    return f'<td class="{"num" if numeric else "name"}" data-v="{key}">{text}</td>'


def _table(table_id: str, columns: list[tuple[str, bool]], rows: list[str]) -> str:
    """A sortable table; `columns` are (label, numeric) pairs, `rows` already-built `<tr>` strings."""
    head = "".join(
        f'<th tabindex="0" aria-sort="none" data-type="{"num" if num else "text"}">{html.escape(label)}</th>'
        for label, num in columns
    )
    return (
        f'<div class="table-wrap"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _delta_cells(d: Mapping[str, Any]) -> str:
    """A, B, Δ, ratio and Δ% cells of one `{a, b, delta, ratio}`."""
    ratio = as_float(d.get("ratio"))
    return (
        _cell(fmt_num(d.get("a")), as_float(d.get("a")), True)
        + _cell(fmt_num(d.get("b")), as_float(d.get("b")), True)
        + _cell(fmt_delta(d.get("delta")), as_float(d.get("delta")), True)
        + _cell(fmt_ratio(ratio), ratio, True)
        + _cell(fmt_signed_pct(None if ratio is None else ratio - 1), ratio, True)
    )


DELTA_COLUMNS = [("A", True), ("B", True), ("Δ (B − A)", True), ("B ÷ A", True), ("change", True)]


def phase_table(phases: Mapping[str, Any]) -> str:
    """Per phase and metric: A, B, Δ, ratio; a phase in one run only says so."""
    rows = []
    for name, ph in phases.items():
        where = PRESENT_WORDS.get(str(ph.get("present")), "")
        for metric, label in METRIC_LABELS.items():
            d = _mapping(_mapping(ph.get("metrics")).get(metric))
            if as_float(d.get("a")) is None and as_float(d.get("b")) is None:
                continue
            phase_text = _esc(name) + (f" ({html.escape(where)})" if where else "")
            rows.append(f"<tr>{_cell(phase_text, name)}{_cell(html.escape(label), label)}{_delta_cells(d)}</tr>")
    return _table("diff-phases", [("phase", False), ("metric", False), *DELTA_COLUMNS], rows)


def category_table(slug: str, categories: Mapping[str, Any]) -> str:
    rows = [f"<tr>{_cell(_esc(cat), cat)}{_delta_cells(_mapping(d))}</tr>" for cat, d in categories.items()]
    return _table(f"diff-categories-{slug}", [("category (µs/step)", False), *DELTA_COLUMNS], rows)


def fusion_table(slug: str, fusions: list[Any]) -> str:
    rows = []
    for row in fusions:
        row = _mapping(row)
        status = str(row.get("status"))
        rows.append(
            "<tr>"
            + _cell(_esc(row.get("fusion")), row.get("fusion"))
            + _cell(html.escape(FUSION_WORDS.get(status, status)), status)
            + "".join(_cell(fmt_count(row.get(k)), as_float(row.get(k)), True) for k in ("count_a", "count_b"))
            + "".join(_cell(fmt_num(row.get(k)), as_float(row.get(k)), True) for k in ("us_a", "us_b"))
            + _cell(fmt_delta(row.get("delta_us")), as_float(row.get("delta_us")), True)
            + "</tr>"
        )
    columns = [("fusion", False), ("status", False), ("groups/step A", True), ("groups/step B", True),
               ("µs/step now A", True), ("µs/step now B", True), ("Δ µs", True)]  # fmt: skip
    return _table(f"diff-fusions-{slug}", columns, rows)


def kernel_table(table_id: str, kernels: list[Any]) -> str:
    rows = []
    for row in kernels[:TOP_CHANGED]:
        row = _mapping(row)
        rows.append(
            f"<tr>{_cell(kernel_html(row.get('name')), row.get('name'))}"
            f"{_cell(fmt_num(row.get('us_per_step')), as_float(row.get('us_per_step')), True)}"
            f"{_cell(fmt_count(row.get('calls_per_step')), as_float(row.get('calls_per_step')), True)}</tr>"
        )
    more = len(kernels) - TOP_CHANGED
    note = f'<p class="note">… and {more} more in diff.json.</p>' if more > 0 else ""
    return _table(table_id, [("kernel", False), ("µs/step", True), ("calls/step", True)], rows) + note


def hta_section(hta: Any) -> list[str]:
    """HTA's trace diff, when both sides were traces: its rows, or why there are none."""
    if not isinstance(hta, Mapping):
        return []
    rows = []
    for r in hta.get("rows") or []:
        r = _mapping(r)
        cells = [_cell(_esc(r.get("name")), r.get("name"))]
        cells += [_cell(fmt_count(r.get(k)), as_float(r.get(k)), True) for k in ("count_a", "count_b")]
        cells += [_cell(fmt_num(r.get(k)), as_float(r.get(k)), True) for k in ("us_a", "us_b")]
        cells.append(_cell(fmt_delta(r.get("delta_us")), as_float(r.get("delta_us")), True))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    columns = [("op or kernel", False), ("count A", True), ("count B", True), ("µs A", True), ("µs B", True),
               ("Δ µs", True)]  # fmt: skip
    body = _table("diff-hta", columns, rows) if rows else _empty(f"HTA's trace diff: {hta.get('source')}.")
    return [_section("HTA trace diff", "Op and kernel counts and total time in the first step of each trace "
                     "(HolisticTraceAnalysis' TraceDiff), largest change first.", body, "hta")]  # fmt: skip


def step_time_figure(phases: Mapping[str, Any]) -> go.Figure | None:
    """Grouped bars: per phase, ms/step of A and of B (unprofiled wall time where the runs have it)."""
    names, values = [], {"A": [], "B": []}
    for name, ph in phases.items():
        metrics = _mapping(_mapping(ph).get("metrics"))
        unprof, prof = _mapping(metrics.get("wall_ms_per_step_unprofiled")), _mapping(metrics.get("wall_ms_per_step"))
        names.append(plot_text(name))
        for side in ("a", "b"):
            value = as_float(unprof.get(side))
            values[side.upper()].append(value if value is not None else as_float(prof.get(side)))
    if not any(v is not None for side in values.values() for v in side):
        return None
    fig = go.Figure()
    for side, colour in (("A", "#9aa5b1"), ("B", "#2f6fb3")):
        fig.add_trace(go.Bar(name=side, x=names, y=values[side], marker_color=colour,
                             hovertemplate=f"{side} %{{x}}: %{{y:,.3f}} ms/step<extra></extra>"))  # fmt: skip
    fig.update_layout(**_base_layout(340), barmode="group", yaxis_title="ms per step")
    return fig


def _run_line(label: str, facts: Mapping[str, Any]) -> str:
    return (
        f'<div class="sub"><b>{label}</b> <code>{_esc(facts.get("path"))}</code> · {_esc(facts.get("model"))} · '
        f"{_esc(facts.get('dtype'))} on {_esc(facts.get('device'))} · {_esc(facts.get('created'))}</div>"
    )


def render_diff_page(result: Mapping[str, Any]) -> str:
    """The whole diff document for `diff_runs`' result."""
    result = _mapping(result)
    phases = _mapping(result.get("phases"))
    slugs = phase_slugs([str(p) for p in phases])
    fig = step_time_figure(phases)
    chart = _figure_html(fig, "fig-diff-steps", TEMPLATE) if fig is not None else _empty("Neither run has a step time.")
    notes = "".join(f'<p class="note">{_esc(n)}</p>' for n in result.get("notes") or [])
    per_phase = []
    for name, ph in phases.items():
        ph, slug = _mapping(ph), slugs[name]
        where = PRESENT_WORDS.get(str(ph.get("present")), "")
        body = f"<h3>{_esc(name)}{f' ({html.escape(where)})' if where else ''}</h3>"
        body += category_table(slug, _mapping(ph.get("categories")))
        fusions = ph.get("fusions") or []
        body += fusion_table(slug, fusions) if fusions else _empty("No fusion found in this phase in either run.")
        if ph.get("present") == "both":
            body += "<h3>Kernels that appeared in B</h3>" + kernel_table(
                f"diff-appeared-{slug}", ph.get("kernels_appeared") or []
            )
            body += "<h3>Kernels that vanished from A</h3>" + kernel_table(
                f"diff-vanished-{slug}", ph.get("kernels_vanished") or []
            )
        per_phase.append(f'<div class="card">{body}</div>')
    a, b = _mapping(result.get("a")), _mapping(result.get("b"))
    page = [
        "<header><h1>fusionscope diff</h1>" + _run_line("A", a) + _run_line("B", b) + "</header>",
        "<main>",
        _section(
            "Phases",
            "Per phase, A (before) and B (after); Δ is B − A and the ratio B ÷ A, so a time below 1× "
            "is a speed-up. Unprofiled wall time is the step as the user sees it.",
            notes + phase_table(phases) + chart,
            "phases",
        ),
        _section(
            "Per phase: categories, fusions, kernels",
            "Kernel time per step by category; the fusions each "
            "run found (a fusion that vanished in B is what applying it did); the kernel names found in one "
            "run only, most time first.",
            "".join(per_phase) or _empty("Neither run has a phase."),
            "details",
        ),
        *hta_section(result.get("hta")),
        "</main>",
        "<footer>fusionscope diff · self-contained report, no network needed</footer>",
    ]
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>fusionscope diff · {html.escape(str(a.get('model')))} vs {html.escape(str(b.get('model')))}</title>\n"
        f"<style>{assets.CSS}</style>\n"
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f'<script type="text/javascript">{_plotly_js()}</script>\n'
        "</head>\n<body>\n" + "\n".join(page) + f"\n<script>{assets.SORT_JS}</script>\n</body>\n</html>\n"
    )
