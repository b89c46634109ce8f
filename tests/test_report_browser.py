"""Open a rendered report in headless Chromium and check it actually works as a page, not just as a string.

String tests cannot see a plotly figure that throws while drawing, a sort script with a typo, or an escaped name
that plotly then shows as ``&lt;``.  This drives Debian's Chromium (``/usr/bin/chromium``) through playwright —
never ``playwright install``, which would download a browser — with the network off, like a report opened from a
run folder on a cluster.  A missing Chromium is a failure, not a skip: CI installs it, so absence means a broken
setup that would otherwise pass silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from fusionscope.report import render_report

try:  # pytest's default import mode puts tests/ on sys.path; a tests/__init__.py would make it a package instead.
    from test_report import CUTLASS, cuda_run
except ImportError:  # pragma: no cover - depends on how the test tree is laid out
    from tests.test_report import CUTLASS, cuda_run

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path("/tmp/report.png")
MISSING_CHROMIUM = (
    f"Chromium not found at {CHROMIUM}: the browser tests need Debian's chromium package "
    "(apt-get install chromium). Do not use `playwright install`."
)


@dataclass
class LoadedReport:
    """A report open in the browser, with everything the page said or fetched while loading."""

    page: Page
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedReport]:
    """Render the CUDA-like fixture run to a temp file and open it once for all tests in this module."""
    if not CHROMIUM.exists():
        pytest.fail(MISSING_CHROMIUM)
    summary, kernels = cuda_run()
    # A real file:// URL, as users open it (page.set_content would leave the page at about:blank).
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(render_report(summary, kernels), encoding="utf-8")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            loaded = LoadedReport(page)
            page.on("console", lambda msg: loaded.errors.append(f"console: {msg.text}") if msg.type == "error" else 0)
            page.on("pageerror", lambda exc: loaded.errors.append(f"pageerror: {exc}"))
            page.on("request", lambda request: loaded.requests.append(request.url))
            page.goto(path.as_uri(), wait_until="load")
            page.wait_for_timeout(500)  # let the post-load resize settle before measuring or screenshotting
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            yield loaded
        finally:
            browser.close()


def test_chromium_is_installed() -> None:
    """Fail loudly (never skip) when the browser is missing, so CI cannot go green without running these tests."""
    assert CHROMIUM.exists(), MISSING_CHROMIUM


def test_every_figure_is_drawn(report: LoadedReport) -> None:
    """Every plotly div on the page ends up with a rendered SVG; the roofline has its dots."""
    states = report.page.evaluate(
        "() => Array.from(document.querySelectorAll('.plotly-graph-div'))"
        ".map(div => [div.id, div.querySelector('.main-svg') !== null, div.getBoundingClientRect().width])"
    )
    assert len(states) == 6
    assert [name for name, drawn, _ in states if not drawn] == []
    assert all(width > 300 for _, _, width in states), states
    dots = report.page.locator("#fig-roofline-decode .scatterlayer .point").count()
    assert dots > 0


def test_page_is_quiet_and_offline(report: LoadedReport) -> None:
    """No console error, no uncaught exception, and nothing fetched beyond the file itself."""
    assert report.errors == []
    assert [url for url in report.requests if not url.startswith(("file:", "data:", "blob:"))] == []


def test_escaped_names_read_correctly(report: LoadedReport) -> None:
    """Kernel names escaped in the HTML read back as the real template names: the table shows the short name with the
    full one as its tooltip, and plotly hovers hold the full one."""
    from fusionscope.kernel_names import short_kernel_name

    first = report.page.locator("#table-decode tbody tr").first.locator("td.name")
    assert first.text_content() == short_kernel_name(CUTLASS) != CUTLASS
    assert CUTLASS in [first.get_attribute("title"), first.locator("[title]").first.get_attribute("title")]
    # The biggest dot is the top kernel (area ∝ time); move the mouse onto it like a reader would.
    report.page.locator("#fig-roofline-decode").scroll_into_view_if_needed()
    x, y = report.page.evaluate(
        """() => {
            const boxes = Array.from(document.querySelectorAll('#fig-roofline-decode .scatterlayer .point'))
                .map(p => p.getBoundingClientRect());
            const big = boxes.reduce((a, b) => (b.width > a.width ? b : a));
            return [big.x + big.width / 2, big.y + big.height / 2];
        }"""
    )
    report.page.mouse.move(x, y)
    report.page.wait_for_selector("#fig-roofline-decode .hoverlayer .hovertext", timeout=5000)
    hover = report.page.locator("#fig-roofline-decode .hoverlayer").text_content() or ""
    assert "void cutlass::Kernel<cutlass_80" in hover
    assert "&lt;" not in hover


def _column(page: Page, table: str, header: str) -> list[str]:
    """Sort keys of one column, in the order the rows currently appear."""
    index = page.locator(f"#{table} thead th").all_text_contents().index(header)
    return page.eval_on_selector_all(
        f"#{table} tbody tr", f"rows => rows.map(r => r.cells[{index}].getAttribute('data-v'))"
    )


def test_clicking_a_header_sorts_the_table(report: LoadedReport) -> None:
    """Text columns sort ascending on first click, numbers descending, and a second click reverses."""
    page, table = report.page, "table-decode"
    initial = _column(page, table, "kernel")
    header = page.locator(f"#{table} thead th", has_text="kernel")
    header.click()
    names = _column(page, table, "kernel")
    assert names == sorted(names) != initial
    assert header.get_attribute("aria-sort") == "ascending"
    header.click()
    assert _column(page, table, "kernel") == sorted(names, reverse=True)

    us = page.locator(f"#{table} thead th", has_text="µs/step")
    us.click()
    values = [float(v) for v in _column(page, table, "µs/step")]
    assert values == sorted(values, reverse=True)
    us.click()
    values = [float(v) for v in _column(page, table, "µs/step")]
    assert values == sorted(values)
    assert header.get_attribute("aria-sort") == "none"
    assert sorted(_column(page, table, "kernel")) == sorted(initial)
