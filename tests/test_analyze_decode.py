"""The fast paths of `analyze` give what the plain ones give: msgspec's typed decode and the standard library's
`json` (the fallback when msgspec is not installed) the same event frame and the same run folder, and
`table_writer.write_csv` the bytes pandas' `to_csv` writes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusionscope import analyze, table_writer, trace_events, trace_pool

DATA = Path(__file__).resolve().parent / "data"
TRACES = [
    DATA / "tiny-llama-cuda.trace.json.gz",
    DATA / "llama-3.2-1b-cuda.trace.json.gz",
    *sorted((DATA / "traces").glob("*.trace.json*")),
    DATA / "traces" / "gloo-2ranks" / "rank0.trace.json.gz",
]


def raw_bytes(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


@pytest.fixture
def without_msgspec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image without msgspec: `trace_events` decodes with `json`."""
    monkeypatch.setattr(trace_events, "msgspec", None)


def test_fallback_decodes_with_json(without_msgspec: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    loads = json.loads
    monkeypatch.setattr(trace_events.json, "loads", lambda raw: calls.append(len(raw)) or loads(raw))
    doc = trace_events.decode(raw_bytes(TRACES[0]))
    assert calls and calls[0] == len(raw_bytes(TRACES[0]))  # the whole document went through json
    assert not doc.events.structs and len(doc.events) == len(json.loads(raw_bytes(TRACES[0]))["traceEvents"])


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_both_decoders_give_one_frame(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("msgspec")
    raw = raw_bytes(path)
    fast = trace_events.decode(raw)
    assert fast.events.structs  # msgspec decoded it
    monkeypatch.setattr(trace_events, "msgspec", None)
    plain = trace_events.decode(raw)
    assert not plain.events.structs
    assert (fast.device_properties, fast.distributed_info) == (plain.device_properties, plain.distributed_info)
    pd.testing.assert_frame_equal(trace_events.events_frame(fast.events), trace_events.events_frame(plain.events))
    listed = json.loads(raw)["traceEvents"]
    pd.testing.assert_frame_equal(trace_events.events_frame(plain.events), trace_events.events_frame(listed))
    assert fast.events.dicts() == plain.events.dicts()


def test_argument_lists_are_shared_objects() -> None:
    """msgspec's path decodes each distinct argument list once: equal shapes are one object, so later stages cache
    per object."""
    pytest.importorskip("msgspec")
    frame = trace_events.events_frame(trace_events.decode(raw_bytes(TRACES[1])).events)
    dims = frame.loc[frame["cat"] == "cpu_op", "input_dims"]
    assert dims.map(repr).nunique() == dims.map(id).nunique() < len(dims)


def test_lists_shared_together_are_shared_one_by_one() -> None:
    """Hashing an op's shapes, types and constants as one key gives each column what hashing it alone gives: equal
    values, and one shared object per distinct text of that column (two keys that differ in one column share the
    other's object). Lists with separators, strings and nesting, repeated in other combinations."""
    msgspec = pytest.importorskip("msgspec")
    rows = [(b"[[1, 2], []]", b'["float", ""]', b'["", "a,b"]'), (b"[[1, 2], []]", b'["float", ""]', b"[]"),
            (b"[[3]]", b'["float", ""]', b'["", "a,b"]'), (b"[[1, 2], []]", b'["float", ""]', b'["", "a,b"]'),
            (b"[]", b"[]", b"[]")]  # fmt: skip
    text = b"[" + b",".join(b'{"a": %s, "b": %s, "c": %s}' % row for row in rows) + b"]"
    structs = msgspec.json.decode(text, type=list[msgspec.defstruct("R", [(c, msgspec.Raw) for c in "abc"])])
    together = trace_events._shared_together(structs, ("a", "b", "c"))
    for column in "abc":
        alone = trace_events._shared([getattr(s, column) for s in structs])
        assert together[column].tolist() == alone.tolist()
        assert pd.factorize(np.array([id(v) for v in together[column]]))[0].tolist() == pd.factorize(
            np.array([repr(v) for v in alone], dtype=object))[0].tolist()  # fmt: skip


@pytest.mark.parametrize(
    "raw",
    [
        b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": NaN, "tid": 1}]}',
        b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 2, "args": [1]}]}',
        b'\xef\xbb\xbf{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 2, "args": {"stream": 7}}]}',
        b'{"traceEvents": [1, {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.5, "dur": 2, "tid": 1}]}',
    ],
    ids=["nan-literal", "args-not-an-object", "byte-order-mark", "event-not-an-object"],
)
def test_what_msgspec_refuses_json_decodes(raw: bytes) -> None:
    """JSON that msgspec's typed decoder refuses and `json` accepts decodes as `json` decodes it."""
    doc = trace_events.decode(raw)
    want = trace_events.from_json(json.loads(raw))
    assert doc.events.dicts() == want.events.dicts()
    pd.testing.assert_frame_equal(trace_events.events_frame(doc.events), trace_events.events_frame(want.events))


def test_not_json_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        trace_events.decode(b'{"traceEvents": [')


def run_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("kernels.csv", "ops.csv", "opportunities.csv")}


def test_run_folder_is_the_same_without_msgspec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole analysis, through the fast decoder (shared argument lists, identity caches) and through `json`
    (a fresh list per event), writes the same tables and figures."""
    pytest.importorskip("msgspec")
    path = DATA / "tiny-llama-cuda.trace.json.gz"
    fast = analyze.analyze(path, out=tmp_path / "fast")
    monkeypatch.setattr(trace_events, "msgspec", None)
    plain = analyze.analyze(path, out=tmp_path / "plain")
    assert run_files(fast.out_dir) == run_files(plain.out_dir)
    drop = ("created", "wall_s", "command")
    assert {k: v for k, v in fast.summary.items() if k not in drop} == {
        k: v for k, v in plain.summary.items() if k not in drop
    }
    assert fast.summary["opportunities"]  # the comparison covers the catalogue's matches


def odd_frame() -> pd.DataFrame:
    """Every kind of field `write_csv` formats itself: floats (NaN, inf, -0.0, tiny, large), ints, bools, and
    object columns with missing values, floats, numpy scalars, nested lists, tuples, dicts and strings that need
    quoting."""
    return pd.DataFrame(
        {
            "f": [1.0, np.nan, np.inf, -0.0, 1e-300, 123456789.0],
            "i": [1, -2, 3, 4, 5, 6],
            "b": [True, False] * 3,
            "o": [None, np.nan, 1.5, np.float64(2.5), [1, [2, 3]], 'a,"b"\nc'],
            "s": ["", "x", " y", "z,", "é", "a\rb"],
            "n": [pd.NA, pd.NaT, np.int64(4), (1, 2), {"a": 1}, np.float32(0.1)],
            3: ['"', "'", "x\ny", "", "", ""],
        }
    )


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    """The llama trace's kernel and op tables as `analyze` writes them, and frames of odd fields."""
    facts, doc = analyze.parse_trace(DATA / "llama-3.2-1b-cuda.trace.json.gz")
    parsed = analyze.parse_rank(facts, doc)
    timeline, _missing = analyze.fill_steps_and_phases(parsed.timeline, parsed.annotations)
    roofs, _roof_missing = analyze.resolve_roofs(facts.gpu_name, facts.device_kind, None)
    kernels = analyze.classify(analyze.kernel_table(timeline), roofs)
    return {"kernels": kernels, "ops": timeline.ops, "odd": odd_frame(), "empty": kernels.iloc[:0],
            "one column": odd_frame()[["s"]], "categorical": odd_frame().astype({"s": "category"})}  # fmt: skip


@pytest.mark.parametrize("which", ["kernels", "ops", "odd", "empty", "one column", "categorical"])
def test_write_csv_is_pandas_to_csv(which: str, tables: dict[str, pd.DataFrame], tmp_path: Path) -> None:
    frame = tables[which]
    frame.to_csv(tmp_path / "pandas.csv", index=False, float_format="%.6g")
    table_writer.write_csv(frame, tmp_path / "fast.csv")
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


def test_write_csv_of_many_equal_string_objects(tmp_path: Path) -> None:
    """A column of thousands of distinct string objects with few values (as `bound` and `module` are) is formatted
    by value, one field per value, and still writes what pandas writes."""
    values = ["".join(["memory", "-bound"]), "a,b", 'say "x"', ""]
    frame = pd.DataFrame({"s": ["".join(list(values[i % 4])) for i in range(3000)], "f": np.arange(3000) / 7.0,
                          "i": np.arange(3000) % 5})  # fmt: skip
    assert len({id(v) for v in frame["s"]}) > 1000
    frame.to_csv(tmp_path / "pandas.csv", index=False, float_format="%.6g")
    table_writer.write_csv(frame, tmp_path / "fast.csv")
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


@pytest.mark.parametrize("path", [TRACES[1], DATA / "traces" / "cpu-plain.trace.json"], ids=["phases", "none"])
def test_filling_steps_and_phases_leaves_the_given_tables_alone(path: Path) -> None:
    """A trace with its own steps and phases keeps its tables; one without gets copies with them filled in, and the
    parsed timeline still holds what the trace held."""
    facts, doc = analyze.parse_trace(path)
    parsed = analyze.parse_rank(facts, doc)
    before = [frame.copy() for frame in (parsed.timeline.ops, parsed.timeline.kernels, parsed.timeline.steps)]
    timeline, missing = analyze.fill_steps_and_phases(parsed.timeline, parsed.annotations)
    for given, kept in zip(before, (parsed.timeline.ops, parsed.timeline.kernels, parsed.timeline.steps)):
        pd.testing.assert_frame_equal(given, kept)
    filled = analyze.MISSING_PHASES in missing
    assert filled == (path.name == "cpu-plain.trace.json")
    assert (timeline.ops is parsed.timeline.ops) == (not filled)
    assert set(timeline.steps["phase"]) == ({analyze.TRACE_PHASE} if filled else {"prefill", "decode"})


def columns_of(doc: trace_events.TraceDocument) -> tuple:
    """Everything a decoded document holds, comparable with ==: the header, each column's values with their types."""
    events = doc.events
    if events is None:
        return doc.device_properties, doc.distributed_info, None
    fields = [[(type(v), v) for v in getattr(events, f).tolist()] for f in trace_events.EVENT_FIELDS]
    return doc.device_properties, doc.distributed_info, events.structs, fields, events.args.tolist()


def streamed(raw: bytes, size: int, monkeypatch: pytest.MonkeyPatch | None = None) -> trace_events.TraceDocument:
    """`StreamedDecode` fed `raw` in chunks of `size` bytes; with `monkeypatch`, `decode` of the whole refused (the
    pieces alone must give the document)."""
    decoder = trace_events.StreamedDecode()
    for start in range(0, len(raw), size):
        decoder.feed(raw[start : start + size])
    if monkeypatch is not None:
        monkeypatch.setattr(trace_events, "decode", lambda _raw: pytest.fail("decoded whole"))
    return decoder.finish()


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
@pytest.mark.parametrize("size", [1 << 22, 65_536, 1000])
def test_streamed_decode_is_decode(path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fed in chunks, each run of whole events decoded on its own, the trace gives what `decode` of it gives."""
    pytest.importorskip("msgspec")
    raw = raw_bytes(path)
    want = columns_of(trace_events.decode(raw))
    assert columns_of(streamed(raw, size, monkeypatch)) == want


EVENT = '{"ph": "X", "cat": "cpu_op", "name": "%s", "ts": %d, "dur": 1, "args": {"Input Dims": [[%d]]}}'
ODD = [  # text whose cuts or end are not where they look: each gives what `decode` gives, or the same error
    '{"traceEvents": [' + ", ".join(EVENT % ("a}, {b", k, k) for k in range(40)) + '], "traceName": "x]y"}',
    '{"traceName": "a\\"traceEvents\\": [", "traceEvents": ['
    + ", ".join(EVENT % ("n", k, k) for k in range(40))
    + "]}",
    '{"traceEvents": [' + ", ".join(EVENT % ("n", k, k) for k in range(40)) + '], "traceEvents": []}',
    '{"traceEvents": [], "traceEvents": [' + ", ".join(EVENT % ("n", k, k) for k in range(40)) + "]}",
    '{"traceEvents": [' + ", ".join(EVENT % ("n", k, k) for k in range(40)) + ", ]}",
    '{"traceEvents": [' + ", ".join(EVENT % ("n", k, k) for k in range(40)) + ", 7]}",
    '{"traceEvents": [' + ", ".join(EVENT % ("n", k, k) for k in range(40)) + "]} trailing",
    '{"traceEvents": [' + ", ".join(EVENT % ("n", k, k) for k in range(40)) + "]",
    '{"traceEvents": []}',
    '{"deviceProperties": [{"id": 0, "name": "H200"}], "traceEvents": [' + EVENT % ("n", 1, 1) + "]}",
    "[" + ", ".join(EVENT % ("n", k, k) for k in range(40)) + "]",
    "",
]


@pytest.mark.parametrize("text", ODD, ids=range(len(ODD)))
@pytest.mark.parametrize("size", [7, 64, 10_000])
def test_streamed_decode_of_odd_text(text: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("msgspec")
    monkeypatch.setattr(trace_events, "GAP_WINDOW", 16)  # cuts in every chunk
    raw = text.encode()
    try:
        want = columns_of(trace_events.decode(raw))
    except ValueError as exc:
        with pytest.raises(type(exc)):
            streamed(raw, size)
        return
    assert columns_of(streamed(raw, size)) == want


def test_streamed_decode_cuts_between_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header, then events cut into several pieces, decoded as they come: the whole is never decoded."""
    pytest.importorskip("msgspec")
    raw = ('{"deviceProperties": [{"id": 0}], "traceEvents": [' + ",\n  ".join(EVENT % ("n", k, k) for k in range(500))
           + '],\n  "traceName": "t"}').encode()  # fmt: skip
    decoder = trace_events.StreamedDecode()
    for start in range(0, len(raw), 4096):
        decoder.feed(raw[start : start + 4096])
    assert len(decoder.pieces) > 5 and not decoder.whole
    want = columns_of(trace_events.decode(raw))
    assert columns_of(streamed(raw, 4096, monkeypatch)) == want


@pytest.mark.parametrize("members", [1, 3])
def test_inflate_is_gzip_decompress(tmp_path: Path, members: int) -> None:
    """`trace_pool.inflate`'s chunks are `gzip.decompress`'s bytes, members and zero padding between them too."""
    raw = raw_bytes(TRACES[1])
    parts = [raw[k * len(raw) // members : (k + 1) * len(raw) // members] for k in range(members)]
    path = tmp_path / "t.json.gz"
    path.write_bytes(b"\0\0".join(gzip.compress(p, compresslevel=3) for p in parts))
    chunks: list = []
    trace_pool.inflate(path, chunks.append, chunk=100_000)
    assert chunks[-1] is None and b"".join(chunks[:-1]) == gzip.decompress(path.read_bytes()) == raw


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage after", "not gzip"])
def test_damaged_gzip_is_refused_as_before(tmp_path: Path, damage: str) -> None:
    """A gzip `inflate` cannot read is read whole as before: the same UsageError, or the same document."""
    packed = gzip.compress(raw_bytes(TRACES[0]))
    packed = {"truncated": packed[: len(packed) // 2], "flipped": packed[:5000] + bytes([packed[5000] ^ 1])
              + packed[5001:], "garbage after": packed + b"xyz", "not gzip": b"{}"}[damage]  # fmt: skip
    path = tmp_path / "t.json.gz"
    path.write_bytes(packed)
    chunks: list = []
    with pytest.raises(Exception):  # noqa: B017 - zlib's error or EOFError, whichever zlib meets first
        trace_pool.inflate(path, chunks.append)
    assert chunks[-1] is None
    with pytest.raises(analyze.UsageError) as streamed_error:
        analyze.parse_trace(path)
    with pytest.raises(analyze.UsageError) as whole_error:
        analyze.read_bytes(path)
    assert str(streamed_error.value) == str(whole_error.value)
