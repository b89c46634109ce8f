"""The bias_gelu entry: a bias add outside a GEMM, its GELU and a residual add, on recorded dataflow; and its
boundaries with linear_act (a GEMM's own bias is its epilogue) and gelu_and_mul (a GLU gate)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionscope import dataflow, models
from fusionscope.fusions import Graph, bias_gelu, find_matches, linear_act
from tests.test_fusions_gpt2_gemma import synthetic

FACTORY = '''
import torch
from torch import nn


class Block(nn.Module):
    """LayerNorm → GEMM → scale → bias + GELU → residual add (a bias applied after a scaled GEMM)."""

    def __init__(self, hidden, approximate):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden, bias=False)
        self.scale = nn.Parameter(torch.rand(hidden) + 0.5)
        self.bias = nn.Parameter(torch.randn(hidden))
        self.approximate = approximate

    def forward(self, x):
        h = self.fc(self.norm(x)) * self.scale
        return x + nn.functional.gelu(h + self.bias, approximate=self.approximate)


def make(device="cpu", dtype=torch.float32):
    model = nn.Sequential(Block(40, "tanh"), Block(40, "none"), Block(40, "tanh")).to(device=device, dtype=dtype)
    return model, (torch.randn(3, 7, 40, device=device, dtype=dtype),)
'''


def record(tmp_path: Path) -> Graph:
    (tmp_path / "blocks.py").write_text(FACTORY)
    spec = models.resolve_model(f"{tmp_path / 'blocks.py'}:make")
    return Graph(dataflow.record_dataflow(models.build_workload(spec, torch.device("cpu"), torch.float32)))


def test_each_block_matches_with_its_residual_add(tmp_path: Path) -> None:
    graph = record(tmp_path)
    matches = [m for m in find_matches(graph) if m.fusion == "bias_gelu"]
    steps = {m.step for m in matches}
    assert steps == {0, 1, 2}  # a factory model is one `forward` phase, run three times like prefill
    for step in steps:
        in_step = sorted((m for m in matches if m.step == step), key=lambda m: m.nodes[0])
        assert [m.anchor_module for m in in_step] == ["0", "1", "2"]
        for i, match in enumerate(in_step):
            names = sorted(graph.name[n] for n in match.nodes)
            # block 0's residual is the model input (no recorded producer): its add is a plain add, not a residual
            expected = ["aten::add", "aten::gelu"] + (["aten::add"] if i else [])
            assert names == sorted(expected) and match.escaping == () and not match.rejected
    assert len(matches) == 3 * len(steps)
    assert linear_act.find(graph) == []  # the GEMM's output is scaled first: no epilogue to fold the bias into


def test_micro_case_takes_the_rows_and_width(tmp_path: Path) -> None:
    graph = record(tmp_path)
    match = next(m for m in find_matches(graph) if m.fusion == "bias_gelu")
    case = bias_gelu.micro_case(graph, match)
    assert (case.kernel, case.label) == ("bias_gelu", "21x40")


def shaped(rows: list[tuple[int, str, tuple[int, ...]]], shapes: dict[int, tuple]) -> Graph:
    graph = synthetic(rows)
    graph.nodes["input_shapes"] = [shapes.get(n, ()) for n in graph.nodes["node"]]
    return graph


def test_a_gemm_bias_is_the_gemm_epilogue_and_a_glu_gate_is_not_a_bias_gelu() -> None:
    mm_bias = [(0, "aten::mm", (-1, -1)), (1, "aten::add", (0, -1)), (2, "aten::gelu", (1,)), (3, "aten::mm", (2, -1))]
    graph = shaped(mm_bias, {1: ((5, 8), (8,))})
    assert len(bias_gelu.find(graph)) == 1  # on its own the entry sees the bias + gelu …
    assert [m.fusion for m in find_matches(graph)] == ["linear_act"]  # … but linear_act, earlier, takes the GEMM
    glu = [(0, "aten::mul", (-1, -1)), (1, "aten::add", (0, -1)), (2, "aten::gelu", (1,)), (3, "aten::mm", (-1, -1)),
           (4, "aten::mul", (2, 3))]  # fmt: skip
    assert bias_gelu.find(shaped(glu, {1: ((5, 8), (8,))})) == []
    # a leaf operand that is not a bias (a full tensor, e.g. a second input) is no bias add
    assert bias_gelu.find(shaped(mm_bias, {1: ((5, 8), (5, 8))})) == []


def test_micro_case_reads_the_computed_operand_whichever_side_the_bias_is_on() -> None:
    rows = [(0, "aten::mul", (-1, -1)), (1, "aten::add", (-1, 0)), (2, "aten::gelu", (1,)), (3, "aten::mm", (2, -1))]
    graph = shaped(rows, {1: ((8,), (5, 8))})  # bias + y, as Megatron's bias_gelu(bias, y) writes it
    (match,) = bias_gelu.find(graph)
    assert bias_gelu.micro_case(graph, match).label == "5x8"
