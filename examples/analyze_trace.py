"""Analyse a trace your own program captured, then compare two runs.

python examples/analyze_trace.py [TRACE]      # default: the CPU fixture trace shipped with the tests

Any torch.profiler Chrome trace works (`prof.export_chrome_trace("trace.json")`); record it with
`record_shapes=True`, a `schedule` and `prof.step()` per step to give the analysis shapes (bytes/FLOPs) and steps.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from fusionscope.analyze import analyze
from fusionscope.diff import diff_runs

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "cpu-steps.trace.json.gz"


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    out = Path(tempfile.mkdtemp())
    run = analyze(trace, out=out / "a")
    for phase, figures in run.summary["phases"].items():
        print(f"{phase}: {figures['steps']} step(s), {figures['wall_ms_per_step']:.2f} ms/step")
    for line in run.summary["missing"]:
        print("  not in the trace:", line)
    again = analyze(trace, out=out / "b")
    delta = diff_runs(run, again)
    print("phases compared:", ", ".join(delta["phases"]), "— report:", run.report_path)


if __name__ == "__main__":
    main()
