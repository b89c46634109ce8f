"""`--cache static`: the profiled, timed and checked decode steps on a transformers StaticCache (the step a CUDA graph
captures), computing what the dynamic cache computes; `apply --graphs` takes it by default, so its predictions start
from the step it captures."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fusionscope import capture, models
from fusionscope.apply import numerics
from fusionscope.cli import app

runner = CliRunner()
WORKLOAD = ["--prompt-len", "12", "--decode-steps", "3"]


def _passes(name: str, cache: str, passes: int = 2) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    workload = models.build_workload(models.resolve_model(name), torch.device("cpu"), torch.float32, prompt_len=7,
                                     decode_steps=4, cache=cache)  # fmt: skip
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def run_step(phase, step):
        out, token = step()
        seen.append((phase, out.logits[:, -1].float().clone(), token.clone()))
        return out, token

    for _ in range(passes):  # the second pass reuses the workload's static cache: its counters start over
        capture.run_sequence(workload, run_step)
    return seen


@pytest.mark.parametrize("name", ["tiny-llama", "gpt2"])
def test_a_static_cache_pass_computes_what_the_dynamic_one_does_pass_after_pass(name: str) -> None:
    dynamic, static = _passes(name, "dynamic"), _passes(name, "static")
    assert [s[0] for s in static] == [d[0] for d in dynamic] and len(static) == 2 * (capture.PREFILL_REPEATS + 4)
    for (_, a, ta), (_, b, tb) in zip(dynamic, static, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(ta, tb)
    assert dynamic[-1][1].abs().max() > 0.1  # a real signal


def test_the_numerics_reference_on_a_static_cache_matches_the_dynamic_one() -> None:
    workload = models.build_workload(models.resolve_model("tiny-llama"), torch.device("cpu"), torch.float32,
                                     prompt_len=9, decode_steps=3)  # fmt: skip
    ids = workload.inputs[0]
    dynamic = numerics.reference(workload.module, ids, 3)
    static = numerics.reference(workload.module, ids, 3, cache="static")
    torch.testing.assert_close(static.decode_logits, dynamic.decode_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static.prefill_logits, dynamic.prefill_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(static.tokens, dynamic.tokens) and static.decode_logits.shape[1] == 3


@pytest.fixture(scope="module")
def static_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("static") / "run"
    result = runner.invoke(app, ["profile", "tiny-llama", "--cache", "static", "--out", str(out), *WORKLOAD])
    assert result.exit_code == 0, result.output
    return out


def test_profile_on_a_static_cache_sees_its_writes_and_finds_decode_attention(static_profile: Path) -> None:
    summary = json.loads((static_profile / "summary.json").read_text())
    assert summary["model"]["cache"] == "static"
    ops = pd.read_csv(static_profile / "ops.csv", usecols=["phase", "name"])
    decode = set(ops.loc[ops["phase"] == "decode", "name"])
    assert "aten::index_copy_" in decode  # the static layer writes each token's row in place
    found = {(o["fusion"], o["phase"]) for o in summary["opportunities"] if o["confidence"] != "low"}
    assert ("decode_attention", "decode") in found and ("rope", "decode") in found


def test_apply_with_graphs_decodes_on_the_static_cache_unless_told(tmp_path: Path) -> None:
    from fusionscope.apply.run import apply

    graphs = apply("tiny-llama", fusions="rms_norm", graphs=True, out=tmp_path / "g", prompt_len=8, decode_steps=2)
    assert graphs.summary["model"]["cache"] == "static"
    plain = apply("tiny-llama", fusions="rms_norm", out=tmp_path / "p", prompt_len=8, decode_steps=2)
    assert plain.summary["model"]["cache"] == "dynamic"
    told = apply("tiny-llama", fusions="rms_norm", graphs=True, cache="dynamic", out=tmp_path / "d", prompt_len=8,
                 decode_steps=2)  # fmt: skip
    assert told.summary["model"]["cache"] == "dynamic"
    followed = apply("tiny-llama", fusions="rms_norm", graphs=True, from_run=tmp_path / "p", out=tmp_path / "f",
                     prompt_len=8, decode_steps=2)  # fmt: skip
    assert followed.summary["model"]["cache"] == "dynamic"  # auto with --from: the earlier run's cache
    result = runner.invoke(app, ["apply", "--from", str(tmp_path / "p"), "--cache", "static", "--fusions", "rms_norm",
                                 "--out", str(tmp_path / "x"), "--prompt-len", "8", "--decode-steps", "2"])  # fmt: skip
    assert result.exit_code == 2 and "cache 'dynamic' there, 'static' here" in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["profile", "apply"])
def test_an_unknown_cache_is_one_line(tmp_path: Path, command: str) -> None:
    result = runner.invoke(app, [command, "--cache", "paged", "--out", str(tmp_path / "x"), *WORKLOAD])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "unknown --cache 'paged'" in lines[0]
    assert not (tmp_path / "x").exists()


def test_rope_on_a_static_cache_takes_its_writes_and_counter_and_counts_rows_not_the_cache() -> None:
    """What rope's graph binding replaces on a StaticCache — the k and v writes (`index_copy_`) and the slot
    arithmetic from the cache's write counter (`arange`, `add`, the counter's `add_`) — is in the finder's match, so
    the estimate counts those launches; and the fused kernel is charged the rows it writes, not the whole cache."""
    from fusionscope import dataflow
    from fusionscope.fusions import Graph, rope
    from fusionscope.opportunities import _group_outputs, fused_bytes, node_columns

    workload = models.build_workload(models.resolve_model("tiny-llama"), torch.device("cpu"), torch.float32,
                                     prompt_len=8, decode_steps=2, cache="static")  # fmt: skip
    nodes = dataflow.record_dataflow(workload).assign(op_id=-1)
    graph = Graph(nodes)
    decode = [m for m in rope.find(graph) if m.phase == "decode"]
    assert decode
    columns = node_columns(nodes)
    for match in decode:
        names = collections.Counter(graph.name[n] for n in match.nodes)
        assert names["aten::index_copy_"] == 2, names
        assert names["aten::arange"] == 1 and names["aten::add_"] == 1, names
        assert not match.escaping and not match.rejected
        written = fused_bytes(columns, match, _group_outputs(columns["consumers"], match))
        caches = sum(math.prod(columns["output_shapes"][n][0]) * 4 for n in match.nodes
                     if graph.name[n] == "aten::index_copy_")  # fmt: skip
        assert 0 < written < caches / 2, (written, caches)  # a few rows of a 24-row cache, not the cache twice over


def test_what_a_replacement_drops_is_counted_and_what_its_kernel_reads_is_charged() -> None:
    """Replacing a static cache's attention leaves its mask without a reader: the mask's `where` is dropped with the
    match (`Match.dropped`, counted as removed) and its bytes are not charged to the kernel. A GEMV's weight reaches
    its matmul through a `t` view that the replacement drops too, but the kernel still reads the weight: its bytes
    stay charged. Partial rotary's re-join and the cache's writes (Phi-3) are rope's binding's, so `Match.bound`."""
    from fusionscope import dataflow
    from fusionscope.fusions import Graph, find_matches
    from fusionscope.opportunities import _group_outputs, fused_bytes, node_columns

    workload = models.build_workload(models.resolve_model("tiny-phi3"), torch.device("cpu"), torch.float32,
                                     prompt_len=8, decode_steps=2, cache="static")  # fmt: skip
    nodes = dataflow.record_dataflow(workload).assign(op_id=-1)
    graph = Graph(nodes)
    columns = node_columns(nodes)
    decode = [m for m in find_matches(graph) if m.phase == "decode"]
    attention = [m for m in decode if m.fusion == "decode_attention"]
    assert attention and all("aten::where" in {graph.name[n] for n in m.dropped} for m in attention)
    for match in attention:
        outputs = _group_outputs(columns["consumers"], match)
        kept = dataclasses.replace(match, dropped=())
        assert fused_bytes(columns, match, outputs) < fused_bytes(columns, kept, outputs)  # the mask is not read
    rope = [m for m in decode if m.fusion == "rope"]
    assert rope
    for match in rope:
        bound = collections.Counter(graph.name[n] for n in match.bound)
        assert bound["aten::cat"] == 2 and bound["aten::index_copy_"] == 2, bound
    counted = [n for m in decode for n in m.counted]
    assert len(counted) == len(set(counted))  # no node counted by two matches
    assert not any(columns["name"][n].endswith("_") for m in decode for n in m.dropped)  # no in-place write dropped
    for match in (m for m in decode if m.fusion == "gemv"):
        assert any(graph.name[n] == "aten::t" for n in match.dropped), match
        mm = next(n for n in match.nodes if graph.name[n] in ("aten::mm", "aten::addmm", "aten::linear"))
        weight = max(math.prod(shape) for shape in columns["input_shapes"][mm]) * 4
        assert fused_bytes(columns, match, _group_outputs(columns["consumers"], match)) >= weight, match
