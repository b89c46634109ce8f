"""`analyze.write_csv`: a table written `CSV_ROWS` rows at a time is, byte for byte, what pandas' `to_csv` writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusionscope import analyze


@pytest.mark.parametrize("rows", [1, 4, 5, 1 << 16])
def test_write_csv_in_parts_is_pandas_to_csv(rows: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written `CSV_ROWS` rows at a time (here a few, so that a table spans parts and a part ends its last row),
    the file is still what pandas writes: every kind of field, with -0.0 and NaN in some parts and not others."""
    monkeypatch.setattr(analyze, "CSV_ROWS", rows)
    frame = pd.DataFrame({"f": [1.0, np.nan, -0.0, 1e-300, 2.5, 0.0, -0.0, 7.0, np.inf],
                          "o": [None, [1, [2, 3]], 'a,"b"\nc', 1.5, "", "x", [1, [2, 3]], None, "é"],
                          "i": np.arange(9) - 4})  # fmt: skip
    frame.to_csv(tmp_path / "pandas.csv", index=False, float_format="%.6g")
    analyze.write_csv(frame, tmp_path / "fast.csv")
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()
