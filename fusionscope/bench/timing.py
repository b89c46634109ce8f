"""How one variant of one kernel is timed on the GPU, three ways, because at decode sizes they disagree.

- GPU time by CUDA-graph replay (`do_bench_cudagraph`): the launch path is out of the picture, so a 2 µs kernel
  reads as 2 µs; at decode sizes `do_bench` alone measures launch cost, not GPU time (±2× between runs on the H200).
- Cold-L2 time (`do_bench`, which flushes the L2 before each call): what a kernel costs when its inputs come from HBM.
- Host cost per call: a back-to-back loop of eager calls with one sync at the end, divided by the count — what the
  Python wrapper and launch path cost the CPU, which decides decode-time wall clock in eager mode.
- Time per call: the same loop timed up to the end of that sync — what a caller waits per call in steady state,
  the slower of host and GPU (the sampler's one-launch kernel costs the host 80 µs but the GPU 740 µs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    gpu_us: float | None  # median CUDA-graph replay time per call
    cold_us: float | None  # median do_bench time (L2 flushed)
    host_us: float | None  # host time per call in a back-to-back loop
    call_us: float | None = None  # the same loop up to the end of its final sync: what a caller waits per call
    note: str = ""


def time_variant(fn: Callable[[], object], host_calls: int = 200) -> Timing:
    """Time `fn` three ways; a way that fails (e.g. graph capture of an op that syncs) is reported, not raised.
    The host loop is shortened for slow calls (≥ 20 calls, ≈ 50 ms of GPU work): there the GPU queue, not the host,
    sets the loop's pace, so more calls would add time and no information."""
    import triton.testing

    notes = []
    fn()
    torch.cuda.synchronize()
    try:
        gpu = triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median") * 1e3
    except Exception as exc:  # capture refuses host syncs, CPU scalars, some RNG paths
        gpu = None
        notes.append(f"no CUDA graph: {type(exc).__name__}")
        torch.cuda.synchronize()
    try:
        cold = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3
    except Exception as exc:
        cold = None
        notes.append(f"do_bench failed: {type(exc).__name__}")
    per_call = gpu or cold or 1.0
    calls = max(20, min(host_calls, int(50_000 / per_call)))
    host, call = host_and_call_us(fn, calls)
    return Timing(gpu_us=gpu, cold_us=cold, host_us=host, call_us=call, note="; ".join(notes))


def host_and_call_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Medians over 3 loops of `calls` back-to-back calls: host µs per call (the loop alone; the GPU queue absorbs
    the work) and µs per call up to the end of the sync that follows (host and GPU overlapped)."""
    torch.cuda.synchronize()
    host, call = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
        call.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(host), statistics.median(call)


def triton_registers(jit_functions: list) -> tuple[int | None, int | None]:
    """Registers per thread and spills of the compiled variants of Triton kernels (max over specialisations)."""
    regs, spills = [], []
    for fn in jit_functions:
        for cache in getattr(fn, "device_caches", {}).values():
            kernel_cache = cache[0] if isinstance(cache, tuple) else {}
            for compiled in kernel_cache.values():
                try:
                    compiled._init_handles()
                    regs.append(int(compiled.n_regs))
                    spills.append(int(compiled.n_spills))
                except Exception:
                    continue
    return (max(regs) if regs else None, max(spills) if spills else None)
