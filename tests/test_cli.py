"""The CLI through typer's CliRunner: the pipeline end to end on CPU, and every bad input as one line + exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fusionscope.cli import app

REPO = Path(__file__).resolve().parents[1]
FACTORY = f"{REPO / 'examples' / 'custom_factory.py'}:make_mlp"
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "tiny"
    result = runner.invoke(app, ["profile", "--out", str(out), "--prompt-len", "32", "--decode-steps", "4"])
    assert result.exit_code == 0, result.output
    return out


def test_profile_writes_a_complete_run_folder(tiny_run: Path) -> None:
    assert sorted(p.name for p in tiny_run.iterdir()) == [
        "kernels.csv",
        "opportunities.csv",
        "ops.csv",
        "report.html",
        "summary.json",
        "trace.json.gz",
    ]
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["model"]["name"] == "tiny-llama" and summary["device"]["kind"] == "cpu"
    assert set(summary["phases"]) == {"prefill", "decode"}
    decode = summary["phases"]["decode"]
    assert decode["steps"] == 4 and decode["wall_ms_per_step"] > 0 and decode["wall_ms_per_step_unprofiled"] > 0
    assert decode["gpu_busy_ms_per_step"] is None and decode["regime"] is None  # GPU fields are null on CPU runs
    assert decode["time_by_category_us"]["gemm"] > 0
    assert sum(decode["time_by_class_us"].values()) > 0
    assert summary["cost_coverage"] >= 0.95
    for key in ("copy_gbps", "read_heavy_gbps", "tflops", "aten_op_host_us"):
        assert summary["roofs"][key]
    assert not list(tiny_run.parent.glob(".*partial"))  # no staging folder left behind


def test_kernel_rows_carry_module_paths(tiny_run: Path) -> None:
    kernels = pd.read_csv(tiny_run / "kernels.csv", keep_default_na=False)
    mm = kernels[(kernels["op"] == "aten::mm") & (kernels["phase"] == "decode")]
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(mm["module"])
    assert set(kernels["bound"]) <= {"compute", "memory", "latency", "unmodeled"}


def test_profile_shows_the_decode_floor_in_the_terminal_and_the_report(tiny_run: Path) -> None:
    """The weight-streaming floor of the decode phase beside its unprofiled step, so a user sees how far eager decode
    is from the least a step can take before applying anything."""
    summary = json.loads((tiny_run / "summary.json").read_text())
    floor = summary["phases"]["decode"]["weight_floor"]
    assert floor["ms"] > 0 and "weight_floor" not in summary["phases"]["prefill"]
    result = runner.invoke(app, ["report", str(tiny_run)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "weight-streaming floor" in x)
    assert line.startswith("decode:") and f"{floor['ms']:.2f} ms/step" in line
    step = summary["phases"]["decode"]["wall_ms_per_step_unprofiled"]
    assert f"{step / floor['ms']:.2f}× the floor" in line
    assert "weight-streaming floor</dt>" in (tiny_run / "report.html").read_text()


def test_report_rerenders_from_saved_data(tiny_run: Path) -> None:
    html = tiny_run / "report.html"
    html.write_text("<html>an earlier rendering</html>")
    result = runner.invoke(app, ["report", str(tiny_run)])
    assert result.exit_code == 0, result.output
    text = html.read_text()
    assert "an earlier rendering" not in text and "Plotly.newPlot" in text


def test_factory_model_is_profiled_as_forward(tmp_path: Path) -> None:
    out = tmp_path / "factory"
    result = runner.invoke(app, ["profile", FACTORY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["phases"]) == ["forward"]
    kernels = pd.read_csv(out / "kernels.csv", keep_default_na=False)
    assert "0.down_proj" in set(kernels["module"])


def _bad(args: list[str], message: str, tmp_path: Path) -> None:
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("fusionscope: error:") and message in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in result.output
    assert set(tmp_path.rglob("*")) == before  # no run folder, no staging folder left behind


def test_unknown_model(tmp_path: Path) -> None:
    _bad(["profile", "llama-99b", "--out", str(tmp_path / "r")], "unknown model 'llama-99b'", tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    _bad(["profile", str(tmp_path / "absent"), "--out", str(tmp_path / "r")], "not found", tmp_path)


def test_malformed_config(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{oops")
    _bad(["profile", str(folder), "--out", str(tmp_path / "r")], "malformed", tmp_path)


def test_factory_that_raises(tmp_path: Path) -> None:
    f = tmp_path / "boom.py"
    f.write_text("def make():\n    raise ValueError('no weights here')\n")
    _bad(["profile", f"{f}:make", "--out", str(tmp_path / "r")], "raised ValueError: no weights here", tmp_path)


def test_cuda_without_gpu(tmp_path: Path) -> None:
    assert not torch.cuda.is_available(), "this test describes the CPU-only CI machine"
    _bad(["profile", "--device", "cuda", "--out", str(tmp_path / "r")], "no usable CUDA GPU", tmp_path)


def test_model_too_large(tmp_path: Path) -> None:
    _bad(
        ["profile", "llama-3.1-8b", "--dtype", "fp32", "--device", "cpu", "--out", str(tmp_path / "r")],
        "needs about",
        tmp_path,
    )


def test_existing_out(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    _bad(["profile", "--out", str(tmp_path / "r")], "already exists", tmp_path)


def test_unwritable_out(tmp_path: Path) -> None:
    """A path under a regular file can never be created, root or not."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    _bad(["profile", "--out", str(blocker / "r")], "cannot write", tmp_path)


def test_report_of_a_non_run_folder(tmp_path: Path) -> None:
    _bad(["report", str(tmp_path)], "not a fusionscope run folder", tmp_path)


def test_python_api_returns_the_run(tmp_path: Path) -> None:
    import fusionscope

    run = fusionscope.profile(FACTORY, out=tmp_path / "api")
    assert run.report_path.is_file() and list(run.summary["phases"]) == ["forward"]


def test_catalog_lists_the_registry() -> None:
    from fusionscope.fusions import fusions

    result = runner.invoke(app, ["catalog"])
    assert result.exit_code == 0, result.output
    for fusion in fusions():
        assert fusion.KEY in result.stdout


def test_profile_reports_fusion_opportunities(tiny_run: Path) -> None:
    """tiny-llama has 2 layers: per step 4 add_rms_norm, 1 rms_norm, 2 silu_and_mul, in both phases."""
    summary = json.loads((tiny_run / "summary.json").read_text())
    counts = {(o["fusion"], o["phase"]): o["count"] for o in summary["opportunities"]}
    for phase in ("prefill", "decode"):
        assert counts[("add_rms_norm", phase)] == 4
        assert counts[("rms_norm", phase)] == 1
        assert counts[("silu_and_mul", phase)] == 2
    for opp in summary["opportunities"]:
        if opp["fusion"] == "decode_attention":
            # under eager's DynamicCache its group is the one SDPA call (GQA native, no mask): the same bytes and one
            # op on a CPU; what it removes shows on a GPU (the backend's kernels) and under a static cache (--graphs)
            assert opp["bytes_fused"] <= 1.001 * opp["bytes_now"] and opp["launches_fused"] <= opp["launches_now"]
        elif opp["fusion"] == "gemv":
            # one GEMM for one GEMM: the same bytes (the split-K sums it saves are a GPU's cuBLAS kernels), one launch
            assert opp["bytes_fused"] <= opp["bytes_now"] and opp["launches_fused"] <= opp["launches_now"]
        else:
            assert opp["bytes_fused"] < opp["bytes_now"] and opp["launches_fused"] < opp["launches_now"]
        assert opp["speedup_gpu"] is None and opp["speedup_wall"] >= 1  # CPU run: no GPU figures; never a loss
        if opp["fusion"] in ("add_rms_norm", "rms_norm", "rope"):  # elementwise: bytes saved on any CPU; a GEMM's
            assert opp["speedup_wall"] > 1  # fused time comes from the CPU's measured matmul roof, which load lowers
    assert summary["dataflow"]["join_rate"] >= 0.95
    table = pd.read_csv(tiny_run / "opportunities.csv")
    assert len(table) == len(summary["opportunities"])
    assert 'id="table-opportunities"' in (tiny_run / "report.html").read_text()
