"""What a reader of the llama-3.1-8b report found, each fixed and held here: the CUDA-graph bar on the fused step,
signed percentages, the measured regime vs the step model's pace, the CPU waterfall, an --out that cannot be made,
tables cut when piped, and a residual add whose other operand is the model's input."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fusionscope import amdahl, cli, dataflow, models, opportunities
from fusionscope.cli import app
from fusionscope.fusions import Graph, find_matches
from fusionscope.report import render_report
from fusionscope.report.formatting import fmt_signed_pct
from fusionscope.report.opportunities import waterfall_figure

REPO = Path(__file__).resolve().parents[1]
SAMPLE_8B = REPO / "reports" / "samples" / "catalogue" / "llama-3.1-8b" / "summary.json"
runner = CliRunner()


def rescored_8b() -> dict[str, Any]:
    """The H200 llama-3.1-8b run's summary with `opportunities` and `cumulative` recomputed from its own per-step
    figures (one row per fusion and phase stands for the step's matches: the medians are the same)."""
    summary = json.loads(SAMPLE_8B.read_text())
    rows = [{"fusion": o["fusion"], "phase": o["phase"], "step": 0, "module": p, "escaping": 0, "unjoined": 0,
             "rejected": "", **{k: o.get(k) for k in opportunities.PER_STEP}}
            for o in summary["opportunities"] for p in o["module_paths"][:1]]  # fmt: skip
    summary["opportunities"], summary["cumulative"] = opportunities.summarize_opportunities(
        pd.DataFrame(rows), summary["phases"], summary["roofs"]
    )
    return summary


@pytest.fixture(scope="module")
def summary_8b() -> dict[str, Any]:
    return rescored_8b()


# --- 1. the CUDA graph after the fusions -------------------------------------------------------------------------


def test_the_8b_decode_graph_share_is_taken_on_the_fused_step(summary_8b: dict[str, Any]) -> None:
    """llama-3.1-8b decode on the H200: host-bound, 31.1 ms of host work for 4659 ops (6.67 µs each), 6.36 ms of GPU
    work. The six fusions remove 2766 ops for 193 launches of 17.9 µs and 2.02 ms of kernel time: 16.1 ms of host
    work is left, of which a graph removes all but the 4.34 ms of GPU work — 73% of the fused step, 38% of the
    unfused one. The sample's summary said 80% (the graph alone, on the unfused step), which on top of the fusions'
    48% came to 128% of the step."""
    decode = summary_8b["phases"]["decode"]
    rows = [o for o in summary_8b["opportunities"] if o["phase"] == "decode"]
    roofs = summary_8b["roofs"]
    wall = 1e3 * decode["wall_ms_per_step_unprofiled"]
    host = wall - sum(o["ops_now"] for o in rows) * wall / decode["ops_per_step"]
    host += sum(o["launches_fused"] for o in rows) * roofs["launch_us"]
    gpu = 1e3 * decode["gpu_busy_ms_per_step"] - sum(o["saved_us"] for o in rows)
    plan = summary_8b["cumulative"]["decode"]
    assert plan["cuda_graph_share"] == pytest.approx((host - gpu) / host) == pytest.approx(0.730, abs=1e-3)
    assert plan["cuda_graph_share_unfused"] == pytest.approx(1 - 6.360 / 31.078, abs=1e-4)
    assert plan["fused_step_model"]["wall_us"] == pytest.approx(host)
    assert plan["fused_step_model"]["gpu_us"] == pytest.approx(gpu)
    final = plan["waterfall"][-1]["speedup_wall"]
    assert final == pytest.approx(wall / host)  # the waterfall ends at the fused step the share is taken on
    saved = (1 - 1 / final) + plan["cuda_graph_share"] / final
    assert saved == pytest.approx(1 - gpu / wall) and saved < 1  # all that is left is the fused GPU time


def test_the_waterfall_bars_are_shares_of_the_unfused_step_and_add_up(summary_8b: dict[str, Any]) -> None:
    plan = summary_8b["cumulative"]["decode"]
    fig = waterfall_figure("decode", plan)
    bars = dict(zip(fig.data[0].x, fig.data[0].y, strict=True))
    final = plan["waterfall"][-1]["speedup_wall"]
    fusions = [w["fusion"] for w in plan["waterfall"]]
    assert sum(bars[f] for f in fusions) == pytest.approx(-100 * (1 - 1 / final))  # −48.2%, not −60.5%
    assert bars["then CUDA graph"] == pytest.approx(-100 * plan["cuda_graph_share"] / final)  # −37.8%
    assert bars["in all"] == pytest.approx(sum(v for k, v in bars.items() if k != "in all"))
    assert -100 < bars["in all"] == pytest.approx(-86.0, abs=0.1)
    assert list(fig.data[0].measure)[-1] == "total"
    assert "% of the unfused step" in fig.layout.title.text


def test_fused_keeps_the_exposed_time_and_agrees_with_speedup() -> None:
    phase = {"wall_ms_per_step": 10.0, "wall_ms_per_step_unprofiled": 9.0, "gpu_busy_ms_per_step": 8.5,
             "ops_per_step": 400.0, "regime": "gpu-bound"}  # fmt: skip
    model = amdahl.step_model(phase, {"aten_op_host_us": 10.0, "launch_us": 16.0})
    after = amdahl.fused(model, 850.0, 40, 4)
    assert after.exposed_us == pytest.approx(model.exposed_us) == pytest.approx(500.0)
    assert after.gpu_us == pytest.approx(7650.0) and after.host_us == pytest.approx(4000 - 400 + 64)
    assert amdahl.speedup(model, 850.0, 40, 4).wall == pytest.approx(model.step_us / after.step_us)
    assert amdahl.cuda_graph_share(after) == pytest.approx(500 / 8150)


# --- 2. signed percentages ---------------------------------------------------------------------------------------


def test_signed_percentages() -> None:
    assert fmt_signed_pct(-0.57) == "−57.0%"
    assert fmt_signed_pct(0.011) == "+1.1%"
    assert fmt_signed_pct(-0.0004) == "0.0%"
    assert fmt_signed_pct(None) == "—"


def test_a_slowdown_bar_reads_plus(summary_8b: dict[str, Any]) -> None:
    """silu_and_mul slows the 8B prefill's wall time (two aten ops at 4.7 µs out, one 17.9 µs launch in)."""
    fig = waterfall_figure("prefill", summary_8b["cumulative"]["prefill"])
    labels = dict(zip(fig.data[0].x, fig.data[0].text, strict=True))
    assert re.fullmatch(r"\+\d+\.\d%", labels["silu_and_mul"]), labels
    assert re.fullmatch(r"−\d+\.\d%", labels["add_rms_norm"]), labels
    assert not any("−-" in t or "+-" in t for t in fig.data[0].text)


# --- 3. the measured regime and the step model's pace ------------------------------------------------------------


def test_prefill_is_measured_gpu_bound_and_paced_by_the_host(summary_8b: dict[str, Any]) -> None:
    """The 8B prefill: GPU busy 68% (measured gpu-bound), but its host work fills the 24.1 ms step (paced by the
    host in the step model, which the estimates use). Both names, each for its own thing, on every surface."""
    assert summary_8b["phases"]["prefill"]["regime"] == "gpu-bound"
    plan = summary_8b["cumulative"]["prefill"]
    assert plan["paced_by"] == "host" and "regime" not in plan
    page = render_report(summary_8b, None)
    card = re.search(r'<div class="card"><h3>prefill</h3>.*?</p></div>', page, re.S).group(0)
    assert "gpu-bound (measured): the GPU is busy 68% of each prefill step" in card
    assert "Paced by the host in the step model (24.1 ms of host work, 16.4 ms of GPU work per step)" in card
    assert "kernel time sets the pace" not in card  # the measured regime no longer claims the pace
    assert "paced-host" in card and "regime (measured)" in card and "paced by (step model)" in card
    assert 'id="fig-waterfall-prefill"' in page
    title = waterfall_figure("prefill", plan).layout.title.text
    assert title == "prefill: wall time per step, cumulative (% of the unfused step) — paced by the host in the step " \
                    "model"  # fmt: skip
    with cli.out.capture() as captured:
        cli.print_summary(summary_8b)
    text = captured.get()
    assert "regime (measured)" in text and "paced by (model)" in text
    prefill_row = next(line for line in text.splitlines() if line.startswith("│ prefill"))
    assert re.search(r"│ gpu-bound\s+│ host\s+│", prefill_row), prefill_row
    assert "prefill: all accepted fusions 1.659× wall, 1.494× GPU; then a CUDA graph would remove 24% of the " \
           "fused step (paced by the host in the step model)" in text  # fmt: skip


# --- 4. CPU runs: the waterfall of wall speedups; 6. piped tables whole ------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("fixes") / "tiny"
    result = runner.invoke(app, ["profile", "--out", str(out), "--prompt-len", "8", "--decode-steps", "2"])
    assert result.exit_code == 0, result.output
    return out, result


def test_cpu_runs_get_the_cumulative_wall_waterfall(cpu_run: tuple[Path, Any]) -> None:
    out, _result = cpu_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["cumulative"]) == {"prefill", "decode"}
    for phase, plan in summary["cumulative"].items():
        wall = 1e3 * summary["phases"][phase]["wall_ms_per_step"]
        accepted = [o for o in summary["opportunities"] if o["phase"] == phase and o["confidence"] != "low"]
        assert [w["fusion"] for w in plan["waterfall"]] == [o["fusion"] for o in accepted] != []
        assert all(w["speedup_gpu"] is None for w in plan["waterfall"])
        saved = sum(o["saved_us"] for o in accepted)
        assert plan["waterfall"][-1]["speedup_wall"] == pytest.approx(wall / (wall - saved))
        walls = [w["speedup_wall"] for w in plan["waterfall"]]
        assert walls == sorted(walls) and walls[0] > 1
        assert plan["paced_by"] is None and plan["cuda_graph_share"] is None
    page = (out / "report.html").read_text()
    assert 'id="fig-waterfall-decode"' in page and 'id="fig-waterfall-prefill"' in page
    assert "CPU run: the ops are the timeline" in page


SUMMARY_HEADERS = ("phase", "ms/step", "unprof.", "GPU busy", "kernels", "µs/kern", "regime (measured)",
                   "paced by (model)", "top kernel (share)")  # fmt: skip
OPPORTUNITY_HEADERS = ("fusion", "phase", "count", "µs now", "µs fused", "micro now→fused", "launches", "GPU ×",
                       "wall ×", "confidence")  # fmt: skip


def test_piped_tables_keep_names_and_numbers_whole(cpu_run: tuple[Path, Any]) -> None:
    """CliRunner's stdout is not a terminal, like a file or a CI log: rich cut these tables to 80 columns."""
    out, result = cpu_run
    assert "…" not in result.output
    header_lines = [line for line in result.stdout.splitlines() if line.startswith("┃")]
    headers = {cell.strip() for line in header_lines for cell in line.strip("┃").split("┃")}
    assert set(SUMMARY_HEADERS) | set(OPPORTUNITY_HEADERS) <= headers
    summary = json.loads((out / "summary.json").read_text())
    for opp in summary["opportunities"]:
        assert re.search(rf"│ {opp['fusion']}\s+│ {opp['phase']}\s+│", result.stdout), opp["fusion"]
    top = summary["phases"]["decode"]["top_kernels"][0]["name"]
    assert f"{top} (" in result.stdout


# --- 5. an --out that cannot be made ------------------------------------------------------------------------------


def _refused(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    err = result.stderr.strip()
    assert err.startswith("fusionscope: error: cannot write to /proc") and len(err.splitlines()) == 1, err
    assert "Traceback" not in result.output
    return err


@pytest.mark.parametrize("out", ["/proc/fusionscope-nowhere/run", "/proc/fusionscope-run"])
def test_profile_refuses_an_out_that_cannot_be_made(out: str) -> None:
    _refused(["profile", "--out", out, "--prompt-len", "4", "--decode-steps", "1"])
    assert not Path(out).exists()


def test_apply_refuses_an_out_that_cannot_be_made() -> None:
    _refused(["apply", "--out", "/proc/fusionscope-nowhere/run", "--prompt-len", "4", "--decode-steps", "1"])


def test_bench_refuses_an_out_that_cannot_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench checks its folder before timing anything; with a GPU pretended, the folder is what refuses."""
    import fusionscope.bench

    def no_bench(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("bench ran although its --out cannot be made")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fusionscope.bench, "run_bench", no_bench)
    _refused(["bench", "--quick", "--out", "/proc/fusionscope-nowhere/bench"])


def test_staged_dir_turns_an_unmakeable_parent_into_a_usage_error() -> None:
    """The parent can vanish between the check and the run: staging says so in one line too."""
    from fusionscope.errors import UsageError
    from fusionscope.run import staged_dir

    with (
        pytest.raises(UsageError, match="cannot write to /proc/fusionscope-nowhere"),
        staged_dir(Path("/proc/fusionscope-nowhere/run")),
    ):
        pass


# --- 8. a residual add of the model's input -----------------------------------------------------------------------

FACTORY = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    """Hugging Face's unfused RMSNorm, written by hand."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


def norm(kind: str, hidden: int) -> nn.Module:
    return RMSNorm(hidden) if kind == "rms" else nn.LayerNorm(hidden)


class Block(nn.Module):
    """Pre-norm residual block: the first one in the stack adds the model's input itself."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(kind, hidden), norm(kind, hidden)
        self.mix = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        h = x + self.mix(self.norm1(x))
        return h + self.proj(self.norm2(h))


class BiasHead(nn.Module):
    """A GEMM, a bias add (a parameter), a shift (a buffer), each read by a norm: neither add is a residual."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden, bias=False)
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.register_buffer("shift", torch.ones(hidden))
        self.norm, self.norm_shift = norm(kind, hidden), norm(kind, hidden)

    def forward(self, x):
        return self.norm(self.lin(x) + self.bias) + self.norm_shift(self.lin(x) + self.shift)


def make(kind: str = "KIND"):
    torch.manual_seed(0)
    return nn.Sequential(Block(kind, 32), Block(kind, 32), BiasHead(kind, 32)), (torch.randn(1, 5, 32),)
'''


def record_factory(kind: str, tmp_path: Path) -> Graph:
    path = tmp_path / f"stack_{kind}.py"
    path.write_text(textwrap.dedent(FACTORY).replace('"KIND"', f'"{kind}"'))
    workload = models.build_workload(models.resolve_model(f"{path}:make"), torch.device("cpu"), torch.float32)
    return Graph(dataflow.record_dataflow(workload))


def anchors(graph: Graph) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for match in find_matches(graph):
        found.setdefault(match.fusion, set()).add(match.anchor_module)
    return found


def test_the_first_blocks_residual_add_of_the_input_feeds_add_rms_norm(tmp_path: Path) -> None:
    """0.norm2 reads `x + mix(...)`, x the model's input: add + RMSNorm, like the norms after the later residual
    adds. 0.norm1 reads the input itself (plain rms_norm); the bias and buffer adds stay plain norms."""
    found = anchors(record_factory("rms", tmp_path))
    assert found["add_rms_norm"] == {"0.norm2", "1.norm1", "1.norm2"}
    assert found["rms_norm"] == {"0.norm1", "2.norm", "2.norm_shift"}


def test_the_first_blocks_residual_add_of_the_input_feeds_add_layer_norm(tmp_path: Path) -> None:
    found = anchors(record_factory("layer", tmp_path))
    assert found["add_layer_norm"] == {"0.norm2", "1.norm1", "1.norm2"}  # not 2.norm / 2.norm_shift: bias adds


def test_dataflow_tells_parameters_and_buffers_from_model_inputs(tmp_path: Path) -> None:
    graph = record_factory("layer", tmp_path)
    nodes = graph.nodes
    adds = nodes[(nodes["name"] == "aten::add") & (nodes["module"].isin(["0", "2"]))]
    kinds = {(module, tuple(p < 0 for p in ins), params) for module, ins, params in
             zip(adds["module"], adds["inputs"], adds["input_params"])}  # fmt: skip
    assert ("0", (True, False), (False, False)) in kinds  # x + mix(...): the leaf is the model input
    assert ("2", (False, True), (False, True)) in kinds  # lin(x) + bias / + shift: the leaf is a parameter or buffer
    t = nodes[nodes["name"] == "aten::t"]
    assert all(params == (True,) for params in t["input_params"])  # every weight, read through aten::t
