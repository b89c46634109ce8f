"""A run folder: what `profile`, `analyze`, `apply` and `distributed` write and `report` reads back.

Every run folder is written to a temporary sibling (`staged_dir`) and renamed into place at the end, so a failed run
leaves nothing behind and an earlier run is never overwritten; `finish_run_folder` writes its summary.json and
report.html last. The commands share these helpers, so they live below all of them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd

from fusionscope.errors import UsageError

SCHEMA_VERSION = 1


@dataclass
class Run:
    """A finished run folder and what it holds."""

    out_dir: Path
    summary: dict
    kernels: pd.DataFrame

    @property
    def report_path(self) -> Path:
        return self.out_dir / "report.html"


def default_out_dir(model_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("reports") / f"{model_name}-{stamp}"
    out, n = base, 2
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out


def check_out_dir(out: Path) -> None:
    """Refuse an existing folder and an unwritable parent before any work is done.

    Permission bits are not enough: root may write anywhere by them, yet no folder can be made under /proc or on a
    read-only mount. So the nearest existing ancestor is tried for real — a folder made in it and removed at once."""
    if out.exists():
        raise UsageError(f"--out {out} already exists; choose a new folder (runs are never overwritten)")
    parent = out.parent if str(out.parent) else Path(".")
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UsageError(f"cannot write to {parent}: choose an --out in a writable folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fusionscope-probe.", dir=probe))
    except OSError as exc:
        raise UsageError(f"cannot write to {parent} ({exc.strerror}): choose an --out in a writable folder") from None


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it to `out` on success, remove it on any failure. A parent that
    cannot be made (it vanished or became unwritable since `check_out_dir`) is a UsageError, not a traceback."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as exc:
        reason = f"cannot write to {out.parent} ({exc.strerror})"
        raise UsageError(f"{reason}: choose an --out in a writable folder") from None
    try:
        yield tmp
        if out.exists():
            raise UsageError(f"{out} appeared while this run was working; its results were not written")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finish_run_folder(tmp: Path, summary: dict, kernels: pd.DataFrame, t_start: float,
                      on_stage: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Write summary.json (with the run's wall time) and report.html into the staged folder."""
    if on_stage:
        on_stage("writing the run folder")
    summary["wall_s"] = round(time.perf_counter() - t_start, 2)
    write_json(tmp / "summary.json", summary)
    (tmp / "report.html").write_text(render_report(summary, kernels), encoding="utf-8")


def command_line() -> str:
    """The command as typed, when running from the CLI (empty from the Python API)."""
    argv0 = Path(sys.argv[0]).name if sys.argv else ""
    return " ".join(["fusionscope", *sys.argv[1:]]) if argv0 in ("fusionscope", "__main__.py") else ""


def write_tables(folder: Path, kernels: pd.DataFrame, ops: pd.DataFrame) -> None:
    kernels.to_csv(folder / "kernels.csv", index=False, float_format="%.6g")
    ops.to_csv(folder / "ops.csv", index=False, float_format="%.6g")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=False, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def render_report(summary: dict, kernels: pd.DataFrame) -> str:
    from fusionscope.report import render_report as render

    return render(summary, kernels)


def load_run(run_dir: str | Path) -> Run:
    """Read a run folder's summary.json and kernels.csv (no trace parsing: that is what makes `report` fast)."""
    folder = Path(run_dir)
    summary_file, kernels_file = folder / "summary.json", folder / "kernels.csv"
    if not folder.is_dir():
        raise UsageError(f"run folder not found: {folder}")
    if not summary_file.is_file() or not kernels_file.is_file():
        raise UsageError(f"{folder} is not a fusionscope run folder (needs summary.json and kernels.csv)")
    try:
        summary = json.loads(summary_file.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"malformed {summary_file}: {exc}") from None
    kernels = pd.read_csv(
        kernels_file, keep_default_na=False, na_values=[""], dtype={"name": str, "op": str, "module": str, "phase": str}
    )
    for col in ("name", "op", "module", "phase"):
        if col in kernels:
            kernels[col] = kernels[col].fillna("")
    return Run(out_dir=folder, summary=summary, kernels=kernels)


def rerender(run_dir: str | Path) -> Path:
    """Re-render `report.html` of a run folder from its saved data, atomically."""
    run = load_run(run_dir)
    html = render_report(run.summary, run.kernels)
    target = run.report_path
    tmp = target.with_name(f".{target.name}.partial")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(target)
    return target
