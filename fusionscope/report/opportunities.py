"""The report's fusion section: the opportunities table (sortable, each row drilling down to its module paths) and a
waterfall per phase of the cumulative end-to-end speedup. Draws `summary["opportunities"]` and
`summary["cumulative"]` as they are; computes nothing."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from fusionscope.report.formatting import as_float, fmt_pct, fmt_signed_pct, text_or_dash
from fusionscope.report.regime import PACER_WORDS, paced_by

HEADERS = (("fusion", "fusion", False), ("phase", "phase", False), ("count", "per step", True),
           ("t_now_us", "µs now", True), ("t_fused_us", "µs fused", True), ("saved_us", "µs saved", True),
           ("bytes_now", "bytes now", True), ("bytes_fused", "bytes fused", True),
           ("launches_now", "launches now", True), ("launches_fused", "launches fused", True),
           ("speedup_gpu", "GPU speedup", True), ("speedup_wall", "wall speedup", True),
           ("micro_now_us", "µs now (micro)", True), ("micro_fused_us", "µs fused (micro)", True),
           ("confidence", "confidence", False))  # fmt: skip


def _cell(key: str, value: Any, numeric: bool) -> str:
    if not numeric:
        return f'<td data-v="{html.escape(text_or_dash(value), quote=True)}">{html.escape(text_or_dash(value))}</td>'
    if value is None:
        return '<td data-v="" class="num">—</td>'
    shown = f"{value:.3f}×" if key.startswith("speedup") else f"{value:,.3g}" if value < 100 else f"{value:,.0f}"
    return f'<td data-v="{value}" class="num">{shown}</td>'


def opportunities_table(opportunities: Sequence[Mapping[str, Any]]) -> str:
    if not opportunities:
        return '<p class="note">No fusion opportunity was found in this run.</p>'
    head = "".join(f'<th scope="col" data-type="{"num" if num else "text"}" tabindex="0" aria-sort="none">'
                   f"{html.escape(label)}</th>" for _key, label, num in HEADERS) + "<th>where · why</th>"  # fmt: skip
    rows = []
    for opp in opportunities:
        cells = "".join(_cell(key, opp.get(key), num) for key, _label, num in HEADERS)
        paths = "".join(f"<li>{html.escape(p)}</li>" for p in opp.get("module_paths") or [])
        detail = (f"<details><summary>{len(opp.get('module_paths') or [])} module paths</summary><ul>{paths}</ul>"
                  f"<p>{html.escape(text_or_dash(opp.get('reason')))}</p>"
                  f"<p>micro: {html.escape(text_or_dash(opp.get('micro_note')))}</p></details>")  # fmt: skip
        rows.append(f"<tr>{cells}<td>{detail}</td></tr>")
    return ('<div class="table-wrap"><table class="sortable" id="table-opportunities">'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")  # fmt: skip


def waterfall_figure(phase: str, plan: Mapping[str, Any]) -> go.Figure | None:
    """Wall time per step as each accepted fusion is added, then what a CUDA graph would remove, and the sum.

    Every bar is a share of the *unfused* step, so the bars add up: a fusion's bar is the step before it minus the
    step after it (from the waterfall's cumulative speedups), the graph's bar its share of the fused step
    (`cuda_graph_share`) times the fused step. Runs written before that share was taken on the fused step (no
    `cuda_graph_share_unfused`) get no graph bar rather than a wrong one."""
    steps = list(plan.get("waterfall") or [])
    if not steps:
        return None
    names, changes, hover = [], [], []
    level = 1.0  # the step so far, as a fraction of the unfused one
    for step in steps:
        after = 1.0 / float(step["speedup_wall"])
        names.append(str(step["fusion"]))
        changes.append(after - level)
        hover.append(f"{fmt_signed_pct(after - level)} of the unfused step; all so far {step['speedup_wall']:.3f}×")
        level = after
    share = as_float(plan.get("cuda_graph_share"))
    if share is not None and "cuda_graph_share_unfused" in plan:
        names.append("then CUDA graph")
        changes.append(-share * level)
        hover.append(f"removes {fmt_pct(share, 1)} of the fused step: {fmt_signed_pct(-share * level)} of the unfused")
    total = sum(changes)
    names.append("in all")
    hover.append(f"{fmt_signed_pct(total)} of the unfused step")
    fig = go.Figure(go.Waterfall(
        x=names, y=[100 * c for c in changes] + [100 * total], measure=["relative"] * len(changes) + ["total"],
        text=[fmt_signed_pct(c) for c in [*changes, total]], textposition="outside", hovertext=hover,
        hoverinfo="x+text",
    ))  # fmt: skip
    fig.update_layout(title=f"{phase}: wall time per step, cumulative (% of the unfused step){_pace_note(plan, steps)}",
                      height=340, showlegend=False, yaxis_title="% of the unfused step",
                      margin={"t": 50, "b": 40, "l": 50, "r": 20})  # fmt: skip
    return fig


def _pace_note(plan: Mapping[str, Any], steps: list[Mapping[str, Any]]) -> str:
    """What paces the step in the step model (the name summary.json gives it: `paced_by`), or that the run is a CPU
    run, for the figure's title."""
    pacer = paced_by(plan)
    if pacer is None:
        return " — CPU run: the ops are the timeline" if all(s.get("speedup_gpu") is None for s in steps) else ""
    note = f" — paced by {PACER_WORDS[pacer]} in the step model"
    fused = plan.get("fused_paced_by")
    if fused in PACER_WORDS and fused != pacer:
        note += f", by {PACER_WORDS[fused]} once fused"
    return note
