"""The catalogue on real dataflow: exact match counts derived from each config, and what an outside consumer does."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from fusionscope import dataflow, models
from fusionscope.fusions import Graph, find_matches, fusions


def record(config: dict, tmp_path: Path, dtype: torch.dtype) -> Graph:
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = models.build_workload(models.resolve_model(str(tmp_path)), torch.device("cpu"), dtype, prompt_len=6,
                                     decode_steps=2)  # fmt: skip
    return Graph(dataflow.record_dataflow(workload))


def counts_per_step(graph: Graph) -> dict[int, Counter]:
    per_step: dict[int, Counter] = {}
    for match in find_matches(graph):
        per_step.setdefault(match.step, Counter())[match.fusion] += 1
    return per_step


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_counts_follow_the_config(layers: int, dtype: torch.dtype, tmp_path: Path) -> None:
    """Per step: 2L add_rms_norm (every norm after a residual add, the final norm included), 1 rms_norm (layer 0's
    input norm), and L each of silu_and_mul, rope, qkv and gate_up; decode steps also L decode_attention (one query
    token's SDPA call per layer) and 2L + 1 gemv: o_proj, down_proj (the one-row Linears the horizontal fusions
    leave) and the LM head."""
    graph = record({**models.PRESETS["tiny-llama"], "num_hidden_layers": layers}, tmp_path, dtype)
    per_step = counts_per_step(graph)
    assert sorted(per_step) == list(range(5))  # 3 prefill steps, 2 decode steps
    for step, counts in per_step.items():
        decode = {"decode_attention": layers, "gemv": 2 * layers + 1} if step >= 3 else {}
        assert counts == Counter({"add_rms_norm": 2 * layers, "rms_norm": 1, "silu_and_mul": layers, "rope": layers,
                                  "qkv": layers, "gate_up": layers, **decode})  # fmt: skip


def test_llama_groups_hold_the_whole_chain(tmp_path: Path) -> None:
    graph = record(models.PRESETS["tiny-llama"], tmp_path, torch.bfloat16)
    matches = [m for m in find_matches(graph) if m.step == 3]
    norm = next(m for m in matches if m.fusion == "add_rms_norm" and m.anchor_module == "model.norm")
    names = Counter(graph.name[n] for n in norm.nodes)
    # residual add + to(fp32), pow, mean, add ε, rsqrt, mul, to(bf16), mul(weight)
    assert names == Counter({"aten::add": 2, "aten::_to_copy": 2, "aten::pow": 1, "aten::mean": 1, "aten::rsqrt": 1,
                             "aten::mul": 2})  # fmt: skip
    assert norm.escaping == () and norm.rejected == ""
    silu = next(m for m in matches if m.fusion == "silu_and_mul")
    assert sorted(graph.name[n] for n in silu.nodes) == ["aten::mul", "aten::silu"]


def test_gemma2_counts(tmp_path: Path) -> None:
    """Gemma-2 has four norms per layer: the residual adds feed the pre-feedforward norm and the next layer's input
    norm (2L add_rms_norm with the final norm); layer 0's input norm (after the embedding scale) and the
    post-attention and post-feedforward norms are plain (2L + 1). Its MLP is GeGLU: L gelu_and_mul, no silu_and_mul;
    and L each of rope, qkv and gate_up. transformers runs Gemma-2's attention eagerly (its logit soft-capping has no
    SDPA path), so flash_attention matches L too. gemv in decode steps: o_proj, down_proj and the LM head (2L + 1)."""
    config = {**models.PRESETS["gemma-2-2b"], "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "vocab_size": 300,
              "sliding_window": 16}  # fmt: skip
    graph = record(config, tmp_path, torch.bfloat16)
    for step, counts in counts_per_step(graph).items():
        decode = {"gemv": 7} if step >= 3 else {}
        assert counts == Counter({"add_rms_norm": 6, "rms_norm": 7, "gelu_and_mul": 3, "rope": 3, "qkv": 3,
                                  "gate_up": 3, "flash_attention": 3, **decode})  # fmt: skip
    norm = next(m for m in find_matches(graph) if m.fusion == "rms_norm")
    assert sum(graph.name[n] == "aten::add" for n in norm.nodes) == 2  # ε and Gemma's 1 + w


def synthetic(extra_reader: bool) -> Graph:
    """gate → silu → mul(·, up); optionally another op also reads the SiLU output."""
    rows = [(0, "aten::mm", (-1, -1)), (1, "aten::mm", (-1, -1)), (2, "aten::silu", (0,)), (3, "aten::mul", (2, 1))]
    if extra_reader:
        rows.append((4, "aten::sum", (2,)))
    consumers = {n: tuple(m for m, _name, ins in rows if n in ins) for n, _name, _ins in rows}
    return Graph(pd.DataFrame({
        "node": [r[0] for r in rows], "name": [r[1] for r in rows], "inputs": [r[2] for r in rows],
        "consumers": [consumers[r[0]] for r in rows], "module": "mlp", "phase": "decode", "step": 0,
    }))  # fmt: skip


def test_an_outside_reader_of_an_intermediate_is_reported() -> None:
    (private,) = find_matches(synthetic(extra_reader=False))
    assert private.escaping == () and set(private.nodes) == {2, 3}
    (shared,) = find_matches(synthetic(extra_reader=True))
    assert shared.escaping == (2,)  # the SiLU output must still be written for the sum: the estimate charges it


def test_registry_entries_are_complete() -> None:
    keys = [f.KEY for f in fusions()]
    assert len(keys) == len(set(keys))
    for fusion in fusions():
        assert fusion.TITLE and fusion.FAMILIES and callable(fusion.find)
        assert "fused" in (fusion.__doc__ or "")  # states the bytes moved unfused vs fused
