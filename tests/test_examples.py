"""The examples run as documented."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_python_api_example(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "python_api.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "decode:" in printed and "add_rms_norm" in printed and "report:" in printed
