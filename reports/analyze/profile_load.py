"""How long `profile` spends loading its own trace: HTA's parser (`trace.load_timeline`) against fusionscope's
decode (`trace_pool.load_timeline`, msgspec into columns), on one trace each size, the two interleaved.

The trace is the one `scale.py` writes (a real H200 Llama-3.2-1B decode trace copied until the size is reached), so
sizes match what `profile` of an 8B model writes (~0.5M events for prompt 512 and 64 decode steps). Both loaders
must give the same tables (`tests/test_analyze_events.py`); this script also checks that on each trace.

    .venv/bin/python reports/analyze/profile_load.py            # writes reports/analyze/profile_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import load_template, write_trace

from fusionscope import trace, trace_pool

RESULT = Path(__file__).with_name("profile_load.json")


def timed(load, path: Path):
    start = time.perf_counter()
    timeline = load(path)
    return time.perf_counter() - start, timeline


def same(a: trace.Timeline, b: trace.Timeline) -> bool:
    for table in ("ops", "kernels", "steps"):
        try:
            pd.testing.assert_frame_equal(getattr(a, table).reset_index(drop=True),
                                          getattr(b, table).reset_index(drop=True), check_dtype=False)  # fmt: skip
        except AssertionError:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 500_000])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    template = load_template()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for size in args.sizes:
            path = Path(work) / f"trace-{size}.json.gz"
            events = write_trace(template, size, path)
            hta, ours, equal = [], [], True
            for _ in range(args.rounds):
                t_ours, ours_timeline = timed(trace_pool.load_timeline, path)
                t_hta, hta_timeline = timed(trace.load_timeline, path)
                ours.append(t_ours)
                hta.append(t_hta)
                equal = equal and same(ours_timeline, hta_timeline)
                del ours_timeline, hta_timeline
            row = {"events": events, "hta_s": statistics.median(hta), "decode_s": statistics.median(ours),
                   "speedup": statistics.median(hta) / statistics.median(ours), "same_tables": equal,
                   "hta_rounds_s": hta, "decode_rounds_s": ours}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "rows": rows,
    }
    RESULT.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
