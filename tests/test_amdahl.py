"""The regime-aware Amdahl model on synthetic steps."""

from __future__ import annotations

import pytest

from fusionscope import amdahl

ROOFS = {"aten_op_host_us": 10.0, "launch_us": 16.0}


def host_bound_phase() -> dict:
    """Eager decode at batch 1: 16% GPU busy, 1000 ops in a 10 ms step."""
    return {"wall_ms_per_step": 20.0, "wall_ms_per_step_unprofiled": 10.0, "gpu_busy_ms_per_step": 1.6,
            "ops_per_step": 1000.0, "regime": "host-bound"}  # fmt: skip


def test_gpu_saving_without_saved_launches_barely_moves_a_host_bound_step() -> None:
    model = amdahl.step_model(host_bound_phase(), ROOFS)
    assert model is not None and model.paced_by == "host"
    result = amdahl.speedup(model, saved_gpu_us=0.12 * model.gpu_us, saved_ops=0, added_launches=0)
    assert result.gpu == pytest.approx(1 / 0.88)
    assert result.wall < 1.02


def test_saved_ops_pay_in_a_host_bound_step() -> None:
    model = amdahl.step_model(host_bound_phase(), ROOFS)
    # a fusion of 9-op groups, 40 groups per step: 360 ops out, 40 launches in
    result = amdahl.speedup(model, saved_gpu_us=100.0, saved_ops=360, added_launches=40)
    expected_host = 10_000 - 360 * 10.0 + 40 * 16.0
    assert result.wall == pytest.approx(10_000 / expected_host)


def test_gpu_bound_step_follows_the_gpu_saving() -> None:
    phase = {"wall_ms_per_step": 10.0, "wall_ms_per_step_unprofiled": 9.0, "gpu_busy_ms_per_step": 8.5,
             "ops_per_step": 400.0, "regime": "gpu-bound"}  # fmt: skip
    model = amdahl.step_model(phase, ROOFS)
    assert model.paced_by == "gpu"
    assert model.host_us == pytest.approx(400 * 10.0)  # the measured one-kernel op cost, host hidden
    assert model.exposed_us == pytest.approx(500.0)  # GPU idle: the part of the 9 ms the GPU's 8.5 ms leaves
    result = amdahl.speedup(model, saved_gpu_us=850.0, saved_ops=0, added_launches=0)
    assert result.wall == pytest.approx(9000 / (7650 + 500))
    assert amdahl.cuda_graph_share(model) == pytest.approx(500 / 9000)


def test_a_gpu_bound_step_never_models_more_host_time_than_its_wall() -> None:
    """Ops × the one-op host cost can exceed the whole step (nested ops are counted): the host term is capped at the
    wall time — the H200's llama-3.1-8b prefill (5114 ops, 24.1 ms wall, 16.4 ms GPU busy, 68%) is then paced by
    its host, and only saved host work shortens it. (The run measured 11.3 µs per op; any cost ≥ 4.7 µs gives the
    same model.)"""
    phase = {"wall_ms_per_step": 91.6, "wall_ms_per_step_unprofiled": 24.1, "gpu_busy_ms_per_step": 16.4,
             "ops_per_step": 5114.0, "regime": "gpu-bound"}  # fmt: skip
    model = amdahl.step_model(phase, {"aten_op_host_us": 10.6, "launch_us": 16.4})
    assert model.host_us == pytest.approx(24_100) and model.exposed_us == 0.0 and model.paced_by == "host"
    assert amdahl.speedup(model, 0.0, 0.0, 0.0).wall == pytest.approx(1.0)
    assert amdahl.speedup(model, 2_000.0, 0.0, 0.0).wall == pytest.approx(1.0)
    per_op = 24_100 / 5114
    assert amdahl.speedup(model, 2_000.0, 576, 64).wall == pytest.approx(24_100 / (24_100 - 576 * per_op + 64 * 16.4))


def test_cuda_graph_share_is_the_unhidden_host_time() -> None:
    model = amdahl.step_model(host_bound_phase(), ROOFS)
    assert amdahl.cuda_graph_share(model) == pytest.approx(1 - 1.6 / 10.0)


def test_cpu_runs_have_no_model() -> None:
    assert amdahl.step_model({"gpu_busy_ms_per_step": None, "ops_per_step": 10}, ROOFS) is None


def test_a_groups_profiled_host_time_is_scaled_to_the_unprofiled_step_and_charged_a_fused_call() -> None:
    """The profiler doubles this step (20 ms profiled, 10 ms not): a group whose ops and gaps took 3 ms profiled saves
    1.5 ms of host time, less one real fused call (24 µs) per group, not its ops × the mean cost per op."""
    model = amdahl.step_model(host_bound_phase(), {**ROOFS, "fused_call_us": 24.0})
    assert model.host_scale == pytest.approx(0.5) and model.launch_us == 24.0
    result = amdahl.speedup(model, saved_gpu_us=0.0, saved_ops=360, added_launches=40, host_now_us=3_000.0)
    assert result.saved_host_us == pytest.approx(1_500.0 - 40 * 24.0)
    assert result.wall == pytest.approx(10_000 / (10_000 - 1_500.0 + 40 * 24.0))
    assert amdahl.speedup(model, 0.0, 360, 40).saved_host_us == pytest.approx(360 * 10.0 - 40 * 24.0)  # no spans


def test_host_spans_count_outer_ops_and_the_gaps_nothing_foreign_fills() -> None:
    """Ops 0–2 are the group (1 nests in 0), op 3 is another module's: the gap 0→2 counts, the one before 4 does
    not, and the nested op's time is inside its parent's."""
    import pandas as pd

    from fusionscope.opportunities import HostSpans

    ops = pd.DataFrame({"op_id": [0, 1, 2, 3, 4], "parent_op": [-1, 0, -1, -1, -1], "tid": [1] * 5,
                        "ts_us": [0.0, 1.0, 12.0, 30.0, 50.0], "dur_us": [10.0, 5.0, 8.0, 10.0, 4.0]})  # fmt: skip
    owner = pd.Series({0: 7, 1: 7, 2: 8, 3: 9, 4: 8})
    spans = HostSpans(ops, owner)
    assert spans.group_us([7, 8]) == pytest.approx(10.0 + 2.0 + 8.0 + 4.0)
    assert spans.group_us([7]) == pytest.approx(10.0)
    assert spans.group_us([42]) == 0.0
