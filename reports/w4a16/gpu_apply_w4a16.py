"""`fusionscope apply --quantize w4 --graphs` on the GPU: the unfused dequantise + GEMM chain (the quantised model,
unpatched) against the fused `w4a16_gemm` kernel, eager and in a CUDA graph, beside the bf16 model's own fused + graph
figure on the same workload; and the quantisation's own error against the bf16 model.

Usage, from the repository root on the GPU machine (fusionscope installed or on the path, one GPU):
    python3 reports/w4a16/gpu_apply_w4a16.py OUT
Runs, one after another, each `fusionscope apply` in its own process under what is left of a 420 s budget
(`W4A16_BUDGET_S`) (a run
that would pass it is stopped and recorded as such; the runs before it keep their folders); `W4A16_RUNS` (names,
comma-separated) runs only those of them:
    OUT/<run>/                  the run folder `apply` writes (summary.json, apply.csv, report.html, ...)
    OUT/<run>.log               its terminal output, as it goes
    OUT/w4a16_apply.json        {"meta", "runs": {run: key figures or why none}}, rewritten after each run
    OUT/w4a16_apply.log         what this script printed
Key figures per run: the quantisation's error (`apply.quantization`), dequant_gemm's status and numerics, per phase
the measured and predicted speedups of dequant_gemm alone and of all together (eager, against the unpatched quantised
model in the same interleaved rounds), and per `--graphs` variant ms/token and × the weight-streaming floor.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BUDGET_S = float(os.environ.get("W4A16_BUDGET_S", "420"))
WORKLOAD = ["--prompt-len", "128", "--decode-steps", "16", "--repeats", "3", "--graphs"]
TOGETHER = ["--graphs-only", "--graphs-together"]  # the 8B runs: eager and graphs unpatched and all together only
RUNS = {  # name: apply arguments; the target's run first, so a stop at the budget keeps it
    "llama-3.1-8b-w4": ["llama-3.1-8b", "--quantize", "w4", *WORKLOAD, *TOGETHER],
    "llama-3.1-8b-bf16": ["llama-3.1-8b", *WORKLOAD, *TOGETHER],
    "llama-3.2-1b-w4": ["llama-3.2-1b", "--quantize", "w4", *WORKLOAD],
}
PICKED = [n for n in os.environ.get("W4A16_RUNS", "").split(",") if n]
if PICKED:
    RUNS = {name: RUNS[name] for name in PICKED}  # an unknown name is a KeyError before anything runs
START = time.monotonic()


def log(out: Path, text: str) -> None:
    print(text, flush=True)
    with open(out / "w4a16_apply.log", "a") as f:
        f.write(text + "\n")


def key_figures(summary: dict) -> dict:
    """What the README quotes from one run's summary.json."""
    applied = summary.get("apply", {})
    rows = {r["fusion"]: r for r in applied.get("fusions", [])}
    dequant = rows.get("dequant_gemm", {})
    timing = applied.get("timing") or {}
    eager = {}
    for name in ("dequant_gemm", *(timing.get("all_together") or {}).values()):
        variant = timing.get("variants", {}).get(name)
        if variant:
            eager[name] = {phase: {k: f.get(k) for k in ("wall_ms", "baseline_wall_ms", "gpu_ms", "baseline_gpu_ms",
                                                          "measured_speedup_wall", "predicted_speedup_wall",
                                                          "measured_speedup_gpu", "predicted_speedup_gpu")}
                           for phase, f in variant["phases"].items()}  # fmt: skip
    graphs = applied.get("graphs") or {}
    return {
        "quantize": {
            k: summary.get("quantize", {}).get(k) for k in ("group_size", "weight_bytes_before", "weight_bytes_after")
        },
        "swapped": len(summary.get("quantize", {}).get("swapped", {})),
        "quantization": applied.get("quantization"),
        "dequant_gemm": {k: dequant.get(k) for k in ("status", "reason", "sites_found", "sites_patched", "numerics")},
        "statuses": {f: r.get("status") for f, r in rows.items()},
        "eager": eager,
        "all_together": timing.get("all_together"),
        "graphs": {
            name: {k: v.get(k) for k in ("fusions", "passed", "reason", "ms_per_token", "x_floor", "speedup_vs_eager")}
            for name, v in (graphs.get("variants") or {}).items()
        },
        "floor": graphs.get("floor"),
        "eager_ms_per_token": graphs.get("eager_ms_per_token"),
        "fused_vs_graph": graphs.get("fused_vs_graph"),
        "fused_vs_compile": graphs.get("fused_vs_compile"),
    }


def main(out: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "budget_s": BUDGET_S, "runs": RUNS}  # fmt: skip
    result: dict = {"meta": meta, "runs": {}}
    log(out, json.dumps(meta))
    for name, args in RUNS.items():
        left = BUDGET_S - (time.monotonic() - START)
        if left < 20:
            result["runs"][name] = {"not_run": f"{left:.0f} s of the budget left"}
            log(out, f"{name}: not run ({left:.0f} s left)")
            continue
        command = [sys.executable, "-m", "fusionscope", "apply", *args, "--out", str(out / name)]
        log(out, f"{name}: {' '.join(command[2:])} (up to {left:.0f} s)")
        t0 = time.monotonic()
        with open(out / f"{name}.log", "w") as run_log:
            try:
                rc = subprocess.run(command, stdout=run_log, stderr=subprocess.STDOUT, timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = None
        took = time.monotonic() - t0
        summary_path = out / name / "summary.json"
        if rc == 0 and summary_path.is_file():
            figures = key_figures(json.loads(summary_path.read_text()))
            result["runs"][name] = {"seconds": round(took, 1), **figures}
            log(out, f"{name}: done in {took:.0f} s: " + json.dumps(figures["graphs"]))
        else:
            why = "stopped at the budget" if rc is None else f"exit status {rc}"
            result["runs"][name] = {"seconds": round(took, 1), "failed": why, "log": f"{name}.log"}
            log(out, f"{name}: {why} after {took:.0f} s")
        (out / "w4a16_apply.json").write_text(json.dumps(result, indent=1))
    log(out, f"done in {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
