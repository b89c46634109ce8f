"""The gemv entry: which GEMMs it takes on recorded dataflow (one-row Linears the other entries leave, at most WIDEST
outputs, a Linear's weight), and its layout patch (each matched nn.Linear's forward through the kernel: the logits
of the unpatched model, the model exactly restored)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fusionscope import dataflow, models
from fusionscope.apply.patching import find_sites, patch
from fusionscope.fusions import Graph, find_matches, gemv


def record(config: dict, tmp_path: Path) -> Graph:
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = models.build_workload(models.resolve_model(str(tmp_path)), torch.device("cpu"), torch.float32,
                                     prompt_len=6, decode_steps=1)  # fmt: skip
    return Graph(dataflow.record_dataflow(workload))


def gemv_modules(graph: Graph, phase: str) -> list[str]:
    return sorted(m.anchor_module for m in find_matches(graph) if m.fusion == "gemv" and m.phase == phase)


def test_llama_decode_projections_and_the_lm_head_within_the_width(tmp_path: Path) -> None:
    """At decode: o_proj and down_proj of each layer (q/k/v and gate/up are the horizontal fusions') and the LM head;
    nothing in prefill (the LM head's one row there runs once per prompt). An LM head wider than WIDEST is cuBLAS's:
    no match."""
    config = {**models.PRESETS["tiny-llama"], "num_hidden_layers": 2}
    graph = record(config, tmp_path)
    layers = [f"model.layers.{i}.{p}" for i in range(2) for p in ("mlp.down_proj", "self_attn.o_proj")]
    assert gemv_modules(graph, "decode") == sorted([*layers, "lm_head"])
    assert gemv_modules(graph, "prefill") == []
    for match in (m for m in find_matches(graph) if m.fusion == "gemv"):
        assert {graph.name[n] for n in match.nodes} <= {"aten::mm", "aten::_unsafe_view", "aten::view"}
        assert match.rejected == "" and match.escaping == ()
    wide = record({**config, "vocab_size": gemv.WIDEST + 1}, tmp_path)
    assert "lm_head" not in gemv_modules(wide, "decode")


def test_biased_projections_take_their_bias_and_conv1d_is_left_alone(tmp_path: Path) -> None:
    """GPT-NeoX's Linears have biases (addmm): matched with them; dense_h_to_4h is linear_act's. GPT-2's Conv1D hands
    W as (K, N) without a `t`: no match."""
    neox = record(models.PRESETS["tiny-neox"], tmp_path)
    decode = gemv_modules(neox, "decode")
    assert any(p.endswith("attention.dense") for p in decode) and any(p.endswith("dense_4h_to_h") for p in decode)
    assert not any(p.endswith("dense_h_to_4h") for p in decode)
    gpt2 = {**models.PRESETS["gpt2"], "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 300, "n_positions": 64}
    assert [p for p in gemv_modules(record(gpt2, tmp_path), "decode") if p != "lm_head"] == []


def test_layout_patch_runs_the_kernel_at_one_row_and_restores(monkeypatch) -> None:
    import fusionscope.kernels

    torch.manual_seed(0)
    workload = models.build_workload(models.resolve_model("tiny-llama"), torch.device("cpu"), torch.float32,
                                     prompt_len=6, decode_steps=1)  # fmt: skip
    model, ids = workload.module.eval(), workload.inputs[0]
    sites = find_sites(model)
    rows: list[int] = []
    kernel = fusionscope.kernels.gemv

    def counted(x, weight, bias=None):
        rows.append(x.shape[:-1].numel())
        return kernel(x, weight, bias)

    monkeypatch.setattr(fusionscope.kernels, "gemv", counted)
    with torch.inference_mode():
        ref, ref_one = model(ids).logits, model(ids[:, :1]).logits
        with patch(model, [{"fusion": "gemv", "module_paths": sites["gemv"]}], rewrite=False) as result:
            assert sorted(result.applied["gemv"]) == sorted(sites["gemv"]) and result.skipped == {}
            got, got_one = model(ids).logits, model(ids[:, :1]).logits
        assert [name for name, m in model.named_modules() if "forward" in vars(m)] == []
        assert torch.equal(model(ids).logits, ref)
    assert 6 in rows and 1 in rows  # the prompt (F.linear inside gemv) and one row (the kernel)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_one, ref_one, atol=1e-4, rtol=0)


def test_each_prologue_fold_is_its_pair_bit_for_bit() -> None:
    """`gemv.GATED_PROLOGUES`: each one call computes what its pair did, called as `rewrite.fold_prologues` calls it
    (the producer's arguments, then the GEMV's after x): SiLU's and both GELUs' GLU, then the GEMV of one row, gate
    and up the halves of one gate_up row; fp32 and bf16."""
    from fusionscope.fusions.gelu_and_mul import fused_gelu_and_mul
    from fusionscope.fusions.silu_and_mul import fused_silu_and_mul

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(1, 1, 80, dtype=dtype)
        gate, up = h[..., :40], h[..., 40:]
        weight, bias = (torch.randn(24, 40) * 40**-0.5).to(dtype), torch.randn(24, dtype=dtype)
        glu_args = {fused_silu_and_mul: [(gate, up)], fused_gelu_and_mul: [(gate, up, "none"), (gate, up, "tanh")]}
        assert {producer for _consumer, producer in gemv.GATED_PROLOGUES} == set(glu_args)
        for (consumer, producer), fold in gemv.GATED_PROLOGUES.items():
            for args in glu_args[producer]:
                assert torch.equal(fold(*args, weight, bias), consumer(producer(*args), weight, bias)), (fold, args)
