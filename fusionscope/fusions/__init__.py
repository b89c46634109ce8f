"""The fusion catalogue: one module per fusion, found through this registry.

Each module holds its pattern (`find(graph) -> [Match]` on the recorded dataflow), the `fusionscope.kernels`
function that serves it (`KERNEL`), the model families it can patch (`FAMILIES`), a one-line `TITLE`, and in its
docstring the bytes moved unfused vs fused. The CLI, `catalog`, the report and the tests read only `FUSIONS`.
Importable without triton: kernels are named here, never imported.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Collection
from types import ModuleType

from fusionscope.fusions.base import Binding, Graph, In, Match

# Order matters where two entries could claim the same node: dequant_gemm before the GEMM entries (on a quantised
# model they share the matmul), linear_act before the activation entries (it never takes a GLU gate), bias_gelu
# after it (a bias add that follows a GEMM belongs to the GEMM's epilogue), allreduce_add_rms_norm before
# add_rms_norm (under tensor parallelism the add + norm after an all-reduce belong to the all-reduce's epilogue),
# gemv after every entry that takes a GEMM (it serves the one-row Linears the others leave).
_MODULES = ("dequant_gemm", "linear_act", "bias_gelu", "allreduce_add_rms_norm", "add_rms_norm", "rms_norm",
            "silu_and_mul", "gelu_and_mul", "add_layer_norm", "rope", "flash_attention", "decode_attention", "qkv",
            "gate_up", "gemv", "sampling")  # fmt: skip


def fusions() -> list[ModuleType]:
    return [importlib.import_module(f"fusionscope.fusions.{name}") for name in _MODULES]


def fusion_modules() -> dict[str, ModuleType]:
    """{fusion name (`KEY`): its module}, in catalogue order."""
    return {f.KEY: f for f in fusions()}


def find_matches(graph: Graph, among: Collection[str] | None = None) -> list[Match]:
    """Every entry's matches (`among`: only those entries'); a node belongs to at most one match (entries earlier in
    the list win). A rewrite passes the fusions it applies: an entry it does not apply leaves its nodes to the
    others (inside torch.compile, where qkv's fused weight cannot exist, the GEMV takes q/k/v one by one)."""
    taken: set[int] = set()
    found: list[tuple[ModuleType, Match]] = []
    for fusion in fusions():
        if among is not None and fusion.KEY not in among:
            continue
        for match in fusion.find(graph):
            if taken.isdisjoint(match.nodes):
                taken.update(match.nodes)
                found.append((fusion, match))
    return replaced_with(graph, found, taken)


def replaced_with(graph: Graph, found: list[tuple[ModuleType, Match]], taken: set[int]) -> list[Match]:
    """The matches, each with what replacing every match by its kernel removes besides its own nodes, as the rewrite of
    a captured graph removes it (`fusionscope.apply.rewrite`): `Match.bound`, the nodes its binding takes beyond the
    match (claimed by the first match that takes them), and `Match.dropped`, the nodes that then have no reader left
    (`rewrite.drop_dead`), each given to the match that holds its first reader. `taken`: every match's nodes.

    Why: the estimate counts the time the kernels remove. On phi-3-mini's replayed decode step (H100, bf16) the fused
    step had 344 kernels where the matches alone left 637: the partial rotary's re-join and the static cache's writes
    that rope's binding takes, the mask `where` and padding of the attention, the mask built once a step for every
    layer. A match whose fusion has no binding, or whose binding refuses it, removes only its nodes and reads all its
    inputs; so does a rejected one, which is not replaced at all."""
    bindings = {}
    for k, (fusion, match) in enumerate(found):
        if not match.rejected and hasattr(fusion, "bind"):
            binding = fusion.bind(graph, match)
            if not isinstance(binding, str):
                bindings[k] = binding
    owner: dict[int, int] = {n: k for k, (_f, m) in enumerate(found) if not m.rejected for n in m.nodes}
    bound: dict[int, list[int]] = {}
    for k, binding in bindings.items():
        for n in binding.nodes:
            if n not in owner and n not in taken:
                owner[n] = k
                bound.setdefault(k, []).append(n)
    read = _read_by_kernels(graph, found, bindings)
    inplace = graph.column("inplace", False)
    dropped: dict[int, list[int]] = {}
    pending = sorted({p for n in owner for p in graph.producers(n)} - owner.keys())
    while pending:
        node = pending.pop()
        if node in owner or node in read or node in taken or inplace.get(node, False):
            continue
        readers = graph.consumers.get(node, ())
        if not readers or any(r not in owner for r in readers):
            continue
        owner[node] = owner[readers[0]]
        dropped.setdefault(owner[node], []).append(node)
        pending.extend(p for p in graph.producers(node) if p not in owner)
    return [
        dataclasses.replace(m, bound=tuple(sorted(bound[k])) if k in bound else (),
                            dropped=tuple(sorted(dropped[k])) if k in dropped else ())
        if k in bound or k in dropped else m
        for k, (_f, m) in enumerate(found)
    ]  # fmt: skip


def _read_by_kernels(graph: Graph, found: list[tuple[ModuleType, Match]], bindings: dict[int, Binding]) -> set[int]:
    """The nodes whose outputs the replacing kernels read: each binding's tensor arguments (a view looked through
    with the views above it); every input of a match without a binding."""
    is_view = graph.column("is_view", False)
    read: set[int] = set()
    for k, (_fusion, match) in enumerate(found):
        binding = bindings.get(k)
        if binding is None:
            read.update(p for n in match.nodes for p in graph.producers(n))
            continue
        for arg in binding.args:
            if isinstance(arg, In):
                node = graph.producer(arg.node, arg.index)
                read.add(node)
                while arg.through_views and node >= 0 and is_view.get(node, False):
                    node = graph.producer(node)
                    read.add(node)
    return read


__all__ = ["Graph", "Match", "find_matches", "fusions"]
