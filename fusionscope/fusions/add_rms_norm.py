"""add_rms_norm: the decoder layer's residual add and the RMSNorm that follows → one
`fusionscope.kernels.add_rms_norm` launch that writes both the new residual and the normalised output.

Pattern: `aten::add(x, residual)` whose output feeds an RMSNorm chain (see `rms_norm`). The add's output is read again
by the next residual add, so it is an intended output of the fused kernel, not an escaping intermediate. Every norm
after a residual add matches — the post-attention norm, the next layer's input norm and the final norm: 2·L per step
for L layers. Bytes per row of N (bf16): unfused ≈ (7s + 28)·N, fused 4·s·N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusionscope.apply.layers import (
    LayerPlan,
    NormState,
    NotPatchable,
    final_norm_forward,
    layer_form,
    layer_forward,
    layer_shape,
    norm_spec,
)
from fusionscope.apply.patcher import Support
from fusionscope.apply.source import forward_replaced
from fusionscope.fusions.base import Binding, Graph, In, Match, row_micro_case
from fusionscope.fusions.rms_norm import fused_rms_norm, is_residual_add, norm_chain, norm_operands

if TYPE_CHECKING:
    from torch import nn

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "add_rms_norm"
KERNEL = "add_rms_norm"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2")
TITLE = "residual add + RMSNorm → one kernel, two outputs"


def find(graph: Graph) -> list[Match]:
    matches = []
    for rsqrt in graph.named("aten::rsqrt"):
        chain = norm_chain(graph, rsqrt)
        if chain is None or not is_residual_add(graph, chain[1]):
            continue
        group, add, out = chain
        group = group | {add}
        phase, step = graph.where(rsqrt)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[rsqrt],
                             escaping=graph.escaping(group, {out, add})))  # fmt: skip
    return matches


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `add_rms_norm(a, b, weight, ε, offset)` in place of the add and the chain: its two results replace the
    chain's output and the add's (the new residual, which the next residual add reads). A chain that multiplies by
    the weight before it casts back (`rms_norm.norm_operands`' upcast) gets the add, then `fused_rms_norm`'s one
    `weight_in_fp32` launch on the sum: the chain's one rounding, two launches and no cast kernels (the add kernel has
    no such mode)."""
    found = norm_operands(graph, match)
    if isinstance(found, str):
        return found
    rsqrt, (_x, weight, eps, offset, dtype, upcast), out = found
    add = norm_chain(graph, rsqrt)[1]
    shapes = graph.column("input_shapes", ()).get(add) or ()
    dtypes = graph.column("input_dtypes", ()).get(add) or ()
    if len(shapes) != 2 or shapes[0] != shapes[1] or len(set(dtypes)) != 1:
        return "the residual add broadcasts or mixes dtypes; the kernel adds two tensors of one shape and dtype"
    args = (In(add, 0), In(add, 1), weight, eps, offset, dtype, upcast)
    return Binding(fused_add_rms_norm, args, (out, add), match.nodes)


def fused_add_rms_norm(a: Any, b: Any, weight: Any, eps: float, offset: float, dtype: str,
                       upcast: bool = False) -> tuple[Any, Any]:  # fmt: skip
    import torch

    from fusionscope.kernels import add_rms_norm

    if upcast:
        residual = a + b
        return fused_rms_norm(residual, weight, eps, offset, dtype, upcast=True), residual
    out, residual = add_rms_norm(a, b, weight, eps, offset)
    return (out if str(out.dtype).removeprefix("torch.") == dtype else out.to(getattr(torch, dtype))), residual


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, hidden) of the normalised activation."""
    from fusionscope.bench.cases import add_rms_norm_case

    return row_micro_case(graph, match, "aten::pow", add_rms_norm_case)


@dataclass(frozen=True)
class _Site:
    """Where one matched norm sits. role "added": the norm after the in-layer residual add of `layer`; "input": the
    input norm of `layer`, fed by the last add of `giver`, the layer before it; "final": the norm after the stack,
    fed by its last layer `giver`. The layers sit in `stack` (its carry links giver and taker), which belongs to a
    module whose `config` says whether hidden states are recorded."""

    role: str
    norm: nn.Module
    layer: nn.Module | None = None
    giver: nn.Module | None = None
    stack: nn.Module | None = None
    config: Any = None


@dataclass
class _Roles:
    """What one layer's rewritten forward must do, gathered over every site it takes part in."""

    stack: nn.Module | None
    config: Any = None  # a giver's: where output_hidden_states is read
    take: bool = False
    fuse: bool = False
    give: bool = False


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Rewrite the decoder layers (and the final norm) around each matched norm so that the residual add before it and
    the norm run as one `fusionscope.kernels.add_rms_norm`, the layer's last add carried to the next layer's input norm
    or the final norm (`fusionscope.apply.layers` says how, and where that stops). One forward per layer instance,
    however many of its sites match; a site is patched only when every module it needs can be."""
    import fusionscope.kernels as kernels  # here, not at import: the catalogue stays importable without triton

    state: NormState = patcher.state.setdefault(KEY, NormState())
    sites: dict[str, _Site] = {}
    result: dict[str, Support] = {}
    for path in paths:
        try:
            sites[path] = _unowned(patcher, _locate(patcher, path))
            result[path] = Support.yes()
        except NotPatchable as why:
            result[path] = Support.no(str(why))
    _rewrite(patcher, sites, state, kernels)
    return result


def _locate(patcher: Patcher, path: str) -> _Site:
    """The site of the norm at `path`; raises NotPatchable when it is no residual add + norm the rewrite reaches."""
    norm = patcher.module(path)
    if norm is None:
        raise NotPatchable(f"no module at {path!r}")
    norm_spec(norm, patcher)
    parent_path, _, attr = path.rpartition(".")
    parent = patcher.module(parent_path)
    stack, index, owner = _stack_of(patcher, parent_path)
    try:
        shape = layer_shape(parent, patcher)
    except NotPatchable as why:
        if stack is not None:  # a layer of a stack, of a structure the rewrite does not know: say what is wrong
            raise
        final = _final_site(norm, parent)
        if final is None:
            raise NotPatchable(
                f"{attr} is neither a norm of a decoder layer nor the norm after a stack of decoder layers ({why})"
            ) from None
        return final
    if attr == shape.added_norm:
        return _Site("added", norm, layer=parent, stack=stack)
    if attr != "input_layernorm":
        raise NotPatchable(f"{attr} of a {shape.name}-shape layer follows no residual add")
    if stack is None or index == 0:
        raise NotPatchable("this input norm follows no decoder layer's residual add (it is the rms_norm fusion's site)")
    giver = stack[index - 1]
    layer_shape(giver, patcher)
    return _Site("input", norm, layer=parent, giver=giver, stack=stack, config=getattr(owner, "config", None))


def _stack_of(patcher: Patcher, layer_path: str) -> tuple[nn.Module | None, int, nn.Module | None]:
    """(the ModuleList holding the layer at `layer_path`, the layer's index in it, the list's owner); Nones and -1
    when the layer is in no list."""
    from torch import nn

    stack_path, _, index = layer_path.rpartition(".")
    stack = patcher.module(stack_path) if index.isdigit() else None
    if not isinstance(stack, nn.ModuleList):
        return None, -1, None
    return stack, int(index), patcher.module(stack_path.rpartition(".")[0])


def _final_site(norm: nn.Module, owner: nn.Module) -> _Site | None:
    """The "final" site of `norm` when its owner holds exactly one stack of known decoder layers and runs all of
    them (`config.num_hidden_layers`), so that its last layer's output is what the norm gets; else None."""
    from torch import nn

    stacks = []
    for child in owner.children():
        if isinstance(child, nn.ModuleList) and len(child):
            try:
                for layer in child:
                    layer_shape(layer)
            except NotPatchable:
                continue
            stacks.append(child)
    config = getattr(owner, "config", None)
    if len(stacks) != 1 or getattr(config, "num_hidden_layers", len(stacks[0])) != len(stacks[0]):
        return None
    return _Site("final", norm, giver=stacks[0][-1], stack=stacks[0], config=config)


def _unowned(patcher: Patcher, site: _Site) -> _Site:
    """The site, once nothing has replaced a forward it must rewrite or of a norm it fuses away."""
    for module in (site.norm, site.layer, site.giver):
        replaced = forward_replaced(module, patcher) if module is not None else ""
        if replaced:
            raise NotPatchable(replaced)
    return site


def _rewrite(patcher: Patcher, sites: dict[str, _Site], state: NormState, kernels: Any) -> None:
    """Bind one forward per layer that any site involves, and the final norm's forward; note the fused norms."""
    roles: dict[int, tuple[nn.Module, _Roles]] = {}

    def roles_of(layer: nn.Module, site: _Site) -> _Roles:
        return roles.setdefault(id(layer), (layer, _Roles(site.stack)))[1]

    for path, site in sites.items():
        state.fused[id(site.norm)] = path
        if site.role == "added":
            roles_of(site.layer, site).fuse = True
        else:
            giver = roles_of(site.giver, site)
            giver.give, giver.config = True, site.config
            if site.role == "input":
                roles_of(site.layer, site).take = True
            else:
                forward = final_norm_forward(state.carry(site.stack), norm_spec(site.norm), kernels)
                patcher.set_forward(site.norm, forward, KEY)
    for layer, r in roles.values():
        form = layer_form(layer)
        carry = state.carry(layer if r.stack is None else r.stack)
        plan = LayerPlan(
            form=form, take=r.take, fuse=r.fuse, give=r.give, carry=carry,
            input_spec=norm_spec(layer.input_layernorm), added_spec=norm_spec(getattr(layer, form.shape.added_norm)),
            config=r.config,
        )  # fmt: skip
        patcher.set_forward(layer, layer_forward(plan, kernels), KEY)
