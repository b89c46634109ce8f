"""Does a change to `fusionscope analyze` leave its results as they were? Analyse a set of traces with the code on
`sys.path` into one folder per trace, then compare two such sets file by file.

Compared: kernels.csv, ops.csv and opportunities.csv byte for byte, and summary.json as JSON less what differs
from run to run (`created`, `wall_s`, `command`, `versions`, and the paths of the trace and its copies).
report.html is not compared: it is made from summary.json and kernels.csv, and it names the run's time.

    # the results of the code before the change (a copy of the tree, `git archive BASE | tar -x -C /tmp/base`)
    PYTHONPATH=/tmp/base python reports/analyze/same.py run /tmp/same-before TRACE...
    python reports/analyze/same.py run /tmp/same-after TRACE...
    python reports/analyze/same.py compare /tmp/same-before /tmp/same-after

With no TRACE, `run` takes every trace under tests/data (the folder of ranks too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data"
TABLES = ("kernels.csv", "ops.csv", "opportunities.csv")
RUN_TO_RUN = ("created", "wall_s", "command", "versions")  # summary.json keys that differ between two runs


def default_traces() -> list[Path]:
    """Every trace the tests analyse: the two model traces, the odd ones and the folder of two ranks."""
    return [DATA / "tiny-llama-cuda.trace.json.gz", DATA / "llama-3.2-1b-cuda.trace.json.gz",
            *sorted((DATA / "traces").glob("*.trace.json*")), DATA / "traces" / "gloo-2ranks"]  # fmt: skip


def run(out: Path, traces: list[Path]) -> None:
    """Analyse each trace into `out/<trace file name>` and print the time each took."""
    from fusionscope.analyze import analyze

    out.mkdir(parents=True, exist_ok=True)
    for trace in traces:
        t0 = time.perf_counter()
        analyze(trace, out=out / trace.name)
        print(f"{time.perf_counter() - t0:7.2f} s  {trace}", flush=True)


def comparable(summary: dict) -> dict:
    """summary.json less what differs from run to run (module docstring)."""
    kept = {k: v for k, v in summary.items() if k not in RUN_TO_RUN}
    trace = dict(kept.get("trace") or {})
    trace.pop("path", None)
    kept["trace"] = trace
    if isinstance(kept.get("ranks"), dict):
        ranks = dict(kept["ranks"])
        ranks.pop("merged_from", None)
        ranks["files"] = {r: {k: v for k, v in f.items() if k != "path"} for r, f in ranks.get("files", {}).items()}
        kept["ranks"] = ranks
    return kept


def compare(before: Path, after: Path) -> list[str]:
    """What differs between two sets of run folders (empty: the same results)."""
    differences = []
    names = sorted(p.name for p in before.iterdir() if p.is_dir())
    if names != sorted(p.name for p in after.iterdir() if p.is_dir()):
        differences.append(f"different traces: {names} vs {sorted(p.name for p in after.iterdir())}")
    for name in names:
        a, b = before / name, after / name
        for table in TABLES:
            if (a / table).read_bytes() != (b / table).read_bytes():
                differences.append(f"{name}/{table} differs")
        left, right = (comparable(json.loads((d / "summary.json").read_text())) for d in (a, b))
        for key in sorted(set(left) | set(right)):
            if left.get(key) != right.get(key):
                differences.append(f"{name}/summary.json[{key!r}] differs")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    running = sub.add_parser("run", help="analyse traces into one folder each")
    running.add_argument("out", type=Path)
    running.add_argument("traces", type=Path, nargs="*")
    comparing = sub.add_parser("compare", help="compare two sets of run folders")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.traces or default_traces())
        return
    differences = compare(args.before, args.after)
    print("\n".join(differences) if differences else "the same results")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
