"""gate_up: the MLP's gate_proj and up_proj GEMMs on one input → one `fusionscope.kernels.fuse_linears` launch over
the concatenated weights (Phi-3's `gate_up_proj`).

Pattern, on the dataflow: the `aten::mm` (or `aten::addmm`) nodes of `*.mlp.gate_proj` and `*.mlp.up_proj` whose
activation operand reaches the same producer through views (the post-attention norm's output:
`dataflow.through_views`), neither depending on the other — found as in `qkv`, with each projection's `view`, `t`
and output views in the group. Models already fused (one `gate_up_proj`) have a single GEMM there: no match. Per
step: one match per layer, L. The SiLU and multiply after it stay with `silu_and_mul`.

Bytes, for an M×K activation into two M×I outputs (element size s): unfused reads the activation twice,
2·M·K·s + 2·(I·K + M·I)·s, in 2 launches; fused reads it once, M·K·s + 2·(I·K + M·I)·s, in one launch (the weights
are read either way). Saved: M·K·s and one launch — worth most at small M (decode, small batches: launch- and
activation-read bound); at large M the GEMMs are compute bound and gain little.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.fusions.base import Graph, Match
from fusionscope.fusions.qkv import find_linears, horizontal_micro_case, patch_linears

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "gate_up"
KERNEL = "fuse_linears"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2")
TITLE = "gate and up projections on one input → one GEMM"

# attribute paths, or the Python tracer's class instances (`…LlamaMLP_0.Linear_4`: its Linears that read one input)
PROJECTION = re.compile(r"^(?P<parent>.+\.mlp|.+\.\w*MLP_\d+)\.(?:gate_proj|up_proj|\w*Linear\w*_\d+)$")


def find(graph: Graph) -> list[Match]:
    return find_linears(graph, KEY, PROJECTION, most=2)


def micro_case(graph: Graph, match: Match) -> Case | None:
    return horizontal_micro_case(graph, match, KEY)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """gate_proj and up_proj of each MLP at `paths` → one GEMM, served to the MLP's two calls (see
    `qkv.FusedProjections`); composes with silu_and_mul / gelu_and_mul, whose forwards call both projections."""
    return patch_linears(patcher, paths, KEY, ("gate_proj", "up_proj"))
