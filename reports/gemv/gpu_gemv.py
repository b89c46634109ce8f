"""The decode GEMV (`fusionscope.kernels.gemv`) against cuBLAS (`F.linear`) on the decode projections of the families
`apply` is measured on: every schedule checked against float64 first, then timed on the GPU alone.

Timing: per (shape, variant) a CUDA graph of ≥ MIN_CALLS calls, each reading its own copy of the weight, the copies
rotating past the 50 MB L2 (a decode step reads each layer's weights from HBM), replayed; µs per call is the median of
REPLAYS replays ÷ calls. Variants are interleaved in ROUNDS rounds (the order rotates each round) and the median per
variant kept, so a drift of the host or the GPU clock touches all of them alike. Rows go to OUT/gemv.jsonl as they come
(a run stopped at its limit keeps what it measured); the summary (best schedule per shape, and per schedule the
geometric mean of cuBLAS's time ÷ its time over the shapes) to OUT/gemv.json and the log.

    python3 reports/gemv/gpu_gemv.py OUT [--budget SECONDS] [--shapes K:N,...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROTATE_BYTES = 160 * 2**20  # > 3× the H200's 50 MB L2
MIN_CALLS = 24
WARMUP_REPLAYS = 2
REPLAYS = 7
ROUNDS = 3

# (K, N, bias, where): the decode projections at published dims (fused q/k/v and gate/up where apply fuses them)
SHAPES = [
    (4096, 6144, False, "llama-3.1-8b / qwen3-8b qkv"),
    (4096, 4096, False, "llama / olmo-2 / qwen3 / pythia o_proj"),
    (4096, 28672, False, "llama-3.1-8b gate_up"),
    (14336, 4096, False, "llama-3.1-8b down"),
    (3072, 9216, False, "phi-3-mini qkv_proj"),
    (3072, 3072, False, "phi-3-mini o_proj"),
    (3072, 16384, False, "phi-3-mini gate_up_proj"),
    (8192, 3072, False, "phi-3-mini down_proj"),
    (4096, 12288, True, "pythia-6.9b query_key_value"),
    (4096, 4096, True, "pythia-6.9b dense"),
    (16384, 4096, True, "pythia-6.9b dense_4h_to_h"),
    (4096, 22016, False, "olmo-2-7b gate_up"),
    (11008, 4096, False, "olmo-2-7b down"),
    (4608, 5632, True, "starcoder2-7b qkv"),
    (4608, 4608, True, "starcoder2-7b o_proj"),
    (18432, 4608, True, "starcoder2-7b c_proj"),
]

# (BLOCK_N, BLOCK_K, num_warps, PREFETCH)
CONFIGS = [
    (2, 1024, 4, 1),
    (4, 512, 4, 1),
    (4, 1024, 4, 1),
    (4, 1024, 8, 1),
    (8, 256, 4, 1),
    (8, 512, 4, 0),
    (8, 512, 4, 1),
    (8, 512, 8, 1),
    (8, 1024, 4, 1),
    (8, 1024, 8, 1),
    (16, 256, 4, 1),
    (16, 512, 4, 1),
    (16, 512, 8, 1),
    (16, 1024, 8, 1),
    (4, 2048, 8, 1),
    (32, 256, 8, 1),
]


def label(config: tuple[int, int, int, int]) -> str:
    n, k, w, p = config
    return f"gemv N{n} K{k} W{w}{' pf' if p else ''}"


class Out:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.jsonl = (folder / "gemv.jsonl").open("a", encoding="utf-8")
        self.log_file = (folder / "gemv.log").open("a", encoding="utf-8")

    def row(self, row: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(row, default=str) + "\n")
        self.jsonl.flush()

    def log(self, line: str) -> None:
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()


def capture(calls: list[Callable[[], Any]], n: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(n):
            calls[i % len(calls)]()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, n: int) -> float:
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in events) / n


def copy_gbps(device: torch.device) -> float:
    """Read + write GB/s of a 256 MiB device copy, timed as the kernels are (graph replay, rotating pairs)."""
    size = 256 * 2**20
    pairs = [(torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device))
             for _ in range(2)]  # fmt: skip
    calls = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
    graph = capture(calls, 8)
    us = replay_us(graph, 8)
    del graph, pairs
    torch.cuda.empty_cache()
    return 2 * size / us / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--shapes", default="", help="K:N[:b],... (default: the families' decode projections)")
    args = parser.parse_args(argv)
    import importlib

    import triton

    gemv_module = importlib.import_module(
        "fusionscope.kernels.gemv"
    )  # the module: the package's `gemv` is the function

    started = time.monotonic()
    out = Out(args.out)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    info = {"kind": "meta", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "name": props.name, "sms": props.multi_processor_count, "rotate_bytes": ROTATE_BYTES,
            "min_calls": MIN_CALLS, "replays": REPLAYS, "rounds": ROUNDS,
            "shipped": dict(gemv_module.TILES)}  # fmt: skip
    info["copy_gbps"] = copy_gbps(device)
    out.row(info)
    out.log(json.dumps(info))
    shapes = SHAPES
    if args.shapes:
        shapes = [(int(p[0]), int(p[1]), len(p) > 2, "given") for p in (s.split(":") for s in args.shapes.split(","))]
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    summary: list[dict[str, Any]] = []
    for K, N, has_bias, where in shapes:
        if time.monotonic() - started > args.budget:
            out.log(f"budget spent: stopped before {K}->{N}")
            break
        weight_bytes = N * K * 2
        copies = max(2, math.ceil(ROTATE_BYTES / weight_bytes))
        ws = [torch.randn(N, K, device=device, dtype=dtype, generator=gen) / math.sqrt(K) for _ in range(copies)]
        bias = torch.randn(N, device=device, dtype=dtype, generator=gen) if has_bias else None
        x = torch.randn(1, K, device=device, dtype=dtype, generator=gen)
        ref = gemv_module.gemv_reference(x, ws[0], bias)
        cublas_err = (F.linear(x, ws[0], bias).double() - ref).abs().max().item()
        variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "cublas": lambda w, x=x, bias=bias: F.linear(x, w, bias)
        }

        def with_tiles(
            config: tuple[int, int, int, int] | None, x=x, bias=bias
        ) -> Callable[[torch.Tensor], torch.Tensor]:
            def call(weight: torch.Tensor) -> torch.Tensor:
                return gemv_module.gemv(x, weight, bias)

            call.config = config  # type: ignore[attr-defined]
            return call

        variants["shipped"] = with_tiles(None)  # the default schedule for this N (`gemv.schedule`)
        for config in CONFIGS:
            variants[label(config)] = with_tiles(config)
        timers: dict[str, Callable[[], float]] = {}
        for name, fn in variants.items():
            gemv_module.TILES["force"] = getattr(fn, "config", None)
            try:
                got = fn(ws[0])
                torch.cuda.synchronize()
                err = (got.double() - ref).abs().max().item()
                again = fn(ws[0])
                ok = err <= max(2 * cublas_err, 1e-2) and bool(torch.equal(got, again))
                out.row({"kind": "check", "K": K, "N": N, "variant": name, "max_err": err, "cublas_err": cublas_err,
                         "repeatable": bool(torch.equal(got, again)), "ok": ok})  # fmt: skip
                if not ok:
                    out.log(f"{K}->{N} {name}: check FAILED err {err:.3g} (cuBLAS {cublas_err:.3g})")
                    continue
                n = copies * math.ceil(MIN_CALLS / copies)
                graph = capture([lambda w=w, fn=fn: fn(w) for w in ws], n)
                timers[name] = lambda graph=graph, n=n: replay_us(graph, n)
            except Exception as exc:  # a schedule that does not compile or launch is a row, not the end of the sweep
                torch.cuda.synchronize()
                error = f"{type(exc).__name__}: {exc}"[:600]
                out.row({"kind": "error", "K": K, "N": N, "variant": name, "error": error})
                out.log(f"{K}->{N} {name}: {type(exc).__name__}: {str(exc)[:200]}")
        gemv_module.TILES["force"] = None
        times: dict[str, list[float]] = {name: [] for name in timers}
        names = list(timers)
        for r in range(ROUNDS):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                us = timers[name]()
                times[name].append(us)
                out.row({"kind": "time", "K": K, "N": N, "variant": name, "round": r, "us": us})
        medians = {name: statistics.median(v) for name, v in times.items()}
        moved = weight_bytes + (K + N) * 2 + (N * 2 if has_bias else 0)
        base = medians.get("cublas", math.nan)
        point = {"kind": "point", "K": K, "N": N, "bias": has_bias, "where": where, "bytes": moved,
                 "us": medians, "gbps": {n: moved / us / 1e3 for n, us in medians.items()},
                 "x_cublas": {n: base / us for n, us in medians.items()}}  # fmt: skip
        out.row(point)
        summary.append(point)
        best = min((n for n in medians if n != "cublas"), key=medians.get, default=None)
        if best:
            out.log(f"{K:>6}->{N:<6} {where:<40} cuBLAS {base:7.2f} µs {moved / base / 1e3:6.0f} GB/s | best {best} "
                    f"{medians[best]:7.2f} µs {moved / medians[best] / 1e3:6.0f} GB/s ×{base / medians[best]:.3f} | "
                    f"shipped {label(gemv_module.schedule(N, K))} "
                    f"×{base / medians.get('shipped', math.nan):.3f}")  # fmt: skip
        del ws, timers
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    per_config = {}
    for config in CONFIGS:
        ratios = [p["x_cublas"].get(label(config)) for p in summary]
        if ratios and all(r is not None for r in ratios):
            per_config[label(config)] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    ranked = sorted(per_config.items(), key=lambda kv: -kv[1])
    for name, g in ranked:
        out.log(f"geomean ×cuBLAS {g:.3f}  {name}  (min {min(p['x_cublas'][name] for p in summary):.3f})")
    (args.out / "gemv.json").write_text(json.dumps({"meta": info, "points": summary, "geomean": dict(ranked),
                                                    "wall_s": time.monotonic() - started}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
