"""`fusionscope profile --nproc N` on GPUs: what tensor parallelism costs and saves per token, and the run folders.

    python3 reports/nproc/gpu_nproc.py OUT [CASE ...]

Run from the repository root (`import fusionscope` must work). Each CASE is one `python3 -m fusionscope profile ...`
(or `apply ...` for the `*-apply-*` cases)
in a subprocess, its run folder in OUT/runs/CASE and its output in OUT/CASE.log; OUT/results.json is rewritten after
every case (device, versions, date, and per case: exit status, wall time, and rank 0's per-phase figures, the
per-rank step times and communication, the straggler, the tensor-parallel fusion's estimate), so a call killed at its
limit keeps what it finished. Without CASEs: on one GPU `tiny-plain tiny-1 8b-plain 8b-1` (the launcher's
`--nproc 1` beside a plain run); on two or more `8b-1 8b-2 8b-1-again` (`--nproc 1` measured before and after
`--nproc 2`, so host drift shows). `70b-2` (llama-3.1-70b dimensions, bf16, from a config.json this script writes)
needs two H200s and a call of its own. A case that would start with less than `MIN_CASE_S` of the budget left is
skipped and recorded as such.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

BUDGET_S = float(os.environ.get("NPROC_BUDGET_S", "230"))  # the lead's calls run about 4 minutes
MIN_CASE_S = 20.0
LLAMA_70B = {  # published dimensions of Llama-3.1-70B; random weights
    "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip
OPPORTUNITY_KEYS = ("fusion", "phase", "count", "t_now_us", "t_fused_us", "saved_us", "speedup_gpu", "speedup_wall",
                    "confidence")  # fmt: skip
WORK_8B = ["--prompt-len", "512", "--decode-steps", "32"]
WORK_TINY = ["--prompt-len", "64", "--decode-steps", "8"]
CASES = {
    "tiny-plain": ["tiny-llama", *WORK_TINY],
    "tiny-1": ["tiny-llama", "--nproc", "1", *WORK_TINY],
    "tiny-2": ["tiny-llama", "--nproc", "2", *WORK_TINY],
    "8b-plain": ["llama-3.1-8b", *WORK_8B],
    "8b-1": ["llama-3.1-8b", "--nproc", "1", *WORK_8B],
    "8b-2": ["llama-3.1-8b", "--nproc", "2", *WORK_8B],
    "8b-1-again": ["llama-3.1-8b", "--nproc", "1", *WORK_8B],
    "8b-4": ["llama-3.1-8b", "--nproc", "4", *WORK_8B],
    "8b-8": ["llama-3.1-8b", "--nproc", "8", *WORK_8B],
    "70b-2": ["{70b}", "--nproc", "2", "--prompt-len", "256", "--decode-steps", "8"],
    # apply on the ranks: each patches its shard, rank 0 decides and measures
    "tiny-apply-1": ["apply", "tiny-llama", "--nproc", "1", *WORK_TINY, "--repeats", "2"],
    "8b-apply-1": ["apply", "llama-3.1-8b", "--nproc", "1", *WORK_8B, "--repeats", "2"],
    "8b-apply-2": ["apply", "llama-3.1-8b", "--nproc", "2", *WORK_8B, "--repeats", "2"],
}


def gpus() -> list[str]:
    """GPU names from nvidia-smi (this process never touches CUDA: the ranks need every GPU's memory)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers", "pandas", "numpy", "holistictraceanalysis"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def figures(folder: Path) -> dict:
    """What results.json keeps of a run folder: rank 0's phases, per-rank step time and communication, the
    straggler, the tensor-parallel section, and the add + norm opportunities."""
    summary = json.loads((folder / "summary.json").read_text())
    keep = ("wall_ms_per_step", "wall_ms_per_step_unprofiled", "gpu_busy_ms_per_step", "gpu_busy_frac",
            "kernels_per_step", "ops_per_step", "host_us_per_kernel", "regime")  # fmt: skip
    ranks = summary.get("ranks") or {}
    per_rank = {}
    for rank, phases in (ranks.get("phases") or {}).items():
        per_rank[rank] = {p: {k: f.get(k) for k in keep} for p, f in phases.items()}
    return {
        "model": summary.get("model"),
        "device": summary.get("device"),
        "wall_s": summary.get("wall_s"),
        "phases": {p: {k: f.get(k) for k in keep} for p, f in summary["phases"].items()},
        "ranks_phases": per_rank,
        "communication": (ranks.get("communication") or {}).get("per_rank"),
        "straggler": ranks.get("straggler"),
        "hta": ranks.get("hta"),
        "tensor_parallel": summary.get("tensor_parallel"),
        "apply": apply_figures(summary.get("apply") or {}),
        "opportunities": [
            {k: o.get(k) for k in OPPORTUNITY_KEYS}
            for o in summary.get("opportunities", [])
            if o["fusion"] in ("allreduce_add_rms_norm", "add_rms_norm")
        ],
    }


APPLY_KEYS = ("wall_ms", "baseline_wall_ms", "measured_speedup_wall", "predicted_speedup_wall", "gpu_ms",
              "baseline_gpu_ms")  # fmt: skip


def apply_figures(applied: dict) -> dict:
    """An apply case's fusions (status, sites, reason) and each timed variant's per-phase figures."""
    variants = (applied.get("timing") or {}).get("variants") or {}
    return {
        "fusions": {f["fusion"]: {k: f.get(k) for k in ("status", "sites_found", "sites_patched", "reason")}
                    for f in applied.get("fusions", [])},
        "timing": {name: {phase: {k: figures.get(k) for k in APPLY_KEYS} for phase, figures in v["phases"].items()}
                   for name, v in variants.items()},
    }  # fmt: skip


def compare(results: dict) -> dict:
    """Same-call ratios of decode and prefill ms/step (unprofiled, rank 0) of each profile case against the first
    `profile --nproc 1` case of the same model."""
    out = {}
    for name, case in results["cases"].items():
        model = case["command"].split()[1:2]
        base = next((c for c in results["cases"].values() if c.get("figures") and "--nproc 1" in c["command"]
                     and c["command"].split()[1:2] == model and c["command"].startswith("profile")), None)  # fmt: skip
        if not case.get("figures") or base is None or not case["command"].startswith("profile"):
            continue
        ratios = {}
        for phase, f in case["figures"]["phases"].items():
            b = base["figures"]["phases"].get(phase, {}).get("wall_ms_per_step_unprofiled")
            mine = f.get("wall_ms_per_step_unprofiled")
            ratios[phase] = mine / b if b and mine else None
        out[name] = {"vs": base["name"], "unprofiled_ms_ratio": ratios}
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    found = gpus()
    names = sys.argv[2:] or (["8b-1", "8b-2", "8b-1-again"] if len(found) >= 2
                             else ["tiny-plain", "tiny-1", "8b-plain", "8b-1"])  # fmt: skip
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    config_dir = out / "llama-3.1-70b"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(LLAMA_70B, indent=1))
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "gpus": found, "versions": versions(),
               "budget_s": BUDGET_S, "cases": {}, "comparison": {}}  # fmt: skip
    t0 = time.monotonic()

    def save() -> None:
        results["comparison"] = compare(results)
        (out / "results.json").write_text(json.dumps(results, indent=1))

    for name in names:
        args = [a.replace("{70b}", str(config_dir)) for a in CASES[name]]
        folder = out / "runs" / name
        verb, rest = (args[0], args[1:]) if args[0] == "apply" else ("profile", args)
        command = [sys.executable, "-m", "fusionscope", verb, *rest, "--out", str(folder)]
        case = {"name": name, "command": " ".join(command[3:])}
        results["cases"][name] = case
        left = BUDGET_S - (time.monotonic() - t0)
        if left < MIN_CASE_S:
            case["status"] = f"skipped: {left:.0f} s of the budget left"
            save()
            continue
        started = time.monotonic()
        with (out / f"{name}.log").open("w") as log:
            # its own session, so a timeout stops the launcher and every rank under it, not the CLI process alone
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        case.update(seconds=round(time.monotonic() - started, 1), returncode=rc)
        case["status"] = "timed out" if rc is None else ("ok" if rc == 0 else "failed")
        if rc == 0:
            case["figures"] = figures(folder)
        save()
    save()


if __name__ == "__main__":
    main()
