"""W4A16 on the GPU: fusionscope::w4a16_gemm checked against its reference, then timed against the unfused chain,
bf16 cuBLAS and torchao's int4 GEMM; or, in `sweep` mode, every schedule candidate checked, then timed side by side.

Usage, from the repository root on the GPU machine (fusionscope installed or on the path, bf16, one GPU):
    python3 reports/w4a16/gpu_w4a16.py OUT                  # check + bench (< 4 min)
    python3 reports/w4a16/gpu_w4a16.py OUT sweep [--quick] [--budget SECONDS] [--warm-l2]   # (< 5 min; `tune`: same)
Writes, as it goes (a run killed at its limit leaves what it measured):
    OUT/w4a16_<mode>.jsonl  one JSON row per check or timing, flushed after each
    OUT/w4a16_<mode>.json   {"meta", "rows", "summary"}, rewritten every DUMP_EVERY_S seconds and at the end
    OUT/w4a16_<mode>.log    what was printed
Shapes: Llama-3-8B's projections as (K, N): 4096 → 4096, 4096 → 14336, 14336 → 4096, group 128, random weights at
nn.Linear's scale quantised by `quantize_w4`.

check (bench mode, first): for M in 1, 4, 16, 4096 on each shape, the kernel against the float64 reference (tolerance:
bf16's times sqrt(K / 64), the kernel tests' rule) and against the unfused chain in bf16 (max difference in units of the
output's last place, share of outputs that differ); CUDA-graph replay equal to eager (M = 1, 16); at one shape the op
under torch.compile(fullgraph=True) equal to eager (if the time budget allows).
bench: GPU time by CUDA-graph replay (`do_bench_cudagraph`, median) for M = 1, 4, 16 and 4096: fused, `unfused`
(dequantise into a bf16 weight, then cuBLAS: `w4a16_reference`), `bf16` (cuBLAS on the float weight before
quantisation), torchao's int4 weight-only Linear where it imports (its version recorded; otherwise the reason).
Variants are interleaved, ROUNDS rounds, the median kept. GB/s on the bytes each variant must move at least (fused:
x, packed weight, scales, zeros, output; bf16: x, the bf16 weight, output), % of the copy bandwidth measured here
(read + write bytes of a 1 GiB device copy, per second). Ratios against bf16 in the same run.
sweep: copy and read roofs (1 GiB; CUDA-graph replay as the kernels, and CUDA events), then per shape a read roof at
the packed weight's size, then for M = 1, 4, 16 and 4096 on each shape: the shipped TILES ("shipped"), the schedule
measured on 2026-12-01 ("before"), the decode candidates (SWEEP_DECODE, at M ≤ 16) or the prefill ones
(SWEEP_PREFILL, at M = 4096), each checked against the float64 reference first (a failure or a compile error is a
row; the variant is not timed), then timed with bf16 cuBLAS in ROUNDS interleaved rounds (medians), each call on the
next of enough copies of its weights to miss L2 (unless --warm-l2). Every check and timing is a row as it happens;
the summary — best variant per (shape, M) with % of the copy and read roofs and × bf16, and per M the candidate with
the best geometric-mean ratio to bf16 — is printed and written however the run ends (budget: SWEEP_BUDGET_S or
--budget). --quick: the first few candidates, one round.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
DECODE_ROWS = (1, 4, 16)
PREFILL_ROWS = 4096
GROUP = 128
ROUNDS = 3
BUDGET_S = 215  # no new measurement starts after this (the whole run must end within 4 minutes)
BF16_ATOL, BF16_RTOL = 1.6e-2, 1.6e-2  # kernels/tolerances.py, bfloat16
DEVICE = "cuda"

MODES = ("bench", "sweep", "tune")  # tune: the former name of sweep

DUMP_EVERY_S = 5  # the .json is rewritten at most this often (and at the end); the .jsonl gets every row at once
START = time.monotonic()


class Out:
    """Rows and log lines written as they come."""

    def __init__(self, folder: Path, mode: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.jsonl = (folder / f"w4a16_{mode}.jsonl").open("a", encoding="utf-8")
        self.log_file = (folder / f"w4a16_{mode}.log").open("a", encoding="utf-8")
        self.json_path = folder / f"w4a16_{mode}.json"
        self.rows: list[dict] = []
        self.summary: dict[str, Any] = {}
        self.dumped = 0.0
        self.meta = meta()
        self.log(json.dumps(self.meta))
        self._dump()

    def log(self, text: str) -> None:
        print(text, flush=True)
        self.log_file.write(text + "\n")
        self.log_file.flush()

    def row(self, row: dict) -> None:
        row = {"t_s": round(time.monotonic() - START, 1), **row}
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if time.monotonic() - self.dumped > DUMP_EVERY_S:  # the .json grows with the rows: not rewritten per row
            self._dump()

    def _dump(self) -> None:
        self.dumped = time.monotonic()
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "rows": self.rows, "summary": self.summary}, indent=1) + "\n")
        tmp.replace(self.json_path)

    def finish(self, summary: dict) -> None:
        self.summary = summary
        self._dump()


def meta() -> dict:
    import fusionscope

    versions = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                "fusionscope": getattr(fusionscope, "__version__", None), "python": sys.version.split()[0]}  # fmt: skip
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except Exception as exc:  # not needed here
        versions["transformers"] = f"not importable: {exc}"
    cuda = DEVICE == "cuda"
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0) if cuda else DEVICE,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
            "versions": versions, "group_size": GROUP, "dtype": "bfloat16"}  # fmt: skip


def over_budget() -> bool:
    return time.monotonic() - START > BUDGET_S


def gpu_us(fn: Callable[[], Any], rep: int = 20) -> float:
    """Median GPU µs per call by CUDA-graph replay (launch cost excluded), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def copy_gbps() -> float:
    """Device-to-device copy bandwidth, read + write bytes per second, on 1 GiB."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    us = gpu_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (us * 1e3)


def kernel() -> Any:
    return importlib.import_module("fusionscope.kernels.w4a16_gemm")


def build(K: int, N: int) -> dict:
    mod = kernel()
    gen = torch.Generator(device=DEVICE).manual_seed(K * 7 + N)
    w = torch.randn(N, K, device=DEVICE, generator=gen).div_(K**0.5).to(torch.bfloat16)
    return {"w": w, "packed": mod.quantize_w4(w, GROUP)}


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def ulp_bf16(t: torch.Tensor) -> torch.Tensor:
    return 2.0 ** (torch.floor(torch.log2(t.abs().clamp_min(1e-30))) - 7)


def check(out: Out, weights: dict, K: int, N: int, M: int) -> None:
    mod = kernel()
    p = weights["packed"]
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    fused = mod.w4a16_gemm(x, *p)
    exact = mod.w4a16_reference(x.double(), p.qweight, p.scales.double(), p.zeros, p.group_size)
    unfused = mod.w4a16_reference(x, *p)
    scale = max(1.0, math.sqrt(K / 64))
    err = (fused.double() - exact).abs()
    limit = BF16_ATOL * scale + BF16_RTOL * scale * exact.abs()
    diff = (fused.double() - unfused.double()).abs()
    plan = mod.schedule(M, N, K, x.device)
    row = {"kind": "check", "K": K, "N": N, "M": M, "splits": plan.splits, "tiles": plan.tiles,
           "max_err_vs_fp64": err.max().item(), "passed": bool((err <= limit).all()),
           "max_ulps_vs_unfused": (diff / ulp_bf16(unfused.double())).max().item(),
           "share_differing_from_unfused": (diff > 0).float().mean().item()}  # fmt: skip
    if M in (1, 16) and DEVICE == "cuda":
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            mod.w4a16_gemm(static_x, *p)  # warm-up on the side stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = mod.w4a16_gemm(static_x, *p)
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        row["graph_replay_equals_eager"] = bool(torch.equal(graphed, mod.w4a16_gemm(static_x, *p)))
    out.row(row)
    out.log(f"check K{K} N{N} M{M}: {row}")


def check_compile(out: Out, weights: dict, K: int, N: int) -> None:
    mod = kernel()
    p = weights["packed"]
    x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
    t0 = time.monotonic()
    compiled = torch.compile(lambda x: mod.w4a16_gemm(x, *p), fullgraph=True)
    got = compiled(x)
    row = {"kind": "compile", "K": K, "N": N, "M": 1, "equals_eager": bool(torch.equal(got, mod.w4a16_gemm(x, *p))),
           "compile_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    out.row(row)
    out.log(f"compile: {row}")


def variants(weights: dict, torchao: Callable | None) -> dict[str, Callable[[torch.Tensor], Any]]:
    mod = kernel()
    p = weights["packed"]
    found = {
        "fused": lambda x: mod.w4a16_gemm(x, *p),
        "unfused": lambda x: mod.w4a16_reference(x, *p),
        "bf16": lambda x: F.linear(x, weights["w"]),
    }
    if torchao is not None:
        try:
            linear = torchao(weights["w"])
            found["torchao"] = lambda x: linear(x)
        except Exception as exc:
            weights["torchao_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return found


def traffic(name: str, weights: dict, M: int, K: int, N: int) -> int | None:
    """The least bytes a variant must move: its inputs read once, its output written once."""
    p, act = weights["packed"], (M * K + M * N) * 2
    if name == "fused":
        return nbytes(p.qweight, p.scales, p.zeros) + act
    if name == "bf16":
        return nbytes(weights["w"]) + act
    return None  # the unfused chain and torchao: their own layouts' temporaries are not modelled here


def bench(out: Out, weights: dict, K: int, N: int, M: int, torchao: Callable | None, copy: float) -> None:
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    fns = variants(weights, torchao)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            if name not in times:  # failed in an earlier round
                continue
            try:
                times[name].append(gpu_us(lambda fn=fn: fn(x)))
            except Exception as exc:
                del times[name]
                out.row({"kind": "bench", "K": K, "N": N, "M": M, "variant": name,
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})  # fmt: skip
    medians = {name: sorted(t)[len(t) // 2] for name, t in times.items() if t}
    for name, us in medians.items():
        moved = traffic(name, weights, M, K, N)
        gbps = moved / (us * 1e3) if moved else None
        row = {"kind": "bench", "K": K, "N": N, "M": M, "variant": name, "gpu_us": us, "rounds_us": times[name],
               "bytes": moved, "gbps": gbps, "pct_copy_bw": 100 * gbps / copy if gbps else None,
               "speedup_vs_bf16": medians["bf16"] / us if "bf16" in medians else None}  # fmt: skip
        out.row(row)
    if "torchao_error" in weights:
        out.row({"kind": "bench", "K": K, "N": N, "M": M, "variant": "torchao", "error": weights["torchao_error"]})
    fused = medians.get("fused")
    line = ", ".join(f"{n} {t:.1f} µs" for n, t in medians.items())
    out.log(f"bench K{K} N{N} M{M}: {line}" + (f"; fused {medians['bf16'] / fused:.2f}× bf16" if fused else ""))


def run_bench(out: Out) -> None:
    from fusionscope.bench.cases import _torchao_int4

    copy = copy_gbps()
    torchao, torchao_note = _torchao_int4(GROUP)
    out.meta["copy_gbps"] = copy
    out.meta["torchao"] = torchao_note if torchao is None else f"torchao {torchao_note}"
    out.log(f"copy bandwidth {copy:.0f} GB/s; torchao: {out.meta['torchao']}")
    built = {}
    for K, N in SHAPES:
        built[(K, N)] = build(K, N)
        for M in (*DECODE_ROWS, PREFILL_ROWS):
            if over_budget():
                out.log("time budget spent: remaining checks skipped")
                break
            try:
                check(out, built[(K, N)], K, N, M)
            except Exception as exc:
                out.row({"kind": "check", "K": K, "N": N, "M": M, "error": repr(exc)[:300]})
                out.log(traceback.format_exc())
    for K, N in SHAPES:
        for M in (*DECODE_ROWS, PREFILL_ROWS):
            if over_budget():
                out.log("time budget spent: remaining timings skipped")
                break
            try:
                bench(out, built[(K, N)], K, N, M, torchao, copy)
            except Exception as exc:
                out.row({"kind": "bench", "K": K, "N": N, "M": M, "error": repr(exc)[:300]})
                out.log(traceback.format_exc())
    if time.monotonic() - START < BUDGET_S - 60:  # a first compile takes tens of seconds
        try:
            check_compile(out, built[SHAPES[0]], *SHAPES[0])
        except Exception as exc:
            out.row({"kind": "compile", "error": repr(exc)[:300]})
            out.log(traceback.format_exc())
    else:
        out.row({"kind": "compile", "skipped": "time budget"})
    summary = {}
    for r in out.rows:
        if r.get("kind") == "bench" and r.get("variant") == "fused" and "gpu_us" in r:
            summary[f"K{r['K']} N{r['N']} M{r['M']}"] = {
                "fused_us": r["gpu_us"], "speedup_vs_bf16": r["speedup_vs_bf16"], "pct_copy_bw": r["pct_copy_bw"]
            }  # fmt: skip
    summary["checks_passed"] = all(r.get("passed", False) for r in out.rows if r.get("kind") == "check")
    out.finish(summary)
    out.log(json.dumps(summary, indent=1))


def gemv(bn: int, bk: int, warps: int, prefetch: bool = True, bm: int = 4, split: int = 0) -> dict:
    """A configuration of the CUDA-core decode kernel (`_w4a16_gemv_kernel`); num_stages changes nothing there."""
    return {"KERNEL": "gemv", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
            "num_stages": 1, "PREFETCH": prefetch}  # fmt: skip


def mma(bm: int, bn: int, bk: int, warps: int, stages: int, unpack: str = "tile", split: int = 0,
        group_m: int = 1) -> dict:  # fmt: skip
    """A configuration of the tensor-core kernel (`_w4a16_mma_kernel`)."""
    return {"KERNEL": "mma", "UNPACK": unpack, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
            "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}  # fmt: skip


# (config, programs per SM for SPLIT_K = 0), besides the shipped TILES ("shipped") and the schedule measured on
# 2026-12-01 ("before"): decode ones are timed at M = 1, 4 and 16 on each shape, prefill ones at M = 4096, in this
# order (--quick keeps the first few). gemv's BLOCK_M is a most: the schedule takes min(BLOCK_M, next power of two
# ≥ M). Compiled for sm_90 with Triton 3.9's ptxas (no GPU), none asks for more shared memory than an H200 has and only
# the 128 × 256 × 128 prefill tile with 3 stages spills registers (16 bytes); left out for that: gemv BLOCK_M 4 with 4
# warps and 256 columns (592 bytes spilled), 256 × 128 × 128 with 3 stages (241 KiB of shared memory).
SWEEP_DECODE: list[tuple[dict, int]] = [
    (gemv(128, 128, 4), 2),
    (gemv(256, 128, 8, prefetch=False), 2),
    (mma(16, 64, 256, 4, 3), 2),
    (gemv(64, 128, 2), 2),
    (gemv(256, 128, 8), 4),
    (gemv(256, 128, 8, split=1), 2),
    (gemv(256, 128, 8, bm=2), 2),
    (gemv(512, 128, 8, bm=1), 2),
    (gemv(256, 128, 4, bm=1), 2),
    (gemv(128, 256, 4, prefetch=False), 2),
    (mma(16, 256, 128, 4, 3), 2),
    (mma(16, 128, 256, 8, 3), 2),
    (mma(16, 64, 128, 4, 3), 2),
    (mma(16, 128, 128, 4, 4), 4),
]
SWEEP_PREFILL: list[tuple[dict, int]] = [
    (mma(128, 128, 128, 8, 3, split=1, group_m=8), 2),
    (mma(128, 256, 128, 8, 3, split=1, group_m=8), 2),
    (mma(256, 128, 128, 8, 2, split=1, group_m=8), 2),
    (mma(64, 256, 128, 4, 3, split=1, group_m=8), 2),
    (mma(128, 128, 128, 4, 4, split=1, group_m=8), 2),
    (mma(128, 256, 128, 8, 2, split=1, group_m=16), 2),
    (mma(128, 128, 256, 8, 2, split=1, group_m=8), 2),
]
QUICK_DECODE, QUICK_PREFILL = 3, 1  # --quick keeps the first of each list
SWEEP_BUDGET_S = 285  # no new measurement starts after this; the summary is written whatever happened
SWEEP_REP_MS = 10  # do_bench_cudagraph's rep per timing
ROOF_ELEMENTS = 2**29  # bf16 elements of the copy and read roofs: 1 GiB


def label(config: dict, fill: int) -> str:
    """A short name of a configuration, unique within the sweep."""
    c = config
    split = f"S{c['SPLIT_K']}" if c["SPLIT_K"] else f"auto{fill}"
    if c["KERNEL"] == "gemv":
        return (f"gemv BM{c['BLOCK_M']} BN{c['BLOCK_N']} BK{c['BLOCK_K']} W{c['num_warps']} "
                f"{'pf' if c.get('PREFETCH') else 'nopf'} {split}")  # fmt: skip
    return (f"mma-{c['UNPACK']} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} W{c['num_warps']} st{c['num_stages']} "
            f"G{c['GROUP_M']} {split}")  # fmt: skip


class Applied:
    """Within the block, `w4a16_gemm` runs `config` at every M (TILES replaced by one unbounded entry) with FILL's
    programs per SM = fill; or, with config None, the TILES given (None: as committed). Restored on exit; Tunables
    forget the recorded launch plans on every change."""

    def __init__(self, config: dict | None, fill: int | None = None, tiles: dict | None = None) -> None:
        self.config, self.fill, self.tiles = config, fill, tiles

    def __enter__(self) -> None:
        mod = kernel()
        self.saved_tiles, self.saved_fill = dict(mod.TILES), dict(mod.FILL)
        if self.config is not None:
            mod.TILES.clear()
            mod.TILES["sweep"] = (None, dict(self.config))
        elif self.tiles is not None:
            mod.TILES.clear()
            mod.TILES.update(self.tiles)
        if self.fill is not None:
            mod.FILL["programs_per_sm"] = self.fill

    def __exit__(self, *exc: object) -> None:
        mod = kernel()
        mod.TILES.clear()
        mod.TILES.update(self.saved_tiles)
        mod.FILL.clear()
        mod.FILL.update(self.saved_fill)


def sweep_variants(quick: bool) -> dict[str, Applied]:
    """name → what to apply: the shipped TILES, the schedule measured on 2026-12-01, then the candidates."""
    mod = kernel()
    decode = SWEEP_DECODE[:QUICK_DECODE] if quick else SWEEP_DECODE
    prefill = SWEEP_PREFILL[:QUICK_PREFILL] if quick else SWEEP_PREFILL
    found = {"shipped": Applied(None), "before": Applied(None, tiles=dict(mod.SHIPPED_BEFORE))}
    for config, fill in (*decode, *prefill):
        found[label(config, fill)] = Applied(config, fill)
    return found


def is_decode(name: str, variant: Applied) -> bool | None:
    """True for a decode candidate, False for a prefill one, None for the shipped schedules (both)."""
    if variant.config is None:
        return None
    return (variant.config, variant.fill) in SWEEP_DECODE


def rotating(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """Each call runs the next of `fns`: captured in a CUDA graph, consecutive calls read different weights."""
    state = {"i": 0}

    def call() -> Any:
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()

    return call


def copies_for(nbytes_one: int, cold: bool) -> int:
    """Copies of a weight so that the calls cycling through them read from HBM, not L2: twice the L2 in all."""
    if not cold:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, min(16, math.ceil(2 * l2 / nbytes_one)))


def _roofs_on(src: torch.Tensor, dst: torch.Tensor) -> dict:
    size = src.numel() * src.element_size()

    def events_us(fn: Callable[[], Any]) -> float:
        return triton.testing.do_bench(fn, return_mode="median") * 1e3

    return {"bytes": size, "copy_gbps": 2 * size / (gpu_us(lambda: dst.copy_(src)) * 1e3),
            "read_gbps": size / (gpu_us(lambda: src.sum()) * 1e3),
            "copy_gbps_events": 2 * size / (events_us(lambda: dst.copy_(src)) * 1e3),
            "read_gbps_events": size / (events_us(lambda: src.sum()) * 1e3)}  # fmt: skip


def roofs(out: Out) -> dict:
    """Copy and read bandwidth, timed as the kernels are (CUDA-graph replay, median), on 1 GiB: the copy counts read
    + write bytes, the read (a sum) its input's; and both by CUDA events (triton's do_bench, L2 flushed between calls),
    the way a copy figure is usually quoted."""
    src = torch.empty(ROOF_ELEMENTS, dtype=torch.bfloat16, device=DEVICE).normal_()
    found = _roofs_on(src, torch.empty_like(src))
    del src
    torch.cuda.empty_cache()
    out.log("roofs: " + ", ".join(f"{k} {v:.0f}" for k, v in found.items()))
    return found


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def read_gbps_at(nbytes_one: int, cold: bool) -> float:
    """A pure read (a sum) of a tensor of the given size, cycling through copies as the kernels' timings do: the read
    roof at the size a call actually reads."""
    n = max(1, nbytes_one // 2)
    tensors = [torch.randn(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies_for(nbytes_one, cold))]
    us = gpu_us(rotating([lambda t=t: t.sum() for t in tensors]), rep=SWEEP_REP_MS)
    return n * 2 / (us * 1e3)


def sweep_point(out: Out, K: int, N: int, M: int, built: dict, variants: dict[str, Applied], roof: dict,
                rounds: int, cold: bool) -> None:  # fmt: skip
    """One (shape, M): check every variant against float64, then time the ones that pass with bf16 cuBLAS in
    `rounds` interleaved rounds; one row per variant with the medians."""
    mod = kernel()
    packs, ws = built["packs"], built["ws"]
    p = packs[0]
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    exact = mod.w4a16_reference(x.double(), p.qweight, p.scales.double(), p.zeros, p.group_size)
    scale = max(1.0, math.sqrt(K / 64))
    limit = BF16_ATOL * scale + BF16_RTOL * scale * exact.abs()
    decode = M <= 16
    fns: dict[str, Callable[[], Any]] = {"bf16": rotating([lambda w=w: F.linear(x, w) for w in ws])}
    info: dict[str, dict] = {}
    for name, variant in variants.items():
        kind = is_decode(name, variant)
        if kind is not None and kind != decode:
            continue
        if over_budget():
            break
        row = {"kind": "sweep_check", "K": K, "N": N, "M": M, "variant": name, "config": variant.config}
        try:
            with variant:
                row["splits"] = mod.schedule(M, N, K, x.device).splits
                row["tiles"] = mod.schedule(M, N, K, x.device).tiles
                got = mod.w4a16_gemm(x, *p)
                torch.cuda.synchronize()
            err = (got.double() - exact).abs()
            row.update(max_err=err.max().item(), passed=bool((err <= limit).all()))
        except Exception as exc:  # a configuration that does not compile (shared memory, registers) is a finding
            row.update(passed=False, error=error_text(exc))
        out.row(row)
        if row["passed"]:
            info[name] = row
            fns[name] = rotating([lambda q=q: mod.w4a16_gemm(x, *q) for q in packs])  # timed inside `with variant`
        else:
            out.log(f"sweep K{K} N{N} M{M} {name}: FAILED {row.get('error', row.get('max_err'))}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            if over_budget() or name not in times:
                continue
            try:
                variant = variants.get(name)
                if variant is None:
                    us = gpu_us(fn, rep=SWEEP_REP_MS)
                else:
                    with variant:  # the plans recorded in the warm-up call are this variant's
                        us = gpu_us(fn, rep=SWEEP_REP_MS)
                times[name].append(us)
                out.row({"kind": "sweep_time", "K": K, "N": N, "M": M, "variant": name, "round": r, "gpu_us": us})
            except Exception as exc:
                del times[name]
                out.row({"kind": "sweep_time", "K": K, "N": N, "M": M, "variant": name, "error": error_text(exc)})
    medians = {name: sorted(t)[len(t) // 2] for name, t in times.items() if t}
    fused_bytes = nbytes(p.qweight, p.scales, p.zeros) + (M * K + M * N) * 2
    bf16_bytes = nbytes(ws[0]) + (M * K + M * N) * 2
    for name, us in medians.items():
        moved = bf16_bytes if name == "bf16" else fused_bytes
        gbps = moved / (us * 1e3)
        row = {"kind": "sweep", "K": K, "N": N, "M": M, "variant": name, "gpu_us": us, "rounds_us": times[name],
               "bytes": moved, "gbps": gbps, "pct_copy": 100 * gbps / roof["copy_gbps"],
               "pct_read": 100 * gbps / roof["read_gbps"], "pct_read_same_size": 100 * gbps / built["read_gbps"],
               "vs_bf16": medians["bf16"] / us if "bf16" in medians else None,
               "vs_shipped": medians["shipped"] / us if "shipped" in medians else None,
               "splits": info.get(name, {}).get("splits"),
               "config": getattr(variants.get(name), "config", None)}  # fmt: skip
        out.row(row)
    line = ", ".join(f"{n} {t:.2f}" for n, t in sorted(medians.items(), key=lambda kv: kv[1])[:6])
    out.log(f"sweep K{K} N{N} M{M} (µs, fastest first): {line}")


def sweep_summary(out: Out) -> dict:
    """Best variant per (shape, M), and per M the candidate with the best geometric-mean time ratio to bf16 over the
    shapes where it ran (the one to put in TILES)."""
    rows = [r for r in out.rows if r.get("kind") == "sweep"]
    points = sorted({(r["K"], r["N"], r["M"]) for r in rows}, key=lambda t: (t[2], t[0], t[1]))
    table, best_by_m = [], {}
    header = (f"{'K → N':>14} {'M':>5} {'best':<44} {'µs':>8} {'%copy':>6} {'%read':>6} {'%read@size':>10} "
              f"{'×bf16':>6} {'bf16 µs':>8} {'shipped µs':>10} {'before µs':>9}")  # fmt: skip
    out.log(header)
    for K, N, M in points:
        here = {r["variant"]: r for r in rows if (r["K"], r["N"], r["M"]) == (K, N, M)}
        fused = {n: r for n, r in here.items() if n != "bf16"}
        if not fused:
            continue
        name, b = min(fused.items(), key=lambda kv: kv[1]["gpu_us"])
        entry = {"K": K, "N": N, "M": M, "best": name, "config": b["config"], "gpu_us": b["gpu_us"],
                 "pct_copy": b["pct_copy"], "pct_read": b["pct_read"], "pct_read_same_size": b["pct_read_same_size"],
                 "vs_bf16": b["vs_bf16"], "bf16_us": here.get("bf16", {}).get("gpu_us"),
                 "shipped_us": here.get("shipped", {}).get("gpu_us"),
                 "before_us": here.get("before", {}).get("gpu_us")}  # fmt: skip
        table.append(entry)

        def fmt(v: float | None, f: str) -> str:
            return format(v, f) if v is not None else "-"

        out.log(f"{f'{K} → {N}':>14} {M:>5} {name:<44} {b['gpu_us']:>8.2f} {b['pct_copy']:>6.0f} "
                f"{b['pct_read']:>6.0f} {b['pct_read_same_size']:>10.0f} {fmt(b['vs_bf16'], '.2f'):>6} "
                f"{fmt(entry['bf16_us'], '.2f'):>8} {fmt(entry['shipped_us'], '.2f'):>10} "
                f"{fmt(entry['before_us'], '.2f'):>9}")  # fmt: skip
    for M in sorted({m for _, _, m in points}):
        ratios: dict[str, list[float]] = {}
        for r in rows:
            if r["M"] == M and r["variant"] != "bf16" and r.get("vs_bf16"):
                ratios.setdefault(r["variant"], []).append(r["vs_bf16"])
        shapes = max((len(v) for v in ratios.values()), default=0)
        complete = {n: math.exp(sum(map(math.log, v)) / len(v)) for n, v in ratios.items() if len(v) == shapes}
        if complete:
            name = max(complete, key=complete.get)
            best_by_m[M] = {"variant": name, "geomean_vs_bf16": complete[name], "shapes": shapes}
            out.log(f"M = {M}: best over {shapes} shapes {name} (geometric mean {complete[name]:.2f}× bf16)")
    return {"best": table, "best_by_m": best_by_m}


def run_sweep(out: Out, quick: bool = False, budget_s: float | None = None, cold: bool = True) -> None:
    """The sweep (module docstring). Every row is written as it comes; the summary is written however it ends."""
    global BUDGET_S
    BUDGET_S = budget_s if budget_s is not None else SWEEP_BUDGET_S
    rounds = 1 if quick else ROUNDS
    out.meta.update(mode="sweep", quick=quick, budget_s=BUDGET_S, rounds=rounds, cold_l2=cold,
                    shipped_tiles=dict(kernel().TILES), before_tiles=kernel().SHIPPED_BEFORE)  # fmt: skip
    try:
        try:
            roof = roofs(out)
        except Exception:  # no roof is no reason to skip the kernels: their shares of it are NaN
            out.log(traceback.format_exc())
            roof = {"copy_gbps": math.nan, "read_gbps": math.nan}
        out.meta["roofs"] = roof
        out.meta["copy_gbps"] = roof["copy_gbps"]
        variants = sweep_variants(quick)
        out.log(f"{len(variants)} variants: {', '.join(variants)}")
        mod = kernel()
        for K, N in SHAPES:
            if over_budget():
                out.log("time budget spent: remaining shapes skipped")
                break
            w = build(K, N)
            packed_bytes = nbytes(*w["packed"][:3])
            built = {"packs": [w["packed"]], "ws": [w["w"]]}
            for _ in range(copies_for(packed_bytes, cold) - 1):
                built["packs"].append(mod.PackedW4(*(t.clone() for t in w["packed"][:3]), w["packed"].group_size))
            for _ in range(copies_for(nbytes(w["w"]), cold) - 1):
                built["ws"].append(w["w"].clone())
            try:
                built["read_gbps"] = read_gbps_at(packed_bytes, cold)
            except Exception:
                out.log(traceback.format_exc())
                built["read_gbps"] = math.nan
            out.row({"kind": "read_roof_at_size", "K": K, "N": N, "bytes": packed_bytes, "gbps": built["read_gbps"],
                     "copies": len(built["packs"])})  # fmt: skip
            for M in (*DECODE_ROWS, PREFILL_ROWS):
                if over_budget():
                    out.log(f"time budget spent: K{K} N{N} M{M} and later skipped")
                    break
                try:
                    sweep_point(out, K, N, M, built, variants, roof, rounds, cold)
                except Exception as exc:
                    out.row({"kind": "sweep", "K": K, "N": N, "M": M, "error": repr(exc)[:300]})
                    out.log(traceback.format_exc())
            del w, built
            torch.cuda.empty_cache()
    except Exception:
        out.log(traceback.format_exc())
    finally:
        summary = sweep_summary(out)
        out.finish(summary)


def main() -> None:
    args = sys.argv[1:]
    flags = {a for a in args if a.startswith("--")}
    budget = None
    if "--budget" in args:
        i = args.index("--budget")
        budget = float(args[i + 1])
        args = args[:i] + args[i + 2 :]
        flags.discard("--budget")
    positional = [a for a in args if not a.startswith("--")]
    unknown = flags - {"--quick", "--warm-l2"}
    if not positional or len(positional) > 2 or unknown or (len(positional) == 2 and positional[1] not in MODES):
        sys.exit("usage: gpu_w4a16.py OUT [bench|sweep|tune] [--quick] [--budget SECONDS] [--warm-l2]")
    if not torch.cuda.is_available():
        sys.exit("gpu_w4a16.py needs a CUDA GPU")
    mode = positional[1] if len(positional) > 1 else "bench"
    mode = "sweep" if mode == "tune" else mode
    out = Out(Path(positional[0]), mode)
    torch._dynamo.config.recompile_limit = 64
    try:
        if mode == "sweep":
            run_sweep(out, quick="--quick" in flags, budget_s=budget, cold="--warm-l2" not in flags)
        else:
            run_bench(out)
    except Exception:
        out.log(traceback.format_exc())
        raise
    out.log(f"done in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
