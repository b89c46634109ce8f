"""The report's fusion section: the opportunities table (sortable, each row drilling down to its module paths) and a
waterfall per phase of the cumulative end-to-end speedup. Draws `summary["opportunities"]` and
`summary["cumulative"]` as they are; computes nothing."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from fusionscope.report.formatting import text_or_dash

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
    """Cumulative wall-time speedup as each accepted fusion is added, then what a CUDA graph would remove."""
    steps = list(plan.get("waterfall") or [])
    if not steps:
        return None
    names, gains, previous = [], [], 1.0
    for step in steps:
        names.append(str(step["fusion"]))
        gains.append(100 * (1 - previous / step["speedup_wall"]))
        previous = step["speedup_wall"]
    share = plan.get("cuda_graph_share")
    if share is not None:
        names.append("then CUDA graph")
        gains.append(100 * float(share))
    fig = go.Figure(go.Waterfall(x=names, y=[-g for g in gains], measure=["relative"] * len(gains),
                                 text=[f"−{g:.1f}%" for g in gains], textposition="outside"))  # fmt: skip
    pacer = {"host-bound": "the host", "gpu-bound": "the GPU"}.get(str(plan.get("regime")))
    title = f"{phase}: wall time saved per step, cumulative (%)"
    if pacer:
        title += f" — paced by {pacer} in the step model"
    fig.update_layout(title=title, height=340, showlegend=False,
                      yaxis_title="% of the step", margin={"t": 50, "b": 40, "l": 50, "r": 20})  # fmt: skip
    return fig
