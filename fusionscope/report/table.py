"""Render a phase's top kernels as a sortable HTML table.

The rows are the profiler's own ranking (``summary.phases[p].top_kernels``); the measured columns (time per call,
intensity, achieved throughput) are joined in from the kernel table so a reader can see *why* a kernel is expensive
without opening the CSV.  Sorting is done in the browser by ``assets.SORT_JS`` from each cell's ``data-v`` value, so
the displayed text can be formatted freely (``1,462``, ``16%``, ``—``) without breaking numeric order.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from .figures import BOUND_COLOURS
from .formatting import DASH, as_float, fmt_count, fmt_int, fmt_num, fmt_pct, kernel_html, text_or_dash


@dataclass(frozen=True)
class Column:
    """One table column: header text, whether it sorts as a number, and how to show a value."""

    key: str
    header: str
    numeric: bool
    show: Callable[[Any], str]
    tip: str = ""


def _share_cell(value: Any) -> str:
    """Percentage with a thin bar behind it, so the eye finds the big rows without reading numbers."""
    number = as_float(value)
    if number is None:
        return DASH
    width = max(0.0, min(100.0, number * 100))
    return f'<span class="bar" style="width:{width:.1f}%"></span><span class="bar-text">{fmt_pct(number, 1)}</span>'


def _bound_cell(value: Any) -> str:
    """Bound class as a coloured badge matching the roofline dots."""
    text = text_or_dash(value)
    colour = BOUND_COLOURS.get(text, "#bbbbbb")
    return f'<span class="dot" style="background:{colour}"></span>{html.escape(text, quote=False)}'


def _text(value: Any) -> str:
    """Escaped free text (kernel names hold ``<``, ``>`` and ``&``)."""
    return html.escape(text_or_dash(value), quote=False)


COLUMNS: tuple[Column, ...] = (
    Column("rank", "#", True, fmt_int),
    Column("name", "kernel", False, kernel_html),
    Column("op", "op", False, _text),
    Column("module", "module", False, _text),
    Column("category", "category", False, _text),
    Column("bound", "bound", False, _bound_cell),
    Column("calls_per_step", "calls/step", True, fmt_count),
    Column("us_per_step", "µs/step", True, lambda v: fmt_num(v, 4)),
    Column("share", "share", True, _share_cell, "share of the phase's step time"),
    Column("us_per_call", "µs/call", True, fmt_num, "measured: mean duration per call"),
    Column("intensity", "FLOP/B", True, fmt_num, "measured: total FLOPs over total bytes"),
    Column("tflops", "TFLOP/s", True, fmt_num, "measured: achieved compute throughput"),
    Column("gbps", "GB/s", True, fmt_num, "measured: achieved memory bandwidth"),
    Column("frac", "of roof", True, lambda v: fmt_pct(v, 1), "measured: time-weighted fraction of the attainable roof"),
)
# Long text columns are cut with an ellipsis to keep the numbers on screen; the full text is in the cell's tooltip.
_CLIPPED = ("name", "op", "module")
_STAT_KEYS = ("us_per_call", "intensity", "tflops", "gbps", "frac")


def _sort_value(value: Any, numeric: bool) -> str:
    """The value the sorter compares; empty for missing so the script can keep such rows last either way."""
    if numeric:
        number = as_float(value)
        return "" if number is None else repr(number)
    text = text_or_dash(value)
    return "" if text == DASH else html.escape(text.lower(), quote=True)


def _rows(top_kernels: list[Mapping[str, Any]], stats: pd.DataFrame) -> list[dict[str, Any]]:
    """Merge each summary row with its measured (name, op) statistics; unmatched rows keep dashes."""
    rows = []
    for rank, kernel in enumerate(top_kernels, start=1):
        row: dict[str, Any] = {**kernel, "rank": rank}
        key = (str(kernel.get("name") or ""), str(kernel.get("op") or ""))
        if not stats.empty and key in stats.index:
            measured = stats.loc[key]
            row.update({k: measured[k] for k in _STAT_KEYS})
        rows.append(row)
    return rows


def top_kernels_table(table_id: str, top_kernels: list[Mapping[str, Any]] | None, stats: pd.DataFrame) -> str:
    """HTML for one phase's sortable table, or a short note when the summary lists no top kernels."""
    if not top_kernels:
        return '<p class="note">The summary lists no top kernels for this phase.</p>'
    head = []
    for column in COLUMNS:
        kind = "num" if column.numeric else "text"
        tip = f' title="{html.escape(column.tip)}"' if column.tip else ""
        head.append(
            f'<th scope="col" data-type="{kind}" tabindex="0" aria-sort="none"{tip}>{html.escape(column.header)}</th>'
        )
    body = []
    for row in _rows(list(top_kernels), stats):
        cells = []
        for column in COLUMNS:
            value = row.get(column.key)
            attrs = f'data-v="{_sort_value(value, column.numeric)}"'
            if column.key in _CLIPPED:
                attrs += f' class="{column.key}" title="{html.escape(text_or_dash(value), quote=True)}"'
            elif column.numeric:
                attrs += ' class="num"'
            cells.append(f"<td {attrs}>{column.show(value)}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'<div class="table-wrap"><table class="sortable" id="{table_id}">'
        f"<thead><tr>{''.join(head)}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )
