"""Warps per program for the norm kernels at prefill shapes, against torch.compile and Liger, on the GPU.

Usage (on the GPU machine): python3 reports/bench/tune_norms.py OUT.json

`launch_config` picks warps by elements per program (4 up to 2048, 8 up to 8192, 16 above). At hidden 8192
rms_norm trailed torch.compile by 3.7–4.0% in the committed bench while add_rms_norm, with the same layout, did
not: this times each kernel at 4, 8, 16 and 32 warps (everything else as `launch_config` chooses) beside the peers,
GPU time by CUDA-graph replay (median), so the choice rests on a measurement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing
from fusionscope.kernels.dispatch import forget_plans

from fusionscope.bench.cases import add_rms_norm_case, kernel_module, rms_norm_case

SHAPES = [(4096, 4096), (32768, 4096), (4096, 8192), (32768, 8192)]
WARPS = (4, 8, 16, 32)
PEERS = ("compile", "liger")
DEVICE = "cuda"


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def write_rows(path: Path, rows: list[dict]) -> None:
    """The sweep's rows and the device and versions they were measured with, as JSON."""
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


def main(path: Path) -> None:
    torch._dynamo.config.recompile_limit = 64
    rms_mod, add_mod = kernel_module("rms_norm"), kernel_module("add_rms_norm")
    shipped = rms_mod.launch_config
    rows = []
    for M, N in SHAPES:
        for case, module in ((rms_norm_case(M, N), rms_mod), (add_rms_norm_case(M, N), add_mod)):
            inputs = case.build(torch.device(DEVICE), torch.bfloat16)
            for warps in (*PEERS, None, *WARPS):
                if warps in PEERS:
                    if warps not in case.variants:
                        continue
                    label, fn = warps, case.variants[warps]
                else:  # our kernel with `launch_config`'s choice, then with each forced warp count
                    label = (
                        f"fusionscope {warps} warps"
                        if warps
                        else f"fusionscope as shipped ({shipped(M, N)['num_warps']})"
                    )
                    fn = case.variants["fusionscope"]
                    module.launch_config = (
                        shipped if warps is None else (lambda m, n, w=warps: {**shipped(m, n), "num_warps": w})
                    )
                forget_plans()  # recorded launches would keep the shipped configuration
                try:
                    us = gpu_us(lambda fn=fn, i=inputs: fn(i))
                finally:
                    module.launch_config = shipped
                    forget_plans()
                rows.append({"kernel": case.kernel, "shape": case.label, "variant": label, "gpu_us": us})
                print(f"{case.kernel:13s} {case.label:11s} {label:30s} {us:8.2f} µs", flush=True)
            del inputs
            torch.cuda.empty_cache()
    write_rows(path, rows)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
