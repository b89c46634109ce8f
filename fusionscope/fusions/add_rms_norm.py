"""add_rms_norm: the decoder layer's residual add and the RMSNorm that follows → one
`fusionscope.kernels.add_rms_norm` launch that writes both the new residual and the normalised output.

Pattern: `aten::add(x, residual)` whose output feeds an RMSNorm chain (see `rms_norm`). The add's output is read again
by the next residual add, so it is an intended output of the fused kernel, not an escaping intermediate. Every norm
after a residual add matches — the post-attention norm, the next layer's input norm and the final norm: 2·L per step
for L layers. Bytes per row of N (bf16): unfused ≈ (7s + 28)·N, fused 4·s·N.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusionscope.fusions.base import Graph, Match, row_micro_case
from fusionscope.fusions.rms_norm import is_residual_add, norm_chain

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "add_rms_norm"
KERNEL = "add_rms_norm"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
TITLE = "residual add + RMSNorm → one kernel, two outputs"


def find(graph: Graph) -> list[Match]:
    matches = []
    for rsqrt in graph.named("aten::rsqrt"):
        chain = norm_chain(graph, rsqrt)
        if chain is None or not is_residual_add(graph, chain[1]):
            continue
        group, add, out = chain
        group = group | {add}
        phase, step = graph.where(rsqrt)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[rsqrt],
                             escaping=graph.escaping(group, {out, add})))  # fmt: skip
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, hidden) of the normalised activation."""
    from fusionscope.bench.cases import add_rms_norm_case

    return row_micro_case(graph, match, "aten::pow", add_rms_norm_case)
