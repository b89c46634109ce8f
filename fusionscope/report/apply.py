"""The report's apply section: where each fusion was patched and whether its numerics held, the tolerance table, and
measured vs predicted per variant and phase (a table and one chart). Draws `summary["apply"]` as it is; computes
nothing but the labels."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from fusionscope.report.formatting import figure_cells, kernel_html, text_or_dash


def _num(value: Any, spec: str) -> str:
    return "—" if value is None or value != value else format(value, spec)


def _pct(value: Any) -> str:
    return "—" if value is None else f"{value * 100:+.0f}%"


def _table(head: list[str], rows: list[list[str]], table_id: str) -> str:
    cols = "".join(f'<th scope="col">{html.escape(h)}</th>' for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return (
        f'<div class="table-wrap"><table id="{table_id}"><thead><tr>{cols}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def numerics_table(result: Mapping[str, Any]) -> str:
    """One row per fusion (and the unpatched model against fp32): sites patched, status, the logit figures."""
    head = [
        "fusion",
        "sites patched",
        "status",
        "max |Δ|",
        "max rel",
        "KL",
        "top-1",
        "top-5",
        "first diff",
        "vs fp32: max |Δ|",
        "vs fp32: KL",
        "reason",
    ]
    vs_fp32 = ("max_abs", "kl_mean")
    rows = [["(eager vs fp32)", "", "", *figure_cells(result.get("eager_vs_fp32")), "", "",
             "the unpatched model's own distance from fp32"]]  # fmt: skip
    for row in result.get("fusions", []):
        where = "".join(f"<li>{html.escape(p)}</li>" for p in row.get("applied") or [])
        sites = f"{row.get('sites_patched')}/{row.get('sites_found')}"
        if where:
            sites = f"<details><summary>{sites}</summary><ul>{where}</ul></details>"
        rows.append([html.escape(row["fusion"]), sites, html.escape(row.get("status", "")),
                     *figure_cells(row.get("numerics")), *figure_cells(row.get("numerics_vs_fp32"), vs_fp32),
                     html.escape(text_or_dash(row.get("reason") or row.get("skipped")))])  # fmt: skip
    together = result.get("together_numerics") or {}
    if together:
        rows.append(["all passing together", html.escape(", ".join(together.get("fusions", []))),
                     "passed" if together.get("passed") else "failed", *figure_cells(together.get("numerics")),
                     *figure_cells(together.get("numerics_vs_fp32"), vs_fp32),
                     html.escape(text_or_dash(together.get("reason")))])  # fmt: skip
    return _table(head, rows, "table-apply-numerics")


def tolerance_table(result: Mapping[str, Any]) -> str:
    """The numerics tolerances per dtype (rows of `numerics.tolerance_table()`), as the judge applied them."""
    rows = list(result.get("tolerances") or [])
    if not rows:
        return ""
    keys = [k for k in rows[0] if k != "dtype"]
    body = [[html.escape(str(r.get("dtype"))), *(html.escape(text_or_dash(r.get(k))) for k in keys)] for r in rows]
    return "<h3>Tolerances</h3>" + _table(["dtype", *keys], body, "table-apply-tolerances")


def timing_table(result: Mapping[str, Any]) -> str:
    timing = result.get("timing")
    if not timing:
        return f'<p class="note">Timing {html.escape(text_or_dash(result.get("timing_note")))}.</p>'
    head = [
        "variant",
        "phase",
        "wall ms",
        "spread",
        "wall × measured",
        "wall × predicted",
        "error",
        "GPU ms",
        "GPU × measured",
        "GPU × predicted",
        "error",
        "kernels",
        "peak MiB",
        "term off",
    ]
    rows = []
    for name, variant in timing.get("variants", {}).items():
        for phase, f in variant.get("phases", {}).items():
            spread = f.get("wall_ms_spread")
            rows.append(
                [
                    html.escape(name),
                    html.escape(phase),
                    _num(f.get("wall_ms"), ".2f"),
                    f"{spread[0]:.2f}–{spread[1]:.2f}" if spread else "—",
                    _num(f.get("measured_speedup_wall"), ".3f"),
                    _num(f.get("predicted_speedup_wall"), ".3f"),
                    _pct(f.get("error_wall")),
                    _num(f.get("gpu_ms"), ".2f"),
                    _num(f.get("measured_speedup_gpu"), ".3f"),
                    _num(f.get("predicted_speedup_gpu"), ".3f"),
                    _pct(f.get("error_gpu")),
                    _num(f.get("kernels"), ".0f"),
                    _num(variant.get("peak_mib"), ".0f"),
                    html.escape(f.get("term_off") or ""),
                ]
            )
    return _table(head, rows, "table-apply-timing")


def speedup_figure(result: Mapping[str, Any]) -> go.Figure | None:
    """Measured and predicted wall speedups side by side, one pair of bars per variant and phase."""
    timing = result.get("timing") or {}
    labels, measured, predicted = [], [], []
    for name, variant in timing.get("variants", {}).items():
        for phase, f in variant.get("phases", {}).items():
            if not variant.get("fusions"):
                continue
            labels.append(f"{name} · {phase}")
            measured.append(f.get("measured_speedup_wall"))
            predicted.append(f.get("predicted_speedup_wall"))
    if not labels:
        return None
    fig = go.Figure([go.Bar(name="measured", x=labels, y=measured), go.Bar(name="predicted", x=labels, y=predicted)])
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(
        title="wall-time speedup per step: measured vs predicted",
        barmode="group",
        height=380,
        yaxis_title="× the unpatched model",
        margin={"t": 50, "b": 120, "l": 50, "r": 20},
    )
    return fig


def graphs_table(graphs: Mapping[str, Any]) -> str:
    """`apply --graphs`: per variant ms/token, tokens/s, GPU time and kernels of one profiled replay, × the floor,
    × eager, the step model's prediction and its error, first call, peak memory and the teacher-forced check."""
    head = ["variant", "ms/token", "tokens/s", "GPU ms", "kernels", "gap µs", "× floor", "× eager", "predicted ms",
            "error", "first call s", "peak MiB", "check"]  # fmt: skip
    rows = [["eager (unpatched)", _num(graphs.get("eager_ms_per_token"), ".2f"), *[""] * 5, "1.000", *[""] * 5]]
    for name, row in (graphs.get("variants") or {}).items():
        replayed = row.get("replay") or {}
        check = ("passed: " if row.get("passed") else "not timed: ") + text_or_dash(row.get("reason"))
        rows.append([html.escape(name), _num(row.get("ms_per_token"), ".2f"), _num(row.get("tokens_per_s"), ".0f"),
                     _num(row.get("gpu_ms_per_step"), ".2f"), _num(row.get("kernels_per_step"), ".0f"),
                     _num(replayed.get("gap_us_per_kernel"), ".2f"), _num(row.get("x_floor"), ".2f"),
                     _num(row.get("speedup_vs_eager"), ".3f"), _num(row.get("predicted_ms"), ".2f"),
                     _pct(row.get("error_vs_predicted")), _num(row.get("first_call_s"), ".1f"),
                     _num(row.get("peak_mib"), ".0f"), html.escape(check)])  # fmt: skip
    pred = graphs.get("predicted") or {}
    lines = (
        f"graph alone vs eager: measured {_num(graphs.get('graph_vs_eager'), '.3f')}×, predicted "
        f"{_num(pred.get('graph_vs_eager'), '.3f')}×, error {_pct(graphs.get('error_graph_vs_eager'))}; "
        f"fused + graph vs graph alone: measured {_num(graphs.get('fused_vs_graph'), '.3f')}×, predicted "
        f"{_num(pred.get('fused_graph_vs_graph'), '.3f')}×, error {_pct(graphs.get('error_fused_vs_graph'))}; "
        f"fused + graph vs torch.compile {_num(graphs.get('fused_vs_compile'), '.3f')}× (compile "
        f"{_num(graphs.get('compile_seconds'), '.0f')} s); fused + compile vs torch.compile "
        f"{_num(graphs.get('fused_compile_vs_compile'), '.3f')}×."
    )
    note = f'<p class="note">{html.escape(lines)}</p>'
    from fusionscope.apply.cudagraph_skips import skip_lines
    from fusionscope.apply.step_drift import drift_line

    for line in skip_lines(graphs):
        note += f'<p class="note">{html.escape(line)}</p>'
    if drift := drift_line(graphs.get("step_drift")):
        note += f'<p class="note">{html.escape(drift)}</p>'
    if graphs.get("timing_note"):
        note += f'<p class="note">{html.escape(graphs["timing_note"])}</p>'
    return _table(head, rows, "table-apply-graphs") + note


def compiled_table(compiled: Mapping[str, Any]) -> str:
    """A one-forward workload beside torch.compile (`apply.forward_compile`): per variant the forward's wall ms
    (median of interleaved rounds), × eager, first call, peak memory and the check."""
    head = ["variant", "wall ms", "× eager", "first call s", "peak MiB", "check"]
    rows = []
    for name, row in (compiled.get("variants") or {}).items():
        check = ("passed: " if row.get("passed") else "not timed: ") + text_or_dash(row.get("reason"))
        rows.append([html.escape(name), _num(row.get("wall_ms"), ".2f"), _num(row.get("speedup_vs_eager"), ".3f"),
                     _num(row.get("first_call_s"), ".1f"), _num(row.get("peak_mib"), ".0f"),
                     html.escape(check)])  # fmt: skip
    line = f"fused + compile vs torch.compile {_num(compiled.get('fused_compile_vs_compile'), '.3f')}×."
    return _table(head, rows, "table-apply-compiled") + f'<p class="note">{html.escape(line)}</p>'


def breakdown_table(graphs: Mapping[str, Any]) -> str:
    """Where the fused (else the unfused) replayed step's kernel time goes, per launching op and kernel."""
    for name in ("fused + graph", "graph"):
        down = ((graphs.get("variants") or {}).get(name) or {}).get("replay", {}).get("breakdown") or {}
        if down.get("rows"):
            break
    else:
        return ""
    head = ["launching op", "kernel", "module", "×", "µs", "share", "GB/s", "% copy", "TFLOP/s", "% peak", "class"]
    rows = [[html.escape(r["op"]), kernel_html(r["kernel"], 120),
             html.escape(r.get("module") or ""), str(r["count"]), _num(r["us"], ".0f"),
             _num(None if r.get("share") is None else 100 * r["share"], ".1f") + "%",
             _num(r.get("achieved_gbps"), ".0f"),
             _num(None if r.get("frac_bandwidth") is None else 100 * r["frac_bandwidth"], ".0f"),
             _num(r.get("achieved_tflops"), ".1f"),
             _num(None if r.get("frac_compute") is None else 100 * r["frac_compute"], ".0f"),
             html.escape(r.get("bound") or "")] for r in down["rows"]]  # fmt: skip
    title = (f"<h3>{html.escape(name)}: one replayed step, kernel by kernel ({_num(down.get('total_us'), '.0f')} µs "
             f"of kernels)</h3>")  # fmt: skip
    return title + _table(head, rows, "table-apply-breakdown")


def graphs_figure(graphs: Mapping[str, Any]) -> go.Figure | None:
    """ms per token of every timed variant side by side, the weight-streaming floor as a line."""
    variants = {n: r.get("ms_per_token") for n, r in (graphs.get("variants") or {}).items() if r.get("ms_per_token")}
    if graphs.get("eager_ms_per_token"):
        variants = {"eager": graphs["eager_ms_per_token"], **variants}
    if not variants:
        return None
    fig = go.Figure([go.Bar(x=list(variants), y=list(variants.values()), name="ms/token")])
    floor = (graphs.get("floor") or {}).get("ms")
    if floor:
        fig.add_hline(y=floor, line_dash="dash", annotation_text=f"weight-streaming floor {floor:.2f} ms")
    fig.update_layout(title="decode ms per token: CUDA-graph variants and peers beside the floor", height=380,
                      yaxis_title="ms per token", margin={"t": 50, "b": 120, "l": 50, "r": 20})  # fmt: skip
    return fig
