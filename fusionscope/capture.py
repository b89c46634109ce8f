"""Run a Workload under torch.profiler and write `trace.json.gz`, the one file every later stage reads.

The sequence is the same three times: warm-up (not recorded: attention backends build a plan per new sequence length,
~30 ms extra per decode step on first sight on the H200), one timed pass without the profiler (its overhead, reported
beside the profiled figures), and the profiled pass. Each step is bracketed by a `ProfilerStep#N` range (HTA's step
marker) and a `fusionscope.phase:<name>` range, and ends with a device sync so a step's wall time includes its GPU work.
Modules are attributed by qualified name through forward hooks that open `record_function` ranges named
`nn.Module: <path>` — `with_modules=True` records nothing in eager mode.
"""

from __future__ import annotations

import contextlib
import gzip
import inspect
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fusionscope.markers import MODULE_PREFIX, PHASE_PREFIX, STEP_PREFIX
from fusionscope.models import Workload
from fusionscope.static_cache import empty

PREFILL_REPEATS = 3  # prefill is one forward; repeat it so its per-step figure is a median, not one sample


@dataclass
class Capture:
    """What `capture` leaves behind: the trace file and the unprofiled per-step wall times (ms) per phase."""

    trace_path: Path
    phases: tuple[str, ...]
    unprofiled_ms: dict[str, list[float]] = field(default_factory=dict)
    profiled_steps: int = 0


StepRunner = Callable[[str, Callable[[], Any]], Any]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_kwargs(module: torch.nn.Module) -> dict[str, str]:
    """transformers 5.24 renamed `past_key_values=` to `cache=`; 5.17 may know only the old name."""
    params = inspect.signature(module.forward).parameters
    return {
        "cache": "cache" if "cache" in params else "past_key_values",
        "logits_to_keep": "logits_to_keep" if "logits_to_keep" in params else "",
    }


def run_sequence(workload: Workload, run_step: StepRunner, sampler: Any = None) -> None:
    """One pass over the workload's phases, each step executed through `run_step(phase, fn)`.

    Each next token is picked by `sampler` (a `fusionscope.apply.sampler.Sampler`; by default one built from the
    workload's sampling settings: argmax, or `generate(do_sample=True)`'s warpers + multinomial). It is reset here, once
    per pass, so that the timed, the profiled and the dataflow passes draw the same tokens."""
    from fusionscope.apply.sampler import Sampler

    model = workload.module
    with torch.inference_mode():
        if workload.phases == ("forward",):
            inputs = workload.inputs
            call = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(*inputs))
            for _ in range(PREFILL_REPEATS):
                run_step("forward", call)
            return
        names = _forward_kwargs(model)
        (ids,) = workload.inputs
        extra = {names["logits_to_keep"]: 1} if names["logits_to_keep"] else {}
        picker = sampler if sampler is not None else Sampler(workload.sampling, workload.device)
        picker.reset()

        def pick(logits: torch.Tensor) -> torch.Tensor:
            return picker(ids, logits)

        static = static_cache_of(workload)
        seq = ids.shape[1]
        # a static cache's rows are addressed by position: the prompt's, then one per decode step (made up front)
        positions = []
        if static is not None:
            positions = [torch.arange(seq, device=ids.device)]
            positions += [torch.tensor([seq + i], device=ids.device) for i in range(workload.decode_steps)]

        def at(i: int) -> dict[str, Any]:
            """The keywords that place call i (0: the prefill) in the static cache."""
            return {} if static is None else {names["cache"]: static, "cache_position": positions[i]}

        def prefill() -> tuple[Any, torch.Tensor]:
            out = model(ids, use_cache=True, **extra, **at(0))
            return out, pick(out.logits)

        for _ in range(PREFILL_REPEATS):
            if static is not None:
                empty(static)  # every prefill starts the sequence over (outside the step: not its work)
            out, token = run_step("prefill", prefill)
        cache = getattr(out, "cache", None) or out.past_key_values
        for i in range(workload.decode_steps):

            def decode(token: torch.Tensor = token, i: int = i) -> tuple[Any, torch.Tensor]:
                step_out = model(
                    token, use_cache=True, **(at(i + 1) if static is not None else {names["cache"]: cache})
                )
                return step_out, pick(step_out.logits)

            _, token = run_step("decode", decode)


def static_cache_of(workload: Workload) -> Any:
    """The workload's static cache (made on first use, for the prompt and every decode step), or None when its
    decode runs on the dynamic cache."""
    if getattr(workload, "cache", "dynamic") != "static":
        return None
    if workload.static is None:
        from fusionscope.static_cache import static_cache

        (ids,) = workload.inputs
        workload.static = static_cache(workload.module, ids.shape[1] + workload.decode_steps)
    return workload.static


@contextmanager
def around_modules(root: torch.nn.Module, enter: Callable[[str], None], leave: Callable[[], None]) -> Iterator[None]:
    """Call `enter(name)` before and `leave()` after every submodule's forward (name: its qualified name, the root's
    class name for the root; `leave` runs even when the forward raises); the hooks are removed on exit."""
    handles = []
    root_name = type(root).__name__
    for name, mod in root.named_modules():

        def pre(_m: torch.nn.Module, _args: Any, label: str = name or root_name) -> None:
            enter(label)

        def post(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
            leave()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def module_ranges(root: torch.nn.Module) -> Iterator[None]:
    """Open a `record_function("nn.Module: <qualified name>")` range around every submodule's forward."""
    stack: list[Any] = []

    def enter(label: str) -> None:
        rf = record_function(MODULE_PREFIX + label)
        rf.__enter__()
        stack.append(rf)

    def leave() -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    with around_modules(root, enter, leave):
        yield


def capture(
    workload: Workload, out_dir: Path, warmup: int = 1, on_stage: Callable[[str], None] | None = None
) -> Capture:
    """Warm up, time one unprofiled pass, profile one pass; write `out_dir/trace.json.gz`."""
    device = workload.device
    note = on_stage or (lambda _msg: None)

    def plain(_phase: str, fn: Callable[[], Any]) -> Any:
        return fn()

    note("warm-up")
    for _ in range(warmup):
        run_sequence(workload, plain)
        _sync(device)

    note("timing without the profiler")
    unprofiled = timed_pass(workload)

    note("profiling")
    trace_path, steps = profiled_pass(workload, out_dir)
    return Capture(trace_path=trace_path, phases=workload.phases, unprofiled_ms=unprofiled, profiled_steps=steps)


def timed_pass(workload: Workload, sampler: Any = None) -> dict[str, list[float]]:
    """One pass without the profiler; each step's wall time in ms (device synced before and after), per phase."""
    device = workload.device
    times: dict[str, list[float]] = {}

    def timed(phase: str, fn: Callable[[], Any]) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        times.setdefault(phase, []).append((time.perf_counter() - t0) * 1e3)
        return result

    run_sequence(workload, timed, sampler)
    return times


def profiled_pass(workload: Workload, out_dir: Path, sampler: Any = None, on_stage: Callable[[str], None] | None = None,
                  name: str = "trace", detail: bool = True) -> tuple[Path, int]:  # fmt: skip
    """One pass under torch.profiler, each step in `ProfilerStep#N` and phase ranges; writes `out_dir/<name>.json.gz`
    and returns its path and the number of steps recorded. `detail=False` records neither shapes nor module ranges:
    enough for GPU time and kernel counts per step, and 2–3× faster to export on an 8B decode pass."""
    device = workload.device
    note = on_stage or (lambda _msg: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = 0

    def profiled(phase: str, fn: Callable[[], Any]) -> Any:
        nonlocal steps
        with record_function(f"{STEP_PREFIX}{steps}"), record_function(PHASE_PREFIX + phase):
            result = fn()
            _sync(device)
        steps += 1
        return result

    # Without a schedule the whole pass is one cycle, so torch's "clears events at the end of each cycle" warning does
    # not apply. (acc_events=True would silence it too, but made stopping the 8B profile 20 s slower on the H200.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        ranges = module_ranges(workload.module) if detail else contextlib.nullcontext()
        with profile(activities=activities, record_shapes=detail) as prof, ranges:
            run_sequence(workload, profiled, sampler)
    note("exporting the trace")
    raw = out_dir / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    trace_path = out_dir / f"{name}.json.gz"
    write_rank_trace(raw, trace_path, rank=0)
    raw.unlink()
    return trace_path, steps


def write_rank_trace(src: Path, dst: Path, rank: int) -> None:
    """Gzip a Chrome trace, adding `"distributedInfo": {"rank": N}` so HTA and Perfetto both open it.

    HTA finds the rank with a regex on that exact text (space after the colon); without it every file is rank 0. The
    key is spliced in as text after the opening brace: re-serialising a 100 MB trace through json costs seconds.
    """
    with open(src, "rb") as f_in, gzip.open(dst, "wb", compresslevel=3) as f_out:
        head = f_in.read(1 << 16)
        brace = head.index(b"{")
        f_out.write(head[: brace + 1] + b'\n  "distributedInfo": {"rank": %d},' % rank + head[brace + 1 :])
        shutil.copyfileobj(f_in, f_out, 1 << 20)
