"""`fusionscope analyze`: a trace captured elsewhere, analysed on the CPU without re-running anything.

Fixtures: the two H200 traces fusionscope itself wrote (tests/data/, see test_trace.py), versions of the small one
with fusionscope's phase, module and step ranges stripped (what another program's trace looks like), and the CPU
traces `tests/data/make_trace_fixtures.py` writes with plain torch.profiler (tests/data/traces/)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fusionscope import analysis, datasheets, trace
from fusionscope.analyze import (
    MISSING_DATAFLOW,
    MISSING_MODULES,
    MISSING_PHASES,
    MISSING_SHAPES,
    MISSING_STEPS,
    MISSING_UNPROFILED_GPU,
    analyze,
    classify,
    kernel_table,
    resolve_roofs,
)
from fusionscope.cli import app
from fusionscope.device import ROOFS_VERSION, DeviceCeilings

DATA = Path(__file__).resolve().parent / "data"
GPU_TRACES = {  # file, decode steps (3 prefill steps each)
    "tiny-llama-cuda": (DATA / "tiny-llama-cuda.trace.json.gz", 4),
    "llama-3.2-1b-cuda": (DATA / "llama-3.2-1b-cuda.trace.json.gz", 2),
}
CPU_STEPS = DATA / "traces" / "cpu-steps.trace.json.gz"
CPU_PLAIN = DATA / "traces" / "cpu-plain.trace.json"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
runner = CliRunner()


def events_of(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def write_trace(path: Path, events: list[dict], source: Path) -> Path:
    """`source`'s trace with `events` in place of its own."""
    with gzip.open(source, "rt") as f:
        doc = json.load(f)
    doc["traceEvents"] = events
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def assert_same(got: object, want: object, where: str = "") -> None:
    """Nested dicts/lists equal, floats to 1e-9 relative (summary.json went through JSON)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and isinstance(got, float | int):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (where, got, want)
    else:
        assert got == want, (where, got, want)


def profile_path_phases(path: Path, roofs: dict | None) -> dict:
    """What `profile_stages` computes from the same trace: the figures analyze must agree with."""
    timeline = trace.load_timeline(path)
    kernels = analysis.kernel_table(timeline)
    kernels = analysis.classify(kernels, roofs["copy_gbps"], {k: v for k, v in roofs["tflops"].items() if v})
    ops_per_step = timeline.ops.groupby("phase").size() / timeline.steps.groupby("phase").size()
    return analysis.summarize_phases(kernels, timeline.steps, {}, timeline.device_kind,
                                     {str(k): float(v) for k, v in ops_per_step.dropna().items()})  # fmt: skip


@pytest.fixture(scope="module", params=list(GPU_TRACES))
def gpu_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    with pytest.MonkeyPatch.context() as mp:  # the module-scoped run must not read the user's roofs cache either
        mp.setenv("FUSIONSCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("empty-cache")))
        run = analyze(GPU_TRACES[request.param][0], out=tmp_path_factory.mktemp("runs") / request.param)
    return request.param, run


def test_gpu_trace_run_folder(gpu_run: tuple) -> None:
    name, run = gpu_run
    files = {p.name for p in run.out_dir.iterdir()}
    assert files == {"kernels.csv", "ops.csv", "opportunities.csv", "summary.json", "report.html", "trace.json.gz"}
    assert (run.out_dir / "trace.json.gz").read_bytes() == GPU_TRACES[name][0].read_bytes()
    assert json.loads((run.out_dir / "summary.json").read_text())["phases"] == json.loads(
        json.dumps(run.summary["phases"])
    )
    assert len(pd.read_csv(run.out_dir / "kernels.csv")) == len(run.kernels)
    assert run.summary["model"] == {"source": "trace", "name": name, "dtype": "bfloat16"}
    assert run.summary["device"] == {"kind": "cuda", "name": "NVIDIA H200"}
    assert "NVIDIA H200" in run.report_path.read_text(encoding="utf-8")


def test_gpu_trace_kernels_phases_and_classes(gpu_run: tuple) -> None:
    name, run = gpu_run
    path, decode_steps = GPU_TRACES[name]
    raw = [e for e in events_of(path) if e.get("cat") in GPU_CATS]
    k = run.kernels
    assert len(k) == len(raw)
    assert set(k["phase"]) == {"prefill", "decode"}
    phases = run.summary["phases"]
    assert list(phases) == ["prefill", "decode"]
    assert (phases["prefill"]["steps"], phases["decode"]["steps"]) == (3, decode_steps)
    assert set(k["bound"]) <= {"memory", "latency", "compute", "unmodeled"}
    assert ((k["bound"] == "latency") >= (k["dur_us"] < 10)).all()  # every kernel under 10 µs is latency
    if name == "llama-3.2-1b-cuda":  # 1B's projection GEMMs stream weights: memory-bound against the sheet too
        gemm = k[(k["category"] == "gemm") & (k["phase"] == "decode")]
        assert (gemm["bound"] == "memory").sum() >= 16 * 6


def test_gpu_trace_figures_agree_with_the_profile_path(gpu_run: tuple) -> None:
    name, run = gpu_run
    roofs = run.summary["roofs"]
    assert roofs["source"] == "datasheet" and roofs["copy_gbps"] == 4800.0 and roofs["tflops"]["bfloat16"] == 989.0
    assert_same(json.loads(json.dumps(run.summary["phases"])), profile_path_phases(GPU_TRACES[name][0], roofs))
    assert run.summary["cost_coverage"] > 0.9


def test_gpu_trace_missing_and_order_based_opportunities(gpu_run: tuple) -> None:
    _name, run = gpu_run
    s = run.summary
    assert s["missing"][:2] == [MISSING_UNPROFILED_GPU, MISSING_DATAFLOW]
    assert not {MISSING_SHAPES, MISSING_STEPS, MISSING_PHASES, MISSING_MODULES} & set(s["missing"])
    assert any(line.startswith("measured roofs of NVIDIA H200") for line in s["missing"])
    assert set(s["cumulative"]) == {"prefill", "decode"} and s["dataflow"]["basis"] == "op order"
    assert {o["basis"] for o in s["opportunities"]} == {"op order"}  # counts: tests/test_analyze_catalogue.py
    assert all(plan["waterfall"] for plan in s["cumulative"].values())
    assert all(ph["wall_ms_per_step_unprofiled"] is None and ph["regime"] for ph in s["phases"].values())
    html = (run.out_dir / "report.html").read_text()
    assert "not in the trace" in html and "tensor identities" in html  # the report says what the analysis lacks
    # the trace's fused kernels are recognised: HF's default sdpa attention runs as cuDNN's fused SDPA kernel, and
    # the unfused norms are offered as opportunities: missing
    status = {(row["fusion"], row["phase"]): row["status"] for row in s["fused_kernels"]["catalogue"]}
    assert status[("flash_attention", "decode")] == "active" and status[("rms_norm", "decode")] == "missing"


def foreign_events(path: Path, keep_steps: bool) -> list[dict]:
    """The trace as another program's: no fusionscope phase or module ranges (and, unless kept, no step markers)."""
    drop = ("fusionscope.phase:", "nn.Module: ") + (() if keep_steps else ("ProfilerStep#",))
    return [e for e in events_of(path) if not str(e.get("name", "")).startswith(drop)]


@pytest.mark.parametrize("keep_steps", [True, False], ids=["steps", "no-steps"])
def test_foreign_gpu_trace_is_one_phase(tmp_path: Path, keep_steps: bool) -> None:
    source = GPU_TRACES["tiny-llama-cuda"][0]
    path = write_trace(tmp_path / "worker0.pt.trace.json.gz", foreign_events(source, keep_steps), source)
    run = analyze(path, out=tmp_path / "run")
    s = run.summary
    assert s["model"]["name"] == "worker0" and list(s["phases"]) == ["trace"]
    assert s["phases"]["trace"]["steps"] == (7 if keep_steps else 1)
    assert MISSING_PHASES in s["missing"] and MISSING_MODULES in s["missing"]
    assert (MISSING_STEPS in s["missing"]) is not keep_steps
    k = run.kernels
    assert len(k) == sum(e.get("cat") in GPU_CATS for e in events_of(source))
    assert (k["module"] == "").all() and set(k["phase"]) == {"trace"}
    if not keep_steps:  # one step from the first event to the last
        timeline = trace.load_timeline(path)
        end = max((timeline.ops["ts_us"] + timeline.ops["dur_us"]).max(),
                  (timeline.kernels["ts_us"] + timeline.kernels["dur_us"]).max())  # fmt: skip
        assert s["phases"]["trace"]["wall_ms_per_step"] == pytest.approx(end / 1e3)


def test_cpu_trace_with_steps_and_shapes(tmp_path: Path) -> None:
    run = analyze(CPU_STEPS, out=tmp_path / "run")
    s = run.summary
    assert s["device"] == {"kind": "cpu", "name": None} and s["roofs"] is None
    assert s["model"] == {"source": "trace", "name": "cpu-steps", "dtype": "float32"}
    ph = s["phases"]["trace"]
    assert list(s["phases"]) == ["trace"] and ph["steps"] == 3
    assert ph["gpu_busy_ms_per_step"] is None and ph["regime"] is None
    cpu_ops = [e for e in events_of(CPU_STEPS) if e.get("cat") == "cpu_op"]
    assert len(run.kernels) == len(cpu_ops) and set(run.kernels["step"]) == {1, 2, 3}
    assert ph["ops_per_step"] == len(cpu_ops) / 3
    assert MISSING_PHASES in s["missing"] and MISSING_STEPS not in s["missing"] and MISSING_SHAPES not in s["missing"]
    assert any("does not name its CPU" in line for line in s["missing"])
    assert s["cost_coverage"] > 0.5  # addmm, layer norm, silu have a cost model from their recorded shapes
    assert set(run.kernels["bound"]) <= {"latency", "unmodeled"}  # no roofs: only the 10 µs rule is known
    assert ((run.kernels["bound"] == "latency") == (run.kernels["dur_us"] < 10)).all()
    assert s["cumulative"]["trace"]["waterfall"] == [] and s["cumulative"]["trace"]["step_model"] is None


def test_cpu_trace_without_steps_or_shapes(tmp_path: Path) -> None:
    run = analyze(CPU_PLAIN, out=tmp_path / "run")
    s = run.summary
    ph = s["phases"]["trace"]
    assert ph["steps"] == 1 and set(run.kernels["step"]) == {0}
    ops = trace.load_timeline(CPU_PLAIN).ops  # kernels.csv times CPU ops by self time; the step spans whole ops
    span_ms = ((ops["ts_us"] + ops["dur_us"]).max() - ops["ts_us"].min()) / 1e3
    assert ph["wall_ms_per_step"] == pytest.approx(span_ms)
    assert {MISSING_STEPS, MISSING_PHASES, MISSING_SHAPES, MISSING_MODULES} <= set(s["missing"])
    assert s["model"]["dtype"] is None
    k = run.kernels  # without shapes only views (0 bytes by name) have a cost; the ops that do work have none
    assert (k["bytes"].fillna(0) == 0).all() and s["cost_coverage"] < 0.01
    addmm = k[k["op"] == "aten::addmm"]
    assert len(addmm) == 4 and addmm["bytes"].isna().all() and set(addmm["category"]) == {"other"}
    with gzip.open(run.out_dir / "trace.json.gz", "rt") as f:  # the plain .json is kept gzipped
        assert json.load(f) == json.loads(CPU_PLAIN.read_text())


def test_cpu_trace_against_this_machines_roofs(tmp_path: Path) -> None:
    result = runner.invoke(app, ["analyze", str(CPU_STEPS), "--device", "cpu", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "not in the trace:" in result.stdout and "report:" in result.stdout
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["roofs"]["kind"] == "cpu" and s["roofs"]["copy_gbps"] > 0
    assert not any("roofs" in line for line in s["missing"])
    written = pd.read_csv(tmp_path / "run" / "kernels.csv")
    direct = classify(kernel_table(trace.load_timeline(CPU_STEPS)), s["roofs"])  # the same rule on the same roofs
    assert list(written["bound"]) == list(direct["bound"])
    modeled_long = direct["bytes"].notna() & (direct["dur_us"] >= 10)
    assert modeled_long.any() and not (direct.loc[modeled_long, "bound"] == "unmodeled").any()


def _cache_entry(folder: Path, name: str, copy_gbps: float, measured_at: str) -> None:
    roofs = DeviceCeilings(kind="cuda", name=name, copy_gbps=copy_gbps, read_heavy_gbps=copy_gbps,
                           tflops={"bfloat16": 700.0, "float16": 690.0, "float32": 50.0, "tf32": 400.0},
                           launch_us=17.0, aten_op_host_us=6.4, measured_at=measured_at)  # fmt: skip
    (folder / "roofs").mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{measured_at}_v{ROOFS_VERSION}".replace(" ", "_").replace(":", "_")
    (folder / "roofs" / f"{stem}.json").write_text(json.dumps(roofs.to_json()))


def test_roofs_cached_measured_before_datasheet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSIONSCOPE_CACHE_DIR", str(tmp_path))
    _cache_entry(tmp_path, "NVIDIA H200", 4200.0, "2026-11-29T09:00:00+00:00")
    _cache_entry(tmp_path, "NVIDIA H200", 4250.0, "2026-12-01T09:00:00+00:00")
    (tmp_path / "roofs" / "damaged_v1.json").write_text("{")
    roofs, missing = resolve_roofs("NVIDIA H200", "cuda", None)
    assert roofs["source"] == "cache" and roofs["copy_gbps"] == 4250.0 and missing == []  # the newest entry
    assert roofs["datasheet"]["gbps"] == 4800.0
    roofs, missing = resolve_roofs("NVIDIA H200", "cuda", "NVIDIA H100 PCIe")  # --device overrides the trace
    assert roofs["source"] == "datasheet" and roofs["copy_gbps"] == 2000.0 and roofs["name"] == "NVIDIA H100 PCIe"
    assert missing and missing[0].startswith("measured roofs of NVIDIA H100 PCIe")
    assert resolve_roofs("NVIDIA H200", "cpu", None)[0] is None  # a CPU trace never takes a GPU's roofs


def test_device_option_picks_the_roofs_not_the_device(tmp_path: Path) -> None:
    path = GPU_TRACES["tiny-llama-cuda"][0]
    result = runner.invoke(app, ["analyze", str(path), "--device", "NVIDIA H100 PCIe", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["device"]["name"] == "NVIDIA H200"  # where the trace ran; the roofs are those of the GPU named
    assert (s["roofs"]["name"], s["roofs"]["source"], s["roofs"]["copy_gbps"]) == (
        "NVIDIA H100 PCIe",
        "datasheet",
        2000.0,
    )


def test_roofs_unknown_gpu_leaves_latency_and_unmodeled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSIONSCOPE_CACHE_DIR", str(tmp_path))
    roofs, missing = resolve_roofs("NVIDIA H200", "cuda", "Acme GPU 9000")
    assert roofs is None and "Acme GPU 9000" in missing[0] and "unmodeled" in missing[0]
    assert resolve_roofs(None, "cuda", None)[1][0].startswith("device roofs: the trace names no GPU")
    timeline = trace.load_timeline(GPU_TRACES["tiny-llama-cuda"][0])
    k = classify(kernel_table(timeline), None)
    assert ((k["bound"] == "latency") == (k["dur_us"] < 10)).all()
    assert (k.loc[k["dur_us"] >= 10, "bound"] == "unmodeled").all() and k["achieved_frac"].isna().all()
    assert k["achieved_gbps"].notna().any()  # what the trace alone gives stays


def test_datasheets_cover_the_named_gpus() -> None:
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-40GB",
             "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S", "AMD Instinct MI300X"]  # fmt: skip
    for name in names:
        sheet = datasheets.lookup(name)
        assert sheet is not None and sheet["source"] == "datasheet", name
        tf = sheet["tflops"]
        assert tf["bfloat16"] == tf["float16"] > tf["tf32"] > tf["float32"] > 0 and sheet["gbps"] > 500, name
    assert datasheets.lookup("nvidia a100-sxm4-80gb")["gbps"] == 2039.0
    assert datasheets.lookup("NVIDIA H200 NVL") is None and datasheets.lookup(None) is None
    sheet = datasheets.lookup("NVIDIA H200")
    sheet["tflops"]["bfloat16"] = 0.0  # a caller's edit never reaches the table
    assert datasheets.lookup("NVIDIA H200")["tflops"]["bfloat16"] == 989.0


def _bad(args: list[str], message: str, tmp_path: Path) -> None:
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, ["analyze", *args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("fusionscope: error:") and message in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in result.output
    assert set(tmp_path.rglob("*")) == before  # no run folder, no staging folder left behind


def test_bad_missing_path(tmp_path: Path) -> None:
    _bad([str(tmp_path / "absent.json")], "trace not found", tmp_path)


def test_bad_truncated_gzip(tmp_path: Path) -> None:
    data = GPU_TRACES["tiny-llama-cuda"][0].read_bytes()
    (tmp_path / "cut.json.gz").write_bytes(data[: len(data) // 2])
    _bad([str(tmp_path / "cut.json.gz")], "truncated or damaged gzip", tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("notes.json", b"this is not json", "is not JSON"),
        ("binary.json", np.arange(64, dtype=np.uint8).tobytes() + b"\xff\xfe", "is not JSON"),
        ("config.json", b'{"hidden_size": 64}', "not a torch.profiler trace (no traceEvents)"),
        ("list.json", b"[1, 2]", "not a torch.profiler trace (no traceEvents)"),
        ("empty.json", b'{"traceEvents": []}', "an empty trace"),
        ("meta.json", b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "an empty trace"),
        ("trace.txt", b'{"traceEvents": []}', "not a .json or .json.gz trace file"),
    ],
)
def test_bad_content(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    _bad([str(tmp_path / name)], message, tmp_path)


def test_bad_cpu_roofs_for_a_gpu_trace(tmp_path: Path) -> None:
    _bad([str(GPU_TRACES["tiny-llama-cuda"][0]), "--device", "cpu"], "ran kernels on a GPU", tmp_path)


def test_bad_existing_out(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    _bad([str(CPU_PLAIN)], "already exists", tmp_path)
