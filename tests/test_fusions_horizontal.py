"""Horizontal fusions (`qkv`, `gate_up`): GEMMs that share an input and do not depend on one another, on real dataflow
from configs (exact counts per step) and on synthetic graphs (a dependency between them prevents the group)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from fusionscope import dataflow, models
from fusionscope.fusions import Graph, fusions, gate_up, qkv

LLAMA = models.PRESETS["tiny-llama"]
QWEN2 = {**LLAMA, "model_type": "qwen2"}  # Qwen2 puts a bias on q/k/v: `aten::addmm`
PHI3 = {**LLAMA, "model_type": "phi3", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fused qkv, gate_up


def record(config: dict, tmp_path: Path, dtype: torch.dtype = torch.bfloat16) -> Graph:
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = models.build_workload(models.resolve_model(str(tmp_path)), torch.device("cpu"), dtype, prompt_len=6,
                                     decode_steps=2)  # fmt: skip
    return Graph(dataflow.record_dataflow(workload))


def horizontal(graph: Graph) -> list:
    return qkv.find(graph) + gate_up.find(graph)


def counts_per_step(graph: Graph) -> dict[int, Counter]:
    per_step: dict[int, Counter] = {step: Counter() for step in set(graph.nodes["step"])}
    for match in horizontal(graph):
        per_step[match.step][match.fusion] += 1
    return per_step


def gemm_names(graph: Graph, match) -> list[str]:
    return sorted(graph.name[n] for n in match.nodes if graph.name[n] in ("aten::mm", "aten::addmm"))


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_counts_follow_the_config(layers: int, dtype: torch.dtype, tmp_path: Path) -> None:
    """Per step (3 prefill, 2 decode): L qkv (q/k/v_proj on the input norm's output) and L gate_up (gate/up_proj on the
    post-attention norm's output); o_proj, down_proj and lm_head read other data and stay alone."""
    graph = record({**LLAMA, "num_hidden_layers": layers}, tmp_path, dtype)
    per_step = counts_per_step(graph)
    assert sorted(per_step) == list(range(5))
    for counts in per_step.values():
        assert counts == Counter({"qkv": layers, "gate_up": layers})
    for match in horizontal(graph):
        assert match.escaping == () and match.rejected == ""
        assert match.anchor_module.endswith(".self_attn" if match.fusion == "qkv" else ".mlp")
        assert gemm_names(graph, match) == ["aten::mm"] * (3 if match.fusion == "qkv" else 2)
    one = next(m for m in horizontal(graph) if m.fusion == "qkv" and m.step == 3)
    # per projection: view of the activation, t of the weight, the mm, _unsafe_view of its output
    assert Counter(graph.name[n] for n in one.nodes) == Counter(
        {"aten::view": 3, "aten::t": 3, "aten::mm": 3, "aten::_unsafe_view": 3}
    )


def test_qwen2_biased_projections(tmp_path: Path) -> None:
    """Qwen2's q/k/v carry a bias, recorded as `aten::addmm` (not mm + add): still L qkv and L gate_up per step."""
    graph = record({**QWEN2, "num_hidden_layers": 2}, tmp_path)
    for counts in counts_per_step(graph).values():
        assert counts == Counter({"qkv": 2, "gate_up": 2})
    for match in horizontal(graph):
        assert match.rejected == "" and match.escaping == ()
        assert gemm_names(graph, match) == (["aten::addmm"] * 3 if match.fusion == "qkv" else ["aten::mm"] * 2)


def test_phi3_is_already_fused(tmp_path: Path) -> None:
    """Phi-3 has one qkv_proj and one gate_up_proj Linear per layer: a single GEMM each, nothing to group."""
    graph = record({**PHI3, "num_hidden_layers": 2}, tmp_path)
    assert "model.layers.0.self_attn.qkv_proj" in set(graph.module.values())
    assert horizontal(graph) == []


def test_disjoint_from_the_other_entries(tmp_path: Path) -> None:
    """The groups start at the views after the norms' output and end before SiLU: no node is shared with the norm and
    activation entries, so the order in the registry does not change any count. gemv, which comes after them, takes
    the one-row GEMMs they leave: its own pattern would match their projections too, which the order settles."""
    graph = record(LLAMA, tmp_path)
    ours = {n for m in horizontal(graph) for n in m.nodes}
    theirs = {n for f in fusions() if f.KEY not in ("qkv", "gate_up", "gemv") for m in f.find(graph) for n in m.nodes}
    assert ours and theirs and ours.isdisjoint(theirs)


def synthetic(depends: dict[str, str]) -> Graph:
    """A norm output x read by q/k/v projections (view x → mm ← t weight); `depends` maps a projection to one whose
    output its weight is made from (`t(q_out)` instead of `t(parameter)`), as in attention's q·kᵀ."""
    rows = [(0, "aten::mul", (-1,), "l.input_layernorm", False)]
    out: dict[str, int] = {}
    for proj in ("q", "k", "v"):
        module = f"l.self_attn.{proj}_proj"
        n = len(rows)
        weight = out[depends[proj]] if proj in depends else -1
        rows += [(n, "aten::view", (0,), module, True), (n + 1, "aten::t", (weight,), module, True),
                 (n + 2, "aten::mm", (n, n + 1), module, False)]  # fmt: skip
        out[proj] = n + 2
    consumers = {r[0]: tuple(m[0] for m in rows if r[0] in m[2]) for r in rows}
    return Graph(pd.DataFrame({
        "node": [r[0] for r in rows], "name": [r[1] for r in rows], "inputs": [r[2] for r in rows],
        "consumers": [consumers[r[0]] for r in rows], "module": [r[3] for r in rows], "is_view": [r[4] for r in rows],
        "phase": "decode", "step": 0,
    }))  # fmt: skip


def test_a_dependent_gemm_is_not_grouped() -> None:
    (independent,) = qkv.find(synthetic({}))
    assert set(independent.nodes) == set(range(1, 10)) and independent.rejected == ""
    graph = synthetic({"v": "q"})  # v's weight is computed from q's output: only q and k are independent
    (two,) = qkv.find(graph)
    assert sorted(graph.module[n] for n in two.nodes if graph.name[n] == "aten::mm") == [
        "l.self_attn.k_proj",
        "l.self_attn.q_proj",
    ]
    assert qkv.find(synthetic({"k": "q", "v": "k"})) == []  # a chain: no two GEMMs are independent


def test_entries_are_complete() -> None:
    for entry in (qkv, gate_up):
        assert entry.KERNEL == "fuse_linears" and entry.TITLE and entry.FAMILIES
        assert "fused" in (entry.__doc__ or "")
