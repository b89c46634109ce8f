"""The micro-measured column: for each opportunity whose fusion has a bundled kernel, that kernel and the unfused
sequence as Hugging Face writes it, timed alone on the GPU on the exact shapes the run found.

It checks the analytic estimate from below: the estimate's "time now" is the run's own kernels (measured in the
model, caches warm or not as the model left them) and its "fused" time is max(bytes / bandwidth, FLOPs / peak) plus a
launch floor, which no real kernel reaches. The micro figures are what `fusionscope.kernels` really delivers on
that shape — if the kernel is slower than the floor (a latency-bound sampler at batch 1, a Triton GEMM against
cuBLAS) this column says so before `apply` does. Times are per call by CUDA-graph replay (launch cost excluded), on
the first accepted match's shapes, times the matches per step; the bench case builders (`fusionscope.bench.cases`)
supply the inputs and the two variants, so `bench` and this column time the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from fusionscope.fusions import Graph, Match, fusions

Timer = Callable[[Callable[[], object]], float]  # µs per call of a zero-argument function


def cuda_graph_timer(fn: Callable[[], object]) -> float:
    """Median GPU µs per call by CUDA-graph replay, after a warm-up call."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def _first_matches(matches: list[Match]) -> dict[tuple[str, str], Match]:
    first: dict[tuple[str, str], Match] = {}
    for match in matches:
        if not match.rejected:
            first.setdefault((match.fusion, match.phase), match)
    return first


def micro_measure(
    opportunities: list[dict],
    graph: Graph,
    matches: list[Match],
    device: torch.device,
    dtype: torch.dtype,
    timer: Timer | None = None,
) -> None:
    """Fill `micro_now_us`, `micro_fused_us` and `micro_note` of each opportunity (per step, like `t_now_us`).

    Without CUDA (and no `timer` given) nothing is timed: the note says why. A case that fails to build or run is
    noted, never raised — this column must not cost the user the rest of the run."""
    by_key: dict[str, ModuleType] = {module.KEY: module for module in fusions()}
    first = _first_matches(matches)
    for opp in opportunities:
        opp.update(micro_now_us=None, micro_fused_us=None)
        module = by_key.get(opp["fusion"])
        match = first.get((opp["fusion"], opp["phase"]))
        if module is None or not hasattr(module, "micro_case"):
            opp["micro_note"] = "no bundled kernel serves this fusion yet"
        elif match is None:
            opp["micro_note"] = "every match was rejected"
        elif timer is None and device.type != "cuda":
            opp["micro_note"] = f"not measured: needs a CUDA GPU (this run: {device.type})"
        else:
            opp["micro_note"] = _measure(opp, lambda m=module, g=match: m.micro_case(graph, g), device, dtype,
                                         timer or cuda_graph_timer)  # fmt: skip


def _measure(opp: dict, make_case: Callable[[], object], device: torch.device, dtype: torch.dtype, timer: Timer) -> str:
    try:
        case = make_case()
        if case is None:
            return "not measured: the match's shapes are not ones its kernel takes"
        inputs = case.build(device, dtype)
        now = timer(lambda: case.variants["eager"](inputs))
        fused = timer(lambda: case.variants["fusionscope"](inputs))
    except Exception as exc:  # a kernel that refuses a shape is a finding, not a crash
        return f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    opp.update(micro_now_us=now * opp["count"], micro_fused_us=fused * opp["count"])
    return f"{case.kernel} {case.label}: {now:.2f} µs unfused, {fused:.2f} µs fused per call (CUDA-graph replay)"
