"""`fusionscope diff A B`: the deltas on two real tiny runs and on an edited copy with known differences, the CLI's
exit codes and one-line errors, and the self-contained HTML page."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from plotly.offline import get_plotlyjs
from typer.testing import CliRunner

import fusionscope
from fusionscope.cli import app
from fusionscope.diff import PHASE_METRICS, diff_runs, load_pair
from fusionscope.errors import UsageError
from fusionscope.report.diff_page import render_diff_page
from fusionscope.run import load_run

runner = CliRunner()
HALVED = "decode"  # the edited copy halves this phase's unprofiled wall time
DROPPED = "aten::pow"  # ... drops this kernel name from it
RENAMED = ("aten::rsqrt", "fs_rms_norm_kernel")  # ... and gives these kernels a new name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real tiny runs, and `edited`: a copy of `a` with known differences (see `edit_run`)."""
    base = tmp_path_factory.mktemp("diff-runs")
    folders = {}
    for name in ("a", "b"):
        fusionscope.profile("tiny-llama", out=base / name, prompt_len=8, decode_steps=2, warmup=0)
        folders[name] = base / name
    folders["edited"] = base / "edited"
    shutil.copytree(folders["a"], folders["edited"])
    edit_run(folders["edited"])
    return folders


def edit_run(folder: Path) -> None:
    """Decode: half the unprofiled wall time, GPU figures set, +100 µs of gemm, no embedding, a new category, one
    kernel name dropped, one renamed, the rms_norm fusion gone and a new one found; prefill removed; another model."""
    summary = json.loads((folder / "summary.json").read_text())
    decode = summary["phases"][HALVED]
    decode["wall_ms_per_step_unprofiled"] /= 2
    decode["gpu_busy_ms_per_step"], decode["kernels_per_step"] = 1.5, 40.0
    cats = decode["time_by_category_us"]
    cats["gemm"] += 100.0
    del cats["embedding"]
    cats["fused"] = 50.0
    del summary["phases"]["prefill"]
    summary["opportunities"] = [
        o for o in summary["opportunities"] if not (o["phase"] == HALVED and o["fusion"] == "rms_norm")
    ] + [{"fusion": "new_fusion", "phase": HALVED, "count": 3.0, "t_now_us": 12.5}]
    summary["model"]["name"] = "tiny-other"
    (folder / "summary.json").write_text(json.dumps(summary))
    kernels = pd.read_csv(folder / "kernels.csv")
    in_decode = kernels["phase"] == HALVED
    kernels = kernels[~(in_decode & (kernels["name"] == DROPPED))]
    kernels.loc[(kernels["phase"] == HALVED) & (kernels["name"] == RENAMED[0]), "name"] = RENAMED[1]
    kernels.to_csv(folder / "kernels.csv", index=False)


def per_step(folder: Path, phase: str, name: str) -> tuple[float, float]:
    """(µs per step, calls per step) of one kernel name in A's kernels.csv, computed here independently."""
    run = load_run(folder)
    rows = run.kernels[(run.kernels["phase"] == phase) & (run.kernels["name"] == name)]
    steps = run.summary["phases"][phase]["steps"]
    return rows["dur_us"].sum() / steps, len(rows) / steps


def test_same_run_twice_has_zero_deltas(runs: dict[str, Path]) -> None:
    """GIVEN one run as A and B WHEN diffed THEN every delta is 0, every ratio of a non-zero figure 1, nothing
    appeared or vanished and no note is made."""
    a = load_run(runs["a"])
    result = diff_runs(a, a)
    assert result["notes"] == []
    assert list(result["phases"]) == ["prefill", "decode"]
    for ph in result["phases"].values():
        assert ph["present"] == "both"
        for d in [*ph["metrics"].values(), *ph["categories"].values()]:
            if d["a"] is not None:
                assert d["delta"] == 0.0
                assert d["ratio"] == (1.0 if d["a"] else None)
        assert ph["fusions"] and all(f["status"] == "both" and f["delta_us"] == 0.0 for f in ph["fusions"])
        assert ph["kernels_appeared"] == [] and ph["kernels_vanished"] == []


def test_edited_copy_gives_the_known_deltas(runs: dict[str, Path]) -> None:
    """GIVEN A and a copy with known edits WHEN diffed THEN the deltas, ratios and lists are exactly those edits."""
    a, c = load_pair(runs["a"], runs["edited"])
    result = diff_runs(a, c)
    wall = a.summary["phases"][HALVED]["wall_ms_per_step_unprofiled"]
    decode = result["phases"][HALVED]
    assert decode["present"] == "both"
    assert decode["metrics"]["wall_ms_per_step_unprofiled"] == {"a": wall, "b": wall / 2, "delta": -wall / 2,
                                                                "ratio": 0.5}  # fmt: skip
    assert decode["metrics"]["wall_ms_per_step"]["ratio"] == 1.0
    # a CPU run has no GPU figures: A's side is null, so no delta either
    assert decode["metrics"]["kernels_per_step"] == {"a": None, "b": 40.0, "delta": None, "ratio": None}
    cats = decode["categories"]
    assert cats["gemm"]["delta"] == pytest.approx(100.0)
    emb = a.summary["phases"][HALVED]["time_by_category_us"]["embedding"]
    assert cats["embedding"] == {"a": emb, "b": 0.0, "delta": -emb, "ratio": 0.0}
    assert cats["fused"] == {"a": 0.0, "b": 50.0, "delta": 50.0, "ratio": None}
    assert next(iter(cats)) == "gemm"  # largest |delta| first
    fusions = {f["fusion"]: f for f in decode["fusions"]}
    rms = next(o for o in a.summary["opportunities"] if o["phase"] == HALVED and o["fusion"] == "rms_norm")
    assert fusions["rms_norm"] == {"fusion": "rms_norm", "status": "vanished", "count_a": rms["count"], "count_b": 0.0,
                                   "us_a": rms["t_now_us"], "us_b": 0.0, "delta_us": -rms["t_now_us"]}  # fmt: skip
    assert fusions["new_fusion"]["status"] == "appeared" and fusions["new_fusion"]["delta_us"] == 12.5
    assert {f["status"] for name, f in fusions.items() if name not in ("rms_norm", "new_fusion")} == {"both"}
    us, calls = per_step(runs["a"], HALVED, RENAMED[0])
    assert decode["kernels_appeared"] == [
        {"name": RENAMED[1], "us_per_step": pytest.approx(us), "calls_per_step": calls}
    ]
    vanished = {r["name"]: r for r in decode["kernels_vanished"]}
    assert set(vanished) == {DROPPED, RENAMED[0]}
    dropped_us, dropped_calls = per_step(runs["a"], HALVED, DROPPED)
    assert vanished[DROPPED]["us_per_step"] == pytest.approx(dropped_us)
    assert vanished[DROPPED]["calls_per_step"] == dropped_calls > 0
    most_first = [RENAMED[0], DROPPED] if us > dropped_us else [DROPPED, RENAMED[0]]
    assert [r["name"] for r in decode["kernels_vanished"]] == most_first


def test_phase_in_one_run_only_is_shown_as_such(runs: dict[str, Path]) -> None:
    """GIVEN B without prefill WHEN diffed either way THEN prefill is a_only / b_only with null on the missing side."""
    a, c = load_pair(runs["a"], runs["edited"])
    prefill = diff_runs(a, c)["phases"]["prefill"]
    assert prefill["present"] == "a_only" and prefill["steps_b"] is None
    assert all(d["b"] is None and d["delta"] is None for d in prefill["metrics"].values())
    assert all(f["status"] == "a_only" and f["count_b"] is None for f in prefill["fusions"])
    assert prefill["kernels_appeared"] == prefill["kernels_vanished"] == []
    backwards = diff_runs(c, a)["phases"]
    assert list(backwards) == ["decode", "prefill"] and backwards["prefill"]["present"] == "b_only"


def test_different_models_make_a_note_not_an_error(runs: dict[str, Path]) -> None:
    a, c = load_pair(runs["a"], runs["edited"])
    assert diff_runs(a, c)["notes"] == [
        "A and B profiled different models (tiny-llama vs tiny-other): the deltas are not one change's"
    ]


def test_two_real_runs_have_the_same_shape(runs: dict[str, Path]) -> None:
    """GIVEN two real runs of one workload THEN both phases compare, with every metric key, and the JSON is strict."""
    result = diff_runs(*load_pair(runs["a"], runs["b"]))
    assert set(result) == {"schema", "a", "b", "notes", "phases"}
    assert result["a"]["path"] == str(runs["a"]) and result["b"]["model"] == "tiny-llama"
    for ph in result["phases"].values():
        assert tuple(ph["metrics"]) == PHASE_METRICS
        assert ph["metrics"]["wall_ms_per_step"]["ratio"] > 0
    json.dumps(result, allow_nan=False)


def test_non_run_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a file, not a run folder"):
        load_pair(runs["a"], runs["a"] / "summary.json")
    with pytest.raises(UsageError, match="not a fusionscope run folder"):
        load_pair(tmp_path, runs["a"])


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------


def test_cli_writes_json_and_html_and_prints_the_tables(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "d"
    result = runner.invoke(app, ["diff", str(runs["a"]), str(runs["edited"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["diff.html", "diff.json"]
    assert json.loads((out / "diff.json").read_text())["phases"][HALVED]["metrics"]["wall_ms_per_step"]["ratio"] == 1
    text = result.stdout
    assert "note: A and B profiled different models (tiny-llama vs tiny-other)" in text
    assert re.search(r"decode\s+│ wall ms/step \(unprof\.\)\s+│.*│\s+0\.500× │", text)
    assert "prefill (only in A)" in text
    assert re.search(r"decode\s+│ rms_norm\s+│ vanished", text)
    assert re.search(rf"decode\s+│ appeared │ {RENAMED[1]}", text)
    assert re.search(rf"decode\s+│ vanished │ {re.escape(DROPPED)}", text)
    assert f"diff: {out}/diff.json" in text


def test_cli_same_folder_twice(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "same"
    result = runner.invoke(app, ["diff", str(runs["a"]), str(runs["a"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stdout and "1.000×" in result.stdout
    assert "the same kernel names in both runs" in result.stdout


def test_cli_default_out_is_under_reports(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["diff", str(runs["a"]), str(runs["b"])])
    assert result.exit_code == 0, result.output
    (made,) = (tmp_path / "reports").iterdir()
    assert made.name.startswith("diff-") and (made / "diff.json").is_file()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "run folder not found"),
        ("not_a_run", "is not a fusionscope run folder"),
        ("bad_trace", "truncated or damaged gzip"),
        ("no_phases", "its summary.json has no phases"),
        ("out_exists", "already exists"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(
    runs: dict[str, Path], tmp_path: Path, case: str, message: str
) -> None:
    a, b, out = runs["a"], runs["b"], tmp_path / "out" / "d"
    if case == "missing":
        b = tmp_path / "nowhere"
    elif case == "not_a_run":
        b = tmp_path / "empty"
        b.mkdir()
    elif case == "bad_trace":
        a = tmp_path / "cut.trace.json.gz"
        a.write_bytes((runs["a"] / "trace.json.gz").read_bytes()[:100])
    elif case == "no_phases":
        b = tmp_path / "odd"
        b.mkdir()
        shutil.copy(runs["a"] / "kernels.csv", b)
        (b / "summary.json").write_text('{"schema": 1, "phases": [1]}')
    else:
        out.mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    result = runner.invoke(app, ["diff", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 2
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fusionscope: error: ") and message in err
    assert "Traceback" not in result.output
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, no partial folder left


# --------------------------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page(runs: dict[str, Path]) -> str:
    return render_diff_page(diff_runs(*load_pair(runs["a"], runs["edited"])))


def test_page_holds_the_phase_table(page: str) -> None:
    match = re.search(r'<table class="sortable" id="diff-phases">.*?</table>', page, re.S)
    assert match
    table = match.group(0)
    assert "wall ms/step (unprofiled)" in table and "0.500×" in table and "−50.0%" in table
    assert "prefill (only in A)" in table
    assert 'id="diff-fusions-decode"' in page and "vanished in B" in page
    assert RENAMED[1] in re.search(r'id="diff-appeared-decode".*?</table>', page, re.S).group(0)


def test_page_needs_no_network_and_embeds_plotly_once(page: str) -> None:
    plotly_js = get_plotlyjs()
    assert page.count(plotly_js) == 1 and page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    own = page.replace(plotly_js, "")
    assert "https://" not in own and "http://" not in own
    assert own.count("Plotly.newPlot(") == 1 and 'id="fig-diff-steps"' in own


def test_page_escapes_run_text(runs: dict[str, Path]) -> None:
    a = load_run(runs["a"])
    result = diff_runs(a, a)
    result["phases"]["<b>x</b>"] = result["phases"]["decode"]
    result["notes"] = ["<script>alert(1)</script>"]
    own = render_diff_page(result).replace(get_plotlyjs(), "")
    assert "<b>x</b>" not in own and "&lt;b&gt;x&lt;/b&gt;" in own
    assert "<script>alert(1)</script>" not in own


@pytest.mark.browser
def test_page_draws_offline_in_chromium(page: str, tmp_path: Path) -> None:
    """GIVEN the diff page opened from a file in headless Chromium THEN its one chart is drawn with both runs' bars,
    nothing is fetched and no script fails."""
    from playwright.sync_api import sync_playwright

    chromium = Path("/usr/bin/chromium")
    assert chromium.exists(), "the browser tests need Debian's chromium package at /usr/bin/chromium"
    path = tmp_path / "diff.html"
    path.write_text(page, encoding="utf-8")
    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=["--no-sandbox", "--disable-gpu"])
        try:
            tab = browser.new_page(viewport={"width": 1440, "height": 900})
            tab.on("pageerror", lambda exc: errors.append(str(exc)))
            tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            tab.on("request", lambda request: requests.append(request.url))
            tab.goto(path.as_uri(), wait_until="load")
            bars = tab.locator("#fig-diff-steps .barlayer .trace").count()
            rows = tab.locator("#diff-phases tbody tr").count()
        finally:
            browser.close()
    assert errors == []
    assert [url for url in requests if not url.startswith(("file:", "data:", "blob:"))] == []
    assert bars == 2  # A and B
    assert rows >= 3  # decode's metrics and prefill's (only in A)


# --------------------------------------------------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------------------------------------------------

CPU_STEPS = Path(__file__).resolve().parent / "data" / "traces" / "cpu-steps.trace.json.gz"


def test_trace_sides_are_analysed_then_diffed(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace file against the run folder it came from: the same kernels, phases as analyze names them; the
    temporary run folder of the trace is gone afterwards; the Run names the trace."""
    from fusionscope.diff import diff_paths, load_side

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the temporary run folders go
    trace_side = load_side(runs["a"] / "trace.json.gz", "A", device="cpu")
    assert trace_side.out_dir == runs["a"] / "trace.json.gz" and trace_side.summary["model"]["source"] == "trace"
    assert list(tmp_path.iterdir()) == []
    result = diff_paths(runs["a"] / "trace.json.gz", runs["a"] / "trace.json.gz", device="cpu")
    assert result["a"]["path"].endswith("trace.json.gz") and set(result["phases"]) == {"prefill", "decode"}
    for ph in result["phases"].values():
        assert ph["present"] == "both" and ph["metrics"]["wall_ms_per_step"]["delta"] == 0
        assert ph["kernels_appeared"] == [] and ph["kernels_vanished"] == []
    assert result["hta"]["source"] == "hta" and all(r["delta_us"] == 0 for r in result["hta"]["rows"])
    mixed = diff_paths(runs["a"], runs["a"] / "trace.json.gz", device="cpu")
    assert "hta" not in mixed and set(mixed["phases"]) == {"prefill", "decode"}


def test_cli_diff_of_two_traces(tmp_path: Path) -> None:
    result = runner.invoke(app, ["diff", str(CPU_STEPS), str(CPU_STEPS), "--out", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert written["hta"]["source"] == "hta" and written["hta"]["rows"]
    assert "HTA trace diff" in (tmp_path / "d" / "diff.html").read_text(encoding="utf-8")
    assert {p.name for p in (tmp_path / "d").iterdir()} == {"diff.json", "diff.html"}
