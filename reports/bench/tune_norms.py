"""Launch settings for the norm kernels at prefill shapes, against torch.compile and Liger, on the GPU.

Usage (on the GPU machine): python3 reports/bench/tune_norms.py OUT.json

`launch_config` picks warps by elements per program (4 up to 2048, 8 up to 8192, 16 above). At hidden 8192
rms_norm trailed torch.compile by 3.7–4.0% in the committed bench while add_rms_norm, with the same layout, did
not: this times each kernel at 4, 8 and 16 warps (32 was slower everywhere on 2026-11-29), and rms_norm at hidden
8192 also without and with each cache hint on the loads of x and with two rows per program (everything else as
shipped: `launch_config`, and rms_norm's `load_hints`), beside the peers: GPU time by CUDA-graph replay (median), so
the choice rests on a measurement. (The committed `tune_norms.json`, 14:38, was measured before rms_norm shipped the
evict_last hint: there "as shipped" and the warps rows ran without a hint, and `{'EVICT_X': ''}` was not yet a row.)
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
import triton.testing
from fusionscope.kernels.dispatch import forget_plans

from fusionscope.bench.cases import add_rms_norm_case, kernel_module, rms_norm_case

SHAPES = [(4096, 4096), (32768, 4096), (4096, 8192), (32768, 8192)]
WARPS = (4, 8, 16)
PEERS = ("compile", "liger")
DEVICE = "cuda"


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


@contextlib.contextmanager
def patched(module: ModuleType, **values: Any) -> Iterator[None]:
    """`module`'s attributes set to `values` while the block runs; recorded launch plans are forgotten on the way in
    and out (a replay would keep the launch settings it recorded)."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    forget_plans()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        forget_plans()


def write_rows(path: Path, rows: list[dict]) -> None:
    """The sweep's rows and the device and versions they were measured with, as JSON."""
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


def overrides(kernel: str, N: int) -> list[dict]:
    """Launch settings tried on top of `launch_config`'s: each warp count, and for rms_norm at hidden 8192 (where it
    trailed) the cache hint on x and two rows per program."""
    tries = [{"num_warps": w} for w in WARPS]
    if kernel == "rms_norm" and N == 8192:
        tries += [{"EVICT_X": ""}, {"EVICT_X": "evict_first"}, {"EVICT_X": "evict_last"}]
        tries += [{"EVICT_X": "evict_first", "num_warps": 16}]
        tries += [{"ROWS": 2, "num_warps": 16}, {"ROWS": 2, "num_warps": 16, "EVICT_X": "evict_first"}]
    return tries


def main(path: Path) -> None:
    torch._dynamo.config.recompile_limit = 64
    rms_mod, add_mod = kernel_module("rms_norm"), kernel_module("add_rms_norm")
    shipped = rms_mod.launch_config
    rows = []
    for M, N in SHAPES:
        for case, module in ((rms_norm_case(M, N), rms_mod), (add_rms_norm_case(M, N), add_mod)):
            inputs = case.build(torch.device(DEVICE), torch.bfloat16)
            for change in (*PEERS, None, *overrides(case.kernel, N)):
                patch = {}
                if change in PEERS:
                    if change not in case.variants:
                        continue
                    label, fn = change, case.variants[change]
                else:  # our kernel with `launch_config`'s choice, then with each change to it
                    hints = rms_mod.load_hints(N) if module is rms_mod else {}
                    label = f"fusionscope {change}" if change else f"fusionscope as shipped {hints | shipped(M, N)}"
                    fn = case.variants["fusionscope"]
                    if change:
                        patch["launch_config"] = lambda m, n, c=change: {**shipped(m, n), **c}
                with patched(module, **patch):
                    us = gpu_us(lambda fn=fn, i=inputs: fn(i))
                rows.append({"kernel": case.kernel, "shape": case.label, "variant": label, "gpu_us": us})
                print(f"{case.kernel:13s} {case.label:11s} {label:60s} {us:8.2f} µs", flush=True)
            del inputs
            torch.cuda.empty_cache()
    write_rows(path, rows)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
