"""gelu_and_mul: GeGLU's `gelu(gate_proj(x), approximate="tanh") * up_proj(x)` (Gemma's MLP) → one
`fusionscope.kernels.gelu_and_mul` launch.

Pattern: `aten::gelu(g)` (either `approximate`) whose reader is a tensor × tensor `aten::mul(·, u)` — the gating
multiply; a multiply by a parameter or a scalar is not a GLU and is left alone. If the GELU output had another reader
it would have to be written anyway (reported as escaping). One match per MLP: L per step for L layers. Bytes per
element of the intermediate I (size s): unfused 5·I·s (gelu reads g, writes a temp; mul reads temp and u, writes),
fused 3·I·s.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.fusions.base import Binding, Graph, Match, gating_muls, row_micro_case
from fusionscope.fusions.silu_and_mul import glu_binding, patch_glu

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "gelu_and_mul"
KERNEL = "gelu_and_mul"
FAMILIES = ("gemma", "gemma2", "gemma3")
TITLE = "GELU(gate) × up → one kernel"


def find(graph: Graph) -> list[Match]:
    matches = []
    for gelu in graph.named("aten::gelu"):
        muls = gating_muls(graph, gelu)
        if not muls:
            continue
        group = {gelu, muls[0]}
        phase, step = graph.where(gelu)
        rejected = "" if len(muls) == 1 else "the GELU output feeds several multiplies"
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[muls[0]],
                             escaping=graph.escaping(group, {muls[0]}), rejected=rejected))  # fmt: skip
    return matches


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `gelu_and_mul(gate, up, approximate)` in place of `gelu(gate) * up`."""
    gelu = next((n for n in match.nodes if graph.name.get(n) == "aten::gelu"), -1)
    approximate = "tanh" if "tanh" in str(graph.column("scalars", ()).get(gelu)) else "none"
    return glu_binding(graph, match, "aten::gelu", fused_gelu_and_mul, approximate)


def fused_gelu_and_mul(gate: Any, up: Any, approximate: str) -> Any:
    from fusionscope.kernels import gelu_and_mul

    return gelu_and_mul(gate, up, approximate)


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, intermediate) of the gate."""
    from fusionscope.bench.cases import glu_case

    return row_micro_case(graph, match, "aten::gelu", partial(glu_case, KERNEL))


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """GeGLU MLPs → `down_proj(gelu_and_mul(gate_proj(x), up_proj(x), approximate))`, approximate from the activation
    module's class (GELUTanh / NewGELU: "tanh", GELUActivation: "none", nn.GELU: its own); see `silu_and_mul.patch`."""
    return patch_glu(patcher, paths, KEY)
