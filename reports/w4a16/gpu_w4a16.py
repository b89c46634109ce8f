"""W4A16 on the GPU: the kernel as shipped (`new`: its TILES, the CUDA-core GEMV at M = 1 and the tensor-core kernel
above) and a few candidate tiles (`new:LABEL`, `CANDIDATES`, each one schedule for every M, its rows per program
following M) against bf16 cuBLAS (`torch.nn.functional.linear` on the float weight before quantisation), after
checking each against the float64 reference.

Usage, from the repository root on the GPU machine (fusionscope importable, one GPU):
    python3 reports/w4a16/gpu_w4a16.py OUT            # < 150 s on an H200 (BUDGET_S; --budget SECONDS to change)
Writes, as it goes (a run killed at its limit leaves what it measured):
    OUT/w4a16.jsonl   one JSON row per check, copy or timing, flushed after each; the first row is the meta (device,
                      SM count, torch / triton / CUDA versions, date, the timing method), the last the summary
    OUT/w4a16.json    {"meta", "summary"}, rewritten at the end
    OUT/w4a16.log     what was printed: the table of medians and the targets
Timing: on the GPU alone. One eager call of the new kernel's public function costs ~25-30 µs of Python on the host
(argument checks, schedule, workspace allocation, the torch.library dispatch, Triton's launcher): more than the kernel
at these sizes, so timing eager calls between CUDA events (`triton.testing.do_bench`) measures the host, the GPU idle
between the start event and the launch. In a model's decode step the calls run inside a CUDA graph, where that cost is
gone. So per (shape, M, variant) the script captures a CUDA graph (`graph_timer`: a few eager calls on a side stream,
then the capture there) of R calls back to back, each on its own copy of the weights (packed weight, scales, zeros;
the float weight for bf16), C copies cycling, C = max(2, ⌈160 MB ÷ one copy's bytes⌉) (> 3× the H200's 50 MB L2, so
every call reads its weights from HBM, as after do_bench's L2 flush), R the smallest multiple of C ≥ MIN_CALLS; x is
shared, each copy has its own preallocated output (bf16 cuBLAS, F.linear having no out, allocates in the graph's
pool). A timing replays the graph WARMUP_REPLAYS times, then REPLAYS times back to back between CUDA events (the GPU
never waits on the host), and keeps the median replay ÷ R. Rows and points record R (`calls`) and C (`copies`); a
variant whose capture fails is timed by do_bench instead (host included) and says so (`"timing": "do_bench"`).
What it does, in order:
1. Copy roofs: a 1 GiB device-to-device copy, and per shape a copy of the packed weight's bytes; GB/s counts the bytes
   read plus written (2 × size) per second, timed as the kernels are (a graph of copies, each between its own pair of
   buffers, the pairs rotating past the L2).
2. Per shape (K → N: 4096 → 4096, 4096 → 14336, 14336 → 4096; group 128, random weights at nn.Linear's scale quantised
   by `quantize_w4`, bf16) and M in 1, 2, 4, 8, 16: each variant checked against the float64 reference (fresh
   random x, outputs poisoned with NaN first, bf16 tolerance × sqrt(K / 64)) and run twice for bit-equality (split-K
   sums in a fixed order); a variant that fails or does not compile is a row and is not timed. Then ROUNDS interleaved
   rounds of every passing variant and bf16 cuBLAS, each a replay timing of its graph (above), median per round,
   median of the rounds kept. The weight copies are made once per shape and freed after it.
3. Summary per (shape, M): µs of new as shipped, of the best of it and the candidates, and of bf16; × bf16 (bf16 µs
   ÷ new µs); GB/s on the bytes the kernel must move (packed weight, scales, zeros, x, output) and % of the copy roof
   at the weight's size and of the 1 GiB one. Targets: ≥ 3× bf16 at M = 1..16 on the three shapes, ≥ 80% of the
   copy bandwidth at M = 1.
Compilation: ~20 kernel specialisations (a few seconds each) happen at the first check of each variant.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
ROWS = (1, 2, 4, 8, 16)
GROUP = 128
ROUNDS = 3
BUDGET_S = 140.0  # no new measurement starts after this many seconds
ROTATE_BYTES = 160_000_000  # weight copies per graph: together > 3× the H200's 50 MB L2, each call's come from HBM
MIN_CALLS = 48  # calls per graph at least (a whole number of turns over the copies): the replay's launch amortised
WARMUP_CALLS = 3  # eager calls on the capture's side stream before it (compilation, allocator, split-K counters)
WARMUP_REPLAYS, REPLAYS = 3, 20  # per timing of a graph
WARMUP_MS, REP_MS = 5, 25  # do_bench's, per timing of a variant whose capture failed
TIMING = {
    "graph_timer": "CUDA graph of R calls over C weight copies, L2-cold by rotation",
    "wall_timer": "wall clock of one eager call (the CPU stand-in)",
}
TARGET_X_BF16 = 3.0
TARGET_COPY_SHARE = 0.8
# Candidates beside the shipped TILES: (label, tiles), in the kernel's TILES format, each a copy of the TILES entry of
# its KERNEL (gemv: M = 1; decode: the tensor-core tiles up to 16 rows) with what the label names changed. BLOCK_M
# follows M (`rows_tiles`): the GEMV takes 1, 2 or 4 rows per program (more rows: more programs along the grid's third
# axis); the tensor-core kernel 16, the shipped decode tile. The GEMV's num_stages changes nothing (its loads feed no
# dot, so Triton does not pipeline them: the kernel's comment).
CANDIDATES = (
    ("gemv-n256-w8", {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 256, "SPLIT_K": 0, "num_warps": 8,
                      "num_stages": 1, "PREFETCH": False}),
    ("gemv-n128-k128-s2", {"KERNEL": "gemv", "BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 0,
                           "num_warps": 4, "num_stages": 2, "PREFETCH": False}),
    ("mma-n128", {"KERNEL": "mma", "UNPACK": "tile", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 0,
                  "GROUP_M": 1, "num_warps": 4, "num_stages": 3}),
    ("mma-n64-k256", {"KERNEL": "mma", "UNPACK": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 0,
                      "GROUP_M": 1, "num_warps": 4, "num_stages": 3}),
)  # fmt: skip
Call = Callable[[], Any]
# A timer takes one call per weight copy and returns (one timing: µs per call, what it does: "timing", "calls",
# "copies" and, for a fallback, "graph_error"); its preparation (a capture) happens once, before the rounds.
Timer = Callable[[Sequence[Call]], tuple[Callable[[], float], dict[str, Any]]]


def kernel_module():
    return importlib.import_module("fusionscope.kernels.w4a16_gemm")


def meta(device: torch.device, timer: Timer) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {"kind": "meta", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                            "python": platform.python_version(), "device": str(device),
                            "timing": TIMING.get(getattr(timer, "__name__", ""), repr(timer)),
                            "rotate_bytes": ROTATE_BYTES, "min_calls": MIN_CALLS, "warmup_replays": WARMUP_REPLAYS,
                            "replays": REPLAYS}  # fmt: skip
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


def capture(calls: Sequence[Call], n: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of n calls, cycling through `calls`, captured on a side stream after a few eager calls there (the
    PyTorch docs' recipe: the warm-up must not be on the stream the graph's inputs come from)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(WARMUP_CALLS):
            calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(n):
            calls[i % len(calls)]()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, n: int) -> float:
    """µs per call: the median of REPLAYS timed replays ÷ n, after WARMUP_REPLAYS untimed ones. All are queued back
    to back before one synchronisation, so each start event runs as the previous replay ends: GPU time only (a graph
    launch costs the host a few µs against a replay of n kernels)."""
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = sorted(start.elapsed_time(end) for start, end in events)
    return 1e3 * ms[len(ms) // 2] / n


def bench_us(fn: Call) -> float:
    """µs per call: median of do_bench's CUDA-event timings, L2 flushed before each call (host cost included)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def graph_timer(calls: Sequence[Call]) -> tuple[Callable[[], float], dict[str, Any]]:
    """The GPU's timer (module docstring): a graph of R calls over the C copies `calls` stands for (R the smallest
    multiple of C ≥ MIN_CALLS), each timing `replay_us` of it. A capture that fails falls back to do_bench on the first
    copy, so a variant that cannot be captured is still timed, and says how."""
    n = len(calls) * math.ceil(MIN_CALLS / len(calls))
    try:
        graph = capture(calls, n)
    except Exception as exc:
        with contextlib.suppress(Exception):  # what the failed capture queued, if the context still takes calls
            torch.cuda.synchronize()
        error = f"{type(exc).__name__}: {exc}"[:1000]
        return (lambda: bench_us(calls[0])), {"timing": "do_bench", "calls": 1, "copies": 1, "graph_error": error}
    # the timer holds `calls` too: the graph writes into the buffers their closures own (outputs, a workspace), which
    # must outlive it; once freed and reused, a replay writes into another tensor's memory, or into memory the
    # allocator gave back (an illegal address: the Gluon check's first GPU run, reports/w4a16/gluon/)
    return (lambda calls=calls: replay_us(graph, n)), {"timing": "cuda_graph", "calls": n, "copies": len(calls)}


def wall_timer(calls: Sequence[Call]) -> tuple[Callable[[], float], dict[str, Any]]:
    """µs per call by the wall clock, one eager call of the first copy (the CPU stand-in the tests use)."""

    def once() -> float:
        start = time.perf_counter()
        calls[0]()
        return 1e6 * (time.perf_counter() - start)

    return once, {"timing": "wall", "calls": 1, "copies": len(calls)}


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copies_for(size: int, device: torch.device) -> int:
    """Copies of `size` bytes a graph cycles through so that each call's are out of the L2 by its next turn; one off
    the GPU (no L2 to defeat, and the interpreter is slow)."""
    return max(2, math.ceil(ROTATE_BYTES / max(size, 1))) if device.type == "cuda" else 1


def rotated(weights: tuple, copies: int) -> list[tuple]:
    """`weights` and copies - 1 others with its tensors cloned (other entries as they are; a NamedTuple stays one)."""

    def clone() -> tuple:
        items = [t.clone() if isinstance(t, torch.Tensor) else t for t in weights]
        return weights._make(items) if hasattr(weights, "_make") else tuple(items)

    return [weights, *(clone() for _ in range(copies - 1))]


def set_bytes(weights: tuple) -> int:
    return nbytes(*(t for t in weights if isinstance(t, torch.Tensor)))


def free(device: torch.device) -> None:
    """Give the freed weight copies and graph pools back to the device, so the next shape starts from what it needs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def copy_gbps(size: int, device: torch.device, timer: Timer) -> tuple[float, dict[str, Any]]:
    """GB/s of a device-to-device copy of `size` bytes, counting read + write, timed as the kernels are: one call per
    (source, destination) pair, the pairs rotating past the L2 like the weight copies."""
    pairs = [(torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device))
             for _ in range(copies_for(2 * size, device))]  # fmt: skip
    once, info = timer([lambda src=src, dst=dst: dst.copy_(src) for src, dst in pairs])
    return 2 * size / once() / 1e3, info


def rows_tiles(config: dict[str, int | str], M: int) -> dict[str, int | str]:
    """`config` with the rows per program for M rows: the GEMV the next power of two ≥ M, at most 4 (its limit; above
    it the rows take several programs), the tensor-core kernel 16."""
    if config["KERNEL"] == "gemv":
        return dict(config, BLOCK_M=min(1 << (M - 1).bit_length(), 4))
    return dict(config, BLOCK_M=16)


def new_variants(M: int) -> dict[str, dict[str, int | str] | None]:
    """{label: tiles for every M, or None for the shipped TILES}."""
    return {"new": None, **{f"new:{label}": rows_tiles(config, M) for label, config in CANDIDATES}}


def run_new(mod, tiles: dict[str, int | str] | None, call: Callable[[], torch.Tensor]) -> torch.Tensor:
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


class Variant(NamedTuple):
    """One thing timed: `run(weights, out)` on one copy of the weight set `weights` names (`weight_sets`), into `out`
    (None: a new tensor); `takes_out` False where the API has none (F.linear), `run` then ignoring it."""

    weights: str
    run: Callable[[tuple, torch.Tensor | None], torch.Tensor]
    takes_out: bool = True


def weight_sets(p, weight: torch.Tensor, device: torch.device) -> dict[str, list[tuple]]:
    """{name: [the original, its copies]} for the new variants' `PackedW4` (packed weight, scales, zeros) and bf16
    cuBLAS' float weight: `copies_for` each."""
    base = {"packed": p, "bf16": (weight,)}
    return {name: rotated(w, copies_for(set_bytes(w), device)) for name, w in base.items()}


def variant_calls(mod, x: torch.Tensor) -> dict[str, Variant]:
    """{label: Variant} for the new variants (into `out`) and bf16 cuBLAS (no out)."""
    calls: dict[str, Variant] = {}
    for label, tiles in new_variants(x.shape[0]).items():
        calls[label] = Variant(
            "packed", lambda w, o=None, tiles=tiles: run_new(mod, tiles, lambda: mod.w4a16_gemm(x, *w, out=o))
        )
    calls["bf16"] = Variant("bf16", lambda w, o=None: F.linear(x, *w), takes_out=False)
    return calls


def bound_calls(variant: Variant, copies: list[tuple], x: torch.Tensor, N: int) -> list[Call]:
    """One call per weight copy, each into its own preallocated (M, N) output where the variant takes one."""
    calls: list[Call] = []
    for w in copies:
        o = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device) if variant.takes_out else None
        calls.append(lambda w=w, o=o: variant.run(w, o))
    return calls


def plan_of(mod, label: str, M: int, N: int, K: int, device: torch.device):
    tiles = new_variants(M)[label]
    return run_new(mod, tiles, lambda: mod.schedule(M, N, K, device))


def time_rounds(out: Out, where: dict[str, int], timers: dict[str, tuple[Callable[[], float], dict[str, Any]]],
                rounds: int, over: Callable[[], bool]) -> dict[str, float]:  # fmt: skip
    """`rounds` interleaved rounds over the prepared timers (a row per timing); the median per variant."""
    times: dict[str, list[float]] = {label: [] for label in timers}
    failed: set[str] = set()
    for r in range(rounds):
        if over():
            break
        for label, (once, info) in timers.items():
            if label in failed:
                continue
            row = {"kind": "time", **where, "variant": label, "round": r, **info}
            try:
                row["us"] = once()
                times[label].append(row["us"])
            except Exception as exc:  # a timing that fails (the do_bench fallback's eager call, say) ends the variant
                failed.add(label)
                row.update(us=None, error=f"{type(exc).__name__}: {exc}"[:2000])
            out.row(row)
    return {label: sorted(v)[len(v) // 2] for label, v in times.items() if v}


def measure(out: Out, folder: Path, device: torch.device | None = None, shapes=SHAPES, rows=ROWS,
            rounds: int = ROUNDS, budget_s: float = BUDGET_S, timer: Timer | None = None) -> dict:  # fmt: skip
    """The whole run (module docstring); returns the summary, also written as the last row."""
    from fusionscope.kernels.tolerances import assert_close

    device = device or torch.device("cuda", torch.cuda.current_device())
    timer = timer or (graph_timer if device.type == "cuda" else wall_timer)
    mod = kernel_module()
    info = meta(device, timer)
    out.row(info)
    out.log(json.dumps(info))
    summary: dict[str, Any] = {"kind": "summary", "points": [], "copy_gbps_1gib": None, "stopped": None}
    start = time.monotonic()

    def over() -> bool:
        if time.monotonic() - start > budget_s:
            summary["stopped"] = f"time budget spent ({budget_s:.0f} s)"
            return True
        return False

    summary["copy_gbps_1gib"], how = copy_gbps(1 << 30 if device.type == "cuda" else 1 << 20, device, timer)
    out.row({"kind": "copy", "bytes": "1GiB", "gbps": summary["copy_gbps_1gib"], **how})
    free(device)
    for K, N in shapes:
        if over():
            break
        gen = torch.Generator().manual_seed(K + N)
        weight = (torch.randn(N, K, generator=gen) / K**0.5).to(device, torch.bfloat16)
        p = mod.quantize_w4(weight, GROUP)
        w64 = mod.dequantize_w4(p.qweight, p.scales.double(), p.zeros, GROUP, K)  # (K, N) float64
        at_size, how = copy_gbps(nbytes(p.qweight), device, timer)
        out.row({"kind": "copy", "K": K, "N": N, "bytes": nbytes(p.qweight), "gbps": at_size, **how})
        sets = weight_sets(p, weight, device)
        for M in rows:
            if over():
                break
            point = measure_point(out, mod, sets, K, N, M, gen, w64, timer, rounds, over, assert_close)
            point = summarise(K, N, M, *point, at_size, summary["copy_gbps_1gib"])
            summary["points"].append(point)
            out.row({"kind": "point", **point})
            out.log(line(point))
        del weight, p, w64, sets
        free(device)
    targets(summary)
    summary["elapsed_s"] = time.monotonic() - start
    out.row(summary)
    (folder / "w4a16.json").write_text(json.dumps({"meta": info, "summary": summary}, indent=1, default=str))
    for text in summary["target_lines"]:
        out.log(text)
    return summary


def measure_point(out: Out, mod, sets: dict[str, list[tuple]], K: int, N: int, M: int, gen: torch.Generator,
                  w64: torch.Tensor, timer: Timer, rounds: int, over: Callable[[], bool],
                  assert_close: Callable) -> tuple[dict[str, float], int, dict[str, dict[str, Any]]]:  # fmt: skip
    """One (shape, M): every variant checked (a row each), the passing ones prepared for timing (their graphs, freed
    on return) and timed in rounds. Returns (median µs per variant, bytes moved, each variant's timing info)."""
    device = w64.device
    x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
    exact = x.double() @ w64
    p = sets["packed"][0]
    moved = nbytes(p.qweight, p.scales, p.zeros, x) + M * N * 2
    calls = variant_calls(mod, x)
    passing = []
    for label, variant in calls.items():
        row = {"kind": "check", "K": K, "N": N, "M": M, "variant": label}
        weights = sets[variant.weights][0]
        try:
            if label != "bf16":  # bf16 is the float weight's answer: no tolerance against the quantised one
                target = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
                got = variant.run(weights, target)
                assert got is target
                assert_close(got, exact, torch.bfloat16, scale=max(1.0, math.sqrt(K / 64)))
                row["bit_equal_twice"] = bool(torch.equal(variant.run(weights, None), got))
                row["max_abs_err"] = float((got.double() - exact).abs().max())
            if label.startswith("new"):
                plan = plan_of(mod, label, M, N, K, device)
                row.update(tiles=plan.tiles, splits=plan.splits, blocks_per_split=plan.blocks_per_split)
            row["ok"] = True
            passing.append(label)
        except Exception as exc:  # a failure is a row; the variant is not timed
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], trace=traceback.format_exc()[-2000:])
        out.row(row)
    timers = {}
    for label in passing:
        if over():
            break
        variant = calls[label]
        timers[label] = timer(bound_calls(variant, sets[variant.weights], x, N))
    medians = time_rounds(out, {"K": K, "N": N, "M": M}, timers, rounds, over)
    return medians, moved, {label: info for label, (_, info) in timers.items()}


def summarise(K: int, N: int, M: int, medians: dict[str, float], moved: int, timing: dict[str, dict[str, Any]],
              at_size: float, roof: float) -> dict:  # fmt: skip
    """One (shape, M): the medians, the best new variant, × bf16 and the copy shares, and how each was timed."""
    news = {k: v for k, v in medians.items() if k.startswith("new")}
    best = min(news, key=news.get) if news else None
    point = {"K": K, "N": N, "M": M, "us": medians, "best_new": best, "bytes": moved, "timing": timing}
    bf16 = medians.get("bf16")
    for key, label in (("shipped", "new"), ("best", best)):
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
            f"bf16 {f(us.get('bf16'))} µs")  # fmt: skip


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
