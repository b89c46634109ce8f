"""The `Timeline` of a trace document already decoded (`analyze` reads and checks the file once), without HTA's
second read and decode of the same file.

`decode` turns the file's bytes into `EventColumns`: one array per field the analysis reads (`ph`, `cat`, `name`,
`tid`, `ts`, `dur` and the arguments `trace._parser_config` asks for, with HTA's defaults), not a dict per event.
With msgspec installed it decodes straight into typed structs that skip every other field, and each distinct
argument list (`Input Dims`, `Input type`, `Concrete Inputs`, `grid`, `block`) becomes one shared Python object: a
1M-event trace repeats a few hundred of them, and sharing lets later stages cache per object instead of per event.
Without msgspec, or when the file is anything but plain JSON objects (a case msgspec refuses and `json` accepts, or
bad input, whose error `json` names), it falls back to the standard library's `json`; both give equal columns.

From the columns it builds the frame HTA's parser builds — one row per complete event (`dur` and `cat` present,
`Trace` dropped), `index` its position in `traceEvents`, timestamps from the earliest event, `index_correlation`
linking each launch to its kernel; each argument read only on the rows whose table reads it (`_arg_rows`) — and
hands it to the same join `trace.load_timeline` uses (`trace._join_rank`), so both give the same tables
(tests/test_analyze_events.py checks it on every fixture) but for one difference: with two or more `ProfilerStep`
ranges HTA's parser drops the GPU events whose launch is not in the trace (launched before the profiler started),
and here they stay (joined to an op by `External id` where the trace holds it, else to none), so that every GPU
event is in the kernels table exactly once. Every number is read by `trace_fields` (hex
strings, numbers as strings, missing values; a time no number reads drops the event). It also returns the
`user_annotation` ranges the join does not keep (`Optimizer.step#…`), for telling a training step's phases apart.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any

import numpy as np
import pandas as pd

from fusionscope import trace
from fusionscope.trace_fields import INT64_MIN, float_array, int_array

try:  # optional: a typed decoder about 5x faster than `json` on traces; everything works without it
    import msgspec
except ImportError:  # pragma: no cover - exercised by monkeypatching `msgspec` to None in the tests
    msgspec = None

# (column, args key, default): what trace._parser_config keeps, with HTA's defaults
ARGS = (("stream", "stream", -1), ("correlation", "correlation", -1), ("input_dims", "Input Dims", "-1"),
        ("input_type", "Input type", "-1"), ("external_id", "External id", -1),
        ("concrete_inputs", "Concrete Inputs", "[]"), ("grid", "grid", "[]"), ("block", "block", "[]"),
        ("registers_per_thread", "registers per thread", -1), ("shared_memory", "shared memory", -1),
        ("bytes", "bytes", -1), ("record_id", "Record function id", -1))  # fmt: skip
INT_ARGS = ("stream", "correlation", "external_id", "registers_per_thread", "shared_memory", "bytes", "record_id")
LIST_ARGS = ("input_dims", "input_type", "concrete_inputs", "grid", "block")  # shared objects, one per distinct value
EXTRA_ARGS = (("device", "device", None),)  # read by `analyze` to name the GPU, not a frame column
ARG_KEYS = {column: (key, default) for column, key, default in (*ARGS, *EXTRA_ARGS)}
EVENT_FIELDS = ("ph", "cat", "name", "tid", "ts", "dur")
SYNC_EVENTS = ("Event Sync", "Context Sync")  # on stream -1, yet GPU events to HTA


@dataclass
class EventColumns:
    """A trace's `traceEvents` as columns, one object array per field with an entry per event in file order (None
    where an event lacks the field), and each event's `args` (a dict or None; or msgspec's struct, every default
    where the event has none), whose columns `arg_columns` reads for the rows asked for."""

    ph: np.ndarray
    cat: np.ndarray
    name: np.ndarray
    tid: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    args: np.ndarray
    structs: bool = False  # `args` holds msgspec structs (`_decoder`), not JSON dicts

    def __len__(self) -> int:
        return len(self.cat)

    @cached_property
    def cats(self) -> trace.Labels:
        """The categories as `trace.Labels`: what `analyze` checks and the join selects rows by."""
        return trace.Labels.of(self.cat)

    @classmethod
    def from_dicts(cls, events: list) -> EventColumns:
        """The columns of JSON-decoded events; anything but a dict is an event without fields."""
        rows = [e if isinstance(e, dict) else {} for e in events]
        return cls(*(_objects([e.get(f) for e in rows]) for f in (*EVENT_FIELDS, "args")))

    def arg_columns(self, columns: Sequence[str], rows: np.ndarray) -> dict[str, np.ndarray]:
        """Argument columns (of `ARGS` and `EXTRA_ARGS`) of the events at `rows`, each an object array with HTA's
        default where an event lacks the argument (`args` that is not a dict holds none)."""
        picked = self.args[rows]
        if not self.structs:
            given = [a if isinstance(a, dict) else {} for a in picked.tolist()]
            return {c: _objects([a.get(ARG_KEYS[c][0], ARG_KEYS[c][1]) for a in given]) for c in columns}
        listed = picked.tolist()  # a list iterates faster than an object array
        lists = tuple(c for c in columns if c in LIST_ARGS)
        out = _shared_together(listed, lists) if len(lists) > 1 else {}
        for c in columns:
            if c not in out:
                values = list(map(attrgetter(c), listed))
                out[c] = _shared(values) if c in LIST_ARGS else _objects(values)
        return {c: out[c] for c in columns}

    def complete(self) -> np.ndarray:
        """Which events are complete ones (`ph` "X")."""
        return self.ph == "X"

    def kernel_devices(self) -> list:
        """The `device` argument of every complete kernel event, in file order (None where one has none)."""
        kernels = np.flatnonzero(self.complete() & self.cats.isin(("kernel",)))
        return self.arg_columns(["device"], kernels)["device"].tolist()

    def dicts(self) -> list[dict]:
        """The events as dicts of their top-level fields (those not None), for code written over decoded JSON."""
        fields = (self.ph, self.cat, self.name, self.tid, self.ts, self.dur)
        return [{k: v for k, v in zip(EVENT_FIELDS, values) if v is not None}
                for values in zip(*(f.tolist() for f in fields))]  # fmt: skip


def distinct_objects(values: list | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's code among the distinct objects (by identity, whatever they hold: lists too), and the place of
    each one's first occurrence: what is computed per object is then computed once."""
    codes, uniques = pd.factorize(object_ids(values))
    return codes, first_rows(codes, len(uniques))


def object_ids(values: list | np.ndarray) -> np.ndarray:
    """`id` of each value. An object array holds its objects' addresses, which are their ids (CPython): they are
    read from its buffer, not by a call of `id` per value (at 440k ops, 0.6 ms instead of 27 ms, and a table's
    shape columns are read this way several times). Any other array is read as its `tolist()`."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1 and len(values):
        held = np.ascontiguousarray(values)  # alive until the addresses are copied out
        buffer = (ctypes.c_char * held.nbytes).from_address(held.ctypes.data)
        return np.frombuffer(buffer, dtype=np.intp).astype(np.int64)
    listed = values.tolist() if isinstance(values, np.ndarray) else values
    return np.fromiter(map(id, listed), dtype=np.int64, count=len(listed))


def value_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`pd.factorize(values)`: each value's code (-1 for None and NaN) and the distinct values in order of first
    occurrence, each distinct object hashed once: the tables share one object per name (`trace.Labels`), and hashing
    a kernel's long name at every row took most of a groupby's time."""
    objects, first = distinct_objects(values)
    codes, uniques = pd.factorize(values[first])
    return codes[objects], uniques


def group_rows(frame: pd.DataFrame, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group among the distinct combinations of the `keys` columns' values, numbered in order of first
    occurrence as `groupby(keys, sort=False, dropna=False)` numbers its groups, and each group's first row. Found
    from each key's `value_codes`; where a key is missing (None, NaN) in a row, by pandas (`ngroup`)."""
    combined, distinct = np.zeros(len(frame), dtype=np.int64), min(len(frame), 1)
    for key in keys:
        codes, uniques = value_codes(frame[key].to_numpy())
        if (codes < 0).any():
            combined = frame.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()
            distinct = int(combined.max()) + 1
            break
        combined, groups = pd.factorize(combined * len(uniques) + codes)  # below rows² < 2**63
        distinct = len(groups)
    return combined, first_rows(combined, distinct)


def first_rows(codes: np.ndarray, distinct: int) -> np.ndarray:
    """The row of each code's first occurrence (codes 0 .. `distinct` - 1, as `pd.factorize` gives them)."""
    first = np.empty(distinct, dtype=np.int64)
    first[codes[::-1]] = np.arange(len(codes) - 1, -1, -1)
    return first


def _objects(values: Sequence) -> np.ndarray:
    """A 1-D object array of the values (lists stay list objects, not nested arrays)."""
    return np.fromiter(values, dtype=object, count=len(values))


@dataclass
class TraceDocument:
    """A decoded trace file: what `analyze` reads of its header, and its events (None when the file is not a JSON
    object holding a `traceEvents` list)."""

    device_properties: object
    distributed_info: object
    events: EventColumns | PooledEvents | None


def decode(raw: bytes) -> TraceDocument:
    """Decode a trace file's bytes: msgspec's typed decoder when installed and the file is plain JSON objects, else
    `json` (which raises ValueError on bytes that are not JSON). Both give equal documents."""
    if msgspec is not None:
        try:
            doc = _decoder().decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):  # not plain JSON objects: json says what it is
            pass
        else:
            return TraceDocument(doc.deviceProperties, doc.distributedInfo, _from_structs(doc.traceEvents))
    return from_json(json.loads(raw))


def from_json(doc: object) -> TraceDocument:
    """The document of a JSON-decoded trace (`json.loads` of the file)."""
    if not isinstance(doc, dict):
        return TraceDocument(None, None, None)
    events = doc.get("traceEvents")
    columns = EventColumns.from_dicts(events) if isinstance(events, list) else None
    return TraceDocument(doc.get("deviceProperties"), doc.get("distributedInfo"), columns)


_DECODER: list = []  # msgspec's decoder, an args struct with every default, and a decoder of a list of events


def _decoder() -> Any:
    """msgspec's decoder for a trace: events as structs holding only the fields read here (the rest is skipped
    unread); argument lists kept as raw JSON text, decoded once per distinct text by `_shared`."""
    if not _DECODER:
        specs = (*ARGS, *EXTRA_ARGS)
        raw_default = {c: msgspec.Raw(json.dumps(d).encode()) for c, _k, d in specs if c in LIST_ARGS}
        fields = [(c, msgspec.Raw, raw_default[c]) if c in LIST_ARGS else (c, Any, d) for c, _k, d in specs]
        args = msgspec.defstruct("TraceArgs", fields, rename={c: k for c, k, _d in specs}, gc=False)
        fields = [*((f, Any, None) for f in EVENT_FIELDS), ("args", args | None, None)]
        event = msgspec.defstruct("TraceEvent", fields, gc=False)  # no cycles: untracked, faster to make and free
        doc = msgspec.defstruct(
            "TraceDoc", [("traceEvents", list[event]), ("deviceProperties", Any, None), ("distributedInfo", Any, None)]
        )
        _DECODER.extend([msgspec.json.Decoder(doc), args(), msgspec.json.Decoder(list[event])])
    return _DECODER[0]


def _events_decoder() -> Any:
    """msgspec's decoder of a list of `_decoder`'s events."""
    _decoder()
    return _DECODER[2]


def _from_structs(events: list) -> EventColumns:
    """Columns of msgspec's event structs, each read by a C-level attribute getter, not a Python loop."""
    return EventColumns(*_struct_columns(events), structs=True)


def _struct_columns(events: list) -> list[np.ndarray]:
    """`_from_structs`' arrays, in `EventColumns`' order."""
    n = len(events)
    columns = [np.fromiter(map(attrgetter(f), events), dtype=object, count=n) for f in (*EVENT_FIELDS, "args")]
    args = columns[-1]
    args[np.fromiter(map(is_, args, repeat(None)), dtype=bool, count=n)] = _DECODER[1]  # no args: every default
    return columns


EVENTS_KEY = re.compile(rb'(?<![\\\w])"traceEvents"\s*:\s*\[')  # where the list of events opens
EVENT_GAP = re.compile(rb"\},\s*\{")  # `}, {`: where one event of the list may end and the next begin
HEAD_LIMIT = 1 << 24  # text before the list of events: a longer header is no profiler's (the whole is decoded)
GAP_WINDOW = 1 << 16  # the end of each chunk searched for the last gap between events
END_TRIES = 8  # `]` from the end tried as the list's end


class StreamedDecode:
    """`decode` of a trace's text handed over chunk by chunk (`feed`, then `finish`) as another thread inflates it:
    each run of whole events is decoded into columns while the next chunk inflates, instead of all of them after.

    The text is cut after an event's `}` followed by `,` and the next event's `{` (`EVENT_GAP`); each piece between
    two cuts is decoded as a list of events, the header (the text before the list, and after it) as the document
    with an empty list, and the columns of the pieces are joined. A cut where no event ends (inside a string or a
    nested object) leaves a piece that is no list of events, since its decode, begun where an event begins, ends
    inside that string or object; so when every piece and the header decode, the whole text is that list in that
    document and `decode` of it would give the same columns. Anything else (a piece or a header that does not
    decode, no `"traceEvents": [` in the first 16 MiB, a second `"traceEvents"` in the header, no msgspec) makes
    `finish` decode the whole text with `decode`, which says what is wrong with it or reads it with `json`."""

    def __init__(self) -> None:
        self.head: bytes | None = None  # the text through the `[` that opens the list of events
        self.rest: list[bytes] = []  # text after the last cut (after the head), not decoded yet
        self.pieces: list[bytes] = []  # each piece decoded, as `[` + its text + `]`
        self.columns: list[list[np.ndarray]] = []  # each piece's columns (`_struct_columns`)
        self.whole = msgspec is None  # True: only collect the text, `finish` decodes it whole

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the text; decode the events it completes."""
        if self.whole or not chunk:
            self.rest.append(chunk)
            return
        if self.head is None:
            self.rest.append(chunk)
            text = b"".join(self.rest)
            found = EVENTS_KEY.search(text)
            if found is None:
                self.rest, self.whole = [text], len(text) > HEAD_LIMIT
                return
            self.head, self.rest, chunk = text[: found.end()], [], text[found.end() :]
        cut = _last_gap(chunk)
        if cut < 0:
            self.rest.append(chunk)
            return
        if not self._take([b"[", *self.rest, memoryview(chunk)[:cut], b"]"]):
            self.rest.append(chunk)
            self.whole = True
            return
        self.rest = [chunk[cut + 1 :]]  # after the `,`

    def _take(self, parts: list[bytes | memoryview]) -> bool:
        """Decode a piece (its text in parts: `[` + whole events + `]`) into columns and keep its text; False where
        it is no list of events."""
        piece = b"".join(parts)
        try:
            events = _events_decoder().decode(piece)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        self.columns.append(_struct_columns(events))
        self.pieces.append(piece)
        return True

    def _piece_texts(self) -> list[bytes]:
        """The text of each piece taken, in order."""
        return self.pieces

    def finish(self) -> TraceDocument:
        """The document of the whole text fed, equal to `decode` of it."""
        doc = None if self.whole or self.head is None else self._end()
        if doc is not None and doc.events is not None:
            return doc
        parts: list[bytes | memoryview] = [] if self.head is None else [self.head]
        texts = self._piece_texts()
        for k, piece in enumerate(texts):
            parts += [b","] * (k > 0) + [memoryview(piece)[1:-1]]
        parts += [b","] * bool(texts) + self.rest
        text = b"".join(parts)
        self.pieces, self.columns, self.rest = [], [], []
        return decode(text)

    def _end(self) -> TraceDocument | None:
        """The last events and the header after them: the list's end is one of the last `]`s, the one where both
        the events before it and the document around the empty list decode (None where none does)."""
        tail = b"".join(self.rest)
        assert self.head is not None
        end = len(tail)
        for _ in range(END_TRIES):
            end = tail.rfind(b"]", 0, end)
            if end < 0:
                return None
            skeleton = self.head + tail[end:]
            if skeleton.count(b'"traceEvents"') != 1:
                continue
            try:
                doc = _decoder().decode(skeleton)
                events = _events_decoder().decode(b"[" + tail[:end] + b"]")
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if doc.traceEvents:
                return None
            return TraceDocument(doc.deviceProperties, doc.distributedInfo, self._joined(events))
        return None

    def _joined(self, last: list) -> EventColumns | PooledEvents | None:
        """The columns of every piece and of the `last` events (msgspec's structs); None where they cannot be had
        (a subclass's pieces decoded elsewhere), and `finish` then decodes the whole text."""
        columns = [*self.columns, _struct_columns(last)]
        return EventColumns(*(np.concatenate(parts) for parts in zip(*columns, strict=True)), structs=True)


def _last_gap(chunk: bytes) -> int:
    """Where the last `EVENT_GAP` of the chunk begins, plus one (after its `}`); -1 without one."""
    start = max(len(chunk) - GAP_WINDOW, 0)
    while True:
        found = None
        for found in EVENT_GAP.finditer(chunk, start):  # noqa: B007 - the last one is wanted
            pass
        if found is not None:
            return found.start() + 1
        if start == 0:
            return -1
        start = max(start - 16 * GAP_WINDOW, 0)


def _shared(raws: list) -> np.ndarray:
    """Decode raw JSON values, each distinct text once (by `json`, as the fallback decodes it), into one shared
    object. An event without the argument holds msgspec's default, HTA's default as JSON text (`_decoder`)."""
    codes, uniques = pd.factorize(_objects(list(map(bytes, raws))))
    decoded = np.empty(len(uniques), dtype=object)
    decoded[:] = [json.loads(text) for text in uniques.tolist()]
    return decoded[codes]


def _shared_together(listed: list, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """`_shared` of several list arguments of the same structs (an op's shapes, types and constants; a kernel's grid
    and block), hashed together: one key per row, the raw texts joined by a byte that no JSON text holds outside a
    string and none inside one unescaped (msgspec refuses it), so one join and one factorize instead of a copy and
    a factorize per argument. The arguments repeat together, so the keys are few; each distinct text of a column is
    still decoded once into one shared object, as `_shared` gives."""
    keys = list(map(b"\x1f".join, map(attrgetter(*columns), listed)))
    codes, uniques = pd.factorize(_objects(keys))
    texts = [key.split(b"\x1f") for key in uniques.tolist()]
    out = {}
    for k, column in enumerate(columns):
        column_texts = [parts[k] for parts in texts]
        decoded = {text: json.loads(text) for text in dict.fromkeys(column_texts)}
        out[column] = _objects([decoded[text] for text in column_texts])[codes]
    return out


def _interned(values: np.ndarray) -> tuple[np.ndarray, trace.Labels]:
    """The values with each distinct one a single shared object: a string's hash is then computed once, not once
    per event, in every later lookup and grouping by name. Only all-string columns: factorizing would take 1 and
    1.0 for one value. Also their `trace.Labels`."""
    if pd.api.types.infer_dtype(values, skipna=False) != "string":
        return values, trace.Labels.of(values)
    labels = trace.Labels.of(values)
    return labels.uniques[labels.codes], labels


def events_frame(events: EventColumns | list) -> pd.DataFrame:
    """HTA's event frame of a trace's `traceEvents` (names and categories as strings, not symbol ids): one row per
    event with `dur` and a category other than `Trace`, each argument read where a table reads it and HTA's default
    elsewhere (`_arg_rows`). `events`: columns, or the decoded JSON list."""
    return pd.DataFrame(event_columns(events))


def event_columns(events: EventColumns | list) -> dict[str, np.ndarray]:
    """The columns of `events_frame`, as arrays (what the join takes: `trace.join_columns`)."""
    return _event_columns(events)[0]


def _event_columns(events: EventColumns | PooledEvents | list,
                   ) -> tuple[dict[str, np.ndarray], tuple[trace.Labels, trace.Labels]]:  # fmt: skip
    """`event_columns`, and the `trace.Labels` of names and categories."""
    if isinstance(events, PooledEvents):
        return _finished(events.part)
    return _finished(columns_of(events if isinstance(events, EventColumns) else EventColumns.from_dicts(events)))


@dataclass
class ColumnsPart:
    """`event_columns` of some of a trace's events, but for the two steps that need all of them (`_finished`):
    timestamps from the earliest event, and the ids of threads that no integer names. A part per piece of the text
    is what a worker process sends back (`trace_pool`), and `concat` makes them one, equal to the whole's."""

    columns: dict[str, np.ndarray]  # `index` counts from the part's first event; `ts` as the trace gives it
    names: trace.Labels
    cats: trace.Labels
    unread_tids: np.ndarray  # the `tid` values no integer reads, in row order; their rows hold INT64_MIN
    cats_by_value: bool  # `cats` factorized from the rows' values (`_interned_cats`' slow way), not taken from all

    @classmethod
    def concat(cls, parts: Sequence[ColumnsPart], firsts: Sequence[int], every_cat: trace.Labels) -> ColumnsPart:
        """One part of consecutive parts, `firsts` the index of each one's first event in the whole; `every_cat`
        the Labels of every event's category in the whole, which `_interned_cats` takes the rows' from."""
        columns = {key: np.concatenate([p.columns[key] + first for p, first in zip(parts, firsts, strict=True)]
                                       if key == "index" else [p.columns[key] for p in parts])
                   for key in parts[0].columns}  # fmt: skip
        by_value = any(p.cats_by_value for p in parts)
        cats = trace.Labels.of(columns["cat"]) if by_value else every_cat.take(columns["index"])
        names = merged_labels([p.names for p in parts])
        for column, labels, interned in (("name", names, _all_text(names)), ("cat", cats, not by_value)):
            if interned:  # each distinct value one object over the whole, as `_interned` of the whole gives
                columns[column] = labels.uniques[labels.codes]
        return cls(columns, names, cats, np.concatenate([p.unread_tids for p in parts]), by_value)


def _all_text(labels: trace.Labels) -> bool:
    """Whether every value is a string (none missing): what `_interned` interns."""
    return bool((labels.codes >= 0).all()) and all(isinstance(u, str) for u in labels.uniques.tolist())


def merged_labels(labels: Sequence[trace.Labels]) -> trace.Labels:
    """The Labels of consecutive columns' values joined, from each one's Labels: what `Labels.of` of the joined
    values gives (distinct values in order of first appearance), without hashing every value again."""
    if len(labels) == 1:
        return labels[0]
    codes, uniques = pd.factorize(np.concatenate([label.uniques for label in labels]))
    joined, start = [], 0
    for label in labels:
        remap = np.append(codes[start : start + len(label.uniques)], -1)  # a missing value (-1) stays missing
        joined.append(remap[label.codes])
        start += len(label.uniques)
    return trace.Labels(np.concatenate(joined), np.asarray(uniques, dtype=object))


def columns_of(cols: EventColumns) -> ColumnsPart:
    """`event_columns` of these events before `_finished` (`ColumnsPart`)."""
    keep = _timed(cols)
    ts, dur = float_array(cols.ts[keep]), float_array(cols.dur[keep])
    complete = np.isfinite(ts) & np.isfinite(dur)  # a time that is no number: not a complete event
    if not complete.all():
        keep, ts, dur = keep[complete], ts[complete], dur[complete]
    (name, names), (cat, cats, by_value) = _interned(cols.name[keep]), _interned_cats(cols, keep)
    tid_values = cols.tid[keep]
    tids = int_array(tid_values, INT64_MIN)
    out = {"index": keep, "name": name, "cat": cat, "tid": tids, "ts": ts, "dur": dur}
    for columns, where in _arg_rows(cats):
        rows = np.flatnonzero(where) if where is not None else None
        for column, values in cols.arg_columns(columns, keep if rows is None else keep[rows]).items():
            default = ARG_KEYS[column][1]
            values = int_array(values, default) if column in INT_ARGS else values
            if rows is not None:
                full = np.empty(len(keep), dtype=values.dtype)
                full.fill(default)  # one shared object, where np.full would make one per row
                full[rows] = values
                values = full
            out[column] = values
    return ColumnsPart(out, names, cats, tid_values[tids == INT64_MIN], by_value)


def _finished(part: ColumnsPart) -> tuple[dict[str, np.ndarray], tuple[trace.Labels, trace.Labels]]:
    """The columns of a whole trace's part: timestamps from the earliest event, and each thread id no integer
    reads (a name, or none) one id of its own per distinct value, below -1, so that one such thread stays one."""
    out = dict(part.columns)
    ts = out["ts"]
    out["ts"] = ts - ts.min() if len(ts) else ts
    if len(part.unread_tids):
        tids = out["tid"].copy()
        codes, _uniques = pd.factorize(_objects([repr(v) for v in part.unread_tids.tolist()]))
        tids[tids == INT64_MIN] = -2 - codes
        out["tid"] = tids
    return out, (part.names, part.cats)


def _timed(cols: EventColumns) -> np.ndarray:
    """The rows of events with a `dur` and a category other than `Trace` (HTA's complete events)."""
    timed = np.fromiter(map(is_not, cols.dur, repeat(None)), dtype=bool, count=len(cols))
    timed &= ~cols.cats.isin(("Trace",))
    unlabelled = np.flatnonzero(timed & (cols.cats.codes < 0))  # None, or a value factorizing takes for missing
    timed[unlabelled] = np.fromiter(map(is_not, cols.cat[unlabelled], repeat(None)), dtype=bool, count=len(unlabelled))
    return np.flatnonzero(timed)


def _interned_cats(cols: EventColumns, keep: np.ndarray) -> tuple[np.ndarray, trace.Labels, bool]:
    """`_interned` of the categories at `keep`, from the categories' `Labels` where every one is a string; also
    whether they were factorized from the values instead."""
    cats = cols.cats.take(keep)
    if (cats.codes < 0).any() or not all(isinstance(u, str) for u in cats.uniques.tolist()):
        return (*_interned(cols.cat[keep]), True)
    return cats.uniques[cats.codes], cats, False


def _arg_rows(cats: trace.Labels) -> list[tuple[tuple[str, ...], np.ndarray | None]]:
    """Each argument column with the rows whose table reads it (None: every row; elsewhere it holds its default):
    an op's shapes and record id are read only for ops, a launch configuration only for GPU events, `stream` only
    off the CPU (`_on_gpu`). Reading an argument costs a pass over its rows' Python objects: at a million events,
    reading every argument on every row took over a second."""
    ops, gpu = cats.isin(("cpu_op",)), cats.isin(trace.GPU_CATS)
    return [(("correlation",), None), (("stream",), ~cats.isin(trace.CPU_CATS)), (("external_id",), ops | gpu),
            (("input_dims", "input_type", "concrete_inputs", "record_id"), ops),
            (("grid", "block", "registers_per_thread", "shared_memory", "bytes"), gpu)]  # fmt: skip


@dataclass
class PooledEvents:
    """A trace's events as worker processes gave them (`trace_pool`): what `analyze` checks of every event and the
    `event_columns` of the complete ones, without the events themselves."""

    cats: trace.Labels  # every event's category
    completes: np.ndarray  # which events are complete ones (`ph` "X")
    devices: list  # `EventColumns.kernel_devices`
    part: ColumnsPart  # the complete events' columns

    def __len__(self) -> int:
        return len(self.completes)

    def complete(self) -> np.ndarray:
        return self.completes

    def kernel_devices(self) -> list:
        return self.devices


@dataclass
class Parsed:
    """A rank's timeline, its annotation ranges (name, tid, ts_us, dur_us; timestamps as the timeline's), and its
    ops' `Record function id`s (what links an op to an execution trace)."""

    timeline: trace.Timeline
    annotations: pd.DataFrame
    record_frame: pd.DataFrame  # index (op_id), record_id of every cpu_op
    unlaunched: int = 0  # GPU events whose launch is not in the trace (`_unlaunched`)

    @property
    def record_ids(self) -> dict[int, int]:
        """op_id → the op's `Record function id`; built when asked (only an execution trace needs it)."""
        return dict(zip(self.record_frame["index"].tolist(), self.record_frame["record_id"].tolist()))


def _on_gpu(cols: dict[str, np.ndarray], names: trace.Labels, cats: trace.Labels) -> np.ndarray:
    """GPU events: kernels, copies and memsets, HTA's rule (an event on a stream with a correlation id) for other
    categories, and synchronisations. A runtime call is never one, though ROCm's launches name their stream."""
    on_stream = (cols["stream"] >= 0) & (cols["correlation"] >= 0) & ~cats.isin(trace.CPU_CATS)
    return cats.isin(trace.GPU_CATS) | on_stream | names.isin(SYNC_EVENTS)


def _unlaunched(cols: dict[str, np.ndarray], gpu: np.ndarray, cats: trace.Labels) -> int:
    """GPU events (kernels, copies, memsets) whose launch is not in the trace: launched before the profiler
    started, or by a call it did not record. HTA's parser drops them when the trace has two or more ProfilerStep
    ranges; here they stay in the kernels table (joined to an op by `External id` only), so every GPU event is in
    it once. `gpu`: `_on_gpu`."""
    correlation = cols["correlation"]
    launched = np.isin(correlation, np.unique(correlation[~gpu & (correlation >= 0)]))
    return int((cats.isin(trace.GPU_CATS) & ~launched).sum())


def _index_correlation(cols: dict[str, np.ndarray], gpu: np.ndarray) -> np.ndarray:
    """HTA's `index_correlation`: a launch's kernel index and a kernel's launch index (0 for a correlation whose
    partner is not in the trace, -1 for none). `gpu`: `_on_gpu`."""
    correlation, index = cols["correlation"], cols["index"]
    values = np.minimum(correlation, 0)
    linked = correlation != -1
    pairs = pd.DataFrame({"index": index, "correlation": correlation})
    merged = pairs[linked & ~gpu].merge(pairs[linked & gpu], on="correlation", how="inner")
    x, y = merged["index_x"].to_numpy(), merged["index_y"].to_numpy()
    values[np.searchsorted(index, x)] = y  # `index` rises: each event's place in the file
    values[np.searchsorted(index, y)] = x
    return values


def parse_events(events: EventColumns | list, rank: int = 0) -> Parsed:
    """The Timeline of one rank's `traceEvents` (columns, or the decoded JSON list; as `trace.load_timeline` builds
    it from the file), its annotation ranges and its ops' record function ids."""
    cols, (names, cats) = _event_columns(events)
    gpu = _on_gpu(cols, names, cats)
    cols["index_correlation"] = _index_correlation(cols, gpu)
    ops, kernels, steps = trace.join_columns(rank, cols, (names, cats))
    annotation = cats.isin(("user_annotation",))
    annotations = pd.DataFrame({"name": cols["name"][annotation], "tid": cols["tid"][annotation],
                                "ts_us": cols["ts"][annotation], "dur_us": cols["dur"][annotation]})  # fmt: skip
    is_op = cats.isin(("cpu_op",))
    records = pd.DataFrame({"index": cols["index"][is_op], "record_id": cols["record_id"][is_op]})
    timeline = trace.Timeline(device_kind="cuda" if len(kernels) else "cpu", ops=ops, kernels=kernels, steps=steps)
    return Parsed(timeline=timeline, annotations=annotations, record_frame=records,
                  unlaunched=_unlaunched(cols, gpu, cats))  # fmt: skip
