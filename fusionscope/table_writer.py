"""kernels.csv and ops.csv: written byte for byte as pandas' `to_csv` writes them, in a fraction of its time
(`write_csv`), and for a large trace by a second process while this one goes on (`tables_beside`).

Formatting a million-event trace's tables holds the interpreter for a second, once they are final (the kernels
classified), while the catalogue, the summary and the report still have to be made and the machine's other core has
nothing to do. Threads cannot share that work (it is Python code, under one interpreter lock), and a forked child
can deadlock on a lock held by a thread of the parent's libraries (torch's pools, the reading thread): the child is a
fresh interpreter, which imports this module only. The tables travel pickled through its stdin (about 60 MB at a
million events, a tenth of a second each way), ops.csv's as soon as the ops are final, and it writes them with
`write_csv`, so the files are the same bytes as when written here. Small tables are written here: starting an
interpreter that imports pandas costs more than they take. A child that cannot start or exits with an error leaves
the tables to be written here: its failure costs time, never the results.
"""

from __future__ import annotations

import csv
import gc
import io
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from fusionscope.trace_events import distinct_objects


def write_tables(folder: Path, kernels: pd.DataFrame, ops: pd.DataFrame) -> None:
    """kernels.csv and ops.csv, as `run_folder.write_tables` writes them (`write_csv`)."""
    write_csv(kernels, folder / "kernels.csv")
    write_csv(ops, folder / "ops.csv")


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    """`frame.to_csv(path, index=False, float_format="%.6g")`, byte for byte, in a fraction of its time: each column
    becomes the fields pandas would write (`_csv_fields`: floats formatted in one pass, each distinct object of an
    object column formatted and quoted once: the ops' shape lists and the names are shared objects, `trace_events`),
    joined into lines by `str.join` rather than `csv.writer`, which scans every character of every field; `CSV_ROWS`
    rows at a time, as the text of a million-event trace's tables is hundreds of MB. Each part is written by another
    thread while the next is formatted: the write into the page cache releases the GIL, and at a million events it
    took a third of the table's time. A frame of one column (whose empty fields `csv` quotes) or with a column of any
    other dtype is left to pandas."""
    columns = [_csv_fields(frame.iloc[:0, j]) for j in range(frame.shape[1])] if frame.shape[1] > 1 else [None]
    if any(c is None for c in columns):
        frame.to_csv(path, index=False, float_format="%.6g")
        return
    header = ",".join(_csv_quoted(label if isinstance(label, str) else _csv_text(label)) for label in frame.columns)
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        pending = writer.submit(f.write, (header + "\n").encode("utf-8"))
        for start in range(0, len(frame), CSV_ROWS):
            part = frame.iloc[start : start + CSV_ROWS]
            columns = [_csv_fields(part.iloc[:, j]) for j in range(part.shape[1])]
            text = ("\n".join(map(",".join, zip(*columns))) + "\n").encode("utf-8")
            pending.result()  # one part in flight: the text of a table is never whole in memory
            pending = writer.submit(f.write, text)
        pending.result()


CSV_ROWS = 1 << 16  # rows of a table formatted and written at a time


FLOAT_FIELD = "%.6g".__mod__  # pandas' float_format="%.6g"
DISTINCT_PROBE = 4096  # the first values of a column, whose share of distinct ones picks how it is formatted


def _csv_fields(column: pd.Series) -> list[str] | None:
    """The fields `to_csv(float_format="%.6g")` writes for a column, quoted as its `csv` writer quotes them: floats
    by "%.6g" (NaN empty), ints and bools by str (neither needs quoting); objects empty when missing, by repr when
    floats (as `csv` writes them), else by str. None for another dtype (categorical, nullable, dates). Each distinct
    value is formatted once (`_by_distinct`): tables repeat their steps, names, shapes and rates."""
    values = column.to_numpy()
    kind = values.dtype.kind
    if kind == "f":
        if ((values == 0) & np.signbit(values)).any():  # -0.0 is one value with 0.0 to factorize, and prints "-0"
            return ["" if v != v else FLOAT_FIELD(v) for v in values.tolist()]
        return _by_distinct(values, FLOAT_FIELD)
    if kind in "iub":
        return _by_distinct(values, str)
    if kind != "O" or not isinstance(column.dtype, np.dtype):
        return None
    listed = values.tolist()
    codes, first = distinct_objects(values)  # each object once, whatever it holds
    if len(first) > 1000 and pd.api.types.infer_dtype(values, skipna=False) == "string":
        return _by_distinct(values, _csv_quoted)  # many string objects of few values (`bound`, `module`): by value
    fields = [_csv_quoted(v) if type(v) is str else _csv_quoted(_csv_text(v)) for v in map(listed.__getitem__, first)]
    return np.asarray(fields, dtype=object)[codes].tolist() if fields else []


def _by_distinct(values: np.ndarray, field: Callable[[object], str]) -> list[str]:
    """`field` of each value, computed once per distinct value (NaN: empty); value by value where the first values
    are mostly distinct (ids, timestamps: hashing them saves nothing, and took half of such a column's time)."""
    head = values[:DISTINCT_PROBE]
    if 2 * len(pd.unique(head)) > len(head) and not (values.dtype.kind == "f" and np.isnan(values).any()):
        return list(map(field, values.tolist()))
    codes, uniques = pd.factorize(values)
    fields = np.array([*map(field, np.asarray(uniques).tolist()), ""], dtype=object)  # code -1 (NaN): the last
    return fields[codes].tolist()


def _csv_text(value: object) -> str:
    """One object column field as pandas and `csv` write it, before quoting."""
    if value is None:
        return ""
    if not isinstance(value, list | tuple | dict | set | np.ndarray) and pd.isna(value):
        return ""
    return float.__repr__(value) if isinstance(value, float) else str(value)


_CSV_PROBE = io.StringIO()
_CSV_WRITER = csv.writer(_CSV_PROBE, lineterminator="\n")


def _csv_quoted(text: str) -> str:
    """`text` as a field of a row of several, quoted (or not) by the `csv` writer pandas uses, so that its rules
    (which characters force quotes) are this Python's."""
    if not text:
        return text
    _CSV_PROBE.seek(0)
    _CSV_PROBE.truncate()
    _CSV_WRITER.writerow((text, ""))
    return _CSV_PROBE.getvalue()[:-2]


BESIDE_ROWS = 100_000  # rows of both tables together from which a child writes them


@contextmanager
def tables_beside(folder: Path, ops: pd.DataFrame, kernel_rows: int, child: subprocess.Popen | None = None,
                  ) -> Iterator[Callable[[pd.DataFrame], None]]:  # fmt: skip
    """ops.csv and kernels.csv are in `folder` when the block ends; the block hands the kernels table, once made, to
    the function it is given. Tables of `BESIDE_ROWS` rows or more (`ops` and the `kernel_rows` expected) are
    written by a child process while the block runs (`child`, one `writer_for` started earlier, whatever their
    size): ops.csv from the start, while the kernels are still costed, kernels.csv once handed over; smaller ones
    here, once the kernels are handed over (module docstring). At a million events the child wrote for a third of
    a second more than the rest of the run took when it began with the kernels. An exception in the block kills
    the child before it propagates, so that no file is written into a folder being removed."""
    if child is None and len(ops) + kernel_rows >= BESIDE_ROWS:
        child = _spawn()
    if child is None:
        yield lambda kernels: write_tables(folder, kernels, ops)
        return
    sender = _Sender(child)
    sender.send(folder / "ops.csv", ops)
    given: list[pd.DataFrame] = []  # the kernels table, once handed over

    def hand_over(kernels: pd.DataFrame) -> None:
        given.append(kernels)
        sender.send(folder / "kernels.csv", kernels)

    try:
        yield hand_over
    except BaseException:
        child.kill()
        child.wait()
        raise
    sender.send(None, None)
    if child.wait() != 0:  # it said why on stderr
        write_tables(folder, given[0], ops)


@contextmanager
def writer_for(events: int) -> Iterator[subprocess.Popen | None]:
    """The child for `tables_beside`, started now for a trace of `events` events (the tables' rows are fewer; None
    below `BESIDE_ROWS`): its interpreter and imports (a third of a second) then run while this process joins the
    trace, on the core the reading left idle. Killed when the block ends if it still runs (an error came before
    `tables_beside` waited for it)."""
    child = _spawn() if events >= BESIDE_ROWS else None
    try:
        yield child
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()


def _spawn() -> subprocess.Popen | None:
    """A child waiting for its tables on stdin; None where no interpreter can be started."""
    if not sys.executable:
        return None
    try:
        return subprocess.Popen(_command(), stdin=subprocess.PIPE)
    except OSError:
        return None


class _Sender:
    """Tables sent to the child, each pickled here as (path, table) and written to its stdin by a thread, in
    order (a pipe write releases the interpreter lock, and this process does not wait for the child to read)."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=_send, args=(child, self.queue), daemon=True).start()

    def send(self, path: Path | None, table: pd.DataFrame | None) -> None:
        """Queue a table for the child; a None path ends what it is sent."""
        self.queue.put(None if path is None else pickle.dumps((str(path), table), protocol=pickle.HIGHEST_PROTOCOL))


CHILD = "import sys; sys.path[:] = sys.argv[1:]; from fusionscope.table_writer import main; main()"


def _command() -> list[str]:
    """The child's command line: this interpreter with this one's flags, importing from this one's `sys.path` (so
    the same fusionscope, wherever it comes from), running `main`."""
    return [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", CHILD, *sys.path]


def _send(child: subprocess.Popen, payloads: queue.SimpleQueue) -> None:
    """Write each payload to the child until a None, then close its stdin; a child that died first is seen by its
    exit status."""
    try:
        with child.stdin:
            while (payload := payloads.get()) is not None:
                child.stdin.write(payload)
    except OSError:
        pass


def main() -> None:
    """The child: write each table it is sent, as it comes (its imports made while the parent joined the trace). The
    collector is paused as in the parent: the unpickled tables are hundreds of thousands of objects and no cycles.
    An interrupt is the parent's to handle (it stops the child)."""
    gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            path, table = pickle.load(sys.stdin.buffer)
        except EOFError:  # all sent
            return
        write_csv(table, Path(path))
