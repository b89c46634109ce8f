"""Does `fusionscope analyze` of a run's own trace agree with what `profile` reported for that run?

For each RUN_DIR (a folder `fusionscope profile` wrote: trace.json.gz + summary.json) it analyses
RUN_DIR/trace.json.gz as a foreign trace (no dataflow: the catalogue matches on op order, shapes and module
nesting) into OUT/<run>/analyze, and compares per phase: steps, kernels per step, GPU busy and kernel time per step,
time by class and by category (µs per step), and per fusion the groups per step and the time now (µs per step),
as `profile` found them on its recorded dataflow and as `analyze` finds them on the inferred one. Roofs: analyze
takes the newest measured roofs of the trace's GPU from the roofs cache (`profile` put them there on the same
machine; a CPU run: this machine's CPU roofs), else the datasheet — `roofs_source` says which; classes differ when
it is the datasheet.

    python3 reports/analyze/agree.py OUT RUN_DIR [RUN_DIR ...]
    python3 reports/analyze/agree.py OUT          # profiles llama-3.1-8b (prompt 512, 32 decode steps) into OUT/run

Writes OUT/agree.json (rewritten after each run folder, so a run stopped at its time limit keeps what it finished)
and OUT/agree.log. Runs on a CPU as well as on the GPU image (torch, pandas, HTA, the fusionscope package).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

PROFILE = ["llama-3.1-8b", "--prompt-len", "512", "--decode-steps", "32"]
TOLERANCE = 1e-6  # relative: figures computed from the same kernels must agree to rounding


def log(out: Path, line: str) -> None:
    print(line, flush=True)
    with (out / "agree.log").open("a") as f:
        f.write(line + "\n")


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-12)


def figure_rows(name: str, a: dict, b: dict) -> list[dict]:
    """One row per key of two {key: number} dicts: profile's value, analyze's, and whether they agree."""
    rows = []
    for key in dict.fromkeys([*a, *b]):
        va, vb = a.get(key), b.get(key)
        rows.append({"figure": f"{name}.{key}", "profile": va, "analyze": vb, "agree": close(va, vb)})
    return rows


def compare(profiled: dict, analyzed: dict) -> dict:
    """Per phase the figures both summaries hold, and per (fusion, phase) groups per step and time now."""
    phases = {}
    for phase, p in profiled["phases"].items():
        a = analyzed["phases"].get(phase)
        if a is None:
            phases[phase] = {"present": "profile only"}
            continue
        rows = []
        for key in ("steps", "kernels_per_step", "gpu_busy_ms_per_step", "ops_per_step", "wall_ms_per_step"):
            rows.append({"figure": key, "profile": p.get(key), "analyze": a.get(key),
                         "agree": close(p.get(key), a.get(key))})  # fmt: skip
        rows += figure_rows("time_by_class_us", p.get("time_by_class_us") or {}, a.get("time_by_class_us") or {})
        rows += figure_rows("time_by_category_us", p.get("time_by_category_us") or {},
                            a.get("time_by_category_us") or {})  # fmt: skip
        kernel_us = [sum((s.get("time_by_class_us") or {}).values()) for s in (p, a)]
        rows.append({"figure": "kernel_us_per_step", "profile": kernel_us[0], "analyze": kernel_us[1],
                     "agree": close(*kernel_us)})  # fmt: skip
        phases[phase] = {"present": "both", "figures": rows, "disagree": [r["figure"] for r in rows if not r["agree"]]}
    fusions = {}
    for side, summary in (("profile", profiled), ("analyze", analyzed)):
        for o in summary.get("opportunities") or []:
            row = fusions.setdefault(f"{o['fusion']}/{o['phase']}", {})
            row[f"count_{side}"], row[f"us_now_{side}"] = o.get("count"), o.get("t_now_us")
            row[f"basis_{side}"] = o.get("basis", "dataflow")
    for row in fusions.values():
        row["count_agree"] = row.get("count_profile") == row.get("count_analyze")
        row["us_now_agree"] = close(row.get("us_now_profile"), row.get("us_now_analyze"))
    return {"phases": phases, "fusions": fusions,
            "fusion_counts_agree": all(r["count_agree"] for r in fusions.values()),
            "roofs_source": (analyzed.get("roofs") or {}).get("source"),
            "missing_in_analyze": analyzed.get("missing")}  # fmt: skip


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in ("torch", "pandas", "numpy", "holistictraceanalysis", "transformers", "fusionscope"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    runs = [Path(p) for p in sys.argv[2:]]
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
              "versions": versions(), "runs": {}}  # fmt: skip
    if not runs:
        log(out, "profiling " + " ".join(PROFILE))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fusionscope", "profile", *PROFILE, "--out", str(out / "run")],
                       check=True)  # fmt: skip
        log(out, f"profiled in {time.perf_counter() - t0:.0f} s")
        runs = [out / "run"]
    from fusionscope.analyze import analyze

    for run_dir in runs:
        profiled = json.loads((run_dir / "summary.json").read_text())
        result["device"] = profiled.get("device")
        t0 = time.perf_counter()
        device = "cpu" if (profiled.get("device") or {}).get("kind") == "cpu" else None  # this machine's CPU roofs
        analyzed = analyze(run_dir / "trace.json.gz", out=out / run_dir.name / "analyze", device=device).summary
        seconds = time.perf_counter() - t0
        entry = {"run": str(run_dir), "model": profiled.get("model"), "analyze_s": round(seconds, 1),
                 **compare(profiled, analyzed)}  # fmt: skip
        result["runs"][run_dir.name] = entry
        (out / "agree.json").write_text(json.dumps(result, indent=1) + "\n")
        log(out, f"{run_dir}: analyzed in {seconds:.1f} s, roofs {entry['roofs_source']}, fusion counts agree: "
                 f"{entry['fusion_counts_agree']}")  # fmt: skip
        for phase, ph in entry["phases"].items():
            log(out, f"  {phase}: disagree on {ph.get('disagree') or 'nothing'}")
        for key, row in entry["fusions"].items():
            log(out, f"  {key}: groups/step {row.get('count_profile')} vs {row.get('count_analyze')}, "
                     f"µs now {row.get('us_now_profile')} vs {row.get('us_now_analyze')}")  # fmt: skip


if __name__ == "__main__":
    main()
