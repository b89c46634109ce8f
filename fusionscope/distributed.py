"""`profile --nproc N` and `apply --nproc N`: a model sharded over N ranks with tensor parallelism, one trace per
rank, one run folder.

The CLI process checks what it can before any rank starts, stages the run folder and launches N ranks through
torch.distributed's own launcher, each running this module (`python -m fusionscope.distributed JOB`): that side is
`fusionscope.launch`, below the `profile` and `apply` commands that call it. This module is the ranks' side, above
them, since a rank runs their stages: NCCL on GPUs, gloo on the CPU. Every rank builds its shard of the model, runs
the same workload as `profile` (warm-up, timed, profiled and dataflow passes: every collective needs every rank) and
writes `traces/rank<k>.json.gz`. Rank 0 runs `profile`'s own stages on its rank (its trace is also `trace.json.gz`,
so the folder reads as any run folder) and assembles the rest: every rank's phases and tables (`rank` column) and the
cross-rank figures `analyze` makes for a folder of ranks (step time per rank, straggler, communication against
computation, HTA's idle time), in summary.json's `ranks`, plus `tensor_parallel` (the plan applied and what fusing
the all-reduce into the add + RMSNorm after it would save).

Sharding follows the model's own plan (`model.tp_plan`: the config's `base_model_tp_plan` with the head's entries),
applied with transformers' tensor-parallel styles (`ALL_PARALLEL_STYLES`: DTensor parameters, local matmuls in
inference, an all-reduce after each row-wise projection). transformers shards this way while loading a checkpoint;
a preset has random weights and no checkpoint, so its parameters are made on the meta device, sharded there, and
each rank then materialises only its own shard: each module's parameters are initialised whole (the model's own
`_init_weights`, one module at a time, so a 70B model never exists whole) and cut to the rank's slice, from the same
seed on every rank, so the N shards are the slices of one model. `--nproc 1` shards nothing: its rank builds the
model as a plain `profile` does, which makes it the baseline of the same launch path.

`apply --nproc N` runs the same passes, then apply's on every rank (`follow`): rank 0 finds the fusions and decides
what every rank patches and times (`apply.lockstep.agree`), each rank patches its own shard (a fusion whose
projections are sharded is skipped with that reason), and rank 0's numerics and timings, taken with every rank in
step, are the run's. `--graphs`, `--quantize` and `--from` are refused with N > 1 (`apply.run.check_options`).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd

from fusionscope.errors import UsageError
from fusionscope.launch import (  # noqa: F401 (the launching side's names, importable from here as they were)
    RANK_TRACE,
    SCRATCH,
    check_nproc,
    launch_command,
    launch_tp,
    profile_tp,
    rank_env,
    rank_failure,
    tp_config,
)
from fusionscope.pipeline import Settings
from fusionscope.run_folder import Run

SHARDING_STYLES = re.compile(r"^(colwise|rowwise|embedding_|packed_)")  # styles whose parameters are split
RANK_TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a slow rank (rank 0 measures roofs alone)


# --- in every rank: the sharded model --------------------------------------------------------------------------


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real (rotary frequencies are
    computed at construction and are not parameters): every parameter registered meanwhile is moved to meta as it
    is registered, before the module's own initialisation touches it."""
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            moved = module._parameters[name]
            module._parameters[name] = type(moved)(moved.to("meta"), requires_grad=moved.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def apply_plan(model: Any, mesh: Any) -> dict[str, str]:
    """Shard `model` along its tensor-parallel plan with transformers' styles; returns {module pattern: style}
    applied. A plan entry names modules with `*` for layer numbers (`model.layers.*.mlp.down_proj`)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from fusionscope.analysis import module_pattern

    plan = dict(model.tp_plan)
    applied: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        pattern = module_pattern(name)
        style_name = plan.get(pattern)
        if not name or style_name is None:
            continue
        style = ALL_PARALLEL_STYLES[style_name]
        for pname in [p for p, value in module._parameters.items() if value is not None]:
            style.validate_param(module, pname, mesh, parameter_name=f"{name}.{pname}")
            style.shard_param(module, pname, mesh)
        style.install_forward(module, mesh)
        applied[pattern] = style_name
    if not any(SHARDING_STYLES.match(style) for style in applied.values()):
        raise UsageError(f"the tensor-parallel plan of {type(model).__name__} matched none of its modules")
    return applied


def local_param_count(model: Any) -> int:
    """Elements of the parameters this rank holds (its shards, and whole the replicated ones)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def global_param_count(model: Any) -> int:
    """Elements of the whole model's parameters (a DTensor's shape is the global one)."""
    return sum(p.numel() for p in model.parameters())


def materialize(model: Any, device: Any) -> None:
    """Give every meta parameter real values on `device`: per module, its parameters whole, initialised by the
    model's own `_init_weights`, then cut to this rank's slice (`distribute_tensor` without communication: every rank
    draws the same values from the same seed, in the same module order). Only one module is ever whole."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, distribute_tensor

    for _name, module in model.named_modules():
        meta = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
        if not meta:
            continue
        for n, p in meta.items():
            module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                 requires_grad=False)  # fmt: skip
        with torch.no_grad():
            model._init_weights(module)
        for n, p in meta.items():
            if isinstance(p, DTensor):
                whole = module._parameters[n].data
                shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                module._parameters[n] = nn.Parameter(shard, requires_grad=False)


def build_module(spec: Any, device: Any, dtype: Any, mesh: Any, world: int) -> tuple[Any, dict[str, str], int]:
    """The model of `spec` sharded over `mesh` on `device` (None: whole); returns it, the plan applied and the
    whole model's parameter count. Random weights are materialised shard by shard (`materialize`); real weights are
    loaded on the CPU and cut to the shard as they move to the device."""
    import torch
    from transformers import AutoModelForCausalLM

    from fusionscope import models

    if spec.weights is None:
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(models._hf_config(spec), dtype=dtype)
    else:
        model = models.load_weights(spec, dtype)
    params = global_param_count(model)  # before sharding, while tied weights are still one parameter
    applied = apply_plan(model, mesh) if mesh is not None else {}
    sharing = world if device.type == "cpu" else 1  # ranks on one CPU share its memory; a GPU rank has its own
    models.check_fits(f"{spec.name} ({world} ranks)", local_param_count(model) * sharing, dtype, device)
    materialize(model, device)
    model = model.to(device).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, applied, params


def build_sharded_workload(spec: Any, device: Any, dtype: Any, *, mesh: Any, world: int, applied: dict[str, str],
                           batch: int = 1, prompt_len: int = 64, decode_steps: int = 8,
                           sampling: tuple[float, int, float] | None = None, seed: int = 0,
                           cache: str = "dynamic") -> Any:  # fmt: skip
    """`models.build_workload` for one rank of a sharded model (same checks, same inputs on every rank: the prompt
    ids come from the same seed); `applied` receives the plan applied."""
    import torch

    from fusionscope import models

    if spec.source == "factory":
        raise UsageError(f"{spec.name} is a file.py:factory model, which has no tensor-parallel plan")
    if batch < 1 or prompt_len < 1 or decode_steps < 0:
        raise UsageError("--batch and --prompt-len must be ≥ 1 and --decode-steps ≥ 0")
    if sampling is not None:
        temperature, top_k, top_p = sampling
        if not (temperature > 0 and top_k >= 1 and 0 < top_p <= 1):
            raise UsageError("--temperature must be > 0, --top-k ≥ 1 and --top-p in (0, 1]")
        sampling = (float(temperature), int(top_k), float(top_p))
    torch.manual_seed(seed)
    module, plan, params = build_module(spec, device, dtype, mesh, world)
    applied.update(plan)
    config = module.config
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and prompt_len + decode_steps > max_pos:
        raise UsageError(f"--prompt-len + --decode-steps = {prompt_len + decode_steps} exceeds the model's {max_pos}")
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len), device=device)
    return models.Workload(spec=spec, module=module, device=device, dtype=dtype,
                           phases=("prefill", "decode") if decode_steps else ("prefill",), batch=batch,
                           prompt_len=prompt_len, decode_steps=decode_steps, inputs=(ids,), params=params,
                           family=getattr(config, "model_type", ""), sampling=sampling, cache=cache)  # fmt: skip


def retag_rank(src: Path, dst: Path, rank: int) -> None:
    """Copy a trace `capture` wrote (tagged `"distributedInfo": {"rank": 0}` first, the text HTA's regex reads) to
    `dst` tagged with `rank`; the rest is streamed through unchanged."""
    tag = b'"distributedInfo": {"rank": 0},'
    with gzip.open(src, "rb") as f_in, gzip.open(dst, "wb", compresslevel=3) as f_out:
        head = f_in.read(1 << 16)
        if tag not in head:
            raise RuntimeError(f"{src} does not start with the rank tag capture writes")
        f_out.write(head.replace(tag, b'"distributedInfo": {"rank": %d},' % rank, 1))
        shutil.copyfileobj(f_in, f_out, 1 << 20)


def main(argv: list[str] | None = None) -> None:
    """One rank, as torchrun starts it (`RANK`, `WORLD_SIZE`, `LOCAL_RANK` set): `python -m fusionscope.distributed
    JOB`. A usage error is written for the CLI process to repeat as its one line."""
    job_file = Path((sys.argv[1:] if argv is None else argv)[0])
    job = json.loads(job_file.read_text())
    rank = int(os.environ["RANK"])
    try:
        run_rank(job, rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank)))
    except UsageError as exc:
        (job_file.parent / f"error-rank{rank}.txt").write_text(f"rank {rank}: {exc}", encoding="utf-8")
        sys.exit(2)


def run_rank(job: dict, rank: int, world: int, local_rank: int) -> None:
    """Build this rank's shard, run the workload's passes with every other rank, write its trace; rank 0 also
    analyses and assembles the run folder."""
    import torch
    import torch.distributed as dist

    from fusionscope import models
    from fusionscope.pipeline import profile_stages

    folder = Path(job["folder"])
    scratch = folder / SCRATCH
    settings = Settings(**job["settings"])
    if job["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # NCCL binds this rank's GPU at once (no guessed device for its first barrier); gloo has no device to bind
    bound = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=RANK_TIMEOUT, **bound)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
    applied: dict[str, str] = {}
    if mesh is None:
        build = models.build_workload
    else:

        def build(*args: Any, **kwargs: Any) -> Any:
            return build_sharded_workload(*args, mesh=mesh, world=world, applied=applied, **kwargs)

    spec = models.resolve_model(settings.model)
    dtype = models.pick_dtype(settings.dtype, device)
    progress = scratch / "progress.log"

    def note(line: str) -> None:
        with progress.open("a", encoding="utf-8") as f:
            f.write(f"rank 0: {line}\n")

    options = None
    if job.get("apply") is not None:
        from fusionscope.apply.run import ApplyOptions

        options = ApplyOptions(**job["apply"])
        if device.type == "cpu":
            from fusionscope.apply.run import use_interpreter

            use_interpreter()  # before any kernel is imported (the launcher's environment has it set already)
    try:
        if rank == 0 and options is None:
            done = profile_stages(settings, spec, device, dtype, folder, note, build=build)
        elif rank == 0:
            from fusionscope.apply.run import apply_stages

            summary, kernels = apply_stages(settings, spec, device, dtype, folder, note, options, build=build)
            done = Run(out_dir=folder, summary=summary, kernels=kernels)
        else:
            follow(settings, spec, device, dtype, folder, rank, build, options)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        note("assembling the ranks")
        assemble(folder, job, done, world, backend, applied)


def follow(settings: Settings, spec: Any, device: Any, dtype: Any, folder: Path, rank: int,
           build: Callable[..., Any], options: Any) -> None:  # fmt: skip
    """A rank other than 0: build its shard and run every pass rank 0 runs, in the same order (each forward holds
    collectives): the profile's timed, profiled and dataflow passes, writing its trace and note for rank 0; then,
    with `options`, apply's numerics and timing passes on rank 0's fusions and decisions (`apply.lockstep`), whose
    figures rank 0 keeps for its own."""
    from fusionscope import capture, dataflow

    scratch = folder / SCRATCH
    workload = build(spec, device, dtype, batch=settings.batch, prompt_len=settings.prompt_len,
                     decode_steps=settings.decode_steps, sampling=settings.sampling, cache=settings.cache)  # fmt: skip
    mine = scratch / f"rank{rank}"
    mine.mkdir()
    cap = capture.capture(workload, mine, warmup=settings.warmup)
    dataflow.record_dataflow(workload)  # the other ranks' collectives need this rank in the pass too
    retag_rank(cap.trace_path, folder / RANK_TRACE.format(rank=rank), rank)
    note_file = scratch / f"rank{rank}.json"
    note_file.with_suffix(".partial").write_text(json.dumps({"unprofiled_ms": cap.unprofiled_ms}))
    note_file.with_suffix(".partial").rename(note_file)
    if options is not None:
        from fusionscope.apply.run import run_apply

        run_apply(workload, {}, options.wanted, options.repeats, mine, lambda _line: None, options.graphs,
                  options.graphs_only, options.graphs_together)  # fmt: skip
    shutil.rmtree(mine)


# --- rank 0: the run folder of all ranks -----------------------------------------------------------------------


def wait_for_ranks(scratch: Path, world: int, timeout_s: float = RANK_TIMEOUT.total_seconds()) -> dict[int, dict]:
    """The other ranks' notes (their unprofiled step times), once each has written its trace and note. They finish
    their passes with rank 0's (collectives), so this waits seconds at most; torchrun stops every rank if one fails."""
    deadline = time.monotonic() + timeout_s
    notes: dict[int, dict] = {}
    while len(notes) < world - 1:
        for k in range(1, world):
            path = scratch / f"rank{k}.json"
            if k not in notes and path.exists():
                notes[k] = json.loads(path.read_text())
        if len(notes) < world - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(1, world)) - set(notes))} wrote no trace in time")
            time.sleep(0.2)
    return notes


def rank_tables(path: Path, rank: int, unprofiled_ms: dict, roofs: dict) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """One other rank's phases (as `profile` summarises them, with its own unprofiled step times), kernel table
    and ops, from its trace."""
    from fusionscope import analysis, trace

    timeline = trace.load_timeline(path)
    kernels = analysis.kernel_table(timeline)
    peaks = {k: float(v) for k, v in (roofs.get("tflops") or {}).items() if v}
    kernels = analysis.classify(kernels, float(roofs["copy_gbps"]), peaks).assign(rank=rank)
    ops_per_step = timeline.ops.groupby("phase").size() / timeline.steps.groupby("phase").size()
    phases = analysis.summarize_phases(kernels, timeline.steps, unprofiled_ms, timeline.device_kind,
                                       {str(k): float(v) for k, v in ops_per_step.dropna().items()})  # fmt: skip
    name_uncosted(phases)
    return phases, kernels, timeline.ops.assign(rank=rank)


def name_uncosted(phases: dict) -> None:
    """Give the top kernels that no cost model knows category `other`, as `analyze` does: on a CPU timeline the
    collectives (`c10d::allreduce_`, `_c10d_functional::*`) have none, and a NaN category is no JSON."""
    for figures in phases.values():
        for row in figures.get("top_kernels") or []:
            if not isinstance(row.get("category"), str):
                row["category"] = "other"


def append_rows(path: Path, frame: pd.DataFrame) -> None:
    """Append rows to a table `profile` wrote, in its header's column order."""
    header = path.open(encoding="utf-8").readline().rstrip("\n").split(",")
    frame.reindex(columns=header).to_csv(path, mode="a", header=False, index=False, float_format="%.6g")


def assemble(folder: Path, job: dict, done: Any, world: int, backend: str, applied: dict[str, str]) -> None:
    """Rank 0's run folder: its own analysis (`done`, from `profile_stages`), every rank's trace, phases and
    tables, the cross-rank figures of `analyze`'s rank folders, and the tensor-parallel section."""
    from fusionscope import analyze
    from fusionscope.fusions import allreduce_add_rms_norm as tp_fusion
    from fusionscope.run_folder import finish_run_folder

    scratch = folder / SCRATCH
    notes = wait_for_ranks(scratch, world)
    rank0 = folder / RANK_TRACE.format(rank=0)
    try:
        os.link(folder / "trace.json.gz", rank0)
    except OSError:
        shutil.copyfile(folder / "trace.json.gz", rank0)
    summary = done.summary
    summary["command"] = job["command"]
    name_uncosted(summary["phases"])
    summary["model"]["nproc"] = world
    phases = {0: {"phases": summary["phases"]}}
    kernels_parts = [done.kernels]
    for k in range(1, world):
        phases_k, kernels_k, ops_k = rank_tables(folder / RANK_TRACE.format(rank=k), k, notes[k]["unprofiled_ms"],
                                                 summary["roofs"])  # fmt: skip
        phases[k] = {"phases": phases_k}
        kernels_parts.append(kernels_k)
        append_rows(folder / "kernels.csv", kernels_k)
        append_rows(folder / "ops.csv", ops_k)
    files = [folder / RANK_TRACE.format(rank=k) for k in range(world)]
    traces = analyze.check_ranks([analyze.read_rank(f) for f in files])
    summary["ranks"] = analyze.ranks_summary(traces, phases)
    for k, entry in summary["ranks"]["files"].items():  # where the traces will be once the folder is in place
        entry.update(path=str(Path(job["out_dir"]) / RANK_TRACE.format(rank=k)), file=RANK_TRACE.format(rank=k))
    summary["tensor_parallel"] = tensor_parallel_section(folder, summary, done.kernels, world, backend, applied,
                                                         tp_fusion)  # fmt: skip
    kernels = pd.concat(kernels_parts, ignore_index=True)
    t_start = time.perf_counter() - (time.time() - float(job["started_at"]))
    finish_run_folder(folder, summary, kernels, t_start)


def tensor_parallel_section(folder: Path, summary: dict, kernels: pd.DataFrame, world: int, backend: str,
                            applied: dict[str, str], tp_fusion: Any) -> dict:  # fmt: skip
    """summary.json's `tensor_parallel`: ranks, backend, the plan applied, and per phase rank 0's all-reduces and
    what fusing each into the add + RMSNorm after it would save (`allreduce_add_rms_norm.estimate_phase`)."""
    ops = pd.read_csv(folder / "ops.csv", usecols=["rank", "name", "phase", "step", "input_dims"],
                      keep_default_na=False, dtype={"name": str, "phase": str})  # fmt: skip
    ops = ops[ops["rank"] == 0]
    element = {"float32": 4, "bfloat16": 2, "float16": 2}.get(summary["model"]["dtype"], 4)
    per_step = tp_fusion.all_reduce_per_step(kernels, ops, summary["device"]["kind"], element)
    rows = {r["phase"]: r for r in per_step.to_dict("records")}
    fusion = {}
    for phase in summary["phases"]:
        opp = next((o for o in summary.get("opportunities", [])
                    if o["fusion"] == tp_fusion.KEY and o["phase"] == phase), None)  # fmt: skip
        fusion[phase] = tp_fusion.estimate_phase(opp, rows.get(phase, {}), summary["roofs"].get("copy_gbps"),
                                                 summary["device"]["kind"])  # fmt: skip
    return {"nproc": world, "backend": backend, "plan": applied, "fusion": fusion}


if __name__ == "__main__":
    main()
