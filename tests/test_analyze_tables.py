"""`table_writer.write_csv`: a table written `CSV_ROWS` rows at a time is, byte for byte, what pandas' `to_csv` writes;
and tables written by a second process (`table_writer`) are the bytes this process writes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusionscope import analyze, table_writer


@pytest.mark.parametrize("rows", [1, 4, 5, 1 << 16])
def test_write_csv_in_parts_is_pandas_to_csv(rows: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written `CSV_ROWS` rows at a time (here a few, so that a table spans parts and a part ends its last row),
    the file is still what pandas writes: every kind of field, with -0.0 and NaN in some parts and not others."""
    monkeypatch.setattr(table_writer, "CSV_ROWS", rows)
    frame = pd.DataFrame({"f": [1.0, np.nan, -0.0, 1e-300, 2.5, 0.0, -0.0, 7.0, np.inf],
                          "o": [None, [1, [2, 3]], 'a,"b"\nc', 1.5, "", "x", [1, [2, 3]], None, "é"],
                          "i": np.arange(9) - 4})  # fmt: skip
    frame.to_csv(tmp_path / "pandas.csv", index=False, float_format="%.6g")
    table_writer.write_csv(frame, tmp_path / "fast.csv")
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


TRACE = Path(__file__).resolve().parent / "data" / "tiny-llama-cuda.trace.json.gz"


def _tables(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("kernels.csv", "ops.csv")}


def _written_here(*_args: object) -> None:
    raise AssertionError("the tables were written by this process, not the child")


def test_tables_written_beside_are_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose tables a child process writes (`table_writer`, forced here for a small trace) has the tables of
    a run that writes them itself, byte for byte; and the child wrote them (this process's writer refuses)."""
    analyze.analyze(TRACE, out=tmp_path / "here")
    monkeypatch.setattr(table_writer, "BESIDE_ROWS", 0)
    monkeypatch.setattr(table_writer, "write_tables", _written_here)
    analyze.analyze(TRACE, out=tmp_path / "beside")
    assert _tables(tmp_path / "beside") == _tables(tmp_path / "here")


def test_a_failed_child_leaves_the_tables_to_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that exits with an error costs time, not the tables: they are written here after it."""
    analyze.analyze(TRACE, out=tmp_path / "here")
    monkeypatch.setattr(table_writer, "BESIDE_ROWS", 0)
    monkeypatch.setattr(table_writer, "_command", lambda: [sys.executable, "-c", "import sys; sys.exit(3)"])
    analyze.analyze(TRACE, out=tmp_path / "fallback")
    assert _tables(tmp_path / "fallback") == _tables(tmp_path / "here")


def test_an_error_in_the_block_stops_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while the child writes kills it before the exception leaves the block: nothing is written into
    the folder afterwards (a staged run folder is being removed then)."""
    monkeypatch.setattr(table_writer, "BESIDE_ROWS", 0)
    frame = pd.DataFrame({"a": np.arange(3), "b": ["x", "y", "z"]})
    with pytest.raises(RuntimeError, match="stop"), table_writer.tables_beside(tmp_path, frame, 3) as hand_over:
        hand_over(frame)
        raise RuntimeError("stop")
    written = sorted(p.name for p in tmp_path.iterdir())
    time.sleep(1.0)  # a child still alive would have imported and written by now
    assert sorted(p.name for p in tmp_path.iterdir()) == written
