"""qkv: the attention block's q_proj, k_proj and v_proj GEMMs on one input → one `fusionscope.kernels.fuse_linears`
launch over the concatenated weights.

Pattern, on the dataflow: 2–3 `aten::mm` (or `aten::addmm`, with bias: Qwen2) nodes in the projections of one
attention module (`*.self_attn.*_proj`) whose activation operand reaches the same producer through views (the input
norm's output: `dataflow.through_views`), with no dependency between them. Each projection's `view` of the
activation, `t` of its weight and `_unsafe_view`/`view` of its output join the group (an `mm` + `add` bias is
taken too); the projections' outputs are the group's outputs. Models already fused (Phi-3's one `qkv_proj`) have a
single GEMM there: no match. Per step: one match per layer, L.

Bytes, for n projections of an M×K activation into N_1…N_n outputs (element size s): unfused reads the activation n
times, n·M·K·s + Σ(N_i·K + M·N_i)·s, in n launches; fused reads it once, M·K·s + Σ(N_i·K + M·N_i)·s, in one
launch (the weights are read either way). Saved: (n − 1)·M·K·s and n − 1 launches — worth most at small M (decode,
small batches: launch- and activation-read bound); at large M the GEMMs are compute bound and gain little.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING

from fusionscope.dataflow import LEAF
from fusionscope.fusions.base import Graph, Match

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "qkv"
KERNEL = "fuse_linears"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
TITLE = "q/k/v projections on one input → one GEMM"

PROJECTION = re.compile(r"^(?P<parent>.+\.self_attn)\.[^.]+_proj$")
GEMMS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}  # operand index of the activation and of the weight


def _view_chain_up(graph: Graph, is_view: dict[int, bool], node: int, module: str) -> list[int]:
    """The view nodes of `module` from `node` up towards the data's producer."""
    chain = []
    while node >= 0 and is_view.get(node, False) and graph.module.get(node) == module:
        chain.append(node)
        node = graph.producer(node)
    return chain


def _output_chain(graph: Graph, is_view: dict[int, bool], gemm: int, module: str) -> list[int]:
    """The GEMM's output views in its module, and a bias `add` of a parameter (`mm` + `add`), in order."""
    chain = [gemm]
    for _ in range(4):
        after = graph.only_consumer(chain[-1])
        if graph.module.get(after) != module:
            break
        bias_add = graph.name.get(after) == "aten::add" and LEAF in graph.inputs.get(after, ())
        if not (is_view.get(after, False) or bias_add):
            break
        chain.append(after)
    return chain


def _depends_on(graph: Graph, node: int, others: set[int]) -> bool:
    """Whether any of `others` is an ancestor of `node` (node ids follow dispatch order: producers come first)."""
    low = min(others, default=node)
    stack, seen = [node], {node}
    while stack:
        for p in graph.producers(stack.pop()):
            if p in others:
                return True
            if p >= low and p not in seen:
                seen.add(p)
                stack.append(p)
    return False


def find_linears(graph: Graph, key: str, projection: re.Pattern, most: int) -> list[Match]:
    """Groups of GEMMs in the projections (`projection`, naming their `parent`) of one module that read the same
    producer's data through views and do not depend on one another; more than `most` of them are rejected."""
    is_view = graph.column("is_view", False)
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for gemm, name in graph.name.items():
        if name not in GEMMS or not (hit := projection.match(graph.module.get(gemm, ""))):
            continue
        source = graph.through_views(graph.producer(gemm, GEMMS[name][0]))
        if source != LEAF:
            groups[(source, hit["parent"])].append(gemm)
    matches = []
    for (_source, parent), gemms in groups.items():
        independent = [g for g in gemms if not _depends_on(graph, g, set(gemms) - {g})]
        if len(independent) < 2:
            continue
        group: set[int] = set()
        outputs: set[int] = set()
        rejected = [] if len(independent) <= most else [f"{len(independent)} projections share the input"]
        shapes = set()
        for gemm in independent:
            module = graph.module[gemm]
            act, weight = (graph.producer(gemm, i) for i in GEMMS[graph.name[gemm]])
            if "input_shapes" in graph.nodes:
                shapes.add(tuple(graph.column("input_shapes")[gemm][GEMMS[graph.name[gemm]][0]]))
            weight_views = _view_chain_up(graph, is_view, weight, module)
            computed = graph.producer(weight_views[-1]) if weight_views else weight
            if computed != LEAF or (graph.name[gemm] == "aten::addmm" and graph.producer(gemm, 0) != LEAF):
                rejected.append(f"{module}'s weight or bias is computed, not a parameter: nothing to concatenate")
            chain = _output_chain(graph, is_view, gemm, module)
            group.update(_view_chain_up(graph, is_view, act, module), weight_views, chain)
            outputs.add(chain[-1])
        if len(shapes) > 1:
            rejected.append("the projections read different views of the input")
        phase, step = graph.where(min(independent))
        matches.append(Match(key, phase, step, tuple(sorted(group)), parent, escaping=graph.escaping(group, outputs),
                             rejected="; ".join(rejected)))  # fmt: skip
    return matches


def horizontal_micro_case(graph: Graph, match: Match, key: str) -> Case | None:
    """n GEMMs vs one on this match's shapes: the activation (M, K) and each projection's output width N_i."""
    from fusionscope.bench.cases import horizontal_case

    shapes = graph.column("input_shapes")
    gemms = [n for n in match.nodes if graph.name.get(n) in GEMMS]
    operands = [(shapes[g][GEMMS[graph.name[g]][0]], shapes[g][GEMMS[graph.name[g]][1]]) for g in gemms]
    if not operands or any(len(x) != 2 or len(w) != 2 for x, w in operands):
        return None
    (rows, hidden), _ = operands[0]
    return horizontal_case(key, rows, hidden, tuple(w[1] for _x, w in operands))


def find(graph: Graph) -> list[Match]:
    return find_linears(graph, KEY, PROJECTION, most=3)


def micro_case(graph: Graph, match: Match) -> Case | None:
    return horizontal_micro_case(graph, match, KEY)
