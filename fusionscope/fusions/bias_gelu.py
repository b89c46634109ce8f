"""bias_gelu: a bias add, the GELU that reads it and a residual add after it → one `fusionscope.kernels.bias_gelu`
launch (Megatron's fused bias-GELU; BERT/ViT-style blocks whose bias is added outside the GEMM).

Pattern, on the dataflow: `aten::add(t, b)` with `b` a 1-D tensor of t's last size that no recorded op made (a
parameter), then a GELU that is the add's only reader — one `aten::gelu` (either `approximate`) or a decomposed
tanh/erf chain as `linear_act` recognises it — and, when the GELU output's only reader is a tensor + tensor
`aten::add`, that residual add. Where a GEMM produces `t` and nothing else reads it, `linear_act` (earlier in the
registry) takes the GEMM, bias and activation together and this entry does not see them; a GLU gate is left to
`gelu_and_mul`. Bytes per row of N (size s): unfused 4·N·s (add, gelu: each reads and writes), 7·N·s with the
residual add; fused 2·N·s, 3·N·s with the residual (counted in `kernels/bias_gelu.py`).

No patch: the three ops run inline in one module's own forward (the match's anchor; e.g. `x + gelu(h + bias)`),
with no submodule boundary before or after them that an instance patch could take over. Putting the kernel there
means rewriting that forward line for line, which only its author's code knows; where a GEMM produces the biased
tensor through an `nn.Linear`/`Conv1D`, `linear_act` takes it instead. `patch` says so for each path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusionscope.apply.patcher import Support
from fusionscope.dataflow_nodes import LEAF
from fusionscope.fusions.base import Graph, Match, gating_muls, rows_and_width
from fusionscope.fusions.linear_act import activation_nodes

if TYPE_CHECKING:
    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "bias_gelu"
KERNEL = "bias_gelu"
FAMILIES = ("bert", "vit")
TITLE = "bias add + GELU (+ residual add) → one kernel"


def _bias_add(graph: Graph, node: int) -> bool:
    """`add(t, b)`: one computed operand, and a 1-D leaf operand as wide as the other's last dimension."""
    inputs = graph.inputs.get(node, ())
    shapes = graph.column("input_shapes", ()).get(node) or ()
    if graph.name.get(node) != "aten::add" or len(inputs) != 2 or sorted(i == LEAF for i in inputs) != [False, True]:
        return False
    leaf, other = (shapes[inputs.index(LEAF)], shapes[1 - inputs.index(LEAF)]) if len(shapes) == 2 else ((), ())
    return len(leaf) == 1 and len(other) >= 1 and leaf[0] == other[-1]


def find(graph: Graph) -> list[Match]:
    matches = []
    for add in (n for n, name in graph.name.items() if name == "aten::add"):
        if not _bias_add(graph, add) or (found := activation_nodes(graph, add)) is None:
            continue
        act, out = found
        if not any(graph.name.get(n) in ("aten::gelu", "aten::tanh", "aten::erf") for n in act) or gating_muls(
            graph, out
        ):
            continue
        group = {add, *act}
        residual = graph.only_consumer(out)
        if graph.name.get(residual) == "aten::add" and len(graph.producers(residual)) == 2:
            group.add(residual)
            out = residual
        phase, step = graph.where(add)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[add],
                             escaping=graph.escaping(group, {out})))  # fmt: skip
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, N) of the biased activation — the bias add's computed operand,
    whichever side of the add it is on (tanh GELU, no residual)."""
    from fusionscope.bench.cases import bias_gelu_case

    add = next((n for n in match.nodes if _bias_add(graph, n)), None)
    if add is None:
        return None
    computed = 0 if graph.inputs[add][0] != LEAF else 1
    shape = rows_and_width(tuple(graph.column("input_shapes")[add][computed]))
    return bias_gelu_case(*shape) if shape else None


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Support.no for every path, naming the module whose own forward holds the ops (see the module docstring)."""
    results = {}
    for path in paths:
        module = patcher.module(path)
        where = f"{type(module).__name__}.forward" if module is not None else "a forward the model has no module for"
        results[path] = Support.no(
            f"the bias add, GELU and residual add run inline in {where}: no submodule boundary to patch at; "
            "fusing them means rewriting that forward"
        )
    return results
