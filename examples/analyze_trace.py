"""Analyse a trace your own program captured (the fusion catalogue included), then compare two traces.

python examples/analyze_trace.py [TRACE]      # default: the CPU fixture trace shipped with the tests

Any torch.profiler Chrome trace works (`prof.export_chrome_trace("trace.json")`); record it with
`record_shapes=True`, a `schedule` and `prof.step()` per step to give the analysis shapes (bytes/FLOPs) and steps.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from fusionscope.analyze import analyze
from fusionscope.diff import diff_paths

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "cpu-steps.trace.json.gz"


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    out = Path(tempfile.mkdtemp())
    run = analyze(trace, out=out / "a")
    for phase, figures in run.summary["phases"].items():
        print(f"{phase}: {figures['steps']} step(s), {figures['wall_ms_per_step']:.2f} ms/step")
    for o in run.summary["opportunities"]:  # matched on op order and shapes: confidence one level lower
        print(f"  {o['fusion']} ({o['phase']}): {o['count']:g} per step, {o['confidence']} ({o['basis']})")
    for line in run.summary["missing"]:
        print("  not in the trace:", line)
    delta = diff_paths(trace, trace)  # trace files are analysed on the spot; run folders work too
    print("phases compared:", ", ".join(delta["phases"]), "— report:", run.report_path)


if __name__ == "__main__":
    main()
