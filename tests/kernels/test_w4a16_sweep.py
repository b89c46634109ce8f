"""`reports/w4a16/gpu_w4a16.py` on the CPU: the run the other machine makes — every variant it times (the shipped
tiles, the candidates, the replaced kernel from `w4a16_before.py`) checked against float64 with outputs poisoned,
then timed in interleaved rounds, rows written as they come, the summary and the targets — end to end with the
interpreter standing in for the GPU, a wall clock for CUDA events and small shapes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fusionscope.kernels.w4a16_gemm import INTERPRETER

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
    """K = 256 → N = 192 (K a multiple of the 256-input step, N of no candidate's column tile: the masked path) at M =
    1 and 9 (8 and 16 rows per program): every variant passes its float64 check (bit-equal on a second call), is
    timed in both rounds, and the summary has a point per M with × bf16 and copy shares."""
    summary, rows = _run(tmp_path, shapes=((256, 192),), rows=(1, 9), rounds=2)
    assert rows[0]["kind"] == "meta" and rows[-1]["kind"] == "summary"
    checks = [r for r in rows if r["kind"] == "check"]
    variants = {"new", "old", "bf16", *(f"new:{label}" for label, _ in SCRIPT.CANDIDATES)}
    assert {r["variant"] for r in checks} == variants and len(checks) == 2 * len(variants)
    failed = [r for r in checks if not r["ok"]]
    assert not failed, failed[0]["trace"]
    assert all(r["bit_equal_twice"] for r in checks if r["variant"] != "bf16")
    times = [r for r in rows if r["kind"] == "time"]
    assert len(times) == 2 * 2 * len(variants) and all(r["us"] > 0 for r in times)
    assert [(p["K"], p["N"], p["M"]) for p in summary["points"]] == [(256, 192, 1), (256, 192, 9)]
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


def test_the_old_kernel_reads_the_same_levels_in_its_own_layout() -> None:
    """The baseline is the replaced kernel on the very weights the new one reads: repacked from the same levels."""
    mod, old = SCRIPT.kernel_module(), SCRIPT.before_module()
    weight = torch.randn(48, 300, generator=torch.Generator().manual_seed(3)).to(device(), torch.bfloat16)
    p = mod.quantize_w4(weight, 64)
    old_q = old.pack_w4(mod.unpack_w4(p.qweight, 300))
    assert torch.equal(old.dequantize_w4(old_q, p.scales, p.zeros, 64, 300), mod.dequantize_w4(*p[:3], 64, 300))
