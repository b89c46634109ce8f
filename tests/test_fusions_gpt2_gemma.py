"""GPT-2 and Gemma entries of the catalogue (add_layer_norm, linear_act, gelu_and_mul) on real dataflow: exact counts
derived from each config, what the groups hold, and what an outside reader or a second consumer does."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from fusionscope import dataflow, models
from fusionscope.fusions import Graph, Match, add_layer_norm, find_matches, fusions, gelu_and_mul, linear_act

MINE = (linear_act, add_layer_norm, gelu_and_mul)
GPT2 = {**models.PRESETS["gpt2"], "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 64}
GEMMA2 = {**models.PRESETS["gemma-2-2b"], "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "vocab_size": 300,
          "sliding_window": 16}  # fmt: skip


def record(config: dict, tmp_path: Path, dtype: torch.dtype) -> Graph:
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = models.build_workload(models.resolve_model(str(tmp_path)), torch.device("cpu"), dtype, prompt_len=6,
                                     decode_steps=2)  # fmt: skip
    return Graph(dataflow.record_dataflow(workload))


def catalogue(graph: Graph) -> list[Match]:
    """`find_matches` once these entries are registered; until then the same first-wins rule with linear_act first
    (before anything that could take its activation nodes) and the other two after the registered entries."""
    registered = list(fusions())
    if {m.KEY for m in MINE} <= {f.KEY for f in registered}:
        return find_matches(graph)
    entries = [linear_act, *(f for f in registered if f.KEY not in {m.KEY for m in MINE}), add_layer_norm,
               gelu_and_mul]  # fmt: skip
    taken: set[int] = set()
    found = []
    for entry in entries:
        for match in entry.find(graph):
            if taken.isdisjoint(match.nodes):
                taken.update(match.nodes)
                found.append(match)
    return found


def counts_per_step(graph: Graph) -> dict[int, Counter]:
    per_step: dict[int, Counter] = {}
    for match in catalogue(graph):
        per_step.setdefault(match.step, Counter())[match.fusion] += 1
    return per_step


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt2_counts_follow_the_config(layers: int, dtype: torch.dtype, tmp_path: Path) -> None:
    """Per step: 2L + 1 add_layer_norm — every LayerNorm reads a tensor + tensor add: ln_2 the attention residual,
    ln_1 of block i > 0 and ln_f the MLP residual, ln_1 of block 0 the embedding sum wte + wpe (through the eval-mode
    dropout copy). That sum is not a skip connection, but it is the residual stream block 0's first residual add reads
    again, so the fused kernel's two outputs (sum, normalised) serve it as they serve a residual add. L linear_act:
    each block's c_fc addmm + the 8-op gelu_new chain (c_attn, c_proj and lm_head have no activation)."""
    graph = record({**GPT2, "n_layer": layers}, tmp_path, dtype)
    per_step = counts_per_step(graph)
    assert sorted(per_step) == list(range(5))  # 3 prefill steps, 2 decode steps
    for counts in per_step.values():
        assert counts["add_layer_norm"] == 2 * layers + 1 and counts["linear_act"] == layers
        assert counts["gelu_and_mul"] == 0


def test_gpt2_groups_hold_the_whole_chain(tmp_path: Path) -> None:
    graph = record({**GPT2, "n_layer": 2}, tmp_path, torch.bfloat16)
    matches = [m for m in catalogue(graph) if m.step == 3]
    mlp = next(m for m in matches if m.fusion == "linear_act")
    assert mlp.anchor_module == "transformer.h.0.mlp.c_fc" and mlp.escaping == () and mlp.rejected == ""
    # addmm, the view back to 3-D, gelu_new: mul 0.5, pow 3, mul 0.044715, add, mul √(2/π), tanh, add 1, mul
    expected = {"aten::addmm": 1, "aten::view": 1, "aten::mul": 4, "aten::pow": 1, "aten::add": 2, "aten::tanh": 1}
    assert Counter(graph.name[n] for n in mlp.nodes) == Counter(expected)
    norms = {m.anchor_module: m for m in matches if m.fusion == "add_layer_norm"}
    assert sorted(graph.name[n] for n in norms["transformer.h.0.ln_1"].nodes) == [
        "aten::add", "aten::clone", "aten::native_layer_norm"]  # fmt: skip
    for name in ("transformer.h.0.ln_2", "transformer.h.1.ln_1", "transformer.ln_f"):
        assert sorted(graph.name[n] for n in norms[name].nodes) == ["aten::add", "aten::native_layer_norm"]
    # the residual is an intended output: the next residual add reads it, and nothing escapes
    assert all(m.escaping == () for m in norms.values())


def test_gemma2_geglu_counts(tmp_path: Path) -> None:
    """Gemma-2's MLP is GeGLU (gelu tanh of gate_proj × up_proj): L gelu_and_mul per step. linear_act leaves the gate
    GEMM to it, and the tanh softcaps (attention scores, lm_head) are not activations: no linear_act; no LayerNorm."""
    graph = record(GEMMA2, tmp_path, torch.bfloat16)
    per_step = counts_per_step(graph)
    assert sorted(per_step) == list(range(5))
    for counts in per_step.values():
        assert counts["gelu_and_mul"] == 3 and counts["linear_act"] == 0 and counts["add_layer_norm"] == 0
    geglu = next(m for m in catalogue(graph) if m.fusion == "gelu_and_mul")
    assert sorted(graph.name[n] for n in geglu.nodes) == ["aten::gelu", "aten::mul"] and geglu.escaping == ()


def test_llama_swiglu_is_left_to_silu_and_mul(tmp_path: Path) -> None:
    graph = record(models.PRESETS["tiny-llama"], tmp_path, torch.float32)
    assert linear_act.find(graph) == [] and add_layer_norm.find(graph) == [] and gelu_and_mul.find(graph) == []


def synthetic(rows: list[tuple[int, str, tuple[int, ...]]]) -> Graph:
    """A dataflow from (node, op, producers) rows; the GEMMs and the sum sit in "mlp", everything else in "mlp.act"."""
    consumers = {n: tuple(m for m, _name, ins in rows if n in ins) for n, _name, _ins in rows}
    outside = ("aten::addmm", "aten::mm", "aten::sum")
    return Graph(pd.DataFrame({
        "node": [r[0] for r in rows], "name": [r[1] for r in rows], "inputs": [r[2] for r in rows],
        "consumers": [consumers[r[0]] for r in rows], "module": ["mlp" if r[1] in outside else "mlp.act" for r in rows],
        "phase": "decode", "step": 0,
    }))  # fmt: skip


def gelu_new(extra: tuple[int, str, tuple[int, ...]] | None = None) -> Graph:
    """addmm → gelu_new (x·0.5·(1 + tanh(c·(x + 0.044715·x³)))) → mm; optionally one more row."""
    rows = [(0, "aten::addmm", (-1, -1, -1)), (1, "aten::mul", (0,)), (2, "aten::pow", (0,)), (3, "aten::mul", (2,)),
            (4, "aten::add", (0, 3)), (5, "aten::mul", (4,)), (6, "aten::tanh", (5,)), (7, "aten::add", (6,)),
            (8, "aten::mul", (1, 7)), (9, "aten::mm", (8, -1))]  # fmt: skip
    return synthetic(rows + ([extra] if extra else []))


def test_linear_act_private_chain_and_an_outside_reader() -> None:
    (private,) = linear_act.find(gelu_new())
    assert set(private.nodes) == set(range(9)) and private.escaping == ()
    (shared,) = linear_act.find(gelu_new(extra=(10, "aten::sum", (6,))))
    assert set(shared.nodes) == set(range(9)) and shared.escaping == (6,)  # tanh's output must still be written


def test_a_gemm_output_with_a_second_reader_is_no_linear_act() -> None:
    assert linear_act.find(gelu_new(extra=(10, "aten::sum", (0,)))) == []
    relu = [(0, "aten::mm", (-1, -1)), (1, "aten::add", (0, -1)), (2, "aten::relu", (1,)), (3, "aten::mm", (2, -1))]
    (match,) = linear_act.find(synthetic(relu))  # mm + bias add + relu
    assert set(match.nodes) == {0, 1, 2}
    assert linear_act.find(synthetic([*relu, (4, "aten::sum", (0,))])) == []


def test_a_softcap_is_not_an_activation() -> None:
    """c·tanh(x / c) reads x once: no GELU, no match."""
    rows = [(0, "aten::mm", (-1, -1)), (1, "aten::div", (0,)), (2, "aten::tanh", (1,)), (3, "aten::mul", (2,))]
    assert linear_act.find(synthetic(rows)) == []


def test_an_outside_reader_of_the_gelu_is_reported() -> None:
    rows = [(0, "aten::mm", (-1, -1)), (1, "aten::mm", (-1, -1)), (2, "aten::gelu", (0,)), (3, "aten::mul", (2, 1))]
    (private,) = gelu_and_mul.find(synthetic(rows))
    assert set(private.nodes) == {2, 3} and private.escaping == ()
    (shared,) = gelu_and_mul.find(synthetic([*rows, (4, "aten::sum", (2,))]))
    assert shared.escaping == (2,)
    assert linear_act.find(synthetic(rows)) == []  # the gate of a GLU is gelu_and_mul's
