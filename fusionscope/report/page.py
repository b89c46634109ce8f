"""Assemble the self-contained HTML page from the summary, the grouped kernel data and the figures.

The page must open from a run folder on a machine with no network (a cluster login node, a laptop on a plane), so
plotly.js is inlined exactly once in <head> and every figure is emitted without its own copy.  All text that comes
from the run is HTML-escaped here or in :mod:`.table`; nothing from the data is ever inserted raw.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from functools import cache
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from . import assets
from .apply import (
    breakdown_table,
    compiled_table,
    graphs_figure,
    graphs_table,
    numerics_table,
    speedup_figure,
    timing_table,
    tolerance_table,
)
from .figures import TEMPLATE, module_treemap_figure, roofline_figure, time_breakdown_figure
from .formatting import (
    DASH,
    as_float,
    fmt_count,
    fmt_int,
    fmt_num,
    fmt_params,
    fmt_pct,
    fmt_timestamp,
    fmt_unit,
    phase_slugs,
    text_or_dash,
)
from .grouping import (
    kernel_stats,
    module_tree,
    normalise_kernels,
    phase_order,
    roofline_points,
    time_per_step_by,
)
from .opportunities import opportunities_table, waterfall_figure
from .regime import PACER_WORDS, paced_by, regime_sentence
from .table import top_kernels_table

_PLOT_CONFIG = {"displaylogo": False, "responsive": True}


@cache
def _plotly_js() -> str:
    """plotly.js source, read once per process: it is ~4.8 MB and identical for every report."""
    return get_plotlyjs()


@cache
def _template_json(name: str) -> dict[str, Any]:
    """The JSON of a registered template as a figure holds it once set (plotly's copy, whose keys are in another
    order than the registered one's); shared by every figure, read only."""
    return go.Figure(layout={"template": name}).to_dict()["layout"]["template"]


def _esc(value: Any) -> str:
    """Escape any run-provided value for HTML text, showing missing values as a dash."""
    return html.escape(text_or_dash(value), quote=False)


def _mapping(value: Any) -> Mapping[str, Any]:
    """Treat anything that is not a dict as empty, so a malformed summary field degrades to dashes, not a crash."""
    return value if isinstance(value, Mapping) else {}


def _figure_html(fig: Any, div_id: str, template: str | None = None) -> str:
    """One figure as a div plus its Plotly.newPlot call, relying on the single plotly.js in <head>. `template`: a
    registered plotly template (`figures.TEMPLATE`), put into the figure's JSON in place of the default one as
    plotly's `update_layout(template=...)` would have put it, made once per process instead of once per figure."""
    height = fig.layout.height or 450
    spec = fig.to_dict()
    if template is not None:
        spec["layout"]["template"] = _template_json(template)
    return pio.to_html(
        spec,
        validate=False,
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        config=_PLOT_CONFIG,
        default_width="100%",
        default_height=f"{height}px",
    )


def _dl(items: list[tuple[str, str]]) -> str:
    """Definition list from (label, already-escaped value) pairs."""
    return "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _header(summary: Mapping[str, Any]) -> str:
    """Title block: which model on which device, when, by which command, with which library versions."""
    model = _mapping(summary.get("model"))
    device = _mapping(summary.get("device"))
    versions = _mapping(summary.get("versions"))
    facts = [
        _esc(model.get("family")),
        f"{fmt_params(model.get('params'))} params",
        _esc(model.get("dtype")),
        f"batch {fmt_int(model.get('batch'))}",
        f"prompt {fmt_int(model.get('prompt_len'))}",
        f"{fmt_int(model.get('decode_steps'))} decode steps",
        f"source {_esc(model.get('source'))}",
    ]
    chips = "".join(f'<span class="chip">{_esc(k)} {_esc(v)}</span>' for k, v in versions.items())
    return (
        "<header>"
        f"<h1>fusionscope · {_esc(model.get('name'))}</h1>"
        f'<div class="sub">{" · ".join(facts)}</div>'
        f'<div class="sub">on <b>{_esc(device.get("name"))}</b> ({_esc(device.get("kind"))}) · '
        f"{html.escape(fmt_timestamp(summary.get('created')))} · "
        f"run took {fmt_unit(summary.get('wall_s'), 's')} · <code>{_esc(summary.get('command'))}</code></div>"
        f'<div class="chips">{chips}</div>'
        "</header>"
    )


def _run_card(summary: Mapping[str, Any]) -> str:
    """Run-wide facts: cost-model coverage and the roofs every class is judged against."""
    roofs = _mapping(summary.get("roofs"))
    tflops = _mapping(roofs.get("tflops"))
    peaks = ", ".join(f"{_esc(k)} {fmt_num(v)}" for k, v in tflops.items() if as_float(v) is not None) or DASH
    sheet = _mapping(roofs.get("datasheet"))
    sheet_peaks = ", ".join(
        f"{_esc(k)} {fmt_num(v)}" for k, v in _mapping(sheet.get("tflops")).items() if as_float(v) is not None
    )
    sheet_text = DASH if not sheet else f"{fmt_unit(sheet.get('gbps'), 'GB/s')}; {sheet_peaks or DASH} TFLOP/s"
    items = [
        ("cost coverage", f"{fmt_pct(summary.get('cost_coverage'), 1)} of kernel time has a cost model"),
        ("copy bandwidth", fmt_unit(roofs.get("copy_gbps"), "GB/s")),
        ("read-heavy bandwidth", fmt_unit(roofs.get("read_heavy_gbps"), "GB/s")),
        ("peak TFLOP/s", peaks),
        ("launch overhead", fmt_unit(roofs.get("launch_us"), "µs")),
        ("fused call host cost", fmt_unit(roofs.get("fused_call_us"), "µs")),
        ("aten op host cost", fmt_unit(roofs.get("aten_op_host_us"), "µs")),
        ("datasheet", sheet_text),
        ("roofs", f"{_esc(roofs.get('source'))}, measured {html.escape(fmt_timestamp(roofs.get('measured_at')))}"),
    ]
    missing = summary.get("missing") or []  # `analyze`: what the trace did not hold, so the analysis lacks
    if missing:
        items.append(("not in the trace", "<ul>" + "".join(f"<li>{_esc(m)}</li>" for m in missing) + "</ul>"))
    return f'<div class="card"><h3>Run</h3>{_dl(items)}</div>'


_REGIME_RULE = {"host-bound": " — the GPU busy under half of the step", "gpu-bound": " — the GPU busy half or more"}
_PACER_RULE = {"host": " — host work ≥ GPU work per step", "gpu": " — GPU work > host work per step"}


def _phase_card(name: str, phase: Mapping[str, Any], device_kind: str, plan: Mapping[str, Any]) -> str:
    """Per-phase headline numbers, the measured regime and what paces the step in the step model (`plan`: the
    phase's `cumulative` entry), and the sentence that says which kind of fix to try first."""
    wall = fmt_unit(phase.get("wall_ms_per_step"), "ms")
    unprofiled = as_float(phase.get("wall_ms_per_step_unprofiled"))
    if unprofiled is not None:
        wall += f" ({fmt_num(unprofiled)} ms unprofiled)"
    busy = fmt_unit(phase.get("gpu_busy_ms_per_step"), "ms")
    if as_float(phase.get("gpu_busy_frac")) is not None:
        busy += f" ({fmt_pct(phase.get('gpu_busy_frac'))})"
    items = [
        ("steps profiled", fmt_int(phase.get("steps"))),
        ("wall per step", wall),
        ("GPU busy per step", busy),
        ("kernels per step", fmt_int(phase.get("kernels_per_step"))),
        ("aten ops per step", fmt_int(phase.get("ops_per_step"))),
        ("host µs per kernel", fmt_num(phase.get("host_us_per_kernel"))),
    ]
    floor = _mapping(phase.get("weight_floor"))
    if as_float(floor.get("ms")) is not None:
        step = as_float(phase.get("wall_ms_per_step_unprofiled")) or as_float(phase.get("wall_ms_per_step"))
        times = f" — the step is {fmt_num(step / as_float(floor['ms']))}× it" if step else ""
        items.append(("weight-streaming floor", f"{fmt_num(floor['ms'])} ms{times}"))
    pacer = paced_by(plan)
    if device_kind != "cpu":
        items += [
            ("regime (measured)", _esc(phase.get("regime")) + _REGIME_RULE.get(str(phase.get("regime")), "")),
            ("paced by (step model)", DASH if pacer is None else PACER_WORDS[pacer] + _PACER_RULE[pacer]),
        ]
    regime = phase.get("regime") if device_kind != "cpu" else "cpu"
    regime_class = html.escape(str(regime or "unknown"), quote=True)
    if pacer is not None and device_kind != "cpu":
        regime_class += f" paced-{pacer}"
    sentence = html.escape(regime_sentence(name, dict(phase), device_kind, plan), quote=False)
    return (
        f'<div class="card"><h3>{html.escape(name)}</h3>{_dl(items)}'
        f'<p class="regime {regime_class}">{sentence}</p></div>'
    )


def _section(title: str, lead: str, body: str, section_id: str) -> str:
    """A titled page section; the lead line tells a first-time reader how to read the figures below it."""
    return f'<section id="{section_id}"><h2>{html.escape(title)}</h2><p class="lead">{lead}</p>{body}</section>'


def _panel(title: str, content: str) -> str:
    """One phase's card inside a section grid, titled with the phase so side-by-side panels stay unambiguous."""
    return f'<div class="card"><h3>{html.escape(title)}</h3>{content}</div>'


def _empty(text: str) -> str:
    """A placeholder saying why a figure is absent, instead of an empty plot that looks like a rendering bug."""
    return f'<div class="empty">{html.escape(text)}</div>'


def _roofline_note(points: Any) -> str:
    """Say what the roofline leaves out and how much time that is, so hidden time is never silent."""
    parts = []
    if points.zero_flop_calls_per_step:
        parts.append(
            f"{fmt_count(points.zero_flop_calls_per_step)} zero-FLOP kernels per step (copies and data movement, "
            f"{fmt_num(points.zero_flop_us_per_step)} µs/step) cannot sit on a log FLOP axis"
        )
    if points.unmodeled_calls_per_step:
        parts.append(
            f"{fmt_count(points.unmodeled_calls_per_step)} kernels per step have no cost model "
            f"({fmt_num(points.unmodeled_us_per_step)} µs/step)"
        )
    if points.folded_calls_per_step:
        parts.append(
            f"{fmt_count(points.folded_calls_per_step)} calls per step in the smallest groups are not drawn "
            f"({fmt_num(points.folded_us_per_step)} µs/step)"
        )
    if not parts:
        return ""
    return f'<p class="note">Not plotted: {"; ".join(parts)}.</p>'


def _apply_sections(summary: Mapping[str, Any]) -> list[str]:
    """The apply run's section (none for a profile run): numerics per fusion, tolerances, measured vs predicted."""
    result = _mapping(summary.get("apply"))
    if not result:
        return []
    fig = speedup_figure(result)
    chart = _figure_html(fig, "fig-apply-speedups") if fig is not None else ""
    return [
        _section(
            "Applied: numerics",
            "Each fusion patched alone where the finder found it, then all passing fusions together; logits against "
            "the unpatched model on the same inputs, and the unpatched model's own distance from an fp32 copy. A "
            "fusion outside tolerance was rolled back and left out of what was measured.",
            numerics_table(result) + tolerance_table(result),
            "apply-numerics",
        ),
        _section(
            "Applied: measured vs predicted",
            "Medians of interleaved rounds (baseline and variants alternate, so the host's drift cancels in the "
            "ratios); GPU time and kernels from one profiled pass per variant; error = measured ÷ predicted − 1.",
            timing_table(result) + chart,
            "apply-timing",
        ),
        *_graphs_section(_mapping(result.get("graphs"))),
        *_compiled_section(_mapping(result.get("compiled"))),
    ]


def _graphs_section(graphs: Mapping[str, Any]) -> list[str]:
    """`apply --graphs`: the decode step captured in a CUDA graph, variants and peers beside the floor (none when the
    run had no --graphs)."""
    if not graphs:
        return []
    fig = graphs_figure(graphs)
    chart = _figure_html(fig, "fig-apply-graphs") if fig is not None else ""
    return [
        _section(
            "Applied: the decode step in a CUDA graph",
            "Each variant's decode step captured once with a static KV cache and replayed per token, checked "
            "teacher-forced against the eager model before its time counts; torch.compile and Liger measured in the "
            "same process; ms/token the median of interleaved rounds; GPU time, kernels and the idle time between "
            "kernels from one profiled replay; × floor against the weight-streaming floor (every weight and the KV "
            "cache read once at the measured copy bandwidth).",
            graphs_table(graphs) + chart + breakdown_table(graphs),
            "apply-graphs",
        )
    ]


def _compiled_section(compiled: Mapping[str, Any]) -> list[str]:
    """A one-forward workload's forward beside torch.compile and fused + compile (none where it was not run)."""
    if not compiled:
        return []
    return [
        _section(
            "Applied: the forward beside torch.compile",
            f"The forward compiled by Inductor ({compiled.get('mode')}), unpatched and with the fusions rewritten into "
            "its graph, each checked against the eager model before its time counts and timed with the eager "
            "forward in the same interleaved rounds.",
            compiled_table(compiled),
            "apply-compiled",
        )
    ]


def _ranks_section(summary: Mapping[str, Any]) -> list[str]:
    """A multi-rank trace's section (none for one rank): per rank, step time, time outside and in communication,
    how often it straggled, and HTA's GPU idle time and launches (or why HTA has none)."""
    ranks = _mapping(summary.get("ranks"))
    if not ranks:
        return []
    steps = [_mapping(s) for s in ranks.get("steps") or []]
    comm = _mapping(_mapping(ranks.get("communication")).get("per_rank"))
    hta = _mapping(ranks.get("hta"))

    def per_step(key: str, rank: str) -> str:
        values = [as_float(_mapping(s.get(key)).get(rank)) for s in steps]
        values = sorted(v for v in values if v is not None)
        return fmt_num(values[len(values) // 2]) if values else DASH

    def hta_cell(result: Any, value: str) -> str:
        result = _mapping(result)
        return value if result.get("source") == "hta" else _esc(result.get("source"))

    head = ["rank", "step ms", "outside comm ms", "comm ms, all steps", "overlap of comm", "straggler in",
            "GPU idle ms", "launches"]  # fmt: skip
    rows = []
    for rank in ranks.get("ranks") or []:
        key = str(rank)
        mine = [s for s in steps if _mapping(s.get("straggler")).get("rank") == rank]
        pct = as_float(_mapping(comm.get(key)).get("overlap_pct_of_comm"))
        idle, launch = _mapping(hta.get(key)).get("idle_time"), _mapping(hta.get(key)).get("kernel_launches")
        idle_ms = sum(as_float(v) or 0.0 for v in _mapping(_mapping(idle).get("idle_ms")).values())
        cells = [_esc(rank), per_step("step_ms", key), per_step("compute_ms", key),
                 fmt_num(_mapping(comm.get(key)).get("comm_ms")), fmt_pct(None if pct is None else pct / 100),
                 f"{len(mine)} of {len(steps)} steps", hta_cell(idle, fmt_num(idle_ms)),
                 hta_cell(launch, fmt_count(_mapping(launch).get("launches")))]  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = (
        '<div class="table-wrap"><table id="table-ranks"><thead><tr>'
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></div>"
    )
    worst = _mapping(ranks.get("straggler"))
    lead = (
        "Step times and time outside communication are medians over the steps all ranks recorded. A "
        "blocking collective evens out step times, so the straggler is the rank with the most time outside "
        f"communication: here rank {_esc(worst.get('rank'))}, {fmt_num(worst.get('mean_excess_ms'))} ms "
        f"({fmt_num(worst.get('mean_excess_pct'))}%) over the median rank. Communication: "
        f"{_esc(_mapping(ranks.get('communication')).get('source'))}."
    )
    return [_section("Ranks", lead, table, "ranks")]


def render_page(summary: Mapping[str, Any], kernels: pd.DataFrame | None) -> str:
    """Build the whole report document (see :func:`fusionscope.report.render_report`)."""
    summary = _mapping(summary)
    frame = normalise_kernels(kernels)
    phases = phase_order(dict(summary), frame)
    slugs = phase_slugs(phases)
    phase_info = _mapping(summary.get("phases"))
    device_kind = str(_mapping(summary.get("device")).get("kind") or "").lower()
    roofs = _mapping(summary.get("roofs"))
    model_dtype = _mapping(summary.get("model")).get("dtype")
    by_phase = {str(name): part for name, part in frame.groupby("phase", sort=False)}
    empty_frame = frame.iloc[0:0]

    plans = _mapping(summary.get("cumulative"))
    cards = [_run_card(summary)]
    time_panels, tree_panels, roof_panels, tables = [], [], [], []
    for name in phases:
        info = _mapping(phase_info.get(name))
        rows = by_phase.get(name, empty_frame)
        slug = slugs[name]
        cards.append(_phase_card(name, info, device_kind, _mapping(plans.get(name))))

        by_category = _mapping(info.get("time_by_category_us")) or time_per_step_by(rows, "category")
        by_class = _mapping(info.get("time_by_class_us")) or time_per_step_by(rows, "bound")
        if by_category or by_class:
            content = _figure_html(time_breakdown_figure(by_category, by_class), f"fig-time-{slug}", TEMPLATE)
        else:
            content = _empty("No time breakdown recorded for this phase.")
        time_panels.append(_panel(name, content))

        if rows.empty:
            tree_panels.append(_panel(name, _empty("No kernels were recorded for this phase.")))
        else:
            tree = module_tree(rows, root_label=name)
            tree_panels.append(_panel(name, _figure_html(module_treemap_figure(tree), f"fig-treemap-{slug}", TEMPLATE)))

        points = roofline_points(rows)
        fig = roofline_figure(points, roofs, str(model_dtype) if model_dtype else None)
        if fig is None:
            content = _empty("No kernel has a cost model and no roofs were measured.")
        else:
            content = _figure_html(fig, f"fig-roofline-{slug}", TEMPLATE)
        roof_panels.append(_panel(name, content + _roofline_note(points)))

        table = top_kernels_table(f"table-{slug}", info.get("top_kernels"), kernel_stats(rows))
        tables.append(_panel(name, table))

    grid = '<div class="grid single">' if len(phases) <= 1 else '<div class="grid">'
    if not phases:
        no_data = _empty("This run recorded no phases.")
        time_panels = tree_panels = roof_panels = tables = [no_data]

    waterfalls = []
    for name, plan in plans.items():
        fig = waterfall_figure(str(name), _mapping(plan))
        if fig is not None:
            waterfalls.append(_figure_html(fig, f"fig-waterfall-{slugs.get(name, name)}"))
    body = [
        _header(summary),
        "<main>",
        _section(
            "Overview",
            "Per-phase step time and what paces it. The regime line says which kind of fix to try first.",
            f'<div class="cards">{"".join(cards)}</div>',
            "overview",
        ),
        _section(
            "Where the time goes",
            "Kernel time per step, split by kernel category and by bound class (which roof limits it).",
            grid + "".join(time_panels) + "</div>",
            "time",
        ),
        _section(
            "Modules",
            "Kernel time per step by nn.Module path; click a box to zoom in, click the top bar to zoom out.",
            grid + "".join(tree_panels) + "</div>",
            "modules",
        ),
        _section(
            "Roofline",
            "One dot per kernel group (same name, op, module leaf, dtype and bound); area ∝ time per step. "
            "Solid lines are roofs measured on this machine, dashed lines the datasheet's.",
            grid + "".join(roof_panels) + "</div>",
            "roofline",
        ),
        _section(
            "Fusion opportunities",
            "Groups of ops one fused kernel could replace, found on the recorded dataflow; time now is measured, "
            "fused time is analytic from the measured roofs; speedups are end to end for the phase, knowing whether "
            "the host or the GPU paces it. Open a row for its module paths.",
            opportunities_table(summary.get("opportunities") or []) + "".join(waterfalls),
            "opportunities",
        ),
        *_apply_sections(summary),
        *_ranks_section(summary),
        _section(
            "Top kernels",
            "The profiler's ranking with measured columns joined in; click a header to sort.",
            "".join(tables),
            "kernels",
        ),
        "</main>",
        f"<footer>fusionscope {_esc(_mapping(summary.get('versions')).get('fusionscope'))} · "
        "self-contained report, no network needed</footer>",
    ]
    title = f"fusionscope · {text_or_dash(_mapping(summary.get('model')).get('name'))}"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n"
        f"<style>{assets.CSS}</style>\n"
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f'<script type="text/javascript">{_plotly_js()}</script>\n'
        "</head>\n<body>\n" + "\n".join(body) + f"\n<script>{assets.SORT_JS}</script>\n</body>\n</html>\n"
    )
