"""`reports/w4a16/gpu_w4a16.py` on the CPU: the run the other machine makes — every variant it times (the shipped
tiles, the candidates, bf16) checked against float64 with outputs poisoned, then timed in interleaved rounds, rows
written as they come, the summary and the targets — end to end with the interpreter standing in for the GPU, a wall
clock for CUDA events and small shapes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from fusionscope.kernels.w4a16_gemm import INTERPRETER, TILES

from tests.conftest import REPO
from tests.kernels.conftest import device


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_w4a16", REPO / "reports" / "w4a16" / "gpu_w4a16.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


@pytest.fixture(autouse=True)
def _gpu_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(INTERPRETER, "enabled", False)


def _run(tmp_path: Path, **kwargs) -> tuple[dict, list[dict]]:
    out = SCRIPT.Out(tmp_path)
    summary = SCRIPT.measure(out, tmp_path, device=device(), **kwargs)
    rows = [json.loads(line) for line in (tmp_path / "w4a16.jsonl").read_text().splitlines()]
    return summary, rows


def test_the_run_checks_times_and_summarises_every_variant(tmp_path: Path) -> None:
    """K = 256 → N = 160 (K a multiple of the 256-input step, N of no column tile, shipped or candidate: the masked
    path) at M = 1 and 9 (the GEMV: 1 row per program, then 4 with a third program of one live row; the tensor-core
    kernel: 16): every variant passes its float64 check (bit-equal on a second call), is timed in both rounds, and the
    summary has a point per M with × bf16 and copy shares."""
    summary, rows = _run(tmp_path, shapes=((256, 160),), rows=(1, 9), rounds=2)
    assert rows[0]["kind"] == "meta" and rows[-1]["kind"] == "summary"
    checks = [r for r in rows if r["kind"] == "check"]
    variants = {"new", "bf16", *(f"new:{label}" for label, _ in SCRIPT.CANDIDATES)}
    assert {r["variant"] for r in checks} == variants and len(checks) == 2 * len(variants)
    failed = [r for r in checks if not r["ok"]]
    assert not failed, failed[0]["trace"]
    assert all(r["bit_equal_twice"] for r in checks if r["variant"] != "bf16")
    times = [r for r in rows if r["kind"] == "time"]
    assert len(times) == 2 * 2 * len(variants) and all(r["us"] > 0 for r in times)
    assert [(p["K"], p["N"], p["M"]) for p in summary["points"]] == [(256, 160, 1), (256, 160, 9)]
    for point in summary["points"]:
        assert set(point["us"]) == variants and point["best_new"].startswith("new")
        assert point["shipped_x_bf16"] > 0 and point["shipped_copy_share_at_size"] > 0
    assert set(summary["targets"]) == {"shipped", "best"} and summary["stopped"] is None
    saved = json.loads((tmp_path / "w4a16.json").read_text())
    assert saved["summary"]["points"] == json.loads(json.dumps(summary["points"], default=str))
    assert "x bf16" in (tmp_path / "w4a16.log").read_text()


def test_the_budget_stops_new_measurements_and_the_summary_is_still_written(tmp_path: Path) -> None:
    summary, rows = _run(tmp_path, shapes=((128, 64),), rows=(1,), rounds=1, budget_s=0.0)
    assert summary["stopped"].startswith("time budget") and not summary["points"]
    assert rows[-1]["kind"] == "summary" and (tmp_path / "w4a16.json").exists()


def test_candidates_hold_every_key_of_the_shipped_tiles_of_their_kernel() -> None:
    """Each candidate is a TILES entry of its KERNEL with values changed, no key missing or extra, and its rows per
    program are legal for every M the sweep times."""
    shipped = {config["KERNEL"]: config for _, config in TILES.values()}
    for label, config in SCRIPT.CANDIDATES:
        assert set(config) == set(shipped[config["KERNEL"]]), label
        for M in SCRIPT.ROWS:
            rows = SCRIPT.rows_tiles(config, M)["BLOCK_M"]
            assert rows in ((1, 2, 4) if config["KERNEL"] == "gemv" else (16,)), (label, M, rows)
