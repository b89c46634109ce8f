"""`--sample`: decode draws its tokens as `generate(do_sample=True)` does, and the catalogue's `sampling` entry finds
that chain on the dataflow (one group per step, 0 in greedy runs)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fusionscope import capture, dataflow, fusions, models
from fusionscope.cli import app
from fusionscope.errors import UsageError
from fusionscope.fusions import Graph, find_matches, sampling

SAMPLING = (0.7, 50, 0.9)


def workload(sampling_args: tuple[float, int, float] | None, dtype: torch.dtype = torch.float32) -> models.Workload:
    return models.build_workload(models.resolve_model("tiny-llama"), torch.device("cpu"), dtype, prompt_len=6,
                                 decode_steps=2, sampling=sampling_args)  # fmt: skip


def tokens_of_one_pass(work: models.Workload) -> list[list[int]]:
    tokens: list[list[int]] = []

    def run_step(_phase: str, fn: Any) -> Any:
        result = fn()
        tokens.append(result[1].flatten().tolist())
        return result

    capture.run_sequence(work, run_step)
    return tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_sampling_group_per_step(dtype: torch.dtype) -> None:
    """Sampling: 1 match per step (3 prefill + 2 decode), the whole chain from the fp32 copy of the logits row to the
    multinomial, nothing escaping; the logits slice (a view of lm_head's output) stays outside."""
    graph = Graph(dataflow.record_dataflow(workload(SAMPLING, dtype)))
    matches = sampling.find(graph)
    assert Counter((m.phase, m.step) for m in matches) == Counter(
        {("prefill", 0): 1, ("prefill", 1): 1, ("prefill", 2): 1, ("decode", 3): 1, ("decode", 4): 1}
    )
    for match in matches:
        names = Counter(graph.name[n] for n in match.nodes)
        assert names == Counter({"aten::_to_copy": 1, "aten::div": 1, "aten::topk": 1, "aten::select": 1,
                                 "aten::unsqueeze": 1, "aten::lt": 1, "aten::masked_fill": 2, "aten::sort": 1,
                                 "aten::_softmax": 2, "aten::cumsum": 1, "aten::le": 1, "aten::slice": 1,
                                 "aten::fill_": 1, "aten::scatter": 1, "aten::multinomial": 1})  # fmt: skip
        assert match.escaping == () and match.rejected == "" and match.anchor_module == "sampling"
        assert all(graph.module[n] == "" for n in match.nodes)
        first = min(match.nodes)
        logits_slice = graph.producer(first)
        assert graph.name[first] == "aten::_to_copy" and graph.module[graph.producer(logits_slice)] == "lm_head"
    # disjoint from every other entry's groups, so find_matches keeps them all wherever `sampling` is registered
    others = {n for m in find_matches(graph) if m.fusion != sampling.KEY for n in m.nodes}
    assert others.isdisjoint(n for m in matches for n in m.nodes)


def test_greedy_has_no_sampling_group() -> None:
    """Greedy (argmax): 0 matches, and no multinomial anywhere."""
    graph = Graph(dataflow.record_dataflow(workload(None)))
    assert sampling.find(graph) == []
    assert not any(graph.named("aten::multinomial"))


def test_a_foreign_op_in_the_chain_rejects_the_group() -> None:
    """An op the sample kernel does not implement (here a repetition-penalty-like `mul` before the warpers) is
    reported, not silently fused."""
    graph = Graph(dataflow.record_dataflow(workload(SAMPLING)))
    div = next(n for n in graph.named("aten::div") if graph.module[n] == "")
    graph.name[div] = "aten::mul"
    rejected = [m.rejected for m in sampling.find(graph)]
    assert rejected[0] == "the chain holds ops the sample kernel does not implement: aten::mul"


def test_every_pass_draws_the_same_tokens() -> None:
    """The generator is seeded once per pass: timed and profiled passes (and the dataflow pass) see the same ids."""
    work = workload(SAMPLING)
    first, second = tokens_of_one_pass(work), tokens_of_one_pass(work)
    assert first == second and len(first) == 5
    assert all(0 <= t < 1000 for step in first for t in step)


def test_bad_sampling_parameters_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="--temperature"):
        workload((0.0, 50, 0.9))
    with pytest.raises(UsageError, match="--top-p"):
        workload((0.7, 50, 1.5))


def test_cli_sample_run_records_sampling(tmp_path: Path) -> None:
    """`profile --sample` end to end: summary.json's model block holds the parameters, and the opportunities list
    one `sampling` group per step in both phases."""
    assert "sampling" in fusions._MODULES
    out = tmp_path / "run"
    args = ["profile", "--out", str(out), "--prompt-len", "16", "--decode-steps", "2", "--warmup", "0", "--sample",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.95"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": 0.95}
    opps = {(o["fusion"], o["phase"]): o for o in summary["opportunities"]}
    for phase in ("prefill", "decode"):
        opp = opps[("sampling", phase)]
        assert opp["count"] == 1 and opp["module_paths"] == ["sampling"]
        assert opp["launches_fused"] == 1 < opp["launches_now"] and opp["bytes_fused"] < opp["bytes_now"]


def test_cli_greedy_records_no_sampling(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["profile", "--out", str(out), "--prompt-len", "8", "--decode-steps", "1",
                                      "--warmup", "0", "--greedy"])  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["sampling"] is None
    assert not any(o["fusion"] == "sampling" for o in summary["opportunities"])
