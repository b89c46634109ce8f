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


def test_analyze_trace_example(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["analyze_trace.py"])  # the default trace, whatever pytest was given
    runpy.run_path(str(EXAMPLES / "analyze_trace.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "trace: 3 step(s)" in printed and "not in the trace: tensor identities" in printed
    assert "phases compared: trace" in printed
