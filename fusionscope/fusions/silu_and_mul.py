"""silu_and_mul: SwiGLU's `act_fn(gate_proj(x)) * up_proj(x)` → one `fusionscope.kernels.silu_and_mul` launch.

Pattern: `aten::silu(g)` whose only consumer is `aten::mul(·, u)`. If the silu output had another reader it would
have to be written anyway (reported as escaping). Bytes per element of the intermediate I (size s): unfused 5·I·s
(silu reads g, writes a temp; mul reads temp and u, writes), fused 3·I·s.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from fusionscope.fusions.base import Graph, Match, row_micro_case

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "silu_and_mul"
KERNEL = "silu_and_mul"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TITLE = "SiLU(gate) × up → one kernel"


def find(graph: Graph) -> list[Match]:
    matches = []
    for silu in graph.named("aten::silu"):
        consumers = set(graph.consumers.get(silu, ()))
        muls = [c for c in consumers if graph.name.get(c) == "aten::mul"]
        if not muls:
            continue
        group = {silu, muls[0]}
        phase, step = graph.where(silu)
        rejected = "" if len(muls) == 1 else "the SiLU output feeds several multiplies"
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[muls[0]],
                             escaping=graph.escaping(group, {muls[0]}), rejected=rejected))  # fmt: skip
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, intermediate) of the gate."""
    from fusionscope.bench.cases import glu_case

    return row_micro_case(graph, match, "aten::silu", partial(glu_case, KERNEL))
