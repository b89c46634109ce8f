"""decode_attention in the catalogue and in the model: the pattern (one query token's SDPA call, with Hugging Face's
repeat_kv copies where they feed it), and the patch — the decode part of the shared attention rewrite, alone and
beside rope, taken for one query token against a static cache only, restored exactly."""

from __future__ import annotations

import fusionscope.kernels as kernels
import pandas as pd
import pytest
import torch

from fusionscope import models
from fusionscope.apply import graphs, numerics
from fusionscope.apply.patching import patch
from fusionscope.fusions import Graph, find_matches
from fusionscope.fusions import decode_attention as fusion
from fusionscope.models import ModelSpec, build_workload, resolve_model


def graph(rows: list[tuple[int, str, tuple[int, ...], tuple]], phase: str = "decode") -> Graph:
    consumers = {n: tuple(m for m, _name, ins, _s in rows if n in ins) for n, _name, _ins, _s in rows}
    return Graph(pd.DataFrame({
        "node": [r[0] for r in rows], "name": [r[1] for r in rows], "inputs": [r[2] for r in rows],
        "consumers": [consumers[r[0]] for r in rows], "input_shapes": [r[3] for r in rows],
        "module": "model.layers.0.self_attn", "phase": phase, "step": 3,
    }))  # fmt: skip


Q, K = (1, 8, 1, 64), (1, 2, 20, 64)
EXPANDED = (1, 8, 20, 64)


def repeat_kv_rows(start: int, source: int) -> list[tuple[int, str, tuple[int, ...], tuple]]:
    """unsqueeze → expand → clone → _unsafe_view of a (1, 2, 20, 64) cache tensor, as `repeat_kv` dispatches."""
    return [(start, "aten::unsqueeze", (source,), (K,)), (start + 1, "aten::expand", (start,), ((1, 2, 1, 20, 64),)),
            (start + 2, "aten::clone", (start + 1,), ((1, 2, 4, 20, 64),)),
            (start + 3, "aten::_unsafe_view", (start + 2,), ((1, 2, 4, 20, 64),))]  # fmt: skip


def test_one_query_tokens_attention_takes_its_repeat_kv_copies_along() -> None:
    rows = [(0, "aten::mm", (-1,), ()), (1, "aten::mm", (-1,), ()), (2, "aten::mm", (-1,), ()),
            *repeat_kv_rows(10, 1), *repeat_kv_rows(20, 2),
            (30, "aten::_scaled_dot_product_efficient_attention", (0, 13, 23), (Q, EXPANDED, EXPANDED))]  # fmt: skip
    (match,) = fusion.find(graph(rows))
    assert set(match.nodes) == {30, *range(10, 14), *range(20, 24)} and match.rejected == ""
    assert match.anchor_module == "model.layers.0.self_attn"


def test_prefill_and_longer_queries_are_not_decode_attention() -> None:
    rows = [(0, "aten::mm", (-1,), ()), (1, "aten::scaled_dot_product_attention", (0, -1, -1),
                                           ((1, 8, 5, 64), K, K))]  # fmt: skip
    assert fusion.find(graph(rows)) == []
    single = [(0, "aten::mm", (-1,), ()), (1, "aten::scaled_dot_product_attention", (0, -1, -1), (Q, K, K))]
    assert fusion.find(graph(single, phase="prefill")) == []
    assert len(fusion.find(graph(single))) == 1


def test_a_one_token_query_with_its_gqa_groups_packed_is_decode_attention() -> None:
    """transformers 5.24 passes a masked one-token GQA query as (B, K, H/K, d), reshaped from (B, H, 1, d)."""
    packed = (1, 2, 4, 64)
    rows = [(0, "aten::mm", (-1,), ()), (1, "aten::reshape", (0,), (Q,)), (2, "aten::view", (1,), (Q,)),
            (3, "aten::scaled_dot_product_attention", (2, -1, -1), (packed, K, K))]  # fmt: skip
    (match,) = fusion.find(graph(rows))
    assert match.nodes == (3,) and match.rejected == ""
    prefill = [(0, "aten::mm", (-1,), ()), (1, "aten::view", (0,), ((1, 8, 4, 64),)),
               (3, "aten::scaled_dot_product_attention", (1, -1, -1), ((1, 2, 16, 64), K, K))]  # fmt: skip
    assert fusion.find(graph(prefill)) == []  # four positions per head: not one token's query


def test_an_expanded_cache_read_elsewhere_is_rejected_with_its_reason() -> None:
    rows = [(0, "aten::mm", (-1,), ()), (1, "aten::mm", (-1,), ()), *repeat_kv_rows(10, 1),
            (30, "aten::_scaled_dot_product_efficient_attention", (0, 13, -1), (Q, EXPANDED, K)),
            (31, "aten::sum", (13,), (EXPANDED,))]  # fmt: skip
    (match,) = find_matches(graph(rows))
    assert match.fusion == fusion.KEY and match.escaping == (13,) and "outside" in match.rejected


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, torch.Tensor, numerics.Reference]:
    workload = build_workload(resolve_model("tiny-llama"), torch.device("cpu"), torch.float32, prompt_len=8,
                              decode_steps=4)  # fmt: skip
    model, ids = workload.module, workload.inputs[0]
    return model, ids, numerics.reference(model, ids, 4)


def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("fusions", [["decode_attention"], ["rope", "decode_attention"]])
def test_every_decode_step_attends_in_one_launch_and_computes_what_eager_does(tiny, monkeypatch, fusions) -> None:
    """Under a static cache every decode layer takes the kernel (alone, or as the second part of the rewrite rope
    binds first); the teacher-forced logits and the greedy tokens are eager's; the model is its own again after."""
    model, ids, ref = tiny
    calls = counted(monkeypatch)
    attention = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    with patch(model, fusions, rewrite=False) as result:  # the layout patchers' attention rewrite (graph path:
        # tests/test_rewrite.py, under a static cache)
        assert len(result.applied["decode_attention"]) == len(attention), result.skipped
        forced, own = graphs.teacher_forced(graphs.StaticDecoder(model, ids, 4), ref)
    assert len(calls) == 2 * 4 * len(attention)  # both passes of 4 decode steps, every layer; no prefill
    fig = numerics.compare(forced, graphs.last_position(ref))
    assert fig["max_abs"] < 1e-4 and torch.equal(own, ref.tokens)
    assert all("forward" not in vars(m) for m in attention)
    assert torch.equal(numerics.reference(model, ids, 4).decode_logits, ref.decode_logits)


def test_a_dynamic_cache_keeps_the_attention_function(tiny, monkeypatch) -> None:
    """Eager decode with a DynamicCache has no static layer to read: the class's attention function runs, the
    kernel is never called, and the logits are the unpatched model's exactly."""
    model, ids, ref = tiny
    calls = counted(monkeypatch)
    with patch(model, ["decode_attention"]):
        test = numerics.reference(model, ids, 4)
    assert calls == [] and torch.equal(test.decode_logits, ref.decode_logits)


def test_soft_capped_attention_is_refused_with_its_reason(tmp_path) -> None:
    config = {**models.PRESETS["gemma-2-2b"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "vocab_size": 300}  # fmt: skip
    spec = ModelSpec(name="gemma2-tiny", source="config", config=config)
    workload = build_workload(spec, torch.device("cpu"), torch.float32, prompt_len=4, decode_steps=1)
    with patch(workload.module, [("decode_attention", ["model.layers.0.self_attn"])], rewrite=False) as result:
        assert "decode_attention" not in result.applied
        assert "soft-capped" in result.skipped["decode_attention"]


def test_the_micro_case_is_the_matched_attention_on_its_whole_cache() -> None:
    rows = [(0, "aten::mm", (-1,), ()), (1, "aten::scaled_dot_product_attention", (0, -1, -1), (Q, K, K))]
    g = graph(rows)
    (match,) = fusion.find(g)
    case = fusion.micro_case(g, match)
    assert case is not None and case.kernel == "decode_attention"
    assert case.label == "B1 H8/2 D64 len20/20" and case.extra["length"] == 20
