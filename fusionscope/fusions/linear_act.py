"""linear_act: a GEMM, its bias and the activation that reads it → one `fusionscope.kernels.linear_act` launch, the
bias and activation applied in the GEMM's epilogue (GPT-2's `c_fc` + `gelu_new`, BERT-style MLPs).

Pattern, on the dataflow: `aten::addmm(b, x, W)` — or `aten::mm` followed by `aten::add(·, bias)` with the bias a
parameter — then, through views, an activation that is the GEMM output's only reader:
  - a single `aten::gelu` (either `approximate`), `aten::relu` or `aten::silu`;
  - or a decomposed GELU chain in one module: the elementwise ops that read only the GEMM output and each other,
    `aten::mul/add/pow` around one `aten::tanh` (`gelu_new` / NewGELUActivation: x·0.5·(1 + tanh(√(2/π)·(x +
    0.044715·x³))), 8 ops) or `aten::mul/add/div` around one `aten::erf`, reading x at least twice (x·Φ(x): a
    softcap `c·tanh(x/c)` reads it once and is not an activation) and ending in one node.
An activation whose output gates a tensor × tensor multiply (SwiGLU, GeGLU) is left to `silu_and_mul` /
`gelu_and_mul`. A GEMM output read outside the group is no match (it would have to be written anyway); an
intermediate of the chain read outside it is reported as escaping. GPT-2: one match per block, L per step.
Bytes per call, x (M, K), W (K, N), size s: the GEMM moves (M·K + K·N + N + M·N)·s; unfused the activation adds
2·M·N·s for one op, ≈ 18·M·N·s for the 8-op gelu_new chain (each op reads and writes M·N, three read two), and a
separate bias add 3·M·N·s; fused (M·K + K·N + N + M·N)·s, one launch.

Patching (`patch`): the GEMM module's parent gets a forward that calls the kernel for GEMM, bias and activation
and then runs the modules the parent applies after them. The parents known by their children (`LAYOUTS`): GPT-2's
MLP (`c_fc` → `act` → `c_proj` → `dropout`) and BERT's intermediate (`dense` → `intermediate_act_fn`) and LM-head
transform (`dense` → `transform_act_fn` → `LayerNorm`). A GEMM is an `nn.Linear` (weight (N, K)) or transformers'
`Conv1D` (weight (K, N): the kernel is given its transposed view, no copy); the activation module is named in
`ACTIVATIONS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusionscope.apply.patching import Support
from fusionscope.fusions.base import Graph, Match
from fusionscope.fusions.gelu_and_mul import gating_muls

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patching import Patcher
    from fusionscope.bench.cases import Case

KEY = "linear_act"
KERNEL = "linear_act"
FAMILIES = ("gpt2", "bert")
TITLE = "GEMM + bias + activation → one kernel (epilogue)"
GEMMS = ("aten::addmm", "aten::mm")
SINGLE = ("aten::gelu", "aten::relu", "aten::silu")
VIEWS = ("aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::unsqueeze", "aten::squeeze")
# decomposed GELUs: the one transcendental, and the ops allowed around it
CHAINS = {"aten::tanh": {"aten::mul", "aten::add", "aten::pow"}, "aten::erf": {"aten::mul", "aten::add", "aten::div"}}


def _is_view(graph: Graph, node: int) -> bool:
    if "is_view" in graph.nodes.columns:
        return bool(graph.column("is_view")[node])
    return graph.name.get(node) in VIEWS


def _chain(graph: Graph, x: int) -> set[int]:
    """The decomposed activation reading `x`: the elementwise ops in one module computed from `x` and each other."""
    readers = set(graph.consumers.get(x, ()))
    modules = {graph.module.get(c) for c in readers}
    if len(modules) != 1:
        return set()
    allowed = set().union(*CHAINS.values(), CHAINS)
    group: set[int] = set()
    grown = True
    while grown:
        grown = False
        for n in sorted(readers - group):
            if (
                graph.name.get(n) in allowed
                and graph.module.get(n) in modules
                and set(graph.producers(n)) <= group | {x}
            ):
                group.add(n)
                readers |= set(graph.consumers.get(n, ()))
                grown = True
    return group


def activation_of(graph: Graph, x: int) -> tuple[set[int], int] | None:
    """The activation reading `x` (its only reader: one op, or a decomposed GELU chain) and its output node, or
    None."""
    readers = set(graph.consumers.get(x, ()))
    if len(readers) == 1 and graph.name.get(next(iter(readers))) in SINGLE:
        (act,) = readers
        return {act}, act
    group = _chain(graph, x)
    names = [graph.name[n] for n in group]
    kinds = [t for t in CHAINS if names.count(t) == 1]
    if len(kinds) != 1 or not set(names) - {kinds[0]} <= CHAINS[kinds[0]] or len(readers) < 2 or not readers <= group:
        return None
    ends = [n for n in group if not set(graph.consumers.get(n, ())) & group]
    return (group, ends[0]) if len(ends) == 1 and graph.name[ends[0]] == "aten::mul" else None


def find(graph: Graph) -> list[Match]:
    matches = []
    for gemm in (n for n, name in graph.name.items() if name in GEMMS):
        group = {gemm}
        x = gemm  # the GEMM's output, followed through views
        while (after := graph.only_consumer(x)) >= 0 and _is_view(graph, after):
            group.add(after)
            x = after
        bias = graph.only_consumer(x)
        is_bias = graph.name.get(bias) == "aten::add" and sorted(graph.inputs.get(bias, ())) == [-1, x]
        if graph.name.get(gemm) == "aten::mm" and is_bias:  # + a parameter of its own: the bias
            group.add(bias)
            x = bias
        found = activation_of(graph, x)
        if found is None:
            continue
        act, out = found
        if gating_muls(graph, out):
            continue  # a GLU's gate: silu_and_mul / gelu_and_mul take it
        group |= act
        phase, step = graph.where(gemm)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[gemm],
                             escaping=graph.escaping(group, {out})))  # fmt: skip
    return matches


def micro_case(graph: Graph, match: Match) -> Case | None:
    """cuBLAS GEMM + separate bias and activation vs `linear_act` on this match's (M, K) × (K, N)."""
    from fusionscope.bench.cases import linear_act_case

    shapes = graph.column("input_shapes")
    gemm = next((n for n in match.nodes if graph.name.get(n) in GEMMS), None)
    operands = shapes.get(gemm, ()) if gemm is not None else ()
    x, w = operands[-2:] if len(operands) >= 2 else ((), ())
    if len(x) != 2 or len(w) != 2:
        return None
    names = {graph.name.get(n) for n in match.nodes}
    scalars = graph.column("scalars", ())
    tanh_gelu = any("tanh" in str(scalars.get(n, ())) for n in match.nodes if graph.name.get(n) == "aten::gelu")
    activation = ("silu" if "aten::silu" in names else "relu" if "aten::relu" in names
                  else "gelu_tanh" if "aten::tanh" in names or tanh_gelu else "gelu")  # fmt: skip
    return linear_act_case(x[0], x[1], w[1], activation)


@dataclass(frozen=True)
class Layout:
    """A parent module that computes `after(act(gemm(x)))`: the attribute names, which are its only children and
    the only names its forward reads (`forward_names`)."""

    gemm: str
    act: str
    after: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.gemm, self.act, *self.after)


def forward_names(module: object) -> tuple[str, ...]:
    """The attribute and global names its class's forward reads, in order of first use (decorators unwrapped), then
    any number it uses: a forward that does more than call its children (`torch.tanh`, `self.scale`, `* 2`) shows it
    here."""
    code = inspect.unwrap(type(module).forward).__code__
    return code.co_names + tuple(repr(c) for c in code.co_consts if c is not None and not isinstance(c, str))


LAYOUTS = (
    Layout("c_fc", "act", ("c_proj", "dropout")),  # GPT2MLP (and its copies: ImageGPT, DecisionTransformer)
    Layout("dense", "intermediate_act_fn"),  # BertIntermediate and its copies
    Layout("dense", "transform_act_fn", ("LayerNorm",)),  # BertPredictionHeadTransform
)
# Activation modules by class name -> the kernel's activation. FastGELU is the tanh GELU with √(2/π) rounded to
# 0.7978845608; GELUActivation is the erf GELU (both of its variants); nn.GELU is looked up by its `approximate`.
ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh", "GELUActivation": "gelu", "ReLU": "relu", "SiLU": "silu",
    "SiLUActivation": "silu",
}  # fmt: skip


def activation_name(module: object) -> str | None:
    """The kernel's name for an activation module, or None when the kernel has no such epilogue."""
    if type(module).__name__ == "GELU" and hasattr(module, "approximate"):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return ACTIVATIONS.get(type(module).__name__)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Put `linear_act` into the parent of each GEMM module at `paths`; one Support per path."""
    try:
        from fusionscope.kernels import linear_act as kernel
    except ImportError as error:
        return {path: Support.no(f"the linear_act kernel does not load here: {error}") for path in paths}
    return {path: _patch_one(patcher, path, kernel) for path in paths}


def _patch_one(patcher: Patcher, path: str, kernel: Callable[..., torch.Tensor]) -> Support:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    gemm = patcher.module(path)
    parent_path, _, name = path.rpartition(".")
    parent = patcher.module(parent_path) if gemm is not None and path else None
    if parent is None:
        return Support.no("the model has no GEMM module with a parent at this path")
    children, names = sorted(n for n, _ in parent.named_children()), forward_names(parent)
    layout = next((lay for lay in LAYOUTS if lay.names == names and sorted(names) == children), None)
    if layout is None or layout.gemm != name:
        return Support.no(
            f"{type(parent).__name__}.forward is not a layout the patch knows (c_fc → act → c_proj → dropout, "
            "dense → intermediate_act_fn, dense → transform_act_fn → LayerNorm, and nothing else)"
        )
    if not isinstance(gemm, nn.Linear | Conv1D):
        return Support.no(f"{type(gemm).__name__} is neither nn.Linear nor Conv1D")
    activation = activation_name(getattr(parent, layout.act))
    if activation is None:
        act = type(getattr(parent, layout.act)).__name__
        return Support.no(f"the kernel has no epilogue for {act} (it has gelu, gelu_tanh, relu, silu)")
    patcher.set_forward(parent, _fused_forward(layout, activation, isinstance(gemm, Conv1D), kernel), owner=KEY)
    return Support.yes()


def _fused_forward(
    layout: Layout, activation: str, transposed: bool, kernel: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The parent's forward with GEMM, bias and activation in one kernel call, then its `after` modules. Conv1D keeps
    W as (K, N): `W.t()` is the (N, K) view the kernel takes (strides (1, N); it reads any strides). In training mode
    the class's own forward runs (the kernel keeps no autograd history)."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training:
            return type(self).forward(self, hidden_states)
        gemm = getattr(self, layout.gemm)
        weight = gemm.weight.t() if transposed else gemm.weight
        h = kernel(hidden_states, weight, gemm.bias, activation)
        for name in layout.after:
            h = getattr(self, name)(h)
        return h

    return forward
