"""A large trace read by worker processes (`trace_pool`) gives the tables a read in this process gives: on every
fixture cut into many pieces, when a worker dies or none starts, and when a piece is no list of events; and the
workers and their files are gone afterwards."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusionscope import analyze, trace_events, trace_pool

DATA = Path(__file__).resolve().parent / "data"
TRACES = [
    DATA / "tiny-llama-cuda.trace.json.gz",
    DATA / "llama-3.2-1b-cuda.trace.json.gz",
    *sorted((DATA / "traces").glob("*.trace.json.gz")),
    DATA / "traces" / "gloo-2ranks" / "rank0.trace.json.gz",
]

pytest.importorskip("msgspec")


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every gzipped trace read by two workers, in pieces of about 20 kB (a fixture becomes tens of them); the
    pieces' files under the returned folder, so a test can see them go."""
    monkeypatch.setattr(trace_pool, "POOL_FROM_BYTES", 0)
    monkeypatch.setattr(trace_pool, "POOL_FROM_BYTES_MANY_CORES", 0)
    monkeypatch.setattr(trace_pool, "INFLATED_CHUNK", 20_000)
    monkeypatch.setattr(trace_events, "GAP_WINDOW", 4096)
    monkeypatch.setattr(trace_pool, "SHARED_MEMORY", tmp_path)
    monkeypatch.setenv(trace_pool.WORKERS_ENV, "2")
    return tmp_path


def parsed_tables(doc: trace_events.TraceDocument) -> dict[str, object]:
    """Everything `analyze` takes from a decoded document: its header, the checks of every event, and the tables."""
    parsed = trace_events.parse_events(doc.events)
    tl = parsed.timeline
    return {"header": (doc.device_properties, doc.distributed_info), "events": len(doc.events),
            "cats": trace_events.trace.Labels.of(doc.events.cats.uniques[doc.events.cats.codes]).uniques.tolist(),
            "complete": doc.events.complete().tolist(), "devices": doc.events.kernel_devices(),
            "ops": tl.ops, "kernels": tl.kernels, "steps": tl.steps, "annotations": parsed.annotations,
            "records": parsed.record_frame, "unlaunched": parsed.unlaunched, "kind": tl.device_kind}  # fmt: skip


def assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    for key, value in want.items():
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(got[key], value, obj=key)
        else:
            assert got[key] == value, key


def whole(path: Path) -> dict[str, object]:
    return parsed_tables(trace_events.decode(gzip.decompress(path.read_bytes())))


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_pooled_read_gives_the_tables_of_a_whole_decode(path: Path, pooled: Path) -> None:
    doc = trace_pool.read_document(path)
    assert isinstance(doc.events, trace_events.PooledEvents)  # the workers made it
    assert_same(parsed_tables(doc), whole(path))
    assert not list(pooled.iterdir())  # the pieces' files are gone


def test_pieces_are_served_by_the_worker_and_here(pooled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture is cut into many pieces; the worker process and this process's own thread both decode some."""
    served: dict[str, int] = {}

    def counted(name: str, serve: Callable[..., None]) -> Callable[..., None]:
        def wrapper(self: trace_pool.DecodePool, *args: object) -> None:
            before = sum(r is not trace_pool.FAILED for r in self.results)
            serve(self, *args)
            served[name] = sum(r is not trace_pool.FAILED for r in self.results) - before

        return wrapper

    monkeypatch.setattr(trace_pool, "INFLATED_CHUNK", 4000)  # hundreds of pieces: both sides get some
    monkeypatch.setattr(trace_pool.DecodePool, "_serve", counted("worker", trace_pool.DecodePool._serve))
    monkeypatch.setattr(trace_pool.DecodePool, "_serve_here", counted("here", trace_pool.DecodePool._serve_here))
    doc = trace_pool.read_document(TRACES[1])
    assert isinstance(doc.events, trace_events.PooledEvents)
    assert set(served) == {"worker", "here"} and sum(served.values()) > 100
    assert_same(parsed_tables(doc), whole(TRACES[1]))


def broken_worker() -> subprocess.Popen:
    """A worker that dies at once, before it reads anything."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip


@pytest.mark.parametrize("start", [broken_worker, lambda: None], ids=["workers die", "no worker starts"])
def test_pieces_no_worker_sent_are_decoded_here(pooled: Path, monkeypatch: pytest.MonkeyPatch, start) -> None:
    monkeypatch.setattr(trace_pool, "_start", start)
    doc = trace_pool.read_document(TRACES[1])
    assert isinstance(doc.events, trace_events.PooledEvents)
    assert_same(parsed_tables(doc), whole(TRACES[1]))


EVENT = '{"ph": "X", "cat": "cpu_op", "name": "%s", "ts": %d, "dur": 1, "tid": %s, "args": {"Input Dims": [[%d]]}}'


@pytest.mark.parametrize("name", ["a}, {b", "plain"])
def test_a_cut_inside_a_string_falls_back_to_a_whole_decode(pooled: Path, tmp_path: Path, name: str) -> None:
    """Names holding `}, {` make cuts where no event ends: such a piece is no list of events, so the caller reads the
    whole file again (`analyze.parse_trace`), with the same tables. Thread ids that no integer reads (names) get
    their ids over the whole."""
    events = ", ".join(EVENT % (name, k, '"worker"' if k % 7 == 0 else k % 3, k) for k in range(3000))
    path = tmp_path / "odd.trace.json.gz"
    path.write_bytes(gzip.compress(('{"traceEvents": [' + events + "]}").encode()))
    doc = trace_pool.read_document(path)
    if name == "plain":
        assert isinstance(doc.events, trace_events.PooledEvents)
    else:
        assert doc is None  # the pieces' text is not kept: the caller reads the file whole
        _facts, doc = analyze.parse_trace(path)
    assert_same(parsed_tables(doc), whole(path))
    assert (trace_events.event_columns(doc.events)["tid"] == -2).sum() == len(range(0, 3000, 7))


def test_analyze_with_workers_writes_the_same_tables(pooled: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with_workers = analyze.analyze(TRACES[1], out=tmp_path / "pooled")
    monkeypatch.setenv(trace_pool.WORKERS_ENV, "0")
    here = analyze.analyze(TRACES[1], out=tmp_path / "here")
    for table in ("kernels.csv", "ops.csv", "opportunities.csv"):
        assert (with_workers.out_dir / table).read_bytes() == (here.out_dir / table).read_bytes(), table
    assert with_workers.summary["opportunities"] == here.summary["opportunities"]


def test_remove_ends_busy_workers_and_their_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_pool, "SHARED_MEMORY", tmp_path)
    pool = trace_pool.DecodePool(2)
    pool.submit([b"[", b"]"])
    pool.remove()
    assert all(child.poll() is not None for child in pool.children)
    assert not pool.folder.exists()


@pytest.mark.parametrize(("given", "cores", "want"), [("3", 16, 3), ("0", 16, 0), ("1", 16, 0), ("", 16, 8),
                                                      ("", 2, 2), ("", 1, 0), ("x", 4, 4)])  # fmt: skip
def test_workers(given: str, cores: int, want: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trace_pool.WORKERS_ENV, given)
    monkeypatch.setattr(trace_pool.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert trace_pool.workers() == want


def test_text_bytes_is_the_gzip_record(tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    text = np.random.default_rng(0).bytes(100_000)
    path.write_bytes(gzip.compress(text))
    assert trace_pool.text_bytes(path) == len(text)


@pytest.mark.parametrize(("workers", "mib", "pooled"), [(2, 100, False), (2, 200, True), (8, 100, True),
                                                        (8, 50, False), (0, 500, False)])  # fmt: skip
def test_only_a_large_trace_is_read_by_workers(workers: int, mib: int, pooled: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Below the size where the workers' start pays back (fewer cores: a larger one) the trace is read here."""
    made: list[int] = []

    class Made(Exception):
        pass

    def pool(count: int, _text_size: int = 0) -> None:
        made.append(count)
        raise Made

    monkeypatch.setattr(trace_pool, "workers", lambda: workers)
    monkeypatch.setattr(trace_pool, "text_bytes", lambda _path: mib << 20)
    monkeypatch.setattr(trace_pool, "DecodePool", pool)
    if pooled:
        with pytest.raises(Made):
            trace_pool.read_document(TRACES[0])
    else:
        assert trace_pool.read_document(TRACES[0]).events is not None
    assert made == ([workers] if pooled else [])


def test_pieces_no_file_can_hold_are_decoded_here(pooled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under the pieces' folder (every third write fails) costs time, not results."""
    real_open, calls = open, [0]

    def full(path: object, mode: str = "r", *args: object, **kwargs: object):
        if "w" in mode and str(path).endswith(".json"):
            calls[0] += 1
            if calls[0] % 3 == 0:
                raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full)
    doc = trace_pool.read_document(TRACES[1])
    assert calls[0] > 6 and isinstance(doc.events, trace_events.PooledEvents)
    assert_same(parsed_tables(doc), whole(TRACES[1]))


def test_the_pieces_go_to_shared_memory_only_where_it_has_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_pool, "SHARED_MEMORY", tmp_path)
    free = trace_pool.shutil.disk_usage(tmp_path).free
    assert trace_pool._pieces_base(free // 4) == tmp_path
    assert trace_pool._pieces_base(free) is None


@pytest.mark.parametrize("workers", ["0", "2"])
def test_gzipped_text_that_is_not_json_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        workers: str) -> None:  # fmt: skip
    monkeypatch.setattr(trace_pool, "POOL_FROM_BYTES", 0)
    monkeypatch.setattr(trace_pool, "POOL_FROM_BYTES_MANY_CORES", 0)
    monkeypatch.setenv(trace_pool.WORKERS_ENV, workers)
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"}, {"ph": nope}]}'))
    with pytest.raises(analyze.UsageError, match="is not JSON"):
        analyze.parse_trace(path)


def test_a_stopped_pool_decodes_nothing_more_and_leaves_no_files(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Stopped with pieces queued (an interrupt, an error): none of them is decoded after, and no file stays."""
    monkeypatch.setattr(trace_pool, "SHARED_MEMORY", tmp_path)
    decoded: list[int] = []
    go = threading.Event()

    def slow(text: bytes) -> None:
        go.wait(30)  # the first piece holds this process's thread until the queue is emptied
        decoded.append(len(text))

    monkeypatch.setattr(trace_pool, "decoded_piece", slow)
    pool = trace_pool.DecodePool(1)  # this process's thread only
    pool.room = threading.Semaphore(100)  # room for every piece: the queue is what this test is about
    for _ in range(30):
        pool.submit([b"[", b"x" * 1000, b"]"])
    stopping = threading.Thread(target=pool.close, kwargs={"kill": True})
    stopping.start()
    for _ in range(3000):
        if pool.todo.empty():
            break
        time.sleep(0.001)
    go.set()
    stopping.join(30)
    pool.remove()
    assert not stopping.is_alive() and len(decoded) <= 2 and not pool.folder.exists()


def test_the_folder_holds_few_pieces(pooled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[int] = []
    real = trace_pool.DecodePool.submit

    def submit(self: trace_pool.DecodePool, parts: list) -> None:
        real(self, parts)
        held.append(len(list(self.folder.iterdir())))

    monkeypatch.setattr(trace_pool.DecodePool, "submit", submit)
    assert isinstance(trace_pool.read_document(TRACES[1]).events, trace_events.PooledEvents)
    assert len(held) > 20 and max(held) <= 2 * 2
