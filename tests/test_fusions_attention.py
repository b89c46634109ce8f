"""rope, flash_attention and dequant_gemm on real dataflow: exact counts per step from each config, negative cases."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from fusionscope import dataflow, models
from fusionscope.fusions import Graph, dequant_gemm, find_matches, flash_attention, rope

STEPS = list(range(5))  # prompt_len=6, decode_steps=2: 3 prefill steps, 2 decode steps


def record(config: dict, tmp_path: Path, dtype: torch.dtype = torch.bfloat16) -> Graph:
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = models.build_workload(models.resolve_model(str(tmp_path)), torch.device("cpu"), dtype, prompt_len=6,
                                     decode_steps=2)  # fmt: skip
    return Graph(dataflow.record_dataflow(workload))


def per_step(matches: list) -> Counter:
    return Counter(m.step for m in matches)


def llama(layers: int, attn: str | None = None) -> dict:
    config = {**models.PRESETS["tiny-llama"], "num_hidden_layers": layers}
    return {**config, "attn_implementation": attn} if attn else config


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rope_is_one_group_per_layer_with_its_cache_write(layers: int, attn: str, tmp_path: Path) -> None:
    """Per step: L rope matches (q's and k's chains of each attention layer, plus the k and v cache cats)."""
    graph = record(llama(layers, attn), tmp_path)
    matches = rope.find(graph)
    assert per_step(matches) == Counter({s: layers for s in STEPS})
    for m in matches:
        names = Counter(graph.name[n] for n in m.nodes)
        # 2 × (mul cos, slice, slice, neg, cat, mul sin, add) + cos/sin unsqueeze + k and v cache cats
        assert names == Counter({"aten::mul": 4, "aten::slice": 4, "aten::neg": 2, "aten::cat": 4, "aten::add": 2,
                                 "aten::unsqueeze": 2})  # fmt: skip
        assert m.escaping == () and m.rejected == "" and m.anchor_module.endswith("self_attn")
        assert not any(graph.module[n].endswith("rotary_emb") for n in m.nodes)  # cos/sin generation is not fused
        cache = [
            n
            for n in m.nodes
            if graph.name[n] == "aten::cat" and tuple(map(str, graph.nodes.loc[n, "scalars"])) == ("-2",)
        ]
        assert len(cache) == 2


def test_rope_finds_nothing_without_rotary_embeddings(tmp_path: Path) -> None:
    """GPT-2 adds learned position embeddings: no rotate_half, no match."""
    config = {**models.PRESETS["gpt2"], "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 300}
    assert rope.find(record(config, tmp_path)) == []


def test_rope_reports_an_outside_reader_and_skips_a_non_rotation() -> None:
    """x → slice/slice → neg → cat → mul(sin) → add(mul(x, cos), ·); a sum also reads rotate_half's cat."""
    rows = [(0, "aten::transpose", (-1,)), (1, "aten::mul", (0, -1)), (2, "aten::slice", (0,)),
            (3, "aten::slice", (0,)), (4, "aten::neg", (3,)), (5, "aten::cat", (4, 2)), (6, "aten::mul", (5, -1)),
            (7, "aten::add", (1, 6)), (8, "aten::sum", (5,))]  # fmt: skip
    (match,) = rope.find(table(rows))
    assert set(match.nodes) == {1, 2, 3, 4, 5, 6, 7} and match.escaping == (5,)
    swapped = [(5, "aten::cat", (2, 4)) if r[0] == 5 else r for r in rows]  # cat(x1, −x2): not rotate_half
    assert rope.find(table(swapped)) == []


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_attention_is_one_flash_attention_per_layer(layers: int, dtype: torch.dtype, tmp_path: Path) -> None:
    """Per step: L flash_attention matches with attn_implementation="eager" (honoured through the config dict)."""
    graph = record(llama(layers, "eager"), tmp_path, dtype)
    matches = flash_attention.find(graph)
    assert per_step(matches) == Counter({s: layers for s in STEPS})
    m = next(m for m in matches if m.step == 3)
    names = Counter(graph.name[n] for n in m.nodes)
    assert names["aten::bmm"] == 2 and names["aten::_softmax"] == 1 and names["aten::add"] == 1  # mask add
    assert names["aten::clone"] == 3  # repeat_kv of k and v (4 heads over 2 kv heads), eval dropout
    assert names["aten::_to_copy"] == (2 if dtype == torch.bfloat16 else 0)  # softmax's fp32 upcast and back
    assert m.escaping == () and m.rejected == ""
    assert not any(graph.name[n] == "aten::cat" for n in m.nodes)  # the cache cats stay with rope


def test_sdpa_attention_is_already_fused(tmp_path: Path) -> None:
    graph = record(llama(2, "sdpa"), tmp_path)
    assert flash_attention.find(graph) == []
    assert any(name.startswith("aten::_scaled_dot_product") for name in graph.name.values())


def test_rope_and_attention_groups_are_disjoint_in_the_registry(tmp_path: Path, monkeypatch) -> None:
    """With the new entries registered after the existing ones, every entry keeps its per-step count."""
    import fusionscope.fusions as catalogue

    order = ("add_rms_norm", "rms_norm", "silu_and_mul", "rope", "flash_attention", "dequant_gemm")
    monkeypatch.setattr(catalogue, "_MODULES", order)
    graph = record(llama(2, "eager"), tmp_path)
    counts: dict[int, Counter] = {}
    for match in find_matches(graph):
        counts.setdefault(match.step, Counter())[match.fusion] += 1
    for step in STEPS:
        assert counts[step] == Counter({"add_rms_norm": 4, "rms_norm": 1, "silu_and_mul": 2, "rope": 2,
                                        "flash_attention": 2})  # fmt: skip


class Int4Linear(torch.nn.Module):
    """Weight-only int4 Linear as quantisation libraries write it in Python: two nibbles per uint8, group scales."""

    def __init__(self, in_features: int = 64, out_features: int = 32, group: int = 16) -> None:
        super().__init__()
        self.register_buffer("packed", torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8))
        self.register_buffer("scales", torch.rand(out_features, in_features // group) + 0.5)
        self.group = group

    def weight(self) -> torch.Tensor:
        low = self.packed & 0x0F
        high = (self.packed >> 4) & 0x0F
        q = torch.stack((low, high), dim=-1).reshape(self.packed.shape[0], -1)
        w = (q.to(self.scales.dtype) - 8).reshape(q.shape[0], -1, self.group) * self.scales[..., None]
        return w.reshape(q.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


class Int4LinearLeaky(Int4Linear):
    """The dequantised weight is also read outside the matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        return F.linear(x, w) + w.sum()


def int4_linear() -> tuple[torch.nn.Module, torch.Tensor]:
    return Int4Linear(), torch.randn(1, 3, 64)


def int4_linear_leaky() -> tuple[torch.nn.Module, torch.Tensor]:
    return Int4LinearLeaky(), torch.randn(1, 3, 64)


def record_factory(name: str) -> Graph:
    workload = models.build_workload(models.resolve_model(f"{__file__}:{name}"), torch.device("cpu"), torch.bfloat16)
    return Graph(dataflow.record_dataflow(workload))


def test_dequant_gemm_matches_the_int4_linear_once_per_forward() -> None:
    """Per forward step: 1 dequant_gemm (one quantised Linear)."""
    graph = record_factory("int4_linear")
    matches = dequant_gemm.find(graph)
    assert per_step(matches) == Counter({s: 1 for s in sorted(set(graph.nodes["step"]))})
    names = Counter(graph.name[n] for n in matches[0].nodes)
    assert names["aten::bitwise_and"] == 2 and names["aten::__rshift__"] == 1 and names["aten::mm"] == 1
    assert {"aten::_to_copy", "aten::sub", "aten::mul", "aten::stack"} <= set(names)
    assert matches[0].escaping == ()
    leaky_graph = record_factory("int4_linear_leaky")
    leaky = dequant_gemm.find(leaky_graph)
    assert leaky and all(
        leaky_graph.name[m.escaping[-1]] == "aten::view" for m in leaky
    )  # the weight is written anyway


def test_dequant_gemm_finds_nothing_in_a_float_model(tmp_path: Path) -> None:
    assert dequant_gemm.find(record(llama(2), tmp_path)) == []


def table(rows: list[tuple[int, str, tuple[int, ...]]]) -> Graph:
    consumers = {n: tuple(m for m, _name, ins in rows if n in ins) for n, _name, _ins in rows}
    return Graph(pd.DataFrame({
        "node": [r[0] for r in rows], "name": [r[1] for r in rows], "inputs": [r[2] for r in rows],
        "consumers": [consumers[r[0]] for r in rows], "module": "self_attn", "phase": "decode", "step": 0,
    }))  # fmt: skip
