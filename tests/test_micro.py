"""The micro-measured column: each fusion's bench case is built on the shapes the run found (derived here from the
config), both variants run on them, and the per-step figures are the per-call time times the matches per step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusionscope import dataflow, micro, models
from fusionscope.fusions import Graph, Match, find_matches, fusions

SMALL_LLAMA = {**models.PRESETS["tiny-llama"], "hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 97}  # fmt: skip
BATCH, PROMPT = 2, 5


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Graph, list[Match]]:
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    spec = models.resolve_model(str(folder))
    workload = models.build_workload(spec, torch.device("cpu"), torch.float32, batch=BATCH, prompt_len=PROMPT,
                                     decode_steps=1, sampling=(0.7, 7, 0.8))  # fmt: skip
    graph = Graph(dataflow.record_dataflow(workload))
    return graph, find_matches(graph)


def first(matches: list[Match], fusion: str, phase: str) -> Match:
    return next(m for m in matches if m.fusion == fusion and m.phase == phase)


@pytest.mark.parametrize("phase, rows", [("prefill", BATCH * PROMPT), ("decode", BATCH)])
def test_cases_take_the_shapes_of_the_config(llama: tuple[Graph, list[Match]], phase: str, rows: int) -> None:
    graph, matches = llama
    by_key = {f.KEY: f for f in fusions()}
    hidden, inter = SMALL_LLAMA["hidden_size"], SMALL_LLAMA["intermediate_size"]
    heads, kv_heads = SMALL_LLAMA["num_attention_heads"], SMALL_LLAMA["num_key_value_heads"]
    dim = hidden // heads
    expected = {
        "add_rms_norm": ("add_rms_norm", f"{rows}x{hidden}"),
        "rms_norm": ("rms_norm", f"{rows}x{hidden}"),
        "silu_and_mul": ("silu_and_mul", f"{rows}x{inter}"),
        "rope": ("rope", f"B{BATCH} S{rows // BATCH} H{heads}/{kv_heads} D{dim}"),
        "qkv": ("qkv", f"{rows}x{hidden}->{heads * dim}+{kv_heads * dim}+{kv_heads * dim}"),
        "gate_up": ("gate_up", f"{rows}x{hidden}->{inter}+{inter}"),
    }
    for fusion, (kernel, label) in expected.items():
        case = by_key[fusion].micro_case(graph, first(matches, fusion, phase))
        assert (case.kernel, case.label) == (kernel, label), fusion
    if phase == "decode":
        case = by_key["sampling"].micro_case(graph, first(matches, "sampling", phase))
        assert case.extra["settings"] == {"temperature": 0.7, "top_k": 7, "top_p": pytest.approx(0.8)}
        assert case.label.startswith(f"B{BATCH} V{SMALL_LLAMA['vocab_size']} ")


def test_both_variants_run_and_scale_by_the_count(llama: tuple[Graph, list[Match]]) -> None:
    """A timer that runs each function for real (the Triton kernels in the interpreter) and reports 1 µs for the
    unfused chain and 0.25 µs for ours: the column is count × those, per opportunity."""
    graph, matches = llama
    calls: list[object] = []

    def timer(fn: object) -> float:
        out = fn()
        calls.append(out)
        return 1.0 if len(calls) % 2 else 0.25

    opportunities = [{"fusion": f, "phase": "decode", "count": c} for f, c in
                     (("add_rms_norm", 4.0), ("silu_and_mul", 2.0), ("rope", 2.0), ("qkv", 2.0))]  # fmt: skip
    micro.micro_measure(opportunities, graph, matches, torch.device("cpu"), torch.float32, timer=timer)
    for opp in opportunities:
        assert opp["micro_now_us"] == opp["count"], opp["micro_note"]
        assert opp["micro_fused_us"] == 0.25 * opp["count"]
        assert "µs unfused" in opp["micro_note"]
    assert len(calls) == 2 * len(opportunities)


def test_without_a_gpu_nothing_is_timed(llama: tuple[Graph, list[Match]]) -> None:
    graph, matches = llama
    opportunities = [{"fusion": "add_rms_norm", "phase": "prefill", "count": 4.0},
                     {"fusion": "flash_attention", "phase": "prefill", "count": 2.0}]  # fmt: skip
    micro.micro_measure(opportunities, graph, matches, torch.device("cpu"), torch.float32)
    assert opportunities[0]["micro_now_us"] is None and "needs a CUDA GPU" in opportunities[0]["micro_note"]
    assert opportunities[1]["micro_now_us"] is None and "no bundled kernel" in opportunities[1]["micro_note"]


def test_a_kernel_that_refuses_is_noted_not_raised(llama: tuple[Graph, list[Match]]) -> None:
    graph, matches = llama

    def timer(fn: object) -> float:
        raise RuntimeError("shape not supported\nsecond line")

    opportunities = [{"fusion": "silu_and_mul", "phase": "prefill", "count": 2.0}]
    micro.micro_measure(opportunities, graph, matches, torch.device("cpu"), torch.float32, timer=timer)
    assert opportunities[0]["micro_now_us"] is None
    assert opportunities[0]["micro_note"] == "not measured: RuntimeError: shape not supported"


def test_a_phase_whose_matches_are_all_rejected(llama: tuple[Graph, list[Match]]) -> None:
    graph, matches = llama
    rejected = [Match(m.fusion, m.phase, m.step, m.nodes, m.anchor_module, rejected="no") for m in matches]
    opportunities = [{"fusion": "qkv", "phase": "decode", "count": 2.0}]
    micro.micro_measure(opportunities, graph, rejected, torch.device("cpu"), torch.float32, timer=lambda fn: 1.0)
    assert opportunities[0]["micro_note"] == "every match was rejected"


def test_linear_act_case_reads_the_gemm_and_activation(tmp_path: Path) -> None:
    config = {**models.PRESETS["gpt2"], "n_embd": 64, "n_head": 4, "n_layer": 1, "vocab_size": 300, "n_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = models.build_workload(models.resolve_model(str(tmp_path)), torch.device("cpu"), torch.float32,
                                     prompt_len=6, decode_steps=1)  # fmt: skip
    graph = Graph(dataflow.record_dataflow(workload))
    match = first(find_matches(graph), "linear_act", "prefill")
    case = {f.KEY: f for f in fusions()}["linear_act"].micro_case(graph, match)
    assert case.label == "6x64->256 gelu_tanh"  # gelu_new is the tanh approximation


def test_a_case_that_cannot_be_built_is_noted_not_raised(
    llama: tuple[Graph, list[Match]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fusionscope.fusions import rope

    def boom(graph: Graph, match: Match) -> None:
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(rope, "micro_case", boom)
    graph, matches = llama
    opportunities = [{"fusion": "rope", "phase": "decode", "count": 2.0}]
    micro.micro_measure(opportunities, graph, matches, torch.device("cpu"), torch.float32, timer=lambda fn: 1.0)
    assert opportunities[0]["micro_now_us"] is None
    assert opportunities[0]["micro_note"] == "not measured: IndexError: tuple index out of range"
