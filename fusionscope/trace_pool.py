"""A large trace read by worker processes: the text is cut between events as it inflates, and each piece is decoded
by a fresh interpreter straight into the columns the join takes (`trace_events.columns_of`), so that no Python object
per event and field ever reaches this process.

Why: decoding a million-event trace in one process makes an object per event (msgspec's structs), columns of them,
then the join's columns: about 4 s of one core on the 2-core CI machine at a million events, while the other cores
idle (a GPU host has 16). Threads cannot share that work (it is Python code, under one interpreter lock), and a
forked child can deadlock on a lock a thread of the parent held (the inflating thread, torch's pools), so the
workers are fresh interpreters, as `table_writer`'s is, started before the first byte is inflated (their imports
overlap the inflating). This process decodes pieces too, on a thread: its main thread only cuts and writes the text
and the inflating thread leaves the interpreter lock free, so of `workers()` one is that thread (on 2 cores: one
worker process and this one; a second process cost 0.45 s more CPU for its start and was no faster). Each piece
travels through a file in shared memory (`/dev/shm`; through a pipe, 325 MB took 0.9 s of this process's time), and
its columns come back pickled: arrays of numbers, and the few distinct names and argument lists once each (pickle's
memo keeps the objects a piece shares shared; `_shared_lists` then makes each argument list one object over the
whole trace, as a read here shares it). Each file is removed once read, and at most two pieces per worker wait in
the folder (the rest of the text waits inflated in this process), so an abrupt end leaves little in shared memory;
where a piece turns out to be no list of events, the caller reads the whole file again (`read_document` gives None).

The pieces are `trace_events.StreamedDecode`'s (cut after an event's `}`, `,` and the next `{`; the header decoded
here), and the parts they give join into the whole's columns (`ColumnsPart.concat`: the index of each event in the
file, names and categories as `Labels` merged, timestamps and unnamed threads finished over the whole), so the tables
are the ones `trace_events.decode` of the whole text gives (tests/test_trace_pool.py, on every fixture). Where any
piece is no list of plain events (a cut inside a string, a value msgspec refuses), the whole text is decoded here as
before; a worker that cannot start or dies leaves its pieces to this process. Small traces are read as before:
starting an interpreter that imports pandas costs 0.3-0.4 s of CPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fusionscope import trace
from fusionscope.trace_events import (
    LIST_ARGS,
    ColumnsPart,
    EventColumns,
    PooledEvents,
    StreamedDecode,
    TraceDocument,
    _events_decoder,
    _objects,
    _struct_columns,
    columns_of,
    distinct_objects,
    first_rows,
    merged_labels,
    msgspec,
)

INFLATED_CHUNK = 1 << 22  # bytes of text handed over at a time: about 12k events, a piece for a worker
# Text from which workers decode it. On 2 cores (2 workers and this process) the workers' start (0.45 s of CPU
# each, mostly pandas' import) is paid back from about 160 MiB (500k events: 2.0-2.6 s here, 2.1-2.2 s pooled; 200k
# events: 1.2-1.4 s here, 1.5-1.8 s pooled); with more cores the starts run side by side and pay back sooner.
POOL_FROM_BYTES = 160 << 20
POOL_FROM_BYTES_MANY_CORES = 64 << 20  # from 4 workers
MAX_WORKERS = 8  # past this the inflating, one stream on one core, is what everything waits for
WORKERS_ENV = "FUSIONSCOPE_TRACE_WORKERS"  # how many worker processes (0: none, every trace read here)
SHARED_MEMORY = Path("/dev/shm")


def inflate(path: Path, put: Callable[[bytes | None], object], chunk: int = INFLATED_CHUNK) -> None:
    """Inflate the gzipped file and `put` its text chunk by chunk, then None (also when it fails). The bytes of
    `gzip.decompress` (every member, zero padding between members skipped), which zlib checks as it goes (each
    member's CRC and length); a damaged or truncated file raises (zlib's error, or EOFError)."""
    try:
        data = path.read_bytes()
        while data:
            member = zlib.decompressobj(16 + zlib.MAX_WBITS)  # a gzip member
            while not member.eof:
                text = member.decompress(data, chunk)
                data = member.unconsumed_tail
                if text:
                    put(text)
                elif not data:
                    raise EOFError("compressed file ended before the end-of-stream marker was reached")
            data = member.unused_data.lstrip(b"\x00")
    finally:
        put(None)


def workers() -> int:
    """Worker processes for a large trace: this process's cores, at most `MAX_WORKERS`, or `WORKERS_ENV`'s
    number; fewer than two is none (one worker beside this process gains nothing a thread does not)."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = int(given) if given.isdigit() else min(cores, MAX_WORKERS)
    return count if count >= 2 else 0


def text_bytes(path: Path) -> int:
    """The size of the trace's text: a gzip's own record of it (its last four bytes, modulo 4 GiB), else the
    file's size."""
    size = path.stat().st_size
    if not path.name.endswith(".gz") or size < 18:
        return size
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little")


def read_document(path: Path, while_reading: Callable[[], object] | None = None,
                  pooled: bool = True) -> TraceDocument | None:  # fmt: skip
    """The gzipped trace decoded as another thread inflates it: by worker processes for a large trace (`pooled`,
    module docstring), else here, each run of whole events as soon as it has arrived (at a million events inflating
    and decoding take most of a second each, now side by side). `while_reading` runs while it inflates. None where
    the file cannot be inflated, or where a piece the workers had is no list of plain events: the caller reads it
    whole and says why (or decodes it with `json`)."""
    count = workers() if pooled and msgspec is not None else 0
    if count and text_bytes(path) < min(POOL_FROM_BYTES, POOL_FROM_BYTES_MANY_CORES if count >= 4 else 1 << 62):
        count = 0
    decoder: StreamedDecode | None = None
    chunks: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    try:
        decoder = PooledDecode(DecodePool(count)) if count else StreamedDecode()
        with ThreadPoolExecutor(max_workers=1) as pool:
            reading = pool.submit(inflate, path, chunks.put, INFLATED_CHUNK)
            if while_reading is not None:
                while_reading()
            with collector_paused():
                while (chunk := chunks.get()) is not None:
                    decoder.feed(chunk)
            if reading.exception() is not None:
                return None
        with collector_paused():
            return decoder.finish()
    finally:  # also on an interrupt, or an error here: the workers are killed, their pieces not wanted
        if isinstance(decoder, PooledDecode):
            decoder.pool.remove()


def load_timeline(path: Path) -> trace.Timeline:
    """The Timeline of one trace file through `trace_events`' decode (msgspec into columns; by worker processes
    for a large one) instead of HTA's parser: `profile` loads its own trace this way. The tables are HTA's
    (tests/test_analyze_events.py) and the load is several times faster (reports/analyze/profile_load.json); an 8B
    model's profile spent 31 s of its run in HTA's parse on the H200 host. A folder of rank traces still goes
    through HTA (`trace.load_timeline`)."""
    from fusionscope.trace_events import decode, parse_events
    from fusionscope.trace_fields import to_int

    if path.is_dir():
        return trace.load_timeline(path)
    doc = read_document(path) if path.name.endswith(".gz") else None
    with collector_paused():
        if doc is None:
            raw = path.read_bytes()
            if path.name.endswith(".gz"):
                import gzip

                raw = gzip.decompress(raw)
            doc = decode(raw)
            del raw
        if doc.events is None:
            raise ValueError(f"{path} is not a torch.profiler trace (no traceEvents)")
        info = doc.distributed_info
        rank = max(to_int(info.get("rank"), 0), 0) if isinstance(info, dict) else 0
        return parse_events(doc.events, rank).timeline


@contextmanager
def collector_paused(paused: bool = True) -> Iterator[None]:
    """Pause the cyclic garbage collector while a trace becomes millions of small objects that hold no cycles:
    each collection it triggers walks all of them: `json.loads` of a 1M-event trace took 25.3 s with it running, 8.6 s
    without (2-core CPU, 2026-12-01). `analyze` pauses it for the whole run: re-enabled between stages, the first
    full collection after each walked every object still alive. With `paused` False, it runs meanwhile: an import
    (`analyze.import_catalogue`) makes few objects but many cycles, and with the collector paused all of its objects
    would still be young at the run's end, where the first collection walked them (0.3 s)."""
    was = gc.isenabled()
    if paused:
        gc.disable()
    else:
        gc.enable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()


@dataclass
class Piece:
    """What a worker sends back for a piece of the text: what `analyze` checks of every event, and the columns of
    the complete ones (`trace_events.columns_of`), each argument list column as codes into its distinct objects
    (`lists`; None in `part` holds its place), which `_joined` makes one object per value over the whole trace."""

    events: int
    cats: trace.Labels  # every event's category
    completes: np.ndarray  # `EventColumns.complete`
    devices: list  # `EventColumns.kernel_devices`
    part: ColumnsPart
    lists: dict[str, tuple[np.ndarray, np.ndarray]]  # column → (codes, distinct objects)


def piece_of(events: list) -> Piece:
    """The `Piece` of msgspec's event structs (`trace_events._events_decoder`)."""
    cols = EventColumns(*_struct_columns(events), structs=True)
    part = columns_of(cols)
    lists = {}
    for column in LIST_ARGS:
        codes, first = distinct_objects(part.columns[column].tolist())
        lists[column], part.columns[column] = (codes, part.columns[column][first]), None
    return Piece(len(cols), cols.cats, cols.complete(), cols.kernel_devices(), part, lists)


def _shared_lists(pieces: list[Piece]) -> None:
    """Fill each piece's argument list columns with one object per distinct value over all pieces (the first
    piece's), as `trace_events._shared` of the whole trace shares them: later stages compute per object, and a
    piece's own objects would repeat each value once per piece (at a million events, 60 times)."""
    for column in LIST_ARGS:
        uniques = np.concatenate([piece.lists[column][1] for piece in pieces])
        codes, values = pd.factorize(_objects([repr(v) for v in uniques.tolist()]))
        shared, start = uniques[first_rows(codes, len(values))][codes], 0
        for piece in pieces:
            piece_codes, piece_uniques = piece.lists[column]
            piece.part.columns[column] = shared[start : start + len(piece_uniques)][piece_codes]
            start += len(piece_uniques)


def decoded_piece(text: bytes) -> Piece | None:
    """The `Piece` of a piece of the text (`[` + whole events + `]`); None where it is no list of plain events."""
    try:
        events = _events_decoder().decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return piece_of(events)


class PooledDecode(StreamedDecode):
    """`StreamedDecode` whose pieces are decoded by the pool's workers; the last piece, which `_end` decodes here to
    find where the list of events ends, is made a `Piece` here."""

    def __init__(self, pool: DecodePool) -> None:
        super().__init__()
        self.pool = pool

    def _take(self, parts: list[bytes | memoryview]) -> bool:
        self.pool.submit(parts)
        return True

    def finish(self) -> TraceDocument | None:
        """The document, or None where the workers' pieces cannot make it (`read_document`'s caller then reads the
        file whole: the pieces' text is not kept)."""
        doc = None if self.whole or self.head is None else self._end()
        return doc if doc is not None and doc.events is not None else None

    def _joined(self, last: list) -> PooledEvents | None:
        pieces = []
        for k, got in enumerate(self.pool.close()):
            if got is FAILED:  # no worker sent it back: decoded here if its text is still there
                text = self.pool.text(k)
                got = None if text is None else decoded_piece(text)
            if got is None:
                return None
            pieces.append(got)
        pieces.append(piece_of(last))
        _shared_lists(pieces)
        firsts = np.cumsum([0, *(p.events for p in pieces[:-1])]).tolist()
        every_cat = merged_labels([p.cats for p in pieces])
        return PooledEvents(cats=every_cat, completes=np.concatenate([p.completes for p in pieces]),
                            devices=[d for p in pieces for d in p.devices],
                            part=ColumnsPart.concat([p.part for p in pieces], firsts, every_cat))  # fmt: skip


FAILED = object()  # a piece no worker sent back


class DecodePool:
    """`count` - 1 worker processes and a thread of this one decoding pieces of a trace's text (`submit`); each
    process is served by a thread here that hands it the next piece (a file in shared memory) and reads its `Piece`
    back (`pickle`); `close` returns them in the order submitted (`FAILED` where none did it)."""

    def __init__(self, count: int) -> None:
        in_flight = 2 * count  # pieces written and not yet read: what the folder holds at most
        self.folder = Path(tempfile.mkdtemp(prefix="fusionscope-pieces-", dir=_pieces_base(in_flight * INFLATED_CHUNK)))
        self.room = threading.BoundedSemaphore(in_flight)
        self.todo: queue.SimpleQueue[tuple[int, Path] | None] = queue.SimpleQueue()
        self.results: list[object] = []
        self.paths: list[Path] = []  # each piece's file, removed once read (its worker's, or this process's)
        self.unwritten: dict[int, bytes] = {}  # pieces no file could hold (a full disk): decoded here
        self.children = [child for child in (_start() for _ in range(count - 1)) if child is not None]
        self.threads = [threading.Thread(target=self._serve, args=(child,), daemon=True) for child in self.children]
        self.threads.append(threading.Thread(target=self._serve_here, daemon=True))
        for thread in self.threads:
            thread.start()
        self.closed: list[object] | None = None

    def submit(self, parts: list[bytes | memoryview]) -> None:
        """Write a piece's text (in parts, not joined: a copy less) and queue it for the next free worker; a piece
        no file can hold (the folder's disk full) is kept here and decoded here."""
        k = len(self.paths)
        path = self.folder / f"{k}.json"
        self.paths.append(path)
        self.results.append(FAILED)
        self.room.acquire()  # at most `in_flight` pieces wait in the folder: the rest of the text waits inflated here
        try:
            with open(path, "wb") as f:
                f.writelines(parts)
        except OSError:
            self.room.release()
            path.unlink(missing_ok=True)
            self.unwritten[k] = b"".join(parts)
            return
        self.todo.put((k, path))

    def text(self, k: int) -> bytes | None:
        """The text of piece `k`, None where it is gone (read by a worker that then died)."""
        if k in self.unwritten:
            return self.unwritten[k]
        with contextlib.suppress(OSError):
            return self.paths[k].read_bytes()
        return None

    def _done(self, path: Path) -> None:
        """A piece read: its file removed, its room given back."""
        path.unlink(missing_ok=True)
        self.room.release()

    def _serve(self, child: subprocess.Popen) -> None:
        """Hand the child pieces until none is left or it fails (its pieces stay FAILED)."""
        while (item := self.todo.get()) is not None:
            k, path = item
            try:
                pickle.dump(str(path), child.stdin)
                child.stdin.flush()
                self.results[k] = pickle.load(child.stdout)
            except Exception:
                self.room.release()  # the piece stays FAILED; its file, if the worker had not read it, stays
                return
            self._done(path)

    def _serve_here(self) -> None:
        """Decode pieces in this process too, beside the workers: its main thread only cuts and writes the text,
        and the inflating thread leaves the interpreter lock free (zlib releases it), so this costs the workers
        nothing and saves one interpreter's start (0.45 s of CPU)."""
        while (item := self.todo.get()) is not None:
            k, path = item
            try:
                self.results[k] = decoded_piece(path.read_bytes())
            except Exception:
                self.room.release()
                continue
            self._done(path)

    def close(self, kill: bool = False) -> list[object]:
        """Each piece's `Piece` (None: no list of plain events; FAILED: none sent it), once every piece is done (with
        `kill`, at once: the workers killed, their pieces FAILED); the workers' stdin closed, so they exit (not
        waited for: their teardown, 0.1 s, is theirs; `remove` reaps them). Safe to call again (the same list)."""
        if self.closed is None:
            if kill:
                for child in self.children:
                    child.kill()
                with contextlib.suppress(queue.Empty):
                    while True:  # the pieces not begun are not wanted: none is decoded after the kill
                        self.todo.get_nowait()
            for _ in self.threads:
                self.todo.put(None)
            for thread in self.threads:
                thread.join()
            for child in self.children:
                with contextlib.suppress(OSError):
                    child.stdin.close()
            self.closed = self.results
        return self.closed

    def remove(self) -> None:
        """End the workers (killed where they still run: their pieces are done or not wanted) and remove the
        pieces' files."""
        self.close(kill=True)
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _pieces_base(held: int) -> Path | None:
    """Where the pieces' files go: shared memory where it has room for twice what the folder holds at most (`held`
    bytes; a container's `/dev/shm` is often 64 MB), else the temporary folder (None: `tempfile`'s)."""
    try:
        if os.access(SHARED_MEMORY, os.W_OK) and shutil.disk_usage(SHARED_MEMORY).free > 2 * held:
            return SHARED_MEMORY
    except OSError:
        pass
    return None


CHILD = "import sys; sys.path[:] = sys.argv[1:]; from fusionscope.trace_pool import main; main()"


def _start() -> subprocess.Popen | None:
    """A worker: this interpreter with its flags, importing from this one's `sys.path` (the same fusionscope);
    None where none can be started."""
    if not sys.executable:
        return None
    command = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", CHILD, *sys.path]
    try:
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    except OSError:
        return None


def main() -> None:
    """A worker: decode each piece named on stdin and send its `Piece` back, until stdin ends. The collector is
    paused (a piece is tens of thousands of objects and no cycles); an interrupt is the parent's to handle."""
    gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _events_decoder()
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            path = Path(pickle.load(source))
        except EOFError:
            return
        try:
            pickle.dump(decoded_piece(path.read_bytes()), sink, protocol=pickle.HIGHEST_PROTOCOL)
            sink.flush()
        except BrokenPipeError:  # the parent is gone, or stopped the pool
            return
