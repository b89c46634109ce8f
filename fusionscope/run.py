"""The Python API the CLI stands on: `profile()` runs capture → analysis → report and returns a `Run`.

A run folder is written to a temporary sibling and renamed into place at the end, so a failed run leaves nothing
behind and an earlier run is never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from fusionscope.errors import UsageError

SCHEMA_VERSION = 1


@dataclass
class Run:
    """A finished run folder and what it holds."""

    out_dir: Path
    summary: dict
    kernels: pd.DataFrame

    @property
    def report_path(self) -> Path:
        return self.out_dir / "report.html"


def default_out_dir(model_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("reports") / f"{model_name}-{stamp}"
    out, n = base, 2
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out


def check_out_dir(out: Path) -> None:
    """Refuse an existing folder and an unwritable parent before any work is done.

    Permission bits are not enough: root may write anywhere by them, yet no folder can be made under /proc or on a
    read-only mount. So the nearest existing ancestor is tried for real — a folder made in it and removed at once."""
    if out.exists():
        raise UsageError(f"--out {out} already exists; choose a new folder (runs are never overwritten)")
    parent = out.parent if str(out.parent) else Path(".")
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UsageError(f"cannot write to {parent}: choose an --out in a writable folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fusionscope-probe.", dir=probe))
    except OSError as exc:
        raise UsageError(f"cannot write to {parent} ({exc.strerror}): choose an --out in a writable folder") from None


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it to `out` on success, remove it on any failure. A parent that
    cannot be made (it vanished or became unwritable since `check_out_dir`) is a UsageError, not a traceback."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as exc:
        reason = f"cannot write to {out.parent} ({exc.strerror})"
        raise UsageError(f"{reason}: choose an --out in a writable folder") from None
    try:
        yield tmp
        if out.exists():
            raise UsageError(f"{out} appeared while this run was working; its results were not written")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class Settings:
    """A run's workload as the user asked for it (CLI flags / keyword arguments), checked before anything is built."""

    model: str = "tiny-llama"
    batch: int = 1
    prompt_len: int = 128
    decode_steps: int = 16
    dtype: str = "auto"
    device: str = "auto"
    warmup: int = 1
    remeasure: bool = False
    sample: bool = False
    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.9
    nproc: int | None = None  # tensor-parallel ranks (`fusionscope.distributed`); None: one process, no launcher
    cache: str = "dynamic"  # the KV cache decode runs on: "dynamic" or "static" (`fusionscope.static_cache`)

    @property
    def sampling(self) -> tuple[float, int, float] | None:
        return (self.temperature, self.top_k, self.top_p) if self.sample else None


@dataclass
class Profiled:
    """What the profile stages leave for a later stage in the same process (`apply`)."""

    summary: dict
    kernels: pd.DataFrame
    workload: Any  # fusionscope.models.Workload, kept only when asked for
    ceilings: Any  # fusionscope.device.DeviceCeilings


def profile(
    model: str = "tiny-llama",
    *,
    out: str | Path | None = None,
    batch: int = 1,
    prompt_len: int = 128,
    decode_steps: int = 16,
    dtype: str = "auto",
    device: str = "auto",
    warmup: int = 1,
    remeasure: bool = False,
    sample: bool = False,
    temperature: float = 0.7,
    top_k: int = 50,
    top_p: float = 0.9,
    on_stage: Callable[[str], None] | None = None,
    nproc: int | None = None,
    cache: str = "dynamic",
) -> Run:
    """Profile MODEL and write its run folder (trace, tables, summary.json, report.html); return the Run.

    `sample=True` picks each next token as `generate(do_sample=True)` does (temperature → top-k → top-p → draw)
    instead of by argmax. `nproc=N` shards the model over N tensor-parallel ranks (`fusionscope.distributed`).
    `cache="static"` decodes on a transformers StaticCache, as a serving engine and a CUDA graph do."""
    settings = Settings(model, batch, prompt_len, decode_steps, dtype, device, warmup, remeasure, sample, temperature,
                        top_k, top_p, cache=cache)  # fmt: skip
    if nproc is not None:
        from fusionscope.distributed import profile_tp

        return profile_tp(dataclasses.replace(settings, nproc=nproc), out, on_stage)
    t_start = time.perf_counter()
    out_dir, spec, dev, torch_dtype = prepare(settings, out)
    with staged_dir(out_dir) as tmp:
        done = profile_stages(settings, spec, dev, torch_dtype, tmp, on_stage)
        finish_run_folder(tmp, done.summary, done.kernels, t_start, on_stage)
    return Run(out_dir=out_dir, summary=done.summary, kernels=done.kernels)


def prepare(settings: Settings, out: str | Path | None) -> tuple[Path, Any, Any, Any]:
    """Resolve the model, device, dtype and run folder, refusing bad input before any work is done."""
    from fusionscope import models

    spec = models.resolve_model(settings.model)
    dev = models.pick_device(settings.device)
    torch_dtype = models.pick_dtype(settings.dtype, dev)
    out_dir = Path(out) if out is not None else default_out_dir(spec.name)
    check_out_dir(out_dir)
    if settings.warmup < 0:
        raise UsageError("--warmup must be ≥ 0")
    models.check_cache(settings.cache)
    return out_dir, spec, dev, torch_dtype


def profile_stages(settings: Settings, spec: Any, dev: Any, torch_dtype: Any, tmp: Path,
                   on_stage: Callable[[str], None] | None = None, keep_workload: bool = False,
                   build: Callable[..., Any] | None = None) -> Profiled:  # fmt: skip
    """Build, capture, analyse and estimate into the staged folder `tmp` (trace and tables written, summary returned;
    summary.json and the report are written by `finish_run_folder`). `build` stands in for `models.build_workload`
    (same arguments): a tensor-parallel rank builds its shard of the model."""
    from fusionscope import analysis, capture, dataflow, micro, models, opportunities, trace
    from fusionscope.device import get_ceilings, software_versions
    from fusionscope.fusions import Graph, find_matches

    note = on_stage or (lambda _msg: None)
    note(f"building {spec.name} on {dev.type} in {str(torch_dtype).removeprefix('torch.')}")
    workload = (build or models.build_workload)(
        spec,
        dev,
        torch_dtype,
        batch=settings.batch,
        prompt_len=settings.prompt_len,
        decode_steps=settings.decode_steps,
        sampling=settings.sampling,
        cache=settings.cache,
    )
    note("measuring the device's roofs")
    ceilings = get_ceilings(dev, remeasure=settings.remeasure)
    cap = capture.capture(workload, tmp, warmup=settings.warmup, on_stage=note)
    note("recording the dataflow (a separate, untimed pass)")
    nodes = dataflow.record_dataflow(workload)
    model_info = {
        "name": spec.name,
        "source": spec.source,
        "family": workload.family,
        "params": workload.params,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "batch": settings.batch,
        "prompt_len": settings.prompt_len if workload.phases != ("forward",) else None,
        "decode_steps": settings.decode_steps if workload.phases != ("forward",) else None,
        "sampling": dict(zip(("temperature", "top_k", "top_p"), workload.sampling)) if workload.sampling else None,
        "cache": workload.cache if workload.phases != ("forward",) else None,
    }
    floor = None
    if "decode" in workload.phases:
        from fusionscope.floor import weight_floor

        kv_len = settings.prompt_len + settings.decode_steps / 2  # the mean length the decode steps read
        floor = weight_floor(workload.module, settings.batch, kv_len, ceilings.copy_gbps)
    if not keep_workload:
        del workload
        workload = None
    note("loading the trace (HTA) and joining kernels to ops and modules")
    timeline = trace.load_timeline(cap.trace_path)
    note("costing and classifying kernels")
    kernels = analysis.kernel_table(timeline)
    kernels = analysis.classify(kernels, ceilings.copy_gbps, ceilings.peak_tflops())
    ops_per_step = timeline.ops.groupby("phase").size() / timeline.steps.groupby("phase").size()
    note("matching the fusion catalogue on the dataflow and estimating each fusion")
    joined = dataflow.join_dataflow(nodes, timeline.ops)
    graph = Graph(joined)
    matches = find_matches(graph)
    per_match = opportunities.estimate_matches(matches, joined, timeline.ops, kernels, ceilings.to_json())
    summary = {
        "schema": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "model": model_info,
        "device": {"kind": dev.type, "name": ceilings.name},
        "versions": software_versions(),
        "roofs": ceilings.to_json(),
        "cost_coverage": analysis.cost_coverage(kernels),
        "phases": analysis.summarize_phases(
            kernels,
            timeline.steps,
            cap.unprofiled_ms,
            timeline.device_kind,
            {str(k): float(v) for k, v in ops_per_step.dropna().items()},
        ),
    }
    if floor is not None and "decode" in summary["phases"]:
        summary["phases"]["decode"]["weight_floor"] = floor
    summary["dataflow"] = {"nodes": len(joined), "join_rate": dataflow.join_rate(joined)}
    summary["opportunities"], summary["cumulative"] = opportunities.summarize_opportunities(
        per_match, summary["phases"], summary["roofs"]
    )
    for row in summary["opportunities"]:
        row["basis"] = opportunities.DATAFLOW
    if dev.type == "cuda" and summary["opportunities"]:
        note("timing the bundled kernels alone on the shapes found (micro-measured column)")
    micro.micro_measure(summary["opportunities"], graph, matches, dev, torch_dtype)
    note("writing the tables")
    write_tables(tmp, kernels, timeline.ops)
    opportunities.opportunities_table(summary["opportunities"]).to_csv(
        tmp / "opportunities.csv", index=False, float_format="%.6g"
    )
    return Profiled(summary=summary, kernels=kernels, workload=workload, ceilings=ceilings)


def finish_run_folder(tmp: Path, summary: dict, kernels: pd.DataFrame, t_start: float,
                      on_stage: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Write summary.json (with the run's wall time) and report.html into the staged folder."""
    if on_stage:
        on_stage("writing the run folder")
    summary["wall_s"] = round(time.perf_counter() - t_start, 2)
    write_json(tmp / "summary.json", summary)
    (tmp / "report.html").write_text(render_report(summary, kernels), encoding="utf-8")


def command_line() -> str:
    """The command as typed, when running from the CLI (empty from the Python API)."""
    argv0 = Path(sys.argv[0]).name if sys.argv else ""
    return " ".join(["fusionscope", *sys.argv[1:]]) if argv0 in ("fusionscope", "__main__.py") else ""


def write_tables(folder: Path, kernels: pd.DataFrame, ops: pd.DataFrame) -> None:
    kernels.to_csv(folder / "kernels.csv", index=False, float_format="%.6g")
    ops.to_csv(folder / "ops.csv", index=False, float_format="%.6g")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=False, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def render_report(summary: dict, kernels: pd.DataFrame) -> str:
    from fusionscope.report import render_report as render

    return render(summary, kernels)


def load_run(run_dir: str | Path) -> Run:
    """Read a run folder's summary.json and kernels.csv (no trace parsing: that is what makes `report` fast)."""
    folder = Path(run_dir)
    summary_file, kernels_file = folder / "summary.json", folder / "kernels.csv"
    if not folder.is_dir():
        raise UsageError(f"run folder not found: {folder}")
    if not summary_file.is_file() or not kernels_file.is_file():
        raise UsageError(f"{folder} is not a fusionscope run folder (needs summary.json and kernels.csv)")
    try:
        summary = json.loads(summary_file.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"malformed {summary_file}: {exc}") from None
    kernels = pd.read_csv(
        kernels_file, keep_default_na=False, na_values=[""], dtype={"name": str, "op": str, "module": str, "phase": str}
    )
    for col in ("name", "op", "module", "phase"):
        if col in kernels:
            kernels[col] = kernels[col].fillna("")
    return Run(out_dir=folder, summary=summary, kernels=kernels)


def rerender(run_dir: str | Path) -> Path:
    """Re-render `report.html` of a run folder from its saved data, atomically."""
    run = load_run(run_dir)
    html = render_report(run.summary, run.kernels)
    target = run.report_path
    tmp = target.with_name(f".{target.name}.partial")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(target)
    return target
