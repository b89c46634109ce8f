"""silu_and_mul with two separate contiguous tensors (a patched MLP whose gate_up is not fused): the flat schedule's
settings against the row schedule, torch.compile and eager, on the GPU.

Usage (on the GPU machine): python3 reports/bench/tune_silu.py OUT.json

The row schedule reached 97.4% of copy bandwidth at 16384 × 14336 bf16 where torch.compile reached 102.2% (H200,
2026-12-01). This times, in one process and interleaved over three rounds, the flat schedule at each (elements per
program, warps) in `CONFIGS`, the row schedule (forced by a column-major `out`, a worst case for it, not the layout a
model passes), compile's kernel and eager `silu(g) * u`; GPU time by CUDA-graph replay, medians; GB/s on
3 × numel × 2 bytes. (`pct_copy` divides by a 1 GiB copy timed the same way, which replays at ~2.7 TB/s against
the 4.1–4.3 TB/s CUDA events give: compare the µs, or the GB/s with the run's roofs.) Each row is written to OUT as
it is measured.
"""

from __future__ import annotations

import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from fusionscope.kernels.silu_and_mul import FLAT, silu_and_mul

SHAPES = [(16384, 14336), (4096, 14336), (1, 14336), (16, 11008)]
CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
ROUNDS = 3


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def copy_gbps() -> float:
    src = torch.empty(1 << 28, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / gpu_us(lambda: dst.copy_(src)) / 1e3


def main(out_path: Path) -> None:
    rows: list[dict] = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "shipped": dict(FLAT)}  # fmt: skip
    copy = copy_gbps()
    meta["copy_gbps"] = copy

    def save() -> None:
        out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    compiled = torch.compile(lambda g, u: F.silu(g) * u)
    shipped = dict(FLAT)
    for m, n in SHAPES:
        gate = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        up = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        strided = torch.empty(n, m, device="cuda", dtype=torch.bfloat16).t()  # not contiguous: the row schedule
        expected = F.silu(gate) * up
        variants = {f"flat {b}/{w}": (b, w) for b, w in CONFIGS}
        times: dict[str, list[float]] = {name: [] for name in [*variants, "rows", "compile", "eager"]}
        for _ in range(ROUNDS):
            for name, (block, warps) in variants.items():
                FLAT.update(BLOCK=block, num_warps=warps)
                silu_and_mul(gate, up, out=out)
                assert torch.equal(out, expected) or (out - expected).abs().max() < 0.05
                times[name].append(gpu_us(lambda g=gate, u=up, o=out: silu_and_mul(g, u, out=o)))
            FLAT.update(shipped)
            times["rows"].append(gpu_us(lambda g=gate, u=up, o=strided: silu_and_mul(g, u, out=o)))
            times["compile"].append(gpu_us(lambda g=gate, u=up: compiled(g, u)))
            times["eager"].append(gpu_us(lambda g=gate, u=up: F.silu(g) * u))
        nbytes = 3 * m * n * 2
        for name, values in times.items():
            us = statistics.median(values)
            gbps = nbytes / us / 1e3
            rows.append({"shape": [m, n], "variant": name, "us": us, "gbps": gbps, "pct_copy": 100 * gbps / copy})
            print(f"{m:6}×{n:6} {name:14} {us:9.2f} µs {gbps:7.0f} GB/s {100 * gbps / copy:6.1f}% of copy", flush=True)
        save()
    FLAT.update(shipped)
    save()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
