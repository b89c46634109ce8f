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
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.apply.source import forward_replaced, unless_training
from fusionscope.dataflow_nodes import LEAF
from fusionscope.fusions.base import Graph, Match

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.bench.cases import Case

KEY = "qkv"
KERNEL = "fuse_linears"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "starcoder2")
TITLE = "q/k/v projections on one input → one GEMM"

# attribute paths (fusionscope's module ranges), or the Python tracer's class instances (a trace captured elsewhere
# with `with_stack=True`: `…LlamaAttention_0.Linear_1`)
PROJECTION = re.compile(r"^(?P<parent>.+\.self_attn|.+\.\w*Attention\w*_\d+)\.(?:[^.]+_proj|\w*Linear\w*_\d+)$")
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


# ------------------------------------------------------------------------------------------------------------ patch


class FusedProjections:
    """One GEMM for a group of Linears that read one input, served to each Linear's own forward call.

    The first projection called on an input computes every projection at once (one GEMM over the weights that
    `fuse_linears` concatenated, the outputs views of its result) and keeps the others' outputs, each with the input
    tensor it was computed from and that tensor's version counter (`_version`); a projection called with that same
    tensor object, unmodified, returns its kept view once, any other call computes the group again and replaces
    everything kept. So the model's forward, which calls each projection on the same `hidden_states`, runs one GEMM
    per group instead of n, in whichever order it calls them, and a call on any other input is still exact.

    The projection that computes the group never keeps its own output, so while a model calls its projections in one
    order (Hugging Face's attention: q_proj, k_proj, v_proj, back to back on one `hidden_states`), every forward's
    first call recomputes the group and drops whatever an earlier forward left. In training mode each projection runs
    nn.Linear's forward on its own weight (`unless_training`), so gradients reach the original Parameters."""

    def __init__(self, fused: nn.Linear, sizes: list[int], linear: Callable[..., torch.Tensor] | None = None) -> None:
        import torch

        self.fused = fused  # holds the fused weight (ΣN, K) and bias (ΣN,) the originals are views of
        self.sizes = sizes
        self.pending: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # index -> (input, version, output)
        # functions bound once: `output` runs at every decode step, where an import would cost host time. The GEMM is
        # `linear` (the patch gives `fusionscope.kernels.gemv`: one row streams as a GEMV, more rows and outputs wider
        # than its WIDEST go to F.linear), else F.linear.
        self.linear = linear or torch.nn.functional.linear
        self.compiling = torch.compiler.is_compiling

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index` of x: (..., K) -> (..., N_index), a view of the group's (..., ΣN) output."""
        kept = self.pending.pop(index, None)
        if kept is not None and kept[0] is x and kept[1] == _version(x, self.compiling):
            return kept[2]
        # the function directly, not the FusedLinear module: a module call costs host time at decode, where this runs
        outputs = self.linear(x, self.fused.weight, self.fused.bias).split(self.sizes, dim=-1)
        version = _version(x, self.compiling)
        self.pending = {i: (x, version, out) for i, out in enumerate(outputs) if i != index}
        return outputs[index]


def _version(x: torch.Tensor, compiling: Callable[[], bool]) -> int:
    """x's version counter, which every in-place write bumps; -1 for an inference tensor (made under
    `torch.inference_mode`, how fusionscope runs models), which has none. For those only identity is checked: inside
    inference mode an inference tensor can be written in place, and a write to the input between the call that
    computed the group and a later projection's call on the same tensor is not seen — that projection returns the
    output of the input as it was. Hugging Face's attention forwards write nothing there (the projections are called
    back to back), and a write before the next forward's first projection call is harmless: that call recomputes
    the group (`FusedProjections`). Code that calls the fused projections itself, with in-place writes between
    them, under inference mode, gets stale outputs."""
    if compiling():  # `torch.compiler.is_compiling`: traced once per graph: identity is what a captured graph can check
        return -1
    return -1 if x.is_inference() else x._version


def projection_forward(group: FusedProjections, index: int) -> Callable[..., torch.Tensor]:
    """The forward of the group's `index`-th Linear: its slice of the group's one GEMM."""

    def forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
        return group.output(index, input)

    return unless_training(forward)


def unfuse(linears: list[nn.Linear]) -> None:
    """Give each Linear's weight and bias their own storage again, with the same values (a copy of their rows of the
    fused tensor), then let the fused tensor go. The storage is re-allocated rather than the original kept through the
    patch, because keeping the original alive beside the fused tensor would cost a full copy of these weights."""
    import torch

    with torch.no_grad():
        for linear in linears:
            linear.weight.data = linear.weight.data.clone()
            if linear.bias is not None:
                linear.bias.data = linear.bias.data.clone()


def _refusal(patcher: Patcher, linears: list[nn.Module | None], names: tuple[str, ...]) -> str:
    """Why these projections cannot share one GEMM ('' when they can)."""
    from torch import nn

    for name, linear in zip(names, linears, strict=True):
        if linear is None:
            return f"it has no {name}"
        if type(linear).forward is not nn.Linear.forward:
            return f"its {name} is a {type(linear).__name__}, not a plain nn.Linear"
        replaced = forward_replaced(linear, patcher)
        if replaced:
            return f"its {name}: {replaced}"
        if linear.weight.is_meta:
            return f"its {name} has no weights yet (meta device)"
    if len({id(linear.weight) for linear in linears}) != len(linears):
        return "two of its projections share one weight"
    return ""


def patch_linears(patcher: Patcher, paths: list[str], key: str, names: tuple[str, ...]) -> dict[str, Support]:
    """Fuse the Linears `names` under each module at `paths` into one GEMM (see `FusedProjections`).

    Memory: `fuse_linears` concatenates the weights (and biases) and re-points each original Parameter (`.data`) at its
    rows of the fused tensor, so the old storages are freed and the model holds one copy of these weights, as before
    (peak: one extra copy of one group while it is built); on restore `unfuse` gives every Parameter its own storage
    back. Where a weight is a view of a larger buffer (weights mapped from a file), that buffer stays alive and the
    patch costs one copy of the group's weights."""
    try:
        from fusionscope.kernels import fuse_linears, gemv
    except ImportError as error:
        return {path: Support.no(f"fusionscope.kernels does not load here: {error}") for path in paths}
    results = {}
    for path in paths:
        parent = patcher.module(path)
        if parent is None:
            results[path] = Support.no("the model has no module at this path")
            continue
        linears = [getattr(parent, name, None) for name in names]
        reason = _refusal(patcher, linears, names)
        if not reason:
            try:
                fused = fuse_linears(linears)
            except ValueError as error:  # in_features, dtype, device or bias differ
                reason = str(error)
        if reason:
            results[path] = Support.no(reason)
            continue
        patcher.on_restore(partial(unfuse, linears))
        group = FusedProjections(fused, [linear.out_features for linear in linears], gemv)
        for index, linear in enumerate(linears):
            patcher.set_forward(linear, projection_forward(group, index), owner=key)
        patcher.state.setdefault(key, {})[path] = group
        results[path] = Support.yes()
    return results


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """q_proj, k_proj and v_proj of each attention module at `paths` → one GEMM (biases too: Qwen2). Models already
    fused (Phi-3's qkv_proj) have no match and are never offered."""
    return patch_linears(patcher, paths, KEY, ("q_proj", "k_proj", "v_proj"))
