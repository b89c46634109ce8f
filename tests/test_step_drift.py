"""The graph alone's replayed step against the profiled step its predictions start from (`apply.step_drift`): the
batch-16 case, where the static cache's attention copies K and V per query head, is named by the run itself."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fusionscope.apply import graphs, run, step_drift


def _kernels_csv(path: Path, steps: int = 4) -> Path:
    """A profile's kernel table: per decode step 32 q_proj GEMMs of 30 µs, 32 SDPA kernels of 12 µs (the dynamic
    cache's GQA attention), on rank 0; a prefill row and a rank-1 row that must not count."""
    rows = []
    for step in range(steps):
        for layer in range(32):
            rows.append((0, "decode", step, "aten::mm", f"model.layers.{layer}.self_attn.q_proj", 30.0))
            rows.append((0, "decode", step, "aten::_efficient_attention_forward", f"model.layers.{layer}.self_attn",
                         12.0))  # fmt: skip
    rows.append((0, "prefill", 0, "aten::mm", "model.layers.0.self_attn.q_proj", 999.0))
    rows.append((1, "decode", 0, "aten::mm", "model.layers.0.self_attn.q_proj", 999.0))
    pd.DataFrame(rows, columns=["rank", "phase", "step", "op", "module", "dur_us"]).to_csv(path, index=False)
    return path


def _graph_breakdown() -> dict:
    """A replayed static-cache step: the same GEMMs, K/V copied per head and cuDNN attention instead of SDPA's GQA."""
    rows = [
        {"op": "aten::copy_", "kernel": "direct_copy", "module": "model.layers.*.self_attn", "count": 64, "us": 5000.0},
        {"op": "aten::mm", "kernel": "nvjet_a", "module": "model.layers.*.self_attn.q_proj", "count": 32, "us": 960.0},
        {"op": "aten::_cudnn_attention_forward", "kernel": "cudnn", "module": "model.layers.*.self_attn", "count": 32,
         "us": 1600.0},
        {"op": "(3 more)", "kernel": "", "module": "", "count": 90, "us": 40.0},
    ]  # fmt: skip
    return {"rows": rows, "total_us": 7600.0}


def test_the_profiled_step_is_per_step_per_op_and_module_pattern_on_rank_0(tmp_path: Path) -> None:
    table = step_drift.profiled_step(_kernels_csv(tmp_path / "kernels.csv"))
    by = {(r["op"], r["module"]): (r["us"], r["count"]) for r in table.to_dict("records")}
    assert by == {("aten::mm", "model.layers.*.self_attn.q_proj"): (960.0, 32.0),
                  ("aten::_efficient_attention_forward", "model.layers.*.self_attn"): (384.0, 32.0)}  # fmt: skip
    assert step_drift.profiled_step(tmp_path / "missing.csv") is None
    assert step_drift.profiled_step(tmp_path / "kernels.csv", phase="forward") is None


def test_the_largest_differences_come_first_and_the_note_names_them(tmp_path: Path) -> None:
    drift = step_drift.step_drift(step_drift.profiled_step(_kernels_csv(tmp_path / "kernels.csv")),
                                  _graph_breakdown())  # fmt: skip
    assert drift["graph_us"] == 7600.0 and drift["profile_us"] == pytest.approx(1344.0)
    assert [(r["op"], r["graph_us"] - r["profile_us"]) for r in drift["rows"]] == [
        ("aten::copy_", 5000.0), ("aten::_cudnn_attention_forward", 1600.0),
        ("aten::_efficient_attention_forward", -384.0), ("aten::mm", 0.0),
    ]  # fmt: skip
    line = step_drift.drift_line(drift)
    assert "runs 7.60 ms of kernels" in line and "from 1.34 ms (+465%)" in line
    assert "aten::copy_ (mostly model.layers.*.self_attn) +5.00 ms (64 kernels the profiled step does not run)" in line
    assert (
        "aten::_efficient_attention_forward (mostly model.layers.*.self_attn) -0.38 ms (not in the graph's step)"
        in line
    )


def test_a_graph_step_like_the_profiled_one_says_nothing(tmp_path: Path) -> None:
    same = {"rows": [{"op": "aten::mm", "kernel": "k", "module": "model.layers.*.self_attn.q_proj", "count": 32,
                      "us": 1000.0},
                     {"op": "aten::_efficient_attention_forward", "kernel": "e", "module": "model.layers.*.self_attn",
                      "count": 32, "us": 390.0}],
            "total_us": 1390.0}  # fmt: skip
    drift = step_drift.step_drift(step_drift.profiled_step(_kernels_csv(tmp_path / "kernels.csv")), same)
    assert drift is not None and step_drift.drift_line(drift) == ""  # 3% apart
    assert step_drift.step_drift(None, same) is None and step_drift.step_drift(pd.DataFrame(), same) is None


def test_graph_variants_compare_the_graph_alones_replay_with_the_profile(tmp_path: Path, monkeypatch) -> None:
    def measured(*args, **kwargs):
        return {"variants": {graphs.GRAPH: {"ms_per_token": 8.0, "replay": {"breakdown": _graph_breakdown()}}}}

    monkeypatch.setattr(graphs, "run_graphs", measured)
    summary = {"phases": {"decode": {}}, "opportunities": []}
    out = run.graph_variants(None, summary, [], None, None, None, {}, False, 1, lambda _: None, False,
                             _kernels_csv(tmp_path / "kernels.csv"), timing=None)  # fmt: skip
    assert out["step_drift"]["rows"][0]["op"] == "aten::copy_"
    out = run.graph_variants(None, summary, [], None, None, None, {}, False, 1, lambda _: None, False,
                             tmp_path / "none.csv", timing=None)  # fmt: skip
    assert out["step_drift"] is None  # no profile table: nothing to compare with


def test_the_report_and_the_terminal_carry_the_note(tmp_path: Path, capsys) -> None:
    from fusionscope import cli
    from fusionscope.report.apply import graphs_table

    drift = step_drift.step_drift(step_drift.profiled_step(_kernels_csv(tmp_path / "kernels.csv")),
                                  _graph_breakdown())  # fmt: skip
    graphs_result = {"variants": {}, "predicted": {}, "step_drift": drift}
    assert "the graph alone&#x27;s step runs 7.60 ms of kernels" in graphs_table(graphs_result)
    cli.print_graphs(graphs_result)
    assert "profiled eager step the predictions start from 1.34 ms" in " ".join(capsys.readouterr().out.split())
    assert "the graph alone" not in graphs_table({"variants": {}, "predicted": {}})
