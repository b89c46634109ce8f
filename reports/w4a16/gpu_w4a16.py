"""W4A16 on the GPU: the tensor-core kernel (`new`: the shipped TILES and a few candidates per M) against the kernel it
replaced (`old`, `w4a16_before.py` beside this script) and bf16 cuBLAS (`torch.nn.functional.linear` on the float
weight before quantisation), after checking each against the float64 reference.

Usage, from the repository root on the GPU machine (fusionscope importable, one GPU):
    python3 reports/w4a16/gpu_w4a16.py OUT            # < 150 s on an H200 (BUDGET_S; --budget SECONDS to change)
Writes, as it goes (a run killed at its limit leaves what it measured):
    OUT/w4a16.jsonl   one JSON row per check, copy or timing, flushed after each; the first row is the meta (device,
                      SM count, torch / triton / CUDA versions, date), the last the summary
    OUT/w4a16.json    {"meta", "summary"}, rewritten at the end
    OUT/w4a16.log     what was printed: the table of medians and the targets
What it does, in order:
1. Copy roofs: a 1 GiB device-to-device copy, and per shape a copy of the packed weight's bytes; GB/s counts the bytes
   read plus written (2 × size) per second, timed as the kernels are.
2. Per shape (K → N: 4096 → 4096, 4096 → 14336, 14336 → 4096; group 128, random weights at nn.Linear's scale quantised
   by `quantize_w4`, bf16) and M in 1, 2, 4, 8, 16: each variant checked against the float64 reference (fresh
   random x, outputs poisoned with NaN first, bf16 tolerance × sqrt(K / 64)) and run twice for bit-equality (split-K
   sums in a fixed order); a variant that fails or does not compile is a row and is not timed. Then ROUNDS interleaved
   rounds of every passing variant and bf16 cuBLAS, each timed by `triton.testing.do_bench` (CUDA events, the L2 cache
   flushed before every call: the weights come from HBM as in a model's decode step), median per round, median of the
   rounds kept.
3. Summary per (shape, M): µs of new (shipped and best candidate), old and bf16; × bf16 (bf16 µs ÷ new µs); GB/s on
   the bytes the kernel must move (packed weight, scales, zeros, x, output) and % of the copy roof at the weight's size
   and of the 1 GiB one. Targets: ≥ 3× bf16 at M = 1..16 on the three shapes, ≥ 80% of the copy bandwidth at M = 1.
Compilation: ~20 kernel specialisations (a few seconds each) happen at the first check of each variant.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
ROWS = (1, 2, 4, 8, 16)
GROUP = 128
ROUNDS = 3
BUDGET_S = 140.0  # no new measurement starts after this many seconds
WARMUP_MS, REP_MS = 5, 25  # do_bench's, per timing
TARGET_X_BF16 = 3.0
TARGET_COPY_SHARE = 0.8
# Candidates beside the shipped TILES, by M: (label, tiles); BLOCK_M follows M (8 up to 8 rows, 16 above).
CANDIDATES = (
    ("n256-k256-w8", {"BLOCK_N": 256, "BLOCK_K": 256, "KC": 128, "SPLIT_K": 0, "num_warps": 8, "num_stages": 3}),
    ("n128-k128-w4", {"BLOCK_N": 128, "BLOCK_K": 128, "KC": 128, "SPLIT_K": 0, "num_warps": 4, "num_stages": 4}),
    ("n64-k256-w4", {"BLOCK_N": 64, "BLOCK_K": 256, "KC": 128, "SPLIT_K": 0, "num_warps": 4, "num_stages": 3}),
)


def kernel_module():
    return importlib.import_module("fusionscope.kernels.w4a16_gemm")


def before_module():
    """The replaced kernel, loaded from this folder (its op registered as fusionscope::w4a16_gemm_before)."""
    name = "w4a16_before"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "w4a16_before.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def meta(device: torch.device) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {"kind": "meta", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                            "python": platform.python_version(), "device": str(device)}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
    return info


class Out:
    """Rows to OUT/w4a16.jsonl as they come, lines to the log and stdout."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.jsonl = (folder / "w4a16.jsonl").open("a", encoding="utf-8")
        self.log_file = (folder / "w4a16.log").open("a", encoding="utf-8")

    def row(self, row: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(row, default=str) + "\n")
        self.jsonl.flush()

    def log(self, line: str) -> None:
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()


def cuda_timer(fn: Callable[[], Any]) -> float:
    """µs per call: median of do_bench's CUDA-event timings, L2 flushed before each call."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def wall_timer(fn: Callable[[], Any]) -> float:
    """µs per call by the wall clock (the CPU stand-in the tests use)."""
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_gbps(size: int, device: torch.device, timer: Callable) -> float:
    """GB/s of a device-to-device copy of `size` bytes, counting read + write."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * size / us / 1e3


def rows_tiles(config: dict[str, int], M: int) -> dict[str, int]:
    return dict(config, BLOCK_M=8 if M <= 8 else 16)


def new_variants(M: int) -> dict[str, dict[str, int] | None]:
    """{label: tiles for every M, or None for the shipped TILES}."""
    return {"new": None, **{f"new:{label}": rows_tiles(config, M) for label, config in CANDIDATES}}


def run_new(mod, tiles: dict[str, int] | None, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`call` with the module's TILES replaced by one unbounded entry (`tiles`), or as shipped (None)."""
    if tiles is None:
        return call()
    saved = dict(mod.TILES)
    mod.TILES.clear()
    mod.TILES["only"] = (None, tiles)
    try:
        return call()
    finally:
        mod.TILES.clear()
        mod.TILES.update(saved)


def variant_calls(mod, old, x: torch.Tensor, p, old_q: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable]:
    """{label: call(out=None)} for the new variants and the old kernel, and bf16 cuBLAS (no out)."""
    calls: dict[str, Callable[..., torch.Tensor]] = {}
    for label, tiles in new_variants(x.shape[0]).items():
        calls[label] = lambda o=None, tiles=tiles: run_new(mod, tiles, lambda: mod.w4a16_gemm(x, *p, out=o))
    calls["old"] = lambda o=None: old.w4a16_gemm(x, old_q, p.scales, p.zeros, GROUP, out=o)
    calls["bf16"] = lambda: F.linear(x, weight)
    return calls


def plan_of(mod, label: str, M: int, N: int, K: int, device: torch.device):
    tiles = new_variants(M)[label]
    return run_new(mod, tiles, lambda: mod.schedule(M, N, K, device, GROUP))


def measure(out: Out, folder: Path, device: torch.device | None = None, shapes=SHAPES, rows=ROWS,
            rounds: int = ROUNDS, budget_s: float = BUDGET_S, timer: Callable | None = None) -> dict:  # fmt: skip
    """The whole run (module docstring); returns the summary, also written as the last row."""
    from fusionscope.kernels.tolerances import assert_close

    device = device or torch.device("cuda", torch.cuda.current_device())
    timer = timer or (cuda_timer if device.type == "cuda" else wall_timer)
    mod, old = kernel_module(), before_module()
    info = meta(device)
    out.row(info)
    out.log(json.dumps(info))
    summary: dict[str, Any] = {"kind": "summary", "points": [], "copy_gbps_1gib": None, "stopped": None}
    start = time.monotonic()

    def over() -> bool:
        if time.monotonic() - start > budget_s:
            summary["stopped"] = f"time budget spent ({budget_s:.0f} s)"
            return True
        return False

    summary["copy_gbps_1gib"] = copy_gbps(1 << 30 if device.type == "cuda" else 1 << 20, device, timer)
    out.row({"kind": "copy", "bytes": "1GiB", "gbps": summary["copy_gbps_1gib"]})
    for K, N in shapes:
        if over():
            break
        gen = torch.Generator().manual_seed(K + N)
        weight = (torch.randn(N, K, generator=gen) / K**0.5).to(device, torch.bfloat16)
        p = mod.quantize_w4(weight, GROUP)
        old_q = old.pack_w4(mod.unpack_w4(p.qweight, K))  # the same levels in the replaced kernel's layout
        w64 = mod.dequantize_w4(p.qweight, p.scales.double(), p.zeros, GROUP, K)  # (K, N) float64
        at_size = copy_gbps(nbytes(p.qweight), device, timer)
        out.row({"kind": "copy", "K": K, "N": N, "bytes": nbytes(p.qweight), "gbps": at_size})
        for M in rows:
            if over():
                break
            x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
            exact = x.double() @ w64
            moved = nbytes(p.qweight, p.scales, p.zeros, x) + M * N * 2
            calls = variant_calls(mod, old, x, p, old_q, weight)
            passing = []
            for label, call in calls.items():
                row = {"kind": "check", "K": K, "N": N, "M": M, "variant": label}
                try:
                    if label != "bf16":  # bf16 is the float weight's answer: no tolerance against the quantised one
                        target = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
                        got = call(target)
                        assert got is target
                        assert_close(got, exact, torch.bfloat16, scale=max(1.0, math.sqrt(K / 64)))
                        row["bit_equal_twice"] = bool(torch.equal(call(), got))
                        row["max_abs_err"] = float((got.double() - exact).abs().max())
                    if label.startswith("new"):
                        plan = plan_of(mod, label, M, N, K, device)
                        row.update(tiles=plan.tiles, splits=plan.splits, even=plan.even)
                    row["ok"] = True
                    passing.append(label)
                except Exception as exc:  # a failure is a row; the variant is not timed
                    row.update(
                        ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], trace=traceback.format_exc()[-2000:]
                    )
                out.row(row)
            times: dict[str, list[float]] = {label: [] for label in passing}
            for r in range(rounds):
                if over():
                    break
                for label in passing:
                    us = timer(calls[label])
                    times[label].append(us)
                    out.row({"kind": "time", "K": K, "N": N, "M": M, "variant": label, "round": r, "us": us})
            medians = {label: sorted(v)[len(v) // 2] for label, v in times.items() if v}
            point = summarise(K, N, M, medians, moved, at_size, summary["copy_gbps_1gib"])
            summary["points"].append(point)
            out.row({"kind": "point", **point})
            out.log(line(point))
    targets(summary)
    summary["elapsed_s"] = time.monotonic() - start
    out.row(summary)
    (folder / "w4a16.json").write_text(json.dumps({"meta": info, "summary": summary}, indent=1, default=str))
    for text in summary["target_lines"]:
        out.log(text)
    return summary


def summarise(K: int, N: int, M: int, medians: dict[str, float], moved: int, at_size: float, roof: float) -> dict:
    """One (shape, M): the medians, the best new variant, × bf16 and the copy shares."""
    news = {k: v for k, v in medians.items() if k.startswith("new")}
    best = min(news, key=news.get) if news else None
    point = {"K": K, "N": N, "M": M, "us": medians, "best_new": best, "bytes": moved}
    bf16 = medians.get("bf16")
    for key, label in (("shipped", "new"), ("best", best), ("old", "old")):
        us = medians.get(label) if label else None
        point[f"{key}_us"] = us
        point[f"{key}_x_bf16"] = bf16 / us if us and bf16 else None
        point[f"{key}_gbps"] = moved / us / 1e3 if us else None
        point[f"{key}_copy_share_at_size"] = moved / us / 1e3 / at_size if us and at_size else None
        point[f"{key}_copy_share_1gib"] = moved / us / 1e3 / roof if us and roof else None
    return point


def line(point: dict) -> str:
    def f(v: float | None, spec: str = ".2f") -> str:
        return "—" if v is None else format(v, spec)

    us = point["us"]
    return (f"{point['K']:>5} → {point['N']:<5} M {point['M']:>2}: new {f(us.get('new'))} µs "
            f"({f(point['shipped_x_bf16'])}× bf16, {f(point['shipped_gbps'], '.0f')} GB/s, "
            f"{f(100 * point['shipped_copy_share_at_size'] if point['shipped_copy_share_at_size'] else None, '.0f')}% "
            f"copy at size) | best {point['best_new']} {f(point['best_us'])} µs ({f(point['best_x_bf16'])}×) | "
            f"old {f(us.get('old'))} µs ({f(point['old_x_bf16'])}×) | bf16 {f(us.get('bf16'))} µs")  # fmt: skip


def targets(summary: dict) -> None:
    """Each target, met or not, per point, for the shipped tiles and the best candidate."""
    lines, verdict = [], {}
    for key in ("shipped", "best"):
        x = [p[f"{key}_x_bf16"] for p in summary["points"]]
        share = [p[f"{key}_copy_share_at_size"] for p in summary["points"] if p["M"] == 1]
        x_ok = bool(x) and all(v is not None and v >= TARGET_X_BF16 for v in x)
        share_ok = bool(share) and all(v is not None and v >= TARGET_COPY_SHARE for v in share)
        verdict[key] = {"x_bf16_met": x_ok, "copy_share_m1_met": share_ok,
                        "x_bf16_min": min((v for v in x if v is not None), default=None),
                        "copy_share_m1_min": min((v for v in share if v is not None), default=None)}  # fmt: skip
        lines.append(f"{key}: >= {TARGET_X_BF16}x bf16 at every point: {'met' if x_ok else 'MISSED'} (min "
                     f"{verdict[key]['x_bf16_min']}); >= {TARGET_COPY_SHARE:.0%} of the copy bandwidth at M = 1: "
                     f"{'met' if share_ok else 'MISSED'} (min {verdict[key]['copy_share_m1_min']})")  # fmt: skip
    summary["targets"] = verdict
    summary["target_lines"] = lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=BUDGET_S)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = Out(args.out)
    summary = measure(out, args.out, budget_s=args.budget)
    return 0 if summary["points"] else 1


if __name__ == "__main__":
    sys.exit(main())
