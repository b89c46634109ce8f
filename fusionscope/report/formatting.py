"""Turn raw summary values into short display strings.

The summary is written by code that may leave any field null (CPU runs have no GPU numbers, a custom model has no
prompt length, an old cache has no datasheet).  Every value therefore goes through one of these helpers, which show
missing or non-finite values as an em dash instead of ``None``/``nan`` leaking into the page.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

DASH = "—"


def kernel_html(value: Any, limit: int | None = None) -> str:
    """A kernel's short name (`fusionscope.kernel_names`) as HTML, its full name the tooltip (`title`); `limit` cuts
    a short name longer than that with an ellipsis (the tooltip keeps it whole)."""
    from fusionscope.kernel_names import short_kernel_name

    full = text_or_dash(value)
    short = short_kernel_name(full) if full != DASH else full
    if limit is not None and len(short) > limit:
        short = short[: limit - 1] + "…"
    return f'<span class="kernel" title="{html.escape(full, quote=True)}">{html.escape(short, quote=False)}</span>'


def as_float(value: Any) -> float | None:
    """Return ``value`` as a finite float, or ``None`` when it is missing, non-numeric, NaN or infinite."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt_num(value: Any, digits: int = 3) -> str:
    """Format a number with ``digits`` significant digits, thousands separators for large values, dash for null."""
    number = as_float(value)
    if number is None:
        return DASH
    if number == 0:
        return "0"
    magnitude = abs(number)
    if magnitude >= 10 ** (digits - 1):
        return f"{number:,.0f}"
    decimals = digits - 1 - math.floor(math.log10(magnitude))
    return f"{number:,.{max(decimals, 0)}f}"


def fmt_int(value: Any) -> str:
    """Format a count with thousands separators (``1,462``), dash for null."""
    number = as_float(value)
    return DASH if number is None else f"{round(number):,}"


def fmt_count(value: Any) -> str:
    """Format a per-step count: whole numbers without decimals (``2``), fractional ones to 3 digits (``2.38``)."""
    number = as_float(value)
    if number is None:
        return DASH
    return fmt_int(number) if abs(number - round(number)) < 1e-9 else fmt_num(number)


def fmt_pct(fraction: Any, digits: int = 0) -> str:
    """Format a 0..1 fraction as a percentage (``0.16`` → ``16%``), dash for null."""
    number = as_float(fraction)
    return DASH if number is None else f"{number * 100:.{digits}f}%"


def fmt_signed_pct(fraction: Any, digits: int = 1) -> str:
    """Format a signed change as a percentage with its sign: ``-0.57`` → ``−57.0%`` (a typographic minus),
    ``0.011`` → ``+1.1%``; a change that rounds to zero shows no sign; dash for null."""
    number = as_float(fraction)
    if number is None:
        return DASH
    text = f"{abs(number) * 100:.{digits}f}%"
    if float(text[:-1]) == 0:
        return text
    return ("−" if number < 0 else "+") + text


def fmt_unit(value: Any, unit: str, digits: int = 3) -> str:
    """Format a number followed by a unit; the unit is dropped when the value is missing so no ``— ms`` appears."""
    text = fmt_num(value, digits)
    return text if text == DASH else f"{text} {unit}"


def fmt_params(value: Any) -> str:
    """Format a parameter count the way model cards do (``2.10 M``, ``8.03 B``)."""
    number = as_float(value)
    if number is None:
        return DASH
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= scale:
            return f"{number / scale:.2f} {suffix}"
    return f"{number:.0f}"


def fmt_timestamp(value: Any) -> str:
    """Show an ISO timestamp as ``YYYY-MM-DD HH:MM UTC±hh:mm``; anything unparsable is shown unchanged."""
    if not value:
        return DASH
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)
    offset = moment.strftime("%z")
    zone = "UTC" if offset in ("", "+0000") else f"UTC{offset[:3]}:{offset[3:]}"
    return f"{moment:%Y-%m-%d %H:%M} {zone}"


def text_or_dash(value: Any) -> str:
    """Return ``str(value)`` or a dash for null/empty/NaN, for free-text fields such as names and dtypes."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    text = str(value)
    return text if text.strip() else DASH


def phase_slugs(names: list[str]) -> dict[str, str]:
    """Map each phase name to a distinct HTML-id fragment.

    Phase names come from the model runner and may hold spaces or punctuation; two names can clean up to the same
    fragment, so later ones get their position appended to keep every figure id unique.
    """
    slugs: dict[str, str] = {}
    for index, name in enumerate(names):
        base = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "phase"
        candidate = base
        while candidate in slugs.values():
            candidate = f"{base}-{index}"
            index += 1
        slugs[name] = candidate
    return slugs


# The numerics figures of an apply run as the terminal and the report show them: (key, format) in column order.
NUMERICS_CELLS = (("max_abs", ".3g"), ("max_rel", ".3g"), ("kl_mean", ".2g"), ("top1", ".3f"), ("top5", ".3f"),
                  ("first_divergence", "d"))  # fmt: skip


def fmt_figure(value: Any, spec: str) -> str:
    """A figure in `spec`, or a dash when it is missing or NaN."""
    return DASH if value is None or value != value else format(value, spec)


def figure_cells(figures: Mapping[str, Any] | None, keys: tuple[str, ...] | None = None) -> list[str]:
    """The numerics cells of one row (`NUMERICS_CELLS`, or only `keys` of them), formatted."""
    figures = figures or {}
    return [fmt_figure(figures.get(k), spec) for k, spec in NUMERICS_CELLS if keys is None or k in keys]
