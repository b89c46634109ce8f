"""silu_and_mul: SwiGLU's `act_fn(gate_proj(x)) * up_proj(x)` → one `fusionscope.kernels.silu_and_mul` launch.

Pattern: `aten::silu(g)` whose only consumer is `aten::mul(·, u)`. If the silu output had another reader it would
have to be written anyway (reported as escaping). Bytes per element of the intermediate I (size s): unfused 5·I·s
(silu reads g, writes a temp; mul reads temp and u, writes), fused 3·I·s.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.apply.source import (
    forward_replaced,
    kernel_dtypes,
    read_source,
    statement_key,
    unless_training,
)
from fusionscope.fusions.base import Binding, Graph, In, Match, input_index, row_micro_case

if TYPE_CHECKING:
    import torch

    from fusionscope.bench.cases import Case

KEY = "silu_and_mul"
KERNEL = "silu_and_mul"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2")
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


def glu_binding(graph: Graph, match: Match, activation: str, call: Callable[..., Any], *extra: Any) -> Binding | str:
    """`call(gate, up, *extra)` in place of `activation(gate) * up` (either operand order)."""
    act = next((n for n in match.nodes if graph.name.get(n) == activation), -1)
    mul = next((n for n in match.nodes if graph.name.get(n) == "aten::mul"), -1)
    at = input_index(graph, mul, act)
    shapes = graph.column("input_shapes", ()).get(mul) or ()
    if at < 0 or len(shapes) != 2 or shapes[0] != shapes[1]:
        return "the gate and up operands differ in shape (a broadcast multiply)"
    return Binding(call, (In(act, 0), In(mul, 1 - at), *extra), (mul,), match.nodes)


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `silu_and_mul(gate, up)` in place of `silu(gate) * up`."""
    return glu_binding(graph, match, "aten::silu", fused_silu_and_mul)


def fused_silu_and_mul(gate: Any, up: Any) -> Any:
    from fusionscope.kernels import silu_and_mul

    return silu_and_mul(gate, up)


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, intermediate) of the gate."""
    from fusionscope.bench.cases import glu_case

    return row_micro_case(graph, match, "aten::silu", partial(glu_case, KERNEL))


# ------------------------------------------------------------------------------------------------------------ patch

# The MLP forwards the patch rewrites, statement by statement ({x}: the forward's input parameter)
LLAMA_MLP = ("down_proj = self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))", "return down_proj")
PHI3_MLP = ("up_states = self.gate_up_proj({x})", "gate, up_states = up_states.chunk(2, dim=-1)",
            "up_states = up_states * self.activation_fn(gate)", "return self.down_proj(up_states)")  # fmt: skip

# the activation, as `fusionscope.fusions.linear_act.activation_kind` names it -> (fusion, F.gelu's approximate)
GLU_KERNELS: dict[str, tuple[str, str]] = {
    "silu": ("silu_and_mul", ""),
    "gelu_tanh": ("gelu_and_mul", "tanh"),
    "gelu": ("gelu_and_mul", "none"),
}


def glu_kernel_of(act: object) -> tuple[str, str] | None:
    """(fusion, approximate) for the MLP's activation module (looked up by its exact class in the activation table
    linear_act's epilogues use too); None when no bundled GLU kernel computes it."""
    from fusionscope.fusions.linear_act import activation_kind

    kind = activation_kind(act)
    return GLU_KERNELS.get(kind) if kind is not None else None


@cache
def mlp_layout(cls: type) -> tuple[str, str] | str:
    """("llama" | "phi3", activation attribute) when the MLP class's forward is one the patch reproduces: Llama's
    `down_proj(act_fn(gate_proj(x)) * up_proj(x))` or Phi-3's `gate_up_proj` → chunk → `up * act(gate)` →
    `down_proj`; else the reason."""
    source = read_source(cls.forward)
    if source is None:
        return f"the source of {cls.__name__}.forward cannot be read"
    if len(source.params) != 2 or source.varargs or source.kwonly or source.varkw or source.decorators:
        return f"{cls.__name__}.forward takes ({', '.join(source.params)}), not one input"
    statements = tuple(source.key(i) for i in range(len(source.statements)))
    for layout, template, act in (("llama", LLAMA_MLP, "act_fn"), ("phi3", PHI3_MLP, "activation_fn")):
        if statements == tuple(statement_key(s.format(x=source.params[1])) for s in template):
            return layout, act
    return f"{cls.__name__}.forward is neither Llama's gate/up/down MLP nor Phi-3's gate_up MLP"


def glu_forward(layout: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The MLP forward with `act(gate) * up` as one `kernel(gate, up)` launch (kernel: silu_and_mul or gelu_and_mul
    with its `approximate` bound). The projections are called as modules, so the gate_up fusion's swap of them runs.
    x: (..., hidden) -> (..., hidden). In training mode, the class's forward."""
    if layout == "phi3":

        def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(kernel(self.gate_up_proj(x)))  # (..., 2·I), gate half first: up=None

    else:

        def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(kernel(self.gate_proj(x), self.up_proj(x)))

    return unless_training(forward)


def glu_support(patcher: Patcher, path: str, fusion: str) -> tuple[str, str] | str:
    """(layout, approximate) when the MLP at `path` can take `fusion`'s kernel; else the reason."""
    from torch import nn

    mlp = patcher.module(path)
    if mlp is None:
        return "the model has no module at this path"
    replaced = forward_replaced(mlp, patcher)
    if replaced:
        return replaced
    layout = mlp_layout(type(mlp))
    if isinstance(layout, str):
        return layout
    layout, act_name = layout
    act = getattr(mlp, act_name, None)
    if isinstance(act, nn.Module) and forward_replaced(act):
        return f"its activation: {forward_replaced(act)}"
    kind = glu_kernel_of(act)
    if kind is None:
        return f"its activation {type(act).__name__} has no fused GLU kernel (silu, gelu tanh or exact only)"
    if kind[0] != fusion:
        return f"its activation {type(act).__name__} is {kind[0]}'s, not {fusion}'s"
    first = mlp.gate_up_proj if layout == "phi3" else mlp.gate_proj
    dtype = getattr(getattr(first, "weight", getattr(first, "scales", None)), "dtype", None)  # a W4 Linear: scales
    if dtype not in kernel_dtypes():
        return f"the {fusion} kernel takes fp32, fp16 or bf16 activations; the gate projection is {dtype}"
    return layout, kind[1]


def patch_glu(patcher: Patcher, paths: list[str], fusion: str) -> dict[str, Support]:
    """Rewrite each MLP at `paths` (the finder's `model.layers.i.mlp`) to call `fusion`'s kernel; one Support each."""
    try:
        from fusionscope import kernels

        kernel = getattr(kernels, fusion)
    except ImportError as error:
        return {path: Support.no(f"the {fusion} kernel does not load here: {error}") for path in paths}
    results = {}
    for path in paths:
        found = glu_support(patcher, path, fusion)
        if isinstance(found, str):
            results[path] = Support.no(found)
            continue
        layout, approximate = found
        bound = partial(kernel, approximate=approximate) if fusion == "gelu_and_mul" else kernel
        patcher.set_forward(patcher.module(path), glu_forward(layout, bound), owner=fusion)
        results[path] = Support.yes()
    return results


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """SwiGLU MLPs (SiLU activation) → `down_proj(silu_and_mul(gate_proj(x), up_proj(x)))`, Phi-3's fused
    gate_up_proj → `down_proj(silu_and_mul(gate_up_proj(x)))`; any other activation is refused with its name."""
    return patch_glu(patcher, paths, KEY)
