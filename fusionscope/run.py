"""The Python API the CLI stands on: `profile()` runs capture → analysis → report and returns a `Run`.

The stages are `pipeline`'s and the run folder's helpers `run_folder`'s; the names below are importable from here
too, as the API has always offered them (`fusionscope.run.load_run`, `Run`, `Settings`, ...).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from fusionscope.pipeline import Profiled, Settings, prepare, profile_stages
from fusionscope.run_folder import (
    SCHEMA_VERSION,
    Run,
    check_out_dir,
    command_line,
    default_out_dir,
    finish_run_folder,
    load_run,
    render_report,
    rerender,
    staged_dir,
    write_json,
    write_tables,
)

__all__ = ["SCHEMA_VERSION", "Profiled", "Run", "Settings", "check_out_dir", "command_line", "default_out_dir",
           "finish_run_folder", "load_run", "prepare", "profile", "profile_stages", "render_report", "rerender",
           "staged_dir", "write_json", "write_tables"]  # fmt: skip


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
        from fusionscope.launch import profile_tp

        return profile_tp(dataclasses.replace(settings, nproc=nproc), out, on_stage)
    t_start = time.perf_counter()
    out_dir, spec, dev, torch_dtype = prepare(settings, out)
    with staged_dir(out_dir) as tmp:
        done = profile_stages(settings, spec, dev, torch_dtype, tmp, on_stage)
        finish_run_folder(tmp, done.summary, done.kernels, t_start, on_stage)
    return Run(out_dir=out_dir, summary=done.summary, kernels=done.kernels)
