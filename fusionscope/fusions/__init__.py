"""The fusion catalogue: one module per fusion, found through this registry.

Each module holds its pattern (`find(graph) -> [Match]` on the recorded dataflow), the `fusionscope.kernels`
function that serves it (`KERNEL`), the model families it can patch (`FAMILIES`), a one-line `TITLE`, and in its
docstring the bytes moved unfused vs fused. The CLI, `catalog`, the report and the tests read only `FUSIONS`.
Importable without triton: kernels are named here, never imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from types import ModuleType

from fusionscope.fusions.base import Graph, Match

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
    found = []
    for fusion in fusions():
        if among is not None and fusion.KEY not in among:
            continue
        for match in fusion.find(graph):
            if taken.isdisjoint(match.nodes):
                taken.update(match.nodes)
                found.append(match)
    return found


__all__ = ["Graph", "Match", "find_matches", "fusions"]
