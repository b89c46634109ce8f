"""W4A16 on the GPU: fusionscope::w4a16_gemm checked against its reference, then timed against the unfused chain,
bf16 cuBLAS and torchao's int4 GEMM; or, in `tune` mode, a handful of launch configurations timed side by side.

Usage, from the repository root on the GPU machine (fusionscope installed or on the path, bf16, one GPU):
    python3 reports/w4a16/gpu_w4a16.py OUT          # check + bench (< 4 min)
    python3 reports/w4a16/gpu_w4a16.py OUT tune     # decode configurations (+ 4 prefill ones) (< 4 min)
Writes, as it goes (a run killed at its limit leaves what it measured):
    OUT/w4a16_<mode>.jsonl  one JSON row per check or timing, flushed after each
    OUT/w4a16_<mode>.json   {"meta", "rows", "summary"}, rewritten after each row
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
tune: decode configurations (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, programs per SM) at M = 1 and 16 and
prefill tiles at M = 4096 on the three shapes, each checked against the reference before it is timed; a config that
fails to compile or to match is recorded and skipped. Prints the best per shape and M.
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

DECODE_CONFIGS = [  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, programs_per_sm); first: as shipped
    (64, 128, 0, 4, 3, 2),
    (32, 256, 0, 4, 3, 2),
    (128, 256, 0, 4, 3, 2),
    (64, 256, 0, 4, 3, 2),
    (64, 512, 0, 4, 3, 2),
    (64, 256, 0, 8, 3, 2),
    (64, 256, 0, 4, 4, 2),
    (64, 256, 0, 4, 3, 4),
    (64, 256, 1, 4, 3, 2),
    (32, 256, 1, 4, 3, 2),
    (16, 512, 1, 4, 4, 2),
    (128, 512, 0, 8, 3, 4),
]
PREFILL_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); first: as shipped
    (128, 256, 128, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 128, 256, 8, 3),
    (64, 128, 128, 4, 4),
]

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
        self._dump()

    def _dump(self) -> None:
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


def gpu_us(fn: Callable[[], Any]) -> float:
    """Median GPU µs per call by CUDA-graph replay (launch cost excluded), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


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


def with_tiles(name: str, config: dict, fill: int | None = None) -> Callable[[], None]:
    """Set one TILES entry (and FILL's programs per SM); returns the undo. Tunables forget recorded plans."""
    mod = kernel()
    saved_tiles, saved_fill = mod.TILES[name], mod.FILL["programs_per_sm"]
    mod.TILES[name] = (saved_tiles[0], {**saved_tiles[1], **config})
    if fill is not None:
        mod.FILL["programs_per_sm"] = fill

    def undo() -> None:
        mod.TILES[name] = saved_tiles
        mod.FILL["programs_per_sm"] = saved_fill

    return undo


def try_config(out: Out, weights: dict, K: int, N: int, M: int, entry: str, config: dict, fill: int | None,
               label: str) -> None:  # fmt: skip
    mod = kernel()
    p = weights["packed"]
    undo = with_tiles(entry, config, fill)
    try:
        x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
        got = mod.w4a16_gemm(x, *p)
        exact = mod.w4a16_reference(x.double(), p.qweight, p.scales.double(), p.zeros, p.group_size)
        scale = max(1.0, math.sqrt(K / 64))
        ok = bool(((got.double() - exact).abs() <= BF16_ATOL * scale + BF16_RTOL * scale * exact.abs()).all())
        splits = mod.schedule(M, N, K, x.device).splits
        row = {"kind": "tune", "K": K, "N": N, "M": M, "config": label, "splits": splits, "matches_reference": ok}
        if ok:
            us = gpu_us(lambda: mod.w4a16_gemm(x, *p))
            row.update(gpu_us=us, pct_copy_bw=100 * (nbytes(*p[:3]) + (M * K + M * N) * 2) / (us * 1e3)
                       / out.meta["copy_gbps"])  # fmt: skip
    except Exception as exc:  # a config that does not compile (shared memory, registers) is a finding, not a crash
        row = {"kind": "tune", "K": K, "N": N, "M": M, "config": label,
               "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}  # fmt: skip
    finally:
        undo()
    out.row(row)
    out.log(f"tune K{K} N{N} M{M} {label}: {row.get('gpu_us', row.get('error', 'mismatch'))}")


def run_tune(out: Out) -> None:
    out.meta["copy_gbps"] = copy_gbps()
    for K, N in SHAPES:
        weights = build(K, N)
        for M in (1, 16):
            for bn, bk, split, warps, stages, fill in DECODE_CONFIGS:
                if over_budget():
                    break
                config = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "num_stages": stages}
                label = f"BN{bn} BK{bk} SPLIT{split or 'auto'} W{warps} S{stages} P{fill}"
                try_config(out, weights, K, N, M, "decode", config, fill, label)
        for bm, bn, bk, warps, stages in PREFILL_CONFIGS:
            if over_budget():
                break
            config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            try_config(out, weights, K, N, PREFILL_ROWS, "large", config, None,
                       f"BM{bm} BN{bn} BK{bk} W{warps} S{stages}")  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    best: dict[str, dict] = {}
    for r in out.rows:
        if r.get("kind") == "tune" and "gpu_us" in r:
            key = f"K{r['K']} N{r['N']} M{r['M']}"
            if key not in best or r["gpu_us"] < best[key]["gpu_us"]:
                best[key] = {"config": r["config"], "gpu_us": r["gpu_us"], "pct_copy_bw": r["pct_copy_bw"]}
    shipped = {f"K{r['K']} N{r['N']} M{r['M']}": r["gpu_us"] for r in out.rows
               if r.get("kind") == "tune" and "gpu_us" in r and r["config"] in (
                   "BN64 BK256 SPLITauto W4 S3 P2", "BM128 BN128 BK128 W8 S3")}  # fmt: skip
    for key, b in best.items():
        b["shipped_us"] = shipped.get(key)
        out.log(f"best {key}: {b['config']} {b['gpu_us']:.2f} µs ({b['pct_copy_bw']:.0f}% of copy bandwidth), "
                f"shipped {b['shipped_us']}")  # fmt: skip
    out.finish({"best": best})


def main() -> None:
    if len(sys.argv) < 2 or (len(sys.argv) > 2 and sys.argv[2] not in ("bench", "tune")):
        sys.exit("usage: gpu_w4a16.py OUT [bench|tune]")
    if not torch.cuda.is_available():
        sys.exit("gpu_w4a16.py needs a CUDA GPU")
    mode = sys.argv[2] if len(sys.argv) > 2 else "bench"
    out = Out(Path(sys.argv[1]), mode)
    torch._dynamo.config.recompile_limit = 64
    try:
        run_tune(out) if mode == "tune" else run_bench(out)
    except Exception:
        out.log(traceback.format_exc())
        raise
    out.log(f"done in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
