"""Report rendering without a browser: structure, escaping, offline-ness, robustness and size.

The fixture builder below makes synthetic runs (a CUDA-like two-phase run and a CPU-like run with null GPU fields);
the kernel names are real-looking templates on purpose (``<``, ``>``, ``&``), because escaping them is the part of the
report most likely to break silently.  Everything is deterministic, so sizes and timings are comparable run to run.
test_report_browser.py imports the builder from here.
"""

from __future__ import annotations

import copy
import html
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from plotly.offline import get_plotlyjs

from fusionscope.report import render_report
from fusionscope.report.figures import roofline_figure
from fusionscope.report.formatting import DASH, fmt_count, fmt_num, fmt_pct, phase_slugs
from fusionscope.report.grouping import ROOT_ID, module_tree, normalise_kernels, roofline_points, steps_in

CUTLASS = "void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)"
AND_KERNEL = (
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::MulFunctor<float> >"
    "(at::TensorIteratorBase&, at::native::MulFunctor<float> const&)::{lambda(int)#1}>(int, ...)"
)
FLASH = "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false, false, cutlass::bfloat16_t>>(Params)"
RMS = "void at::native::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, int)"
MEMCPY = "Memcpy DtoD (Device -> Device)"
INDEX = "void at::native::index_elementwise_kernel<128, 4>(int, at::native::IndexFunctor)"
SAMPLE = "void at::native::sampling_kernel<float>(float*)"

# (name, op, module suffix or None for a module-less kernel, category, flops, bytes, dur_us, bound)
PER_LAYER: list[tuple[str, str, str | None, str, float, float, float, str]] = [
    (CUTLASS, "aten::mm", "self_attn.q_proj", "gemm", 1.7e10, 2.1e7, 40.0, "compute"),
    (CUTLASS, "aten::mm", "mlp.down_proj", "gemm", 6.0e10, 7.0e7, 120.0, "compute"),
    (FLASH, "aten::_flash_attention_forward", "self_attn", "attention", 8.0e9, 1.0e7, 30.0, "compute"),
    (RMS, "aten::_fused_rms_norm", "input_layernorm", "norm", 4.0e6, 1.6e7, 6.0, "memory"),
    (AND_KERNEL, "aten::mul", "mlp", "elementwise", 2.0e6, 2.4e7, 8.0, "memory"),
    (AND_KERNEL, "aten::mul", "mlp.act_fn", "elementwise", 1.0e4, 1.2e5, 2.0, "latency"),
    (MEMCPY, "aten::copy_", "self_attn", "copy", 0.0, 8.0e6, 4.0, "memory"),
    (INDEX, "aten::index", "self_attn.rotary_emb", "other", math.nan, math.nan, 3.0, "unmodeled"),
]
EXTRAS: list[tuple[str, str, str | None, str, float, float, float, str]] = [
    (SAMPLE, "aten::multinomial", None, "sampling", 1.0e5, 4.0e5, 5.0, "latency"),
]

DECODE_REGIME = (
    "host-bound (measured): the GPU is busy 16% of each decode step, under half of it; the CPU launching 1,462 "
    "kernels per step sets the pace"
)
CPU_SENTENCE = "CPU run: the aten ops are the timeline; classes are against this CPU's measured roofs."


def make_kernels(
    phases: dict[str, int], layers: int = 2, ranks: int = 1, cpu: bool = False, decode_scale: float = 0.1
) -> pd.DataFrame:
    """One row per kernel launch: ``layers`` copies of PER_LAYER plus EXTRAS, per step, per phase, per rank."""
    template = []
    for layer in range(layers):
        for name, op, suffix, category, flops, nbytes, dur, bound in PER_LAYER:
            module = f"model.layers.{layer}.{suffix}"
            template.append((name, op, module, category, flops, nbytes, dur, bound))
    template += [(n, o, "" if m is None else m, c, f, b, d, bd) for n, o, m, c, f, b, d, bd in EXTRAS]
    base = pd.DataFrame(template, columns=["name", "op", "module", "category", "flops", "bytes", "dur_us", "bound"])
    if cpu:
        # aten ops on a 2-core CPU: same work, ~5000× the time, so dots sit under this CPU's roofs.
        base["name"] = base["op"]
        base["dur_us"] = base["dur_us"] * 5000
    frames = []
    jitter = np.random.default_rng(0)
    for phase, steps in phases.items():
        scale = decode_scale if phase == "decode" else 1.0
        for rank in range(ranks):
            for step in range(steps):
                part = base.copy()
                part["flops"] = part["flops"] * scale
                part["bytes"] = part["bytes"] * scale
                part["dur_us"] = part["dur_us"] * scale * jitter.uniform(0.9, 1.1, len(part))
                part["ts_us"] = part["dur_us"].cumsum() + step * 1e5
                part.insert(0, "step", step)
                part.insert(0, "phase", phase)
                part.insert(0, "rank", rank)
                frames.append(part)
    kernels = pd.concat(frames, ignore_index=True)
    kernels["stream"] = 7
    kernels["dtype"] = "float32" if cpu else "bfloat16"
    with np.errstate(divide="ignore", invalid="ignore"):
        kernels["intensity"] = kernels["flops"] / kernels["bytes"]
        kernels["achieved_gbps"] = kernels["bytes"] / kernels["dur_us"] / 1e3
        kernels["achieved_tflops"] = kernels["flops"] / kernels["dur_us"] / 1e6
    kernels["attainable_tflops"] = np.minimum(989.0, kernels["intensity"] * 4.8)
    kernels["achieved_frac"] = kernels["achieved_tflops"] / kernels["attainable_tflops"]
    columns = ["rank", "phase", "step", "name", "op", "module", "category", "stream", "ts_us", "dur_us", "flops"]
    columns += ["bytes", "dtype", "intensity", "achieved_gbps", "achieved_tflops", "attainable_tflops"]
    return kernels[[*columns, "achieved_frac", "bound"]]


def _top_kernels(kernels: pd.DataFrame, phase: str) -> list[dict[str, Any]]:
    """What the profiler's summary would list: (name, op) groups by time, with share of the phase."""
    rows = kernels[kernels["phase"] == phase]
    if rows.empty:
        return []
    steps = rows[["rank", "step"]].drop_duplicates().shape[0]
    total = rows["dur_us"].sum()
    groups = rows.groupby(["name", "op"], sort=False).agg(
        category=("category", "first"),
        bound=("bound", "first"),
        module=("module", "first"),
        calls=("dur_us", "size"),
        dur=("dur_us", "sum"),
    )
    groups = groups.sort_values("dur", ascending=False).reset_index()
    return [
        {
            "name": row.name,
            "op": row.op,
            "category": row.category,
            "bound": row.bound,
            "calls_per_step": row.calls / steps,
            "us_per_step": row.dur / steps,
            "share": row.dur / total,
            "module": row.module,
        }
        for row in groups.itertuples(index=False)
    ]


def _by(kernels: pd.DataFrame, phase: str, column: str) -> dict[str, float]:
    rows = kernels[kernels["phase"] == phase]
    steps = max(1, rows[["rank", "step"]].drop_duplicates().shape[0])
    return {str(k): float(v) for k, v in (rows.groupby(column)["dur_us"].sum() / steps).items()}


def make_summary(kernels: pd.DataFrame, cpu: bool = False) -> dict[str, Any]:
    """A summary.json consistent with ``kernels``; GPU fields are null on the CPU variant, like a real CPU run."""
    phases: dict[str, Any] = {}
    for phase in pd.unique(kernels["phase"]):
        gpu = {
            "gpu_busy_ms_per_step": None if cpu else (1.6 if phase == "decode" else 9.3),
            "gpu_busy_frac": None if cpu else (0.16 if phase == "decode" else 0.93),
            "kernels_per_step": None if cpu else (1462 if phase == "decode" else 1510),
            "host_us_per_kernel": None if cpu else 6.8,
            "regime": None if cpu else ("host-bound" if phase == "decode" else "gpu-bound"),
        }
        phases[phase] = {
            "steps": int(kernels.loc[kernels["phase"] == phase, "step"].nunique()),
            "wall_ms_per_step": 10.2,
            "wall_ms_per_step_unprofiled": 8.1,
            **gpu,
            "ops_per_step": 410,
            "time_by_class_us": _by(kernels, phase, "bound"),
            "time_by_category_us": _by(kernels, phase, "category"),
            "top_kernels": _top_kernels(kernels, phase),
        }
    device = {"kind": "cpu", "name": "x86_64 (2 cores)"} if cpu else {"kind": "cuda", "name": "NVIDIA H200"}
    roofs: dict[str, Any] = {
        "copy_gbps": 12.3 if cpu else 4020.0,
        "read_heavy_gbps": 14.0 if cpu else 4310.0,
        "tflops": {"float32": 0.21, "bfloat16": 0.05, "float16": 0.04, "tf32": None}
        if cpu
        else {"float32": 51.0, "bfloat16": 720.0, "float16": 730.0, "tf32": 380.0},
        "launch_us": None if cpu else 4.2,
        "aten_op_host_us": 3.1,
        "datasheet": None if cpu else {"gbps": 4800, "tflops": {"bfloat16": 989, "float32": 67}},
        "source": "measured",
        "measured_at": "2026-11-29T09:29:00+00:00",
    }
    return {
        "schema": 1,
        "created": "2026-11-29T09:30:00+00:00",
        "command": "fusionscope profile tiny-llama --decode-steps 8 && echo <done>",
        "model": {
            "name": "tiny-llama",
            "source": "preset",
            "family": "llama",
            "params": 2103040,
            "dtype": "float32" if cpu else "bfloat16",
            "batch": 1,
            "prompt_len": 64,
            "decode_steps": 8,
        },
        "device": device,
        "versions": {"python": "3.11.7", "torch": "2.13.0", "triton": "3.9.0", "fusionscope": "0.1.0", "hta": None},
        "roofs": roofs,
        "cost_coverage": 0.98,
        "phases": phases,
        "wall_s": 14.2,
    }


def cuda_run(**kwargs: Any) -> tuple[dict[str, Any], pd.DataFrame]:
    """Two phases (prefill, decode) on a pretend H200."""
    kernels = make_kernels({"prefill": 3, "decode": 8}, **kwargs)
    return make_summary(kernels), kernels


def cpu_run() -> tuple[dict[str, Any], pd.DataFrame]:
    """Same model on CPU: rows are aten ops, every GPU field is null."""
    kernels = make_kernels({"prefill": 2, "decode": 4}, cpu=True)
    return make_summary(kernels, cpu=True), kernels


def big_run() -> tuple[dict[str, Any], pd.DataFrame]:
    """~50k rows: 35 decode-like steps × ~1,430 kernels, the size of an 8B model profile."""
    kernels = make_kernels({"prefill": 3, "decode": 32}, layers=178)
    return make_summary(kernels), kernels


def without(summary: dict[str, Any], *path: str) -> dict[str, Any]:
    """Deep copy of ``summary`` with the key at ``path`` removed."""
    out = copy.deepcopy(summary)
    node = out
    for key in path[:-1]:
        node = node[key]
    node.pop(path[-1], None)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------------------------

PLOTLY_JS = get_plotlyjs()
FIGURES = ("time", "treemap", "roofline")


def page_without_plotly(page: str) -> str:
    """The page minus the embedded library, i.e. only what the report itself wrote."""
    return page.replace(PLOTLY_JS, "")


def table_html(page: str, phase: str) -> str:
    """The HTML of one phase's top-kernels table."""
    match = re.search(rf'<table class="sortable" id="table-{phase}">.*?</table>', page, re.S)
    assert match, f"no table for phase {phase}"
    return match.group(0)


@pytest.fixture(scope="module")
def cuda_page() -> str:
    summary, kernels = cuda_run()
    return render_report(summary, kernels)


@pytest.fixture(scope="module")
def cpu_page() -> str:
    summary, kernels = cpu_run()
    return render_report(summary, kernels)


def test_plotly_js_is_embedded_exactly_once(cuda_page: str) -> None:
    """GIVEN a two-phase run with six figures WHEN rendered THEN plotly.js is inlined once, not once per figure."""
    assert cuda_page.count(PLOTLY_JS) == 1
    assert cuda_page.count("plotly.js v") == 1
    assert cuda_page.startswith("<!DOCTYPE html>")
    assert cuda_page.rstrip().endswith("</html>")


def test_page_needs_no_network(cuda_page: str) -> None:
    """GIVEN a rendered report THEN no script is loaded from anywhere and the report adds no URL of its own."""
    assert not re.search(r"<script[^>]*\bsrc\s*=", cuda_page, re.I)
    own = page_without_plotly(cuda_page)
    assert "cdn.plot.ly" not in own
    assert "https://" not in own
    assert "http://" not in own


def test_every_figure_div_is_present(cuda_page: str) -> None:
    """GIVEN prefill and decode WHEN rendered THEN each phase has its time, treemap and roofline figure."""
    for phase in ("prefill", "decode"):
        for figure in FIGURES:
            assert f'id="fig-{figure}-{phase}"' in cuda_page
    assert page_without_plotly(cuda_page).count("Plotly.newPlot(") == 6


def test_kernel_names_and_command_are_escaped(cuda_page: str) -> None:
    """GIVEN kernel names with <, > and & WHEN rendered THEN they appear escaped and never raw."""
    for name in (CUTLASS, AND_KERNEL, FLASH, MEMCPY):
        assert name not in cuda_page
        assert html.escape(name, quote=False) in cuda_page
    own = page_without_plotly(cuda_page)
    assert "Kernel<" not in own
    assert "TensorIteratorBase&," not in own
    assert "echo &lt;done&gt;" in own


def test_regime_is_said_in_plain_words(cuda_page: str) -> None:
    """GIVEN a host-bound decode and a gpu-bound prefill THEN both regime sentences are on the page."""
    assert DECODE_REGIME in cuda_page
    assert "capturing CUDA graphs helps more than faster kernels" in cuda_page
    assert "gpu-bound (measured): the GPU is busy 93% of each prefill step, at least half of it" in cuda_page
    assert 'class="regime host-bound"' in cuda_page


def test_table_lists_the_summary_top_kernels(cuda_page: str) -> None:
    """GIVEN the summary's top kernels WHEN rendered THEN each phase's table has one row per top kernel, in order."""
    summary, _ = cuda_run()
    for phase in ("prefill", "decode"):
        table = table_html(cuda_page, phase)
        top = summary["phases"][phase]["top_kernels"]
        assert table.count("<tr>") == len(top) + 1  # header row + body rows
        positions = [table.index(html.escape(k["name"], quote=False)) for k in top[:3]]
        assert positions == sorted(positions)
        assert 'data-type="num"' in table
        assert "aten::_flash_attention_forward" in table
    # Measured columns are joined in from the kernel rows: the copy has zero FLOP/B, the index op no cost model.
    decode = table_html(cuda_page, "decode")
    memcpy_row = next(r for r in decode.split("<tr>") if "Memcpy" in r)
    assert '<td data-v="0.0" class="num">0</td>' in memcpy_row


def test_cpu_run_shows_dashes_and_says_it_is_a_cpu_run(cpu_page: str) -> None:
    """GIVEN a CPU run with null GPU fields THEN those read as a dash, never None/nan, and the CPU sentence shows."""
    assert html.escape(CPU_SENTENCE, quote=False) in cpu_page
    assert f"<dt>GPU busy per step</dt><dd>{DASH}</dd>" in cpu_page
    assert f"<dt>kernels per step</dt><dd>{DASH}</dd>" in cpu_page
    assert "<dt>aten ops per step</dt><dd>410</dd>" in cpu_page
    own = page_without_plotly(cpu_page)
    assert not re.search(r">\s*(None|nan|NaN|null)\s*<", own)
    for phase in ("prefill", "decode"):
        for figure in FIGURES:
            assert f'id="fig-{figure}-{phase}"' in cpu_page


def test_render_is_pure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """WHEN rendering THEN nothing is printed and no file appears: the CLI owns all I/O."""
    monkeypatch.chdir(tmp_path)
    summary, kernels = cuda_run()
    before = kernels.copy()
    render_report(summary, kernels)
    assert capsys.readouterr() == ("", "")
    assert list(tmp_path.iterdir()) == []
    pd.testing.assert_frame_equal(kernels, before)


def _phase_kernels_only(phase: str) -> tuple[dict[str, Any], pd.DataFrame]:
    summary, kernels = cuda_run()
    return summary, kernels[kernels["phase"] == phase].reset_index(drop=True)


def _nan_costs() -> tuple[dict[str, Any], pd.DataFrame]:
    summary, kernels = cuda_run()
    cost = ["flops", "bytes", "intensity", "achieved_gbps", "achieved_tflops", "attainable_tflops", "achieved_frac"]
    kernels[cost] = np.nan
    kernels["bound"] = "unmodeled"
    return summary, kernels


def _custom_model() -> tuple[dict[str, Any], pd.DataFrame]:
    kernels = make_kernels({"forward": 2})
    return make_summary(kernels), kernels


def _bare_summary() -> tuple[dict[str, Any], pd.DataFrame]:
    return {}, make_kernels({"forward": 1})


def _sparse_columns() -> tuple[dict[str, Any], pd.DataFrame]:
    summary, kernels = cuda_run()
    return summary, kernels.drop(columns=["stream", "dtype", "achieved_frac", "module", "ts_us", "rank"])


def _no_roofs() -> tuple[dict[str, Any], pd.DataFrame]:
    summary, kernels = _nan_costs()
    summary["roofs"] = None
    return summary, kernels


def _odd_phase_names() -> tuple[dict[str, Any], pd.DataFrame]:
    kernels = make_kernels({"pre fill": 1, "pre/fill": 1, "<b>x</b>": 1})
    return make_summary(kernels), kernels


ROBUSTNESS = {
    "no phases, no kernels": (lambda: ({"phases": {}}, pd.DataFrame()), ["This run recorded no phases."]),
    "kernels is None": (lambda: (cuda_run()[0], None), ["No kernels were recorded for this phase."]),
    "phase without kernels": (lambda: _phase_kernels_only("prefill"), ['id="fig-time-decode"']),
    "all-NaN cost columns": (_nan_costs, ["kernels per step have no cost model"]),
    "custom model, one phase": (_custom_model, ['id="fig-roofline-forward"', 'class="grid single"']),
    "empty summary": (_bare_summary, ['id="fig-treemap-forward"', "Regime not recorded"]),
    "missing kernel columns": (_sparse_columns, ['id="fig-treemap-decode"', "(no module)"]),
    "no roofs, no costs": (_no_roofs, ["No kernel has a cost model and no roofs were measured."]),
    "odd phase names": (_odd_phase_names, ['id="fig-time-pre-fill"', 'id="fig-time-pre-fill-1"', "&lt;b&gt;x"]),
}


@pytest.mark.parametrize("case", list(ROBUSTNESS))
def test_degenerate_runs_still_render(case: str) -> None:
    """GIVEN a half-empty or malformed run WHEN rendered THEN the page is complete and says what is missing."""
    build, expected = ROBUSTNESS[case]
    summary, kernels = build()
    page = render_report(summary, kernels)
    assert page.count(PLOTLY_JS) == 1
    assert page.rstrip().endswith("</html>")
    for text in expected:
        assert text in page, text
    assert "<b>x</b>" not in page_without_plotly(page)


def test_phase_without_kernels_says_so_instead_of_drawing() -> None:
    """GIVEN decode in the summary but not in kernels THEN decode gets a note, not an empty treemap or roofline."""
    page = render_report(*_phase_kernels_only("prefill"))
    assert 'id="fig-treemap-prefill"' in page
    assert 'id="fig-treemap-decode"' not in page
    assert "No kernels were recorded for this phase." in page


def test_fifty_thousand_kernels_render_fast_and_small() -> None:
    """GIVEN an 8B-sized profile (~50k kernel rows) THEN rendering takes seconds and the data stays small."""
    summary, kernels = big_run()
    assert len(kernels) >= 45_000
    start = time.perf_counter()
    page = render_report(summary, kernels)
    elapsed = time.perf_counter() - start
    data_bytes = len(page_without_plotly(page).encode())
    assert elapsed < 5.0, f"render took {elapsed:.1f}s"
    assert data_bytes < 1_000_000, f"report data is {data_bytes / 1e6:.2f} MB"
    assert len(page.encode()) < len(PLOTLY_JS.encode()) + 1_000_000


# --- the groupings behind the figures ------------------------------------------------------------------------------


def test_steps_are_counted_per_rank() -> None:
    frame = normalise_kernels(make_kernels({"decode": 3}, ranks=2))
    assert steps_in(frame) == 6
    assert steps_in(frame.iloc[0:0]) == 1


def test_module_tree_totals_add_up() -> None:
    """Parents hold their children's time (plotly's branchvalues="total"); module-less time is kept visible."""
    frame = normalise_kernels(make_kernels({"decode": 4}))
    tree = module_tree(frame, root_label="decode")
    values = dict(zip(tree.ids, tree.values, strict=True))
    parents = dict(zip(tree.ids, tree.parents, strict=True))
    assert values[ROOT_ID] == pytest.approx(frame["dur_us"].sum() / 4)
    assert parents["model.layers.0.mlp.down_proj"] == "model.layers.0.mlp"
    assert parents["(no module)"] == ROOT_ID
    for node, value in values.items():
        children = [values[c] for c, p in parents.items() if p == node]
        assert value >= sum(children) - 1e-6
    assert tree.labels[tree.ids.index(ROOT_ID)] == "decode"


def test_roofline_groups_take_ratios_of_sums() -> None:
    """A group's intensity is total FLOPs over total bytes and its throughput total FLOPs over total time."""
    rows = pd.DataFrame(
        {
            "phase": "decode",
            "step": [0, 0, 1, 1, 1],
            "name": ["k", "k", "k", "copy", "idx"],
            "op": "aten::mm",
            "module": ["m.a", "m.a", "m.a", "m.b", ""],
            "category": ["gemm", "gemm", "gemm", "copy", "other"],
            "dtype": "bfloat16",
            "bound": ["compute", "compute", "compute", "memory", "unmodeled"],
            "dur_us": [1.0, 3.0, 4.0, 2.0, 5.0],
            "flops": [1e6, 3e6, 4e6, 0.0, np.nan],
            "bytes": [1e3, 1e3, 2e3, 1e4, np.nan],
        }
    )
    result = roofline_points(normalise_kernels(rows))
    (point,) = result.points.to_dict("records")
    assert point["intensity"] == pytest.approx(8e6 / 4e3)
    assert point["tflops"] == pytest.approx(8e6 / 8.0 / 1e6)
    assert point["us_per_step"] == pytest.approx(4.0)
    assert point["calls_per_step"] == pytest.approx(1.5)
    assert result.zero_flop_calls_per_step == pytest.approx(0.5)
    assert result.zero_flop_us_per_step == pytest.approx(1.0)
    assert result.unmodeled_us_per_step == pytest.approx(2.5)
    assert result.dtypes == ["bfloat16"]


def test_roofline_folds_the_tail_beyond_max_points() -> None:
    frame = normalise_kernels(make_kernels({"decode": 1}, layers=3))
    full = roofline_points(frame)
    capped = roofline_points(frame, max_points=2)
    assert len(capped.points) == 2
    assert capped.folded_us_per_step == pytest.approx(full.points["us_per_step"].iloc[2:].sum())


def test_roofline_draws_measured_and_datasheet_roofs() -> None:
    """Measured roofs are solid, datasheet roofs dashed, one per dtype present, each with its ridge point."""
    summary, kernels = cuda_run()
    points = roofline_points(normalise_kernels(kernels[kernels["phase"] == "decode"]))
    fig = roofline_figure(points, summary["roofs"], "bfloat16")
    assert fig is not None
    roofs = {t.name: t for t in fig.data if t.mode == "lines"}
    assert set(roofs) == {
        "measured roof · bfloat16 720 TFLOP/s · 4,020 GB/s",
        "datasheet roof · bfloat16 989 TFLOP/s · 4,800 GB/s",
    }
    measured = roofs["measured roof · bfloat16 720 TFLOP/s · 4,020 GB/s"]
    assert measured.line.dash == "solid"
    assert measured.x[1] == pytest.approx(720e3 / 4020)  # ridge: peak over bandwidth
    assert roofs["datasheet roof · bfloat16 989 TFLOP/s · 4,800 GB/s"].line.dash == "dash"
    dots = [t for t in fig.data if t.mode == "markers" and t.name.endswith("-bound")]
    assert {t.name for t in dots} == {"compute-bound", "memory-bound", "latency-bound"}
    assert all(min(t.y) > 0 for t in dots)  # zero-FLOP copies never reach the log axis
    assert fig.layout.xaxis.type == "log"
    assert fig.layout.yaxis.type == "log"


def test_cpu_roofline_uses_the_measured_cpu_roof() -> None:
    summary, kernels = cpu_run()
    points = roofline_points(normalise_kernels(kernels[kernels["phase"] == "prefill"]))
    fig = roofline_figure(points, summary["roofs"], "float32")
    assert fig is not None
    assert [t.name for t in fig.data if t.mode == "lines"] == ["measured roof · float32 0.210 TFLOP/s · 12.3 GB/s"]


# --- formatting ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [None, math.nan, math.inf, "n/a"])
def test_missing_numbers_show_as_a_dash(missing: Any) -> None:
    assert fmt_num(missing) == DASH
    assert fmt_pct(missing) == DASH
    assert fmt_count(missing) == DASH


def test_numbers_are_short_and_readable() -> None:
    assert fmt_num(1462.4) == "1,462"
    assert fmt_num(0.2103) == "0.210"
    assert fmt_num(12.34) == "12.3"
    assert fmt_pct(0.164) == "16%"
    assert fmt_count(2.0) == "2"
    assert fmt_count(2.375) == "2.38"


def test_phase_slugs_are_unique_html_ids() -> None:
    slugs = phase_slugs(["decode", "Decode", "pre fill", "<>"])
    assert len(set(slugs.values())) == 4
    assert all(re.fullmatch(r"[a-z0-9-]+", s) for s in slugs.values())


def test_opportunities_section_formats_times_and_speedups() -> None:
    from fusionscope.report.opportunities import opportunities_table

    html_text = opportunities_table([
        {"fusion": "rms_norm", "phase": "decode", "count": 1.0, "t_now_us": 32.1, "t_fused_us": 0.25,
         "saved_us": 31.85, "bytes_now": 8240.0, "bytes_fused": 3072.0, "launches_now": 20.0, "launches_fused": 1.0,
         "speedup_gpu": None, "speedup_wall": 1.0113, "confidence": "high", "reason": "r <ok>",
         "module_paths": ["model.layers.0.input_layernorm"]}
    ])  # fmt: skip
    assert ">32.1<" in html_text and ">1.011×<" in html_text and "32.100×" not in html_text
    assert "r &lt;ok&gt;" in html_text and "model.layers.0.input_layernorm" in html_text


def test_the_waterfall_names_what_paces_the_step() -> None:
    from fusionscope.report.opportunities import waterfall_figure

    plan = {"waterfall": [{"fusion": "add_rms_norm", "speedup_gpu": 1.1, "speedup_wall": 1.2}],
            "cuda_graph_share": 0.8, "cuda_graph_share_unfused": 0.9, "paced_by": "host"}  # fmt: skip
    fig = waterfall_figure("decode", plan)
    assert "paced by the host" in fig.layout.title.text
    assert list(fig.data[0].x) == ["add_rms_norm", "then CUDA graph", "in all"]
    assert "paced by" not in waterfall_figure("decode", {**plan, "paced_by": None}).layout.title.text
    old = {"waterfall": plan["waterfall"], "cuda_graph_share": 0.8, "regime": "host-bound"}  # before `paced_by`
    assert "paced by the host" in waterfall_figure("decode", old).layout.title.text


@pytest.mark.parametrize(
    "values",
    [["decode", None, "prefill", np.nan, "decode", ""], [1, 1.0, True, "1", None, pd.NA], [np.str_("a"), "a", None],
     pd.Categorical(["x", None, "y", "x"]), []],
    ids=["strings", "numbers-and-strings", "str-subclass", "categorical", "empty"],
)  # fmt: skip
def test_text_columns_are_what_astype_str_gives(values: list) -> None:
    """`normalise_kernels`' text columns: each distinct string converted once is what converting every value gives
    (missing values empty), and values of other types (1, 1.0 and True, which hash alike) each keep their own text."""
    from fusionscope.report.grouping import _text

    column = pd.Series(values, dtype=object if not isinstance(values, pd.Categorical) else None, name="phase")
    want = column.astype(object).where(column.notna(), "").astype(str)
    got = _text(column)
    pd.testing.assert_series_equal(got, want)
    assert got.tolist() == want.tolist() and [type(v) for v in got] == [type(v) for v in want]
