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
`Conv1D` (weight (K, N): the kernel is given its transposed view, no copy); the activation module is one
`activation_kind` names, by its exact class. The parent's forward must be, statement for statement, `x =
self.<child>(x)` for each child in order and `return x` (`fusionscope.apply.source`): a forward that scales, adds or
calls anything else is refused at the statement that differs. In training mode the class's forward runs.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Support
from fusionscope.apply.source import difference, forward_replaced, read_source, template, unless_training
from fusionscope.fusions.base import Binding, Graph, In, Match, gating_muls, leaf_input

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "linear_act"
KERNEL = "linear_act"
FAMILIES = ("gpt2", "bert", "gpt_neox", "starcoder2")
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


def activation_nodes(graph: Graph, x: int) -> tuple[set[int], int] | None:
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
        found = activation_nodes(graph, x)
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
    return linear_act_case(x[0], x[1], w[1], activation_of(graph, match))


def activation_of(graph: Graph, match: Match) -> str:
    """The matched activation as `linear_act` names it."""
    names = {graph.name.get(n) for n in match.nodes}
    scalars = graph.column("scalars", ())
    tanh_gelu = any("tanh" in str(scalars.get(n, ())) for n in match.nodes if graph.name.get(n) == "aten::gelu")
    return ("silu" if "aten::silu" in names else "relu" if "aten::relu" in names
            else "gelu_tanh" if "aten::tanh" in names or tanh_gelu else "gelu")  # fmt: skip


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `linear_act(x, weight, bias, activation)` in place of a GEMM on a weight parameter, its row views, bias add
    and activation: an `nn.Linear`'s `x @ Wᵀ` (the `t` is the call's own) or GPT-2's `Conv1D` `x @ W` (W handed over
    as its transpose). The result keeps x's leading dims: a group whose views regroup the GEMM's columns is refused."""
    gemm = next((n for n in match.nodes if graph.name.get(n) in GEMMS), -1)
    first = 1 if graph.name.get(gemm) == "aten::addmm" else 0
    weight_t = graph.producer(gemm, first + 1)
    if graph.name.get(weight_t) == "aten::t" and graph.producer(weight_t) < 0:
        weight, transposed = In(weight_t, 0), False
    elif weight_t < 0:  # Conv1D: (K, N) straight into the GEMM
        weight, transposed = In(gemm, first + 1), True
    else:
        return "the GEMM's weight is not a parameter (a Linear's transposed one, or a Conv1D's)"
    bias: Any = In(gemm, 0) if first else None
    adds = [n for n in match.nodes if graph.name.get(n) == "aten::add" and leaf_input(graph, n) >= 0]
    adds = [n for n in adds if len(graph.producers(n)) == 1]  # the bias: a parameter plus the GEMM's output
    if not first and adds:
        bias = In(adds[0], leaf_input(graph, adds[0]))
    scalars = graph.column("scalars", ()).get(gemm) or ()
    if any(t.startswith(("beta=", "alpha=")) and float(t.split("=")[1]) != 1.0 for t in scalars):
        return "the GEMM scales its terms (addmm's beta/alpha)"
    members = set(match.nodes)
    ends = [n for n in members if not set(graph.consumers.get(n, ())) & members]
    if len(ends) != 1:
        return "the group has more than one output"
    columns = (graph.column("output_shapes", ()).get(gemm) or ((),))[0]
    out_shape = (graph.column("output_shapes", ()).get(ends[0]) or ((),))[0]
    if not columns or not out_shape or out_shape[-1] != columns[-1]:
        return "views after the GEMM regroup its columns; the kernel's result keeps x's leading dims"
    x = In(gemm, first, through_views=True)
    args = (x, weight, bias, activation_of(graph, match), transposed)
    return Binding(fused_linear_act, args, (ends[0],), match.nodes)


def fused_linear_act(x: Any, weight: Any, bias: Any, activation: str, transposed: bool = False) -> Any:
    from fusionscope.kernels import linear_act

    return linear_act(x, weight.t() if transposed else weight, bias, activation)


@dataclass(frozen=True)
class Layout:
    """A parent module whose forward computes `after(act(gemm(x)))`, one call per statement (`statements`): the
    attribute names, which are its only children."""

    gemm: str
    act: str
    after: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.gemm, self.act, *self.after)

    def statements(self) -> tuple[ast.stmt, ...]:
        """The forward's body: `hidden_states = self.<name>(hidden_states)` for each name, then the return."""
        calls = [f"hidden_states = self.{name}(hidden_states)" for name in self.names]
        return template("\n".join([*calls, "return hidden_states"]))

    def describe(self) -> str:
        return " → ".join(self.names)


LAYOUTS = (
    Layout("c_fc", "act", ("c_proj", "dropout")),  # GPT2MLP (and its copies: ImageGPT, DecisionTransformer)
    Layout("dense", "intermediate_act_fn"),  # BertIntermediate and its copies
    Layout("dense", "transform_act_fn", ("LayerNorm",)),  # BertPredictionHeadTransform
)


def layout_of(parent: nn.Module) -> Layout | str:
    """The layout whose children the parent holds and whose statements its class's forward is, one for one; else the
    reason, naming the statement that differs."""
    cls = type(parent)
    children = sorted(n for n, _ in parent.named_children())
    held = [lay for lay in LAYOUTS if sorted(lay.names) == children]
    refused = f"{cls.__name__}.forward is not a layout the patch knows"
    if not held:
        return f"{refused} ({', '.join(lay.describe() for lay in LAYOUTS)}, and nothing else)"
    source = read_source(cls.forward)
    if source is None:
        return f"{refused}: its source cannot be read"
    if source.signature != (("self", "hidden_states"), None, (), None, ()):
        return f"{refused}: it takes ({', '.join(source.params)}), not (self, hidden_states)"
    reasons = []
    for lay in held:
        reason = difference(source, lay.statements(), f"{cls.__name__}.forward", lay.describe())
        if not reason:
            return lay
        reasons.append(reason)
    return f"{refused}: {'; '.join(reasons)}"


# Activation modules by exact class -> the function they compute, in the kernels' names (linear_act's epilogues,
# silu_and_mul / gelu_and_mul's GLUs). transformers.activations' classes are looked up by name in that module only (a
# class of the same name elsewhere may compute anything); PytorchGELUTanh is GELUTanh. NewGELU, FastGELU (√(2/π)
# rounded to 0.7978845608) and the `*_python` variants compute the same function in several rounded ops: the fused
# kernel rounds once, so their outputs agree within the dtype's tolerance, not bit for bit. nn.GELU is looked up by
# its `approximate`.
HF_ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu", "SiLUActivation": "silu",
}  # fmt: skip


def activation_kind(act: object) -> str | None:
    """The function an activation module computes ("gelu", "gelu_tanh", "relu", "silu"), by its exact class (a
    subclass may compute anything else); None for any other."""
    from torch import nn

    kind = type(act)
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if kind is nn.SiLU:
        return "silu"
    if kind is nn.ReLU:
        return "relu"
    if kind.__module__ == "transformers.activations":
        return HF_ACTIVATIONS.get(kind.__name__)
    return None


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
    replaced = forward_replaced(parent, patcher)
    if replaced:
        return Support.no(replaced)
    layout = layout_of(parent)
    if isinstance(layout, str):
        return Support.no(layout)
    if layout.gemm != name:
        return Support.no(f"{name} is not the GEMM of {type(parent).__name__} ({layout.describe()})")
    if not isinstance(gemm, nn.Linear | Conv1D) or type(gemm).forward not in (nn.Linear.forward, Conv1D.forward):
        return Support.no(f"{type(gemm).__name__} is neither nn.Linear nor Conv1D")
    act = getattr(parent, layout.act)
    replaced = forward_replaced(gemm, patcher) or (isinstance(act, nn.Module) and forward_replaced(act, patcher))
    if replaced:
        return Support.no(replaced)
    activation = activation_kind(act)
    if activation is None:
        return Support.no(f"the kernel has no epilogue for {type(act).__name__} (it has gelu, gelu_tanh, relu, silu)")
    patcher.set_forward(parent, _fused_forward(layout, activation, isinstance(gemm, Conv1D), kernel), owner=KEY)
    return Support.yes()


def _fused_forward(
    layout: Layout, activation: str, transposed: bool, kernel: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The parent's forward with GEMM, bias and activation in one kernel call, then its `after` modules. Conv1D keeps
    W as (K, N): `W.t()` is the (N, K) view the kernel takes (strides (1, N); it reads any strides). In training mode
    the class's own forward runs (`unless_training`: the kernel keeps no autograd history)."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        gemm = getattr(self, layout.gemm)
        weight = gemm.weight.t() if transposed else gemm.weight
        h = kernel(hidden_states, weight, gemm.bias, activation)
        for name in layout.after:
            h = getattr(self, name)(h)
        return h

    return unless_training(forward)
