"""`reports/w4a16/gpu_w4a16.py sweep` on the CPU: every configuration it will time on the GPU computes the right answer
here first (so the one GPU run does not discover a broken candidate), and the sweep's own bookkeeping — checks,
interleaved timings, rows written as they come, the summary table, the time budget — runs end to end with the
interpreter standing in for the GPU and a wall clock for CUDA-graph timing."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fusionscope.kernels.tolerances import assert_close
from fusionscope.kernels.w4a16_gemm import INTERPRETER, quantize_w4, schedule, w4a16_gemm, w4a16_reference

from tests.conftest import REPO
from tests.kernels.conftest import device, poisoned, randn


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_w4a16", REPO / "reports" / "w4a16" / "gpu_w4a16.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SWEEP = _script()
VARIANTS = SWEEP.sweep_variants(quick=False)


@pytest.fixture(autouse=True)
def _gpu_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(INTERPRETER, "enabled", False)


def test_candidates_are_distinct_and_quick_keeps_the_first() -> None:
    configs = [label for label in VARIANTS if label not in ("shipped", "before")]
    assert len(configs) == len(SWEEP.SWEEP_DECODE) + len(SWEEP.SWEEP_PREFILL)  # labels unique
    quick = SWEEP.sweep_variants(quick=True)
    first = [*SWEEP.SWEEP_DECODE[: SWEEP.QUICK_DECODE], *SWEEP.SWEEP_PREFILL[: SWEEP.QUICK_PREFILL]]
    assert list(quick) == ["shipped", "before", *(SWEEP.label(config, fill) for config, fill in first)]


@pytest.mark.parametrize("name", list(VARIANTS), ids=str)
def test_every_candidate_matches_float64(name: str) -> None:
    """Each decode candidate at M = 3 (and the shipped schedules at 3 and 40), each prefill candidate at M = 40, on
    K = 300 (not a multiple of any BLOCK_K), N = 200, group 64, bf16; the output poisoned first."""
    variant = VARIANTS[name]
    decode = SWEEP.is_decode(name, variant)
    rows = [3] if decode else [40] if decode is False else [3, 40]
    K, N = 300, 200
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) / K**0.5
    p = quantize_w4(weight.to(device(), torch.bfloat16), 64)
    for M in rows:
        x = randn(M, K, dtype=torch.bfloat16, seed=M)
        exact = w4a16_reference(x.double(), p.qweight, p.scales.double(), p.zeros, p.group_size)
        with variant:
            if variant.config is not None:
                assert schedule(M, N, K, device()).tiles["KERNEL"] == variant.config["KERNEL"]
            out = poisoned((M, N), torch.bfloat16)
            got = w4a16_gemm(x, *p, out=out)
        assert_close(got, exact, torch.bfloat16, scale=max(1.0, math.sqrt(K / 64)))


def test_applied_restores_the_tiles() -> None:
    mod = importlib.import_module("fusionscope.kernels.w4a16_gemm")
    tiles, fill = dict(mod.TILES), dict(mod.FILL)
    for variant in VARIANTS.values():
        with variant:
            pass
    assert dict(mod.TILES) == tiles and dict(mod.FILL) == fill
    with VARIANTS["before"]:
        assert schedule(1, 64, 256, device()).tiles["UNPACK"] == "planes"
    assert dict(mod.TILES) == tiles


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> None:
    """The CPU as the device: timing by wall clock (one call), no CUDA synchronisation, a small roof tensor."""

    def wall_us(fn, rep: int = 20) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "gpu_us", wall_us)
    monkeypatch.setattr(module.triton.testing, "do_bench", lambda fn, return_mode="median": wall_us(fn) / 1e3)
    monkeypatch.setattr(module, "ROOF_ELEMENTS", 2**12)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(module, "meta", lambda: {"device": "cpu"})


def test_sweep_runs_end_to_end_and_writes_its_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quick on two small shapes: every row a JSON line, a best entry per (shape, M) whose variant was timed there,
    the bf16 ratio and bandwidth shares computed, and a suggestion per M."""
    module = _script()
    _fake_gpu(monkeypatch, module)
    monkeypatch.setattr(module, "SHAPES", ((256, 96), (130, 64)))
    monkeypatch.setattr(module, "DECODE_ROWS", (1, 3))
    monkeypatch.setattr(module, "PREFILL_ROWS", 20)
    out = module.Out(tmp_path, "sweep")
    module.run_sweep(out, quick=True, budget_s=600, cold=False)
    lines = [json.loads(line) for line in (tmp_path / "w4a16_sweep.jsonl").read_text().splitlines()]
    checks = [r for r in lines if r["kind"] == "sweep_check"]
    assert checks and all(r["passed"] for r in checks), [r for r in checks if not r["passed"]]
    summary = json.loads((tmp_path / "w4a16_sweep.json").read_text())["summary"]
    points = {(b["K"], b["N"], b["M"]) for b in summary["best"]}
    assert points == {(K, N, M) for K, N in module.SHAPES for M in (1, 3, 20)}
    timed = {(r["K"], r["N"], r["M"], r["variant"]) for r in lines if r["kind"] == "sweep"}
    for b in summary["best"]:
        assert (b["K"], b["N"], b["M"], b["best"]) in timed and b["vs_bf16"] > 0 and b["pct_copy"] > 0
    assert set(summary["best_by_m"]) == {"1", "3", "20"}
    assert "best" in (tmp_path / "w4a16_sweep.log").read_text()


def test_sweep_stops_at_its_budget_and_still_writes_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _script()
    _fake_gpu(monkeypatch, module)
    monkeypatch.setattr(module, "SHAPES", ((256, 96), (130, 64)))
    out = module.Out(tmp_path, "sweep")
    module.run_sweep(out, quick=True, budget_s=0, cold=False)
    saved = json.loads((tmp_path / "w4a16_sweep.json").read_text())
    assert saved["summary"] == {"best": [], "best_by_m": {}}
    assert not any(r["kind"] == "sweep" for r in saved["rows"])
    assert "time budget spent" in (tmp_path / "w4a16_sweep.log").read_text()
