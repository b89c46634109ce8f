"""Tiles for linear_act's Triton path, and which kernels cuBLAS launches for each GEMM form, on the GPU.

Usage (on the GPU machine): python3 reports/bench/tune_linear_act.py OUT.json [--probe-only]

Two questions, one file:
1. What does cuBLAS launch per call? At 4096×4096→16384 `torch._addmm_activation` ran a `Memset (Device)` before its
   GEMM (a second launch). For each shape and each form — the GELU epilogue, `addmm`, `F.linear`, `mm` — this lists
   the kernels torch.profiler sees in one call and the GPU time (CUDA-graph replay, median). Run a second time with
   `--probe-only` under `CUBLASLT_WORKSPACE_SIZE=0` it shows what cuBLASLt picks without its workspace.
2. Which Triton tiles? For each shape, the Triton path (exact GELU, which cuBLASLt has no epilogue for) at each
   candidate of `TILES`, beside cuBLASLt's tanh-GELU epilogue and eager `gelu(linear)`: GPU time, max error against
   the float64 reference, and registers and spills where the tile compiled anew for the shape (a shape whose integer
   arguments specialise like an earlier one's reuses its kernel and leaves them out).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from tune_norms import gpu_us  # this folder is on sys.path when run as a script

from fusionscope.bench.cases import kernel_module

SHAPES = [  # (M, K, N)
    (1, 4096, 16384),
    (64, 4096, 16384),
    (1024, 4096, 16384),
    (4096, 4096, 16384),
    (4096, 768, 3072),
    (4096, 3072, 768),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
TILES = [
    (64, 64, 32, 8, 4, 3),
    (16, 64, 128, 8, 4, 4),
    (16, 128, 128, 8, 4, 4),
    (32, 64, 128, 8, 4, 4),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 4, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 4, 4),
    (128, 256, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
]
DEVICE = "cuda"
mod = kernel_module("linear_act")


def kernels_of(fn) -> list[str]:
    """Names of the GPU kernels and memsets one call of `fn` launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def compiled_kernels() -> list:
    return [c for cache in getattr(mod._linear_act_kernel, "device_caches", {}).values() for c in cache[0].values()]


def forms(x, w, b, out):
    return {
        "addmm_activation gelu": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True, out=out),
        "addmm": lambda: torch.addmm(b, x, w.t(), out=out),
        "F.linear": lambda: F.linear(x, w, b),
        "mm": lambda: torch.mm(x, w.t(), out=out),
    }


def probe(rows: list) -> None:
    for M, K, N in SHAPES:
        x, w, b = (torch.randn(*s, device=DEVICE, dtype=torch.bfloat16) for s in ((M, K), (N, K), (N,)))
        out = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
        for form, fn in forms(x, w, b, out).items():
            names = kernels_of(fn)
            row = {"part": "cublas", "shape": f"{M}x{K}->{N}", "form": form, "kernels": names, "gpu_us": gpu_us(fn)}
            row["workspace_env"] = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
            rows.append(row)
            print(json.dumps(row), flush=True)


def sweep_shape(M: int, K: int, N: int, rows: list) -> None:
    x, w, b = (torch.randn(*s, device=DEVICE, dtype=torch.bfloat16) for s in ((M, K), (N, K), (N,)))
    w /= K**0.5
    expected = mod.linear_act_reference(x.double(), w.double(), b.double(), "gelu")
    shape = f"{M}x{K}->{N}"
    peers = {
        "cublaslt gelu_tanh epilogue": lambda: mod.linear_act(x, w, b, "gelu_tanh", backend="cublaslt"),
        "eager gelu(linear)": lambda: mod.linear_act_reference(x, w, b, "gelu"),
    }
    for label, fn in peers.items():
        rows.append({"part": "tiles", "shape": shape, "variant": label, "gpu_us": gpu_us(fn)})
        print(json.dumps(rows[-1]), flush=True)

    def ours() -> torch.Tensor:
        return mod.linear_act(x, w, b, "gelu", backend="triton")

    for tiles in TILES:
        bm, bn, bk, group, warps, stages = tiles
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}
        mod.TRITON_TILES.clear()
        mod.TRITON_TILES["all"] = (None, {**config, "num_warps": warps, "num_stages": stages})
        row = {"part": "tiles", "shape": shape, "variant": "triton", "tiles": tiles}
        try:
            seen = set(map(id, compiled_kernels()))
            row["max_err"] = (ours().double() - expected).abs().max().item()
            row["gpu_us"] = gpu_us(ours)
            new = [c for c in compiled_kernels() if id(c) not in seen]  # compiled for this tile
            if new:
                new[-1]._init_handles()
                row["registers"], row["spills"] = int(new[-1].n_regs), int(new[-1].n_spills)
        except Exception as error:  # a tile that does not fit is a result, not a crash
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)


def sweep(rows: list) -> None:
    shipped = dict(mod.TRITON_TILES)
    try:
        for M, K, N in SHAPES:
            sweep_shape(M, K, N, rows)
    finally:
        mod.TRITON_TILES.clear()
        mod.TRITON_TILES.update(shipped)


def main(path: Path, probe_only: bool) -> None:
    rows: list = []
    probe(rows)
    if not probe_only:
        sweep(rows)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    meta["CUBLASLT_WORKSPACE_SIZE"] = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--probe-only" in sys.argv[2:])
