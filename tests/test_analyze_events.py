"""One decode: `fusionscope.trace_events` builds from the document `analyze` already decoded the same Timeline that
`trace.load_timeline` builds through HTA's parser, on every committed trace fixture."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from fusionscope import trace, trace_events

DATA = Path(__file__).resolve().parent / "data"
TRACES = [
    DATA / "tiny-llama-cuda.trace.json.gz",
    DATA / "llama-3.2-1b-cuda.trace.json.gz",
    *sorted((DATA / "traces").glob("*.trace.json*")),
    DATA / "traces" / "gloo-2ranks" / "rank0.trace.json.gz",
]


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_same_timeline_as_hta(path: Path) -> None:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    doc = json.loads(raw)
    want = trace.load_timeline(path)
    got = trace_events.parse_events(doc["traceEvents"], (doc.get("distributedInfo") or {}).get("rank", 0)).timeline
    assert got.device_kind == want.device_kind
    for table in ("ops", "kernels", "steps"):
        pd.testing.assert_frame_equal(getattr(got, table).reset_index(drop=True),
                                      getattr(want, table).reset_index(drop=True), check_dtype=False)  # fmt: skip


def test_record_ids_and_annotations() -> None:
    path = DATA / "traces" / "train-steps.trace.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    parsed = trace_events.parse_events(doc["traceEvents"])
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    assert len(parsed.record_ids) == len(ops)
    assert sorted(parsed.record_ids.values()) == sorted(e["args"]["Record function id"] for e in ops)
    names = set(parsed.annotations["name"])
    assert {"Optimizer.step#AdamW.step", "ProfilerStep#1"} <= names
