"""add_layer_norm: a residual add and the LayerNorm that reads it (GPT-2's blocks) → one
`fusionscope.kernels.add_layer_norm` launch that writes both the new residual and the normalised output.

Pattern: `aten::add(x, residual)` (tensor + tensor) feeding `aten::native_layer_norm` (what the recorder sees for
`F.layer_norm`; `aten::layer_norm` is accepted too). The add's output is read again by the next residual add, so it is
an intended output of the fused kernel, not an escaping intermediate. An `aten::clone` between the two whose only
input is the add, the add's only reader — GPT-2's embedding dropout in eval mode, a plain copy — is folded in: the
fused kernel's residual write replaces it. GPT-2 thus matches every LayerNorm: ln_1 and ln_2 of each block and ln_f,
2·L + 1 per step (ln_1 of block 0 reads wte + wpe, through the dropout copy). Bytes per row of N (size s): unfused
5·N·s (add reads 2, writes 1; layer_norm reads 1, writes 1; plus 8 bytes of statistics), 7·N·s with the copy;
fused 4·N·s (reads x and residual, writes the residual and the output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusionscope.fusions.base import Graph, Match, row_micro_case
from fusionscope.fusions.rms_norm import is_residual_add

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "add_layer_norm"
KERNEL = "add_layer_norm"
FAMILIES = ("gpt2",)
TITLE = "residual add + LayerNorm → one kernel, two outputs"
LAYER_NORMS = ("aten::native_layer_norm", "aten::layer_norm")


def find(graph: Graph) -> list[Match]:
    matches = []
    for norm in (n for n, name in graph.name.items() if name in LAYER_NORMS):
        residual = graph.producer(norm)  # the tensor the kernel writes as the new residual
        add = residual
        if graph.name.get(residual) == "aten::clone" and graph.only_consumer(graph.producer(residual)) == residual:
            add = graph.producer(residual)
        if not is_residual_add(graph, add):
            continue
        group = {add, residual, norm}
        phase, step = graph.where(norm)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[norm],
                             escaping=graph.escaping(group, {residual, norm})))  # fmt: skip
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, hidden) of the residual add."""
    from fusionscope.bench.cases import add_layer_norm_case

    return row_micro_case(graph, match, "aten::add", add_layer_norm_case)
