"""`profile`'s stages: build the workload, measure the roofs, capture the trace, record the dataflow, cost and
classify the kernels, match the catalogue and estimate each fusion, into a staged run folder.

`profile` runs them in one process; `apply` runs them first and keeps the workload; a tensor-parallel rank runs them
on its shard (`build`). So they sit below all three commands, which differ only in what they do around them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from fusionscope.errors import UsageError
from fusionscope.run_folder import SCHEMA_VERSION, check_out_dir, command_line, default_out_dir, write_tables


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
    from fusionscope import analysis, capture, dataflow, micro, models, opportunities, trace_pool
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
    note("loading the trace and joining kernels to ops and modules")
    timeline = trace_pool.load_timeline(Path(cap.trace_path))
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
