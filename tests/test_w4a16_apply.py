"""W4A16 in a model: `quantize_model` swaps a float model's Linears for `PlainW4Linear` (the unfused dequantise + GEMM
chain), the real finder matches `dequant_gemm` on each, and its patcher serves them with the `w4a16_gemm` kernel on
the same packed tensors (interpreter on the CPU) and takes it out exactly. On SmolLM2-135M's real weights the
quantisation's own error against the bf16 model is measured apart from the fusion's against the unfused chain."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import fusionscope
from fusionscope import dataflow
from fusionscope.apply.numerics import compare, fp32_copy, judge, reference, text_ids
from fusionscope.apply.quantize import PlainW4Linear, parse_quantize, quantize_model, quantize_workload
from fusionscope.cli import app
from fusionscope.errors import UsageError
from fusionscope.fusions import Graph, dequant_gemm, find_matches
from fusionscope.models import build_workload, resolve_model
from tests.test_fusions_attention import Int4Linear

CPU = torch.device("cpu")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def tiny_llama(dtype: torch.dtype = torch.bfloat16, prompt_len: int = 6, decode_steps: int = 2):
    return build_workload(resolve_model("tiny-llama"), CPU, dtype, prompt_len=prompt_len, decode_steps=decode_steps,
                          seed=0)  # fmt: skip


def ids(vocab: int = 1000, length: int = 6) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(2))


def test_quantize_model_swaps_the_linears_but_not_the_head_or_the_embedding() -> None:
    model = tiny_llama().module
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    report = quantize_model(model, group_size=64)
    expected = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    assert sorted(report["swapped"]) == sorted(expected)
    assert report["skipped"] == {"lm_head": "the LM head (include_lm_head=True quantises it too)"}
    assert model.get_input_embeddings() is embedding and model.get_output_embeddings() is head
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is PlainW4Linear and q_proj.group_size == 64 and not q_proj.training
    assert q_proj.qweight.dtype == torch.int32 and q_proj.scales.dtype == torch.bfloat16
    assert report["swapped"]["model.layers.0.mlp.down_proj"] == {"in_features": 512, "out_features": 256,
                                                                 "group_size": 64}  # fmt: skip
    assert 3.5 < report["weight_bytes_before"] / report["weight_bytes_after"] < 4  # 2 bytes → 0.5 + 3/64


def test_quantize_model_takes_the_head_when_asked_and_refuses_bad_groups() -> None:
    model = tiny_llama().module
    report = quantize_model(model, group_size=-1, include_lm_head=True)
    assert "lm_head" in report["swapped"] and not report["skipped"]
    assert type(model.lm_head) is PlainW4Linear and model.lm_head.group_size == 256  # per channel: K
    with pytest.raises(UsageError, match="power of two"):
        quantize_model(tiny_llama().module, group_size=48)


@pytest.mark.parametrize(("text", "group"), [("w4", 128), ("w4:64", 64), ("w4:channel", -1), (" w4:32 ", 32)])
def test_parse_quantize(text: str, group: int) -> None:
    assert parse_quantize(text) == group


@pytest.mark.parametrize("text", ["w8", "w4:48", "w4:8", "w4:abc", "int4"])
def test_parse_quantize_refuses_in_one_line(text: str) -> None:
    with pytest.raises(UsageError, match="--quantize"):
        parse_quantize(text)


# ---------------------------------------------------------------- apply --quantize, end to end on the CPU

QUANTISED_RUN = ["--dtype", "bf16", "--prompt-len", "8", "--decode-steps", "1", "--warmup", "0", "--repeats", "1"]


@pytest.fixture(scope="module")
def quantised_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """`fusionscope apply tiny-llama --quantize w4:32 --graphs --fusions dequant_gemm,rms_norm` in bf16: (run folder,
    summary.json, output). Two fusions, so that fused + graph holds more than dequant_gemm; the others found (norms,
    SwiGLU, rope, attention) are left out: each costs its own numerics and graph checks in the interpreter, and
    tests/test_apply.py and the graph tests cover them. 8 prompt tokens and one decode step (8 rows and 1 per kernel
    call): every check runs the 14 quantised projections per forward, and a graph variant 5 forwards."""
    out = tmp_path_factory.mktemp("w4") / "run"
    result = CliRunner().invoke(app, ["apply", "tiny-llama", "--quantize", "w4:32", "--graphs", "--fusions",
                                      "dequant_gemm,rms_norm", *QUANTISED_RUN, "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "summary.json").read_text()), result.output


def test_apply_quantize_finds_dequant_gemm_and_passes_it(quantised_run) -> None:
    """Quantised before profiling: the finder matches the unfused chain at all 14 projections of the 2 layers (not
    the LM head), the patch reaches each, and the fused model is within tolerance of the unfused quantised one."""
    _out, summary, _output = quantised_run
    quantize = summary["quantize"]
    assert quantize["group_size"] == 32 and len(quantize["swapped"]) == 14 and list(quantize["skipped"]) == ["lm_head"]
    found = [o for o in summary["opportunities"] if o["fusion"] == "dequant_gemm"]
    assert {o["phase"] for o in found} == {"prefill", "decode"}
    assert all(o["count"] == 14 for o in found)
    rows = {row["fusion"]: row for row in summary["apply"]["fusions"]}
    assert rows["dequant_gemm"]["status"] == "passed", rows["dequant_gemm"]["reason"]
    assert rows["dequant_gemm"]["sites_patched"] == rows["dequant_gemm"]["sites_found"] == 14
    assert sorted(rows["dequant_gemm"]["applied"]) == sorted(quantize["swapped"])


def test_apply_quantize_reports_the_quantisations_own_error_against_the_float_model(quantised_run) -> None:
    """`apply.quantization` is the unpatched quantised model against the bf16 model taken before quantising, on the
    run's own ids and decode steps: the same figures `quantize_workload` gives on a workload built alike, non-zero,
    and apart from the fusion's error (against the unfused quantised model), which is far smaller."""
    _out, summary, output = quantised_run
    quantization = summary["apply"]["quantization"]
    assert (quantization["spec"], quantization["group_size"]) == ("w4:32", 32)
    assert "bfloat16" in quantization["against"]
    figures = quantization["numerics"]
    assert figures["positions"] > 0 and figures["decode_compared"] > 0
    assert figures["max_abs"] > 0 and 0 < figures["kl_mean"] < 1 and 0 <= figures["top1"] <= 1
    _report, again = quantize_workload(tiny_llama(prompt_len=8, decode_steps=1), 32)
    for key in ("max_abs", "kl_mean", "top1", "top5", "positions"):
        assert figures[key] == pytest.approx(again[key], rel=1e-9), key
    fusion = next(r for r in summary["apply"]["fusions"] if r["fusion"] == "dequant_gemm")["numerics"]
    assert fusion["kl_mean"] <= figures["kl_mean"] / 10 and fusion["max_abs"] < figures["max_abs"]
    assert "quantisation w4:32 of 14 Linears" in output and f"{figures['max_abs']:.3g}" in output


def test_apply_quantize_with_graphs_takes_the_fused_kernel_into_the_graph(quantised_run) -> None:
    _out, summary, _output = quantised_run
    variants = summary["apply"]["graphs"]["variants"]
    assert variants["dequant_gemm + graph"]["passed"], variants["dequant_gemm + graph"]["reason"]
    assert variants["fused + graph"]["fusions"] == ["dequant_gemm", "rms_norm"] and variants["fused + graph"]["passed"]


def test_apply_from_a_run_quantised_otherwise_is_refused(quantised_run, tmp_path) -> None:
    out, _summary, _output = quantised_run
    for extra, said in (
        ([], "this one is without --quantize"),
        (["--quantize", "w4"], "this one is with --quantize w4:128"),
    ):
        result = CliRunner().invoke(app, ["apply", "--from", str(out), *QUANTISED_RUN, *extra, "--out",
                                          str(tmp_path / "f")])  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "made with --quantize w4:32" in result.output and said in result.output
        assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("spec", ["w4:48", "w8", "int4:128"])
def test_apply_with_a_bad_quantize_spec_is_one_line_and_writes_nothing(spec: str, tmp_path) -> None:
    result = CliRunner().invoke(app, ["apply", "--quantize", spec, *QUANTISED_RUN, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "--quantize" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())


def test_the_finder_matches_dequant_gemm_on_every_plain_w4_linear() -> None:
    """The catalogue on the recorded dataflow: per step one dequant_gemm per quantised projection, anchored at its
    module, and the norm and SwiGLU fusions found as in the float model."""
    workload = tiny_llama()
    report = quantize_model(workload.module)
    graph = Graph(dataflow.record_dataflow(workload))
    matches = [m for m in find_matches(graph) if not m.rejected]
    per_step: dict[int, Counter] = {}
    for m in matches:
        per_step.setdefault(m.step, Counter())[m.fusion] += 1
    for step in sorted(set(graph.nodes["step"])):
        counts = per_step[step]
        assert counts["dequant_gemm"] == 14
        assert (counts["add_rms_norm"], counts["rms_norm"], counts["silu_and_mul"]) == (4, 1, 2)
    anchors = {m.anchor_module for m in matches if m.fusion == "dequant_gemm"}
    assert anchors == set(report["swapped"])
    one = next(m for m in matches if m.fusion == "dequant_gemm")
    names = Counter(graph.name[n] for n in one.nodes)
    assert names["aten::__rshift__"] == 1 and names["aten::bitwise_and"] == 1 and names["aten::mm"] == 1
    assert one.escaping == ()
    case = dequant_gemm.micro_case(graph, one)  # the micro-measured column's case: this match's shapes and group
    module = graph.module[next(n for n in one.nodes if graph.name[n] == "aten::mm")]
    linear = workload.module.get_submodule(module)
    rows = graph.column("input_shapes")[next(n for n in one.nodes if graph.name[n] == "aten::mm")][0][0]
    assert case.label == f"{rows}x{linear.in_features}->{linear.out_features} g{linear.group_size}"
    inputs = case.build(CPU, torch.float32)
    torch.testing.assert_close(case.variants["fusionscope"](inputs), case.variants["eager"](inputs), atol=1e-4,
                               rtol=1e-4)  # fmt: skip


def test_patch_serves_every_site_on_the_same_tensors_and_restores_exactly() -> None:
    """bf16 tiny-llama, quantised: the patched model is as close to the fp32 copy of the quantised model as the
    unfused one (the rule `apply` judges by); after the block the model is bit for bit what it was, no forward left on
    an instance, and the packed tensors were never replaced. 2 × 6 prompt tokens and one decode step (12 and 2 rows
    per call: the prefill and the decode schedule)."""
    model = tiny_llama().module
    report = quantize_model(model)
    x = ids()
    tensors = {p: tuple(model.get_submodule(p).packed()[:3]) for p in report["swapped"]}
    unfused = reference(model, x, decode_steps=1)
    exact = reference(fp32_copy(model), x, decode_steps=1)
    with fusionscope.patch(model, ["dequant_gemm"]) as p:
        assert sorted(p.applied["dequant_gemm"]) == sorted(report["swapped"]) and "dequant_gemm" not in p.skipped
        assert all("forward" in vars(model.get_submodule(path)) for path in report["swapped"])
        fused = reference(model, x, decode_steps=1)
    after = reference(model, x, decode_steps=1)
    assert not any("forward" in vars(model.get_submodule(path)) for path in report["swapped"])
    for path, (qweight, scales, zeros) in tensors.items():
        module = model.get_submodule(path)
        assert module.qweight is qweight and module.scales is scales and module.zeros is zeros
    assert torch.equal(after.prefill_logits, unfused.prefill_logits)
    assert torch.equal(after.decode_logits, unfused.decode_logits)
    assert not torch.equal(fused.prefill_logits, unfused.prefill_logits)  # the kernel did run
    ok, why = judge(compare(fused, unfused), compare(fused, exact), compare(unfused, exact), torch.bfloat16,
                    real_weights=False)  # fmt: skip
    assert ok, why


def test_a_patched_layer_in_training_mode_runs_the_unfused_chain() -> None:
    model = tiny_llama(torch.float32).module
    quantize_model(model)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    with fusionscope.patch(model, [{"fusion": "dequant_gemm", "module_paths": ["model.layers.0.mlp.down_proj"]}]):
        fused = layer(x)
        layer.train()
        trained = layer(x)
    assert torch.equal(trained, layer(x))  # the class's forward, exactly
    torch.testing.assert_close(fused, trained, atol=1e-5, rtol=1e-5)


def test_modules_of_another_layout_are_refused_with_the_reason() -> None:
    """The tests' Int4Linear (two nibbles per uint8, scales only) is matched by the finder, but its layout is not one
    the kernel reads: no patch, a reason naming it; nn.Linear likewise."""
    model = nn.Sequential(Int4Linear(), nn.Linear(4, 4))
    with fusionscope.patch(model, [{"fusion": "dequant_gemm", "module_paths": ["0", "1"]}]) as p:
        assert not p.applied
        reasons = p.skipped_paths["dequant_gemm"]
        assert reasons["0"].startswith("Int4Linear is not a PlainW4Linear")
        assert reasons["1"].startswith("Linear is not a PlainW4Linear")


# ---------------------------------------------------------------- SmolLM2-135M, real weights, real text


def test_smollm2_quantisation_error_is_reported_apart_from_the_fusions(smollm2: tuple, monkeypatch) -> None:
    """bf16 SmolLM2-135M, every one of its 210 projections quantised (group 128) and then served by the kernel in the
    interpreter. The quantisation's own error is the unfused quantised model against the bf16 one; the fusion's is the
    fused model against the unfused quantised one, judged by `apply`'s rule against the fp32 copy of the quantised
    model. Measured 2026-12-02 on 2 × 16 tokens, 2 decode steps: quantisation KL 0.57, top-1 0.59 (round-to-nearest
    int4 of weights that ship as GGUF Q4_1 already); fusion KL 0.0016, top-1 1.0. Here one forward over 16 tokens
    (16 rows: one tensor-core decode tile; fewer rows cost no less in the interpreter, and the GEMV costs more), since
    each of the 210 kernel calls costs ~0.1–0.4 s in the interpreter. The decode tiles take 4 blocks of 128 inputs per
    step and no split of K here (K = 576 is then 2 loop steps, the second ending 3 blocks past K; unsplit, no second
    launch): half the interpreter's time of the shipped 1 block per step in 2 splits, the same kernel and unpacking
    (every schedule is checked against float64 in tests/kernels/test_w4a16_gemm.py)."""
    w4 = importlib.import_module("fusionscope.kernels.w4a16_gemm")
    bound, tiles = w4.TILES["decode"]
    monkeypatch.setitem(w4.TILES, "decode", (bound, dict(tiles, BLOCK_K=512, SPLIT_K=1)))
    plan = w4.schedule(16, 1536, 576, CPU)
    assert plan.tiles["KERNEL"] == "mma" and plan.tiles["BLOCK_K"] == 512 and plan.splits == 1
    model32, tokenizer = smollm2
    model = fp32_copy(model32)
    x = text_ids(tokenizer, length=16, batch=1)
    for p in model.parameters():  # what loading in bf16 gives: weights rounded, rotary buffers kept in fp32
        p.data = p.data.to(torch.bfloat16)
    bf16 = reference(model, x, decode_steps=0)
    report = quantize_model(model)
    assert len(report["swapped"]) == 30 * 7 and list(report["skipped"]) == ["lm_head"]
    unfused = reference(model, x, decode_steps=0)
    exact = reference(fp32_copy(model), x, decode_steps=0)
    with fusionscope.patch(model, [{"fusion": "dequant_gemm", "module_paths": list(report["swapped"])}]) as p:
        assert len(p.applied["dequant_gemm"]) == 210
        fused = reference(model, x, decode_steps=0)
    quantisation, fusion = compare(unfused, bf16), compare(fused, unfused)
    ok, why = judge(fusion, compare(fused, exact), compare(unfused, exact), torch.bfloat16, real_weights=True)
    assert ok, why
    # a quantiser that scrambled the weights would leave ~no top-1 agreement (vocabulary 49152) and a KL of several
    # nats; and the fusion's error is a bf16 rounding effect, two orders of magnitude under the quantisation's
    assert quantisation["top1"] >= 0.3 and quantisation["kl_mean"] < 2.0, quantisation
    assert fusion["kl_mean"] < quantisation["kl_mean"] / 50, (fusion, quantisation)
