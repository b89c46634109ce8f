"""`fusionscope bench`: each bundled kernel against eager PyTorch, torch.compile, PyTorch's own fused op and
Liger-Kernel, over decode and prefill shapes, on the GPU.

Per variant: GPU time by CUDA-graph replay, cold-L2 time, host cost and time per call, GB/s by minimal traffic, % of the
measured copy bandwidth, max error against the float64 reference, and for our Triton kernels registers per thread and
spills. Results are plain rows (a DataFrame) plus a meta block (device, versions, date, roofs); `page.py` draws them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import pandas as pd
import torch

from fusionscope.errors import UsageError


@dataclass
class BenchResult:
    rows: pd.DataFrame
    meta: dict


def kernel_names() -> list[str]:
    from fusionscope.bench.cases import CASES

    return list(CASES)


def check_variants(names: list[str], variants: list[str]) -> None:
    """Refuse a variant name that none of the named kernels' cases has (a typo would otherwise bench nothing)."""
    from fusionscope.bench.cases import CASES

    known = {v for name in names if name in CASES for case in CASES[name]() for v in case.variants}
    unknown = sorted(set(variants) - known)
    if unknown:
        raise UsageError(f"unknown variant(s) {', '.join(unknown)}; these kernels have {', '.join(sorted(known))}")


def _max_error(output: object, reference: object) -> float | None:
    if reference is None:
        return None
    outs = output if isinstance(output, (tuple, list)) else (output,)
    refs = reference if isinstance(reference, (tuple, list)) else (reference,)
    errors = [
        (o.double() - r.double()).abs().max().item()
        for o, r in zip(outs, refs)
        if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o.shape == r.shape
    ]
    return max(errors) if errors else None


def run_bench(
    names: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    quick: bool = False,
    variants: list[str] | None = None,
    on_case: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark the named kernels (all when None). `quick` keeps one decode and one prefill shape per kernel;
    `variants` keeps only those variants (e.g. re-timing our own kernel after a change, peers left as they were)."""
    if not torch.cuda.is_available():
        raise UsageError("fusionscope bench needs a CUDA GPU; this machine has none (use --list to see the cases)")
    from fusionscope.bench.cases import CASES, kernel_module
    from fusionscope.bench.timing import time_variant, triton_registers
    from fusionscope.device import get_ceilings, software_versions

    unknown = sorted(set(names or []) - set(CASES))
    if unknown:
        raise UsageError(f"unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if variants:
        check_variants(names or list(CASES), variants)
    device = torch.device("cuda")
    ceilings = get_ceilings(device)
    # every `compile` variant recompiles once per shape (dynamic=False); dynamo's default limit (8 per function)
    # would silently fall back to eager for the later shapes of a sweep
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    rows = []
    for name in names or list(CASES):
        cases = CASES[name]()
        if quick:
            cases = [c for i, c in enumerate(cases) if i == 0 or c.phase != cases[0].phase][:2]
        module_name = {"qkv": "horizontal", "rope_and_cache": "rope"}.get(name, name)
        jit_fns = [v for v in vars(kernel_module(module_name)).values() if type(v).__name__ == "JITFunction"]
        for case in cases:
            (on_case or (lambda _m: None))(f"{name} {case.label}")
            inputs = case.build(device, dtype)
            traffic = case.traffic(inputs)
            reference = case.reference(inputs) if case.reference else None
            for variant, fn in case.variants.items():
                if variants and variant not in variants:
                    continue
                row = {
                    "kernel": name,
                    "case": case.label,
                    "phase": case.phase,
                    "variant": variant,
                    "dtype": str(dtype).removeprefix("torch."),
                    "traffic_bytes": traffic,
                }
                try:
                    # the error is taken before timing: a peer that works in place (Liger's rope) would otherwise
                    # be judged on its output rotated a thousand times over
                    max_err = _max_error(fn(inputs), reference)
                    timing = time_variant(lambda fn=fn, i=inputs: fn(i))
                except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
                    rows.append({**row, "note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
                    continue
                gbps = traffic / (timing.gpu_us * 1e3) if timing.gpu_us else None
                regs, spills = triton_registers(jit_fns) if variant.startswith("fusionscope") else (None, None)
                rows.append(
                    {
                        **row,
                        "gpu_us": timing.gpu_us,
                        "cold_us": timing.cold_us,
                        "host_us": timing.host_us,
                        "call_us": timing.call_us,
                        "host_vs_empty_launch": (
                            timing.host_us / ceilings.launch_us if timing.host_us and ceilings.launch_us else None
                        ),
                        "gbps": gbps,
                        "pct_copy_bw": 100 * gbps / ceilings.copy_gbps if gbps else None,
                        "max_err": max_err,
                        "registers": regs,
                        "spills": spills,
                        "note": timing.note,
                    }
                )
            del inputs, reference
            torch.cuda.empty_cache()

    meta = {
        "device": ceilings.name,
        "versions": software_versions(),
        "roofs": ceilings.to_json(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dtype": str(dtype),
    }
    return BenchResult(rows=pd.DataFrame(rows), meta=meta)
