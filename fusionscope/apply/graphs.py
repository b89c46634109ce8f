"""`apply --graphs`: the decode step with a static KV cache, captured once in a `torch.cuda.CUDAGraph` and replayed per
token, unfused and fused, beside torch.compile, Liger and the weight-streaming floor.

A replayed graph takes the host out of the step, so what it measures is the GPU work alone — but only if it computes
what the eager step computes. Two traps, both seen on the H200:
- transformers' `StaticLayer` keeps its own write position, a device counter (`cumulative_length`) that every call
  advances whatever `cache_position` says. The warm-up calls a capture needs (on a side stream) advance it too, so a
  graph captured after them writes each token's K/V rows several positions past where its mask and rotary embedding
  (which follow `cache_position`) put them: logits off by ~4–8 at every step. `StaticDecoder` snapshots every small
  tensor of each cache layer before the warm-up and copies it back after the capture.
- `cache_position` must be passed: left to the model, it is computed from the counter with `torch.arange` on a
  tensor start, a host sync that a capture refuses.

The captured step reads the token and position tensors it was captured with and writes the logits, the argmax token
(back into the token input) and the next position in place, so one `replay()` is one greedy decode step. Every graph
variant is checked teacher-forced before its time counts: fed the eager reference's tokens, its logits at every decode
step are held to the same rule as a fusion (`numerics.judge` against the fp32 copy), and its free-running greedy
tokens are compared with the reference's.

On a CPU the same static-cache step runs eagerly (no capture): the numerics path is the one the GPU takes, the timing
is not measured.
"""

from __future__ import annotations

import copy
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from fusionscope.apply import numerics, replay
from fusionscope.apply.cudagraph_skips import cudagraph_skips
from fusionscope.capture import _forward_kwargs
from fusionscope.floor import weight_floor
from fusionscope.static_cache import cache_state, empty, restore_state, static_cache, window_overrun

WARMUP_CALLS = 2  # eager calls on a side stream before a capture (cuBLAS handles, lazy inits)
GRAPH = "graph"
FUSED_GRAPH = "fused + graph"
COMPILE = "torch.compile"
FUSED_COMPILE = "fused + compile"
LIGER = "liger"
BROKEN_DOWN = (GRAPH, FUSED_GRAPH)  # the variants whose replay gets a per-kernel breakdown against the roofs


class StaticDecoder:
    """Prefill into a static cache, then one greedy decode step per `step()`: a graph replay on a GPU once
    `capture()` ran, else the eager step. `token` (B, 1), `position` (1,) and `logits` (B, V) fp32 are the step's
    static tensors; `step()` leaves the next token in `token` and advances `position`."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, decode_steps: int,
                 forward: Callable[..., Any] | None = None) -> None:  # fmt: skip
        self.model, self.ids = model, ids
        self.forward = forward or model
        self.names = _forward_kwargs(model)
        self.steps = decode_steps
        batch, device = ids.shape[0], ids.device
        # inference tensors, as the eager runs' tokens, positions and caches are: dynamo guards on a tensor's
        # dispatch keys, so a normal tensor here would make a patched forward capture the whole model again
        with torch.inference_mode():
            # the warm-up and capture steps write rows the first real steps write again: no rows of their own, and
            # the eager runs' cache length, which the patched forward's graphs are guarded on
            self.cache = static_cache(model, ids.shape[1] + max(decode_steps, WARMUP_CALLS + 1))
            self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
            self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None
        self.roofs: dict | None = None  # the device's roofs, for the per-kernel breakdown of a profiled replay

    def _call(
        self, ids: torch.Tensor, position: torch.Tensor, forward: Callable[..., Any] | None = None
    ) -> torch.Tensor:
        out = (forward or self.forward)(ids, use_cache=True, cache_position=position,
                                        **{self.names["cache"]: self.cache})  # fmt: skip
        return out.logits[:, -1]

    def prefill(self) -> torch.Tensor:
        """Write the prompt's rows (eager) and set `token` to the greedy first token; returns the last logits."""
        seq = self.ids.shape[1]
        # the cache's tensors are made inside inference mode (its first write), so they are changed only there
        with torch.inference_mode():
            empty(self.cache)
            last = self._call(self.ids, torch.arange(seq, device=self.ids.device), self.model).float()
            self.token.copy_(last.argmax(-1, keepdim=True))
            self.position.fill_(seq)
        return last

    def _body(self) -> None:
        logits = self._call(self.token, self.position).float()
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.position.add_(1)

    def capture(self) -> None:
        """Warm up on a side stream and capture one step; the cache's counters and `position` are put back to where
        the prefill left them (see the module docstring)."""
        overrun = window_overrun(self.cache, self.ids.shape[1] + self.steps)
        if overrun:
            raise RuntimeError(overrun)
        with torch.inference_mode():
            state = cache_state(self.cache)
        position, token = self.position.clone(), self.token.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(WARMUP_CALLS):
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            self._body()
        with torch.inference_mode():
            restore_state(self.cache, state)
            self.position.copy_(position)
            self.token.copy_(token)
        self.graph = graph

    def step(self) -> torch.Tensor:
        """One decode step; returns `logits` (overwritten by the next step)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self._body()
        assert self.logits is not None
        return self.logits


def teacher_forced(decoder: StaticDecoder, ref: numerics.Reference) -> tuple[numerics.Reference, torch.Tensor]:
    """What the decoder computes fed `ref`'s tokens: prefill, then each decode step given the reference's token (its
    own argmax is overwritten), as a Reference whose tokens are the ones fed — so `numerics.compare` pools each
    step's logits with the reference step that saw the same tokens; and the decoder's own free-running greedy tokens.
    """
    steps = ref.decode_logits.shape[1]
    last = decoder.prefill()
    logits = []
    for t in range(steps):
        with torch.inference_mode():
            decoder.token.copy_(ref.tokens[:, t : t + 1])
        logits.append(decoder.step().clone())
    decoder.prefill()
    tokens = [decoder.token.clone()]
    for _ in range(steps):
        decoder.step()
        tokens.append(decoder.token.clone())
    decode = torch.stack(logits, dim=1) if logits else ref.decode_logits[:, :0]
    forced = numerics.Reference(prefill_logits=last[:, None], tokens=ref.tokens, decode_logits=decode)
    return forced, torch.cat(tokens, dim=1)


def free_running(tokens: torch.Tensor, ref: numerics.Reference) -> dict[str, Any]:
    """The decoder's own greedy tokens against the eager reference's: the share equal and the first decode step
    where they differ (None when they never do). With random weights the next-token distributions are nearly flat,
    so a rounding difference flips an argmax and the sequences part early; the teacher-forced logits decide."""
    equal = tokens == ref.tokens.to(tokens.device)
    differs = (~equal).any(dim=0).nonzero()
    return {"tokens_equal": float(equal.float().mean()), "first_divergence": int(differs[0]) if len(differs) else None}


def last_position(ref: numerics.Reference) -> numerics.Reference:
    """`ref` with only its last prefill position (what a decoder's prefill returns)."""
    return numerics.Reference(prefill_logits=ref.prefill_logits[:, -1:], tokens=ref.tokens,
                              decode_logits=ref.decode_logits)  # fmt: skip


def time_tokens(decoder: StaticDecoder, steps: int) -> float:
    """ms per decode token: `steps` steps after a prefill, each synced (as the eager timing syncs each step)."""
    decoder.prefill()
    cuda = decoder.ids.device.type == "cuda"
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        decoder.step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextmanager
def built(make: Callable[[], StaticDecoder], capture: bool) -> Iterator[tuple[StaticDecoder, float]]:
    """A decoder, prefilled and (on a GPU) captured, with the seconds that took (the variant's first call)."""
    t0 = time.perf_counter()
    decoder = make()
    decoder.prefill()
    if capture:
        decoder.capture()
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    try:
        yield decoder, seconds
    finally:
        decoder.graph = None
        del decoder


def liger_available() -> str | None:
    """Liger-Kernel's version, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return None


@contextmanager
def liger_copy(model: nn.Module) -> Iterator[tuple[nn.Module | None, str]]:
    """A deep copy of `model` with Liger-Kernel applied to it (its instance-level `model=` path), and what Liger
    covered; transformers' module globals that Liger rebinds (its class swaps, for models built later) are put back on
    exit.
    (None, reason) when Liger is absent or has no entry for the model's family."""
    if liger_available() is None:
        yield None, "liger-kernel is not installed"
        return
    import importlib

    import liger_kernel.transformers as liger

    family = getattr(model.config, "model_type", "")
    apply = getattr(liger, f"apply_liger_kernel_to_{family}", None)
    if apply is None:
        yield None, f"Liger has no apply_liger_kernel_to_{family}"
        return
    import inspect

    modeling = importlib.import_module(type(model).__module__)
    saved = dict(vars(modeling))
    accepted = inspect.signature(apply).parameters
    # rope off: Liger's rope rebinds a module global (`apply_rotary_pos_emb`) that every model of the family in this
    # process calls, so the other variants, timed while this copy exists, would run it too
    wanted = {"rope": False, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False}  # fmt: skip
    flags = {k: v for k, v in wanted.items() if k in accepted}
    clone = copy.deepcopy(model)
    try:
        try:
            apply(model=clone, **flags)
            covered = ", ".join(k for k, v in flags.items() if v)
            result = (
                clone,
                f"Liger {liger_available()}: {covered} (instance-level; its loss kernels are for training)",
            )
        except Exception as exc:  # a Liger that cannot patch this model is reported, not fatal
            result = (None, f"Liger failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        yield result
    finally:
        for key in set(vars(modeling)) - set(saved):
            delattr(modeling, key)
        for key, value in saved.items():
            if vars(modeling).get(key) is not value:
                setattr(modeling, key, value)
        del clone


def _param_mib(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def compiled_forward(model: nn.Module) -> Callable[..., Any]:
    """The model's forward under torch.compile with CUDA graphs (`reduce-overhead`, transformers' own decode compile
    configuration), for the peer. Outputs live in the compiler's graph pool: callers copy what they keep."""
    return torch.compile(model.forward, mode="reduce-overhead", fullgraph=False, dynamic=False)


def profile_variant(name: str, decoder: StaticDecoder) -> dict[str, Any]:
    """One profiled step of a checked variant: its replay (the compiled peer: one compiled step), kernels and GPU
    time; for `BROKEN_DOWN` variants also each kernel against the roofs, costed by the same step run eagerly. It
    starts with a prefill: the checks before it leave the cache full (its length is the eager runs', prompt + steps),
    and the profiled replay and the eager step write a row each."""
    decoder.prefill()
    if decoder.graph is None:
        return replay.replay_profile(decoder.step, None, decoder.model, None)

    def eager() -> None:
        with torch.inference_mode():
            decoder._body()

    return replay.replay_profile(decoder.graph.replay, eager if name in BROKEN_DOWN else None, decoder.model,
                                 decoder.roofs)  # fmt: skip


def _profiled(name: str, decoder: StaticDecoder) -> dict[str, Any]:
    """`profile_variant`, or the reason it failed: a profiler that cannot trace a replay costs the figures, not the
    variant's timing."""
    try:
        return profile_variant(name, decoder)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def _first_calls(peer: StaticDecoder) -> float:
    """Seconds of a compiled peer's prefill and first three steps (compile, record, replay)."""
    t0 = time.perf_counter()
    peer.prefill()
    for _ in range(3):
        peer.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_graphs(workload: Any, fusions_by_variant: dict[str, list[str]], enter: Callable[[list[str]], Any],
               ref: numerics.Reference, ref32: numerics.Reference, eager_vs_fp32: dict,
               real_weights: bool, repeats: int, roofs: dict | None, eager_ms: float | None,
               note: Callable[[str], None],
               fused_sites: dict[str, list[str]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Every graph variant (`fusions_by_variant`: name → fusions; `[]` is the graph alone) and peer, checked
    teacher-forced against the eager model with the same patches (`ref`: the unpatched one's reference), profiled
    over one replay (`profile_variant`), then timed in interleaved rounds (each round builds and captures each
    variant afresh: a patch's fused weights exist only while it is entered, and a graph holds their addresses).
    `fused_sites` ({fusion: paths} of the fusions patched on the captured graph): the peer "fused + compile", those
    fusions rewritten into the graph Inductor compiles (`fusionscope.apply.rewrite.compile_fused`).
    Returns `summary["apply"]["graphs"]`."""
    copy_gbps = (roofs or {}).get("copy_gbps")
    model = workload.module
    (ids,) = workload.inputs
    steps = workload.decode_steps
    gpu = workload.device.type == "cuda"
    dtype = workload.dtype
    variants: dict[str, dict[str, Any]] = {}
    makers: dict[str, tuple[Callable[[], Any], Callable[[], StaticDecoder], bool]] = {}
    for name, fusions in fusions_by_variant.items():
        makers[name] = ((lambda f=fusions: enter(f)), (lambda: StaticDecoder(model, ids, steps)), gpu)
    compile_seconds = None
    compile_failed = ""
    skips: dict[str, list[str]] = {}  # compiled variant -> Inductor's reasons for running it without CUDA graphs
    if gpu:
        note("torch.compile (reduce-overhead) of the unpatched model: compiling")
        try:
            peer = StaticDecoder(model, ids, steps, forward=compiled_forward(model))
            with cudagraph_skips() as skips[COMPILE]:
                compile_seconds = _first_calls(peer)
            makers[COMPILE] = (nullcontext, lambda: peer, False)
        except Exception as exc:  # the peer failing to compile is reported, not fatal
            compile_failed = (
                f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
    fused_compile_failed = ""
    fused_compile_fusions: list[str] = []
    if gpu and fused_sites:
        from fusionscope.apply import rewrite

        note("fused + compile: the fusions rewritten into the graph torch.compile (reduce-overhead) compiles")
        try:
            forward, rewritten = rewrite.compile_fused(model, fused_sites)
            fused_peer = StaticDecoder(model, ids, steps, forward=forward)
            with cudagraph_skips() as skips[FUSED_COMPILE]:
                fused_compile_seconds = _first_calls(fused_peer)
            fused_compile_fusions = sorted(f for f, paths in rewritten.items() if "" in paths.values())
            makers[FUSED_COMPILE] = (nullcontext, lambda: fused_peer, False)
        except Exception as exc:  # reported, not fatal
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            cause = f"{lines[0]} … {lines[-1]}" if len(lines) > 1 else (lines[0] if lines else "")
            fused_compile_failed = f"fused + compile failed: {type(exc).__name__}: {cause}"
            traceback.print_exc()  # the whole cause, for the run's log
    with liger_copy(model) if gpu else nullcontext((None, "not run on a CPU")) as (liger_model, liger_note):
        if liger_model is not None:
            makers[LIGER] = (nullcontext, lambda: StaticDecoder(liger_model, ids, steps), True)
        for name, (enter_fn, make, capture) in makers.items():
            note(f"graphs: capturing and checking {name} teacher-forced")
            fusions = fusions_by_variant.get(name, [])
            row: dict[str, Any] = {"fusions": fusions, "ms_per_token_rounds": []}
            try:
                with enter_fn(), built(make, capture) as (decoder, seconds):
                    # the eager model with the same patches (greedy, on the run's cache, as `ref`) sets the tokens
                    # fed; on a static cache the patched forward's graphs captured for the eager check serve it
                    eager_ref = numerics.reference(model, ids, steps, cache=workload.cache) if fusions else ref
                    test, own_tokens = teacher_forced(decoder, eager_ref)
                    row["first_call_s"] = compile_seconds + seconds if name == COMPILE else seconds
                    if name == FUSED_COMPILE:
                        row["first_call_s"] = fused_compile_seconds + seconds
                        row["fusions"] = fused_compile_fusions
                    fig = numerics.compare(test, last_position(eager_ref))
                    fig32 = numerics.compare(test, last_position(ref32))
                    ok, why = numerics.judge(fig, fig32, eager_vs_fp32, dtype, real_weights)
                    row.update(numerics=numerics.json_safe(fig), numerics_vs_fp32=numerics.json_safe(fig32),
                               passed=ok, reason=why, free_running=free_running(own_tokens, eager_ref))  # fmt: skip
                    if gpu and ok:
                        note(f"graphs: profiling one step of {name}")
                        decoder.roofs = roofs
                        row["replay"] = _profiled(name, decoder)
            except Exception as exc:  # a fusion that cannot be captured is skipped with its reason
                row.update(passed=False, reason=f"could not be captured: {type(exc).__name__}: "
                                                f"{str(exc).splitlines()[0] if str(exc) else ''}")  # fmt: skip
            if name in skips:
                row["cudagraph_skips"] = skips[name]
            variants[name] = row
        timed = [n for n, r in variants.items() if r.get("passed")]
        if gpu and timed:
            for r in range(repeats):
                order = timed if r % 2 == 0 else timed[::-1]
                for name in order:
                    note(f"graphs: round {r + 1}/{repeats}: {name}")
                    enter_fn, make, capture = makers[name]
                    with enter_fn(), built(make, capture) as (decoder, _):
                        torch.cuda.reset_peak_memory_stats()
                        variants[name]["ms_per_token_rounds"].append(time_tokens(decoder, steps))
                        # the Liger copy's weights sit beside every variant while it exists, and the original's
                        # beside the copy's: each variant counts one model's
                        other = 0.0 if liger_model is None else _param_mib(model if name == LIGER else liger_model)
                        peak = torch.cuda.max_memory_allocated() / 2**20 - other
                        variants[name]["peak_mib"] = max(variants[name].get("peak_mib") or 0.0, peak)
    if compile_failed:
        variants[COMPILE] = {"fusions": [], "passed": False, "reason": compile_failed, "ms_per_token_rounds": []}
    if fused_compile_failed:
        variants[FUSED_COMPILE] = {"fusions": [], "passed": False, "reason": fused_compile_failed,
                                   "ms_per_token_rounds": []}  # fmt: skip
    if LIGER not in variants:
        variants[LIGER] = {"fusions": [], "passed": False, "reason": liger_note, "ms_per_token_rounds": []}
    floor = weight_floor(model, ids.shape[0], ids.shape[1] + steps / 2, copy_gbps or 0.0)
    for row in variants.values():
        figures = row.get("replay") or {}
        row["gpu_ms_per_step"] = figures.get("gpu_busy_ms")
        row["kernels_per_step"] = figures.get("kernels")
        rounds = row.get("ms_per_token_rounds") or []
        row["ms_per_token"] = statistics.median(rounds) if rounds else None
        ms = row["ms_per_token"]
        row["tokens_per_s"] = ids.shape[0] * 1e3 / ms if ms else None
        row["x_floor"] = ms / floor["ms"] if ms and floor["ms"] else None
        row["speedup_vs_eager"] = eager_ms / ms if ms and eager_ms else None
    graph_ms, fused_ms = variants.get(GRAPH, {}).get("ms_per_token"), variants.get(FUSED_GRAPH, {}).get("ms_per_token")
    compile_ms = variants.get(COMPILE, {}).get("ms_per_token")
    fused_compile_ms = variants.get(FUSED_COMPILE, {}).get("ms_per_token")
    return {
        "variants": variants,
        "floor": floor,
        "eager_ms_per_token": eager_ms,
        "compile_seconds": compile_seconds,
        "liger": {"version": liger_available(), "note": liger_note},
        "fused_vs_graph": graph_ms / fused_ms if graph_ms and fused_ms else None,
        "fused_vs_compile": compile_ms / fused_ms if compile_ms and fused_ms else None,
        "fused_compile_vs_compile": compile_ms / fused_compile_ms if compile_ms and fused_compile_ms else None,
        "timing_note": ""
        if gpu
        else "not measured: CUDA graphs need a GPU; on a CPU the static-cache step ran eagerly",
    }
