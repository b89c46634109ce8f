"""rms_norm: Hugging Face's unfused RMSNorm chain → one `fusionscope.kernels.rms_norm` launch.

Pattern (Llama, Mistral, Qwen2; Gemma's `(1 + w)` variant too), on the dataflow:
    x → [_to_copy fp32] → pow → mean → add ε → rsqrt → mul(·, x32) → [_to_copy dtype] → mul(weight)
The bracketed casts vanish in fp32 models (`.to(float32)` of an fp32 tensor dispatches nothing). Matched where the
norm's input is not a residual add (layer 0's input norm, Qwen3's q/k norms); after a residual add `add_rms_norm`
takes the group instead. Bytes per row of N: unfused ≈ (4s + 28)·N in bf16 (each op reads and writes a row, some
in fp32), fused 2·s·N.

OLMo-2 (`Olmo2RMSNorm`) ends the chain the other way round, `(weight * x̂).to(dtype)`: the weight product in fp32,
then one rounding, where Llama rounds x̂ and multiplies in the low dtype. `norm_operands` calls that `upcast`, and the
bind hands it to the kernel's `weight_in_fp32` mode with the chain's output dtype: x read in its own dtype, one launch.
Not `rms_norm(x.float()).to(dtype)`, which was the binding before the mode: right numbers, but a cast kernel on each
side of every norm (on an H200, OLMo-2-7B bf16 decode: 260 copy kernels a step, 458 µs of 5.28 ms).

A norm *after* its sublayer (OLMo-2's `h = residual + post_attention_layernorm(attn_out)` and post-feedforward norm)
hands its output to the residual add and nothing else. The match then takes that add too (`absorbed_add`), and the
bind runs the kernel's residual operand: `residual + norm(x)` in one launch, the norm rounded to its dtype first and
the sum rounded once, as the unfused add rounds. Why: the add was one elementwise launch per post-norm that nothing
else fused (on an H200, OLMo-2-7B bf16 decode: 64 `aten::add` a step, ~80 µs plus a launch gap each; torch.compile
fuses the same pair into one reduction). Only when it is safe: the norm's output has no other reader, the add is a
plain tensor + tensor (alpha 1) of one shape and dtype, no broadcast, the residual not the norm itself nor a second
norm whose only reader is the same add (then neither takes it: each keeps its match). An add whose
result feeds another norm stays the add + norm fusions' (add_rms_norm takes the add *before* a norm: the last
post-norm add of OLMo-2's stack, before the final norm, is theirs). Llama's pre-norms (read by the q/k/v projections)
and Qwen3/OLMo-2's q/k norms (read by the rotary embedding) have no such add and match as before. Bytes per row of N
with the add: unfused, the norm's chain (above) and 3·s·N for the add; fused 3·s·N (x and the residual read, the sum
written), one launch fewer than the norm and the add.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from fusionscope.apply.layers import NormSpec, NormState, NotPatchable, norm_spec
from fusionscope.apply.patcher import Support
from fusionscope.apply.source import forward_replaced, unless_training
from fusionscope.fusions.base import Binding, Graph, In, Match, leaf_input, row_micro_case, scalar_values

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "rms_norm"
KERNEL = "rms_norm"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2")
TITLE = "RMSNorm chain → one kernel"


def norm_chain(graph: Graph, rsqrt: int) -> tuple[set[int], int, int] | None:
    """The nodes of the RMSNorm around `rsqrt`, its input's producer (-1: a parameter or model input), and its
    output node; None when the neighbourhood is not an RMSNorm."""
    name = graph.name
    eps_add = graph.producer(rsqrt)
    mean = graph.producer(eps_add)
    power = graph.producer(mean)
    if (name.get(eps_add), name.get(mean), name.get(power)) != ("aten::add", "aten::mean", "aten::pow"):
        return None
    x32 = graph.producer(power)
    group = {eps_add, mean, power, rsqrt}
    source = x32
    if name.get(x32) == "aten::_to_copy":
        group.add(x32)
        source = graph.producer(x32)
    scale = graph.only_consumer(rsqrt)
    if name.get(scale) != "aten::mul" or x32 not in graph.inputs.get(scale, ()):
        return None
    group.add(scale)
    node = scale
    for _ in range(4):  # cast back, weight multiply, Gemma's (1 + w) and final cast
        after = graph.only_consumer(node)
        if name.get(after) not in ("aten::_to_copy", "aten::mul") or graph.module.get(after) != graph.module[rsqrt]:
            break
        group.add(after)
        group.update(_weight_prep(graph, after))
        node = after
    return group, source, node


def _weight_prep(graph: Graph, node: int) -> set[int]:
    """Gemma's `1.0 + weight.float()`: the producers of `node`, in its module, computed from parameters alone."""

    def params_only(p: int) -> set[int] | None:
        if graph.module.get(p) != graph.module.get(node) or graph.name.get(p) not in ("aten::add", "aten::_to_copy"):
            return None
        found = {p}
        for i in graph.producers(p):
            upstream = params_only(i)
            if upstream is None:
                return None
            found |= upstream
        return found

    prep: set[int] = set()
    for p in graph.producers(node):
        prep |= params_only(p) or set()
    return prep


def is_residual_add(graph: Graph, node: int) -> bool:
    """A tensor + tensor add of two activations, or of an activation and a model input — the residual connection
    of a decoder layer, or of the first block of a hand-written stack that adds the model's input; not a bias add,
    whose other operand is a parameter or buffer (`input_params`, see `fusionscope.dataflow`). A graph without that
    column takes every leaf for a parameter."""
    if graph.name.get(node) != "aten::add":
        return False
    produced, inputs = len(graph.producers(node)), graph.inputs.get(node, ())
    if produced == 2:
        return True
    if produced != 1 or len(inputs) != 2:
        return False
    leaf = 0 if inputs[0] < 0 else 1
    params = graph.column("input_params", ()).get(node) or ()
    return leaf < len(params) and not params[leaf]


NORM_OPS = ("aten::native_layer_norm", "aten::layer_norm", "aten::rms_norm", "aten::_fused_rms_norm")


def absorbed_add(graph: Graph, out: int, norm_inputs: set[int] = frozenset()) -> tuple[int, int] | None:
    """(the residual add that reads the norm's output `out`, the position of its other operand, the residual) when
    the kernel can take that add: it is the output's only reader, a residual add (`is_residual_add`: tensor + tensor,
    not a bias) with alpha 1, both operands and its result of one shape and dtype (no broadcast, no promotion), the
    other operand not the norm's output again; and its result is no norm's input (`norm_inputs`: the inputs of the
    graph's RMSNorm chains, which add_rms_norm takes with the add; a LayerNorm's, add_layer_norm's). None otherwise."""
    add = graph.only_consumer(out)
    if add < 0 or not is_residual_add(graph, add):
        return None
    inputs = graph.inputs.get(add, ())
    if len(inputs) != 2 or inputs.count(out) != 1:
        return None
    if any(s.startswith("alpha=") and float(s.removeprefix("alpha=")) != 1.0
           for s in graph.column("scalars", ()).get(add) or ()):  # fmt: skip
        return None
    shapes = graph.column("input_shapes", ()).get(add) or ()
    dtypes = graph.column("input_dtypes", ()).get(add) or ()
    out_shape = (graph.column("output_shapes", ()).get(add) or (None,))[0]
    out_dtype = (graph.column("output_dtypes", ()).get(add) or (None,))[0]
    if len(shapes) != 2 or len(dtypes) != 2 or not (tuple(shapes[0]) == tuple(shapes[1]) == tuple(out_shape or ())):
        return None
    if not dtypes[0] == dtypes[1] == out_dtype:
        return None
    if add in norm_inputs or any(graph.name.get(c) in NORM_OPS for c in graph.consumers.get(add, ())):
        return None
    return add, 1 - inputs.index(out)


def find(graph: Graph) -> list[Match]:
    chains = {rsqrt: norm_chain(graph, rsqrt) for rsqrt in graph.named("aten::rsqrt")}
    norm_inputs = {chain[1] for chain in chains.values() if chain is not None}
    kept = {r: c for r, c in chains.items() if c is not None and not is_residual_add(graph, c[1])}
    adds = {r: absorbed_add(graph, c[2], norm_inputs) for r, c in kept.items()}
    # the sum of two norms' outputs is each one's only reader: neither takes it (the other would lose its match)
    claims = Counter(a[0] for a in adds.values() if a is not None)
    matches = []
    for rsqrt, chain in kept.items():
        group, _source, out = chain
        absorbed = adds[rsqrt]
        if absorbed is not None and claims[absorbed[0]] == 1:  # the post-norm's residual add: the kernel writes the sum
            group, out = group | {absorbed[0]}, absorbed[0]
        phase, step = graph.where(rsqrt)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[rsqrt],
                             escaping=graph.escaping(group, {out})))  # fmt: skip
    return matches


def norm_operands(graph: Graph, match: Match) -> tuple[int, list, int] | str:
    """(rsqrt node, [x, weight, ε, offset, output dtype, upcast] as a bind passes them, output node) of a matched
    RMSNorm chain, or why it cannot be bound: the weight is the parameter operand of a multiply after the
    normalisation, or, through Gemma's `1 + weight.float()`, offset 1. `upcast`: the chain multiplies by the weight
    before it casts back (OLMo-2's `(weight * x̂).to(dtype)`, the product in fp32, one rounding), where Llama's
    `weight * x̂.to(dtype)` rounds x̂ first; the bind then runs the kernel's `weight_in_fp32` mode, x as the chain
    reads it before its fp32 cast, the result rounded once to the output dtype."""
    rsqrt = next((n for n in match.nodes if graph.name.get(n) == "aten::rsqrt"), -1)
    chain = norm_chain(graph, rsqrt) if rsqrt >= 0 else None
    if chain is None:
        return "the group is no longer an RMSNorm chain"
    group, _source, out = chain
    power = graph.producer(graph.producer(graph.producer(rsqrt)))
    x32 = graph.producer(power)
    x = In(x32, 0) if graph.name.get(x32) == "aten::_to_copy" else In(power, 0)
    eps = scalar_values(graph, graph.producer(rsqrt))
    if len(eps) != 1:
        return "ε is not a constant of the norm's add"
    weight, offset = None, 0.0
    scale = graph.only_consumer(rsqrt)  # x32 · rsqrt: its leaf, if any, is x itself, never the weight
    params = graph.column("input_params", ())
    for node in sorted(group - {scale}):
        leaf = leaf_input(graph, node)
        is_param = leaf >= 0 and (leaf >= len(params.get(node) or ()) or params[node][leaf])
        if graph.name.get(node) == "aten::mul" and is_param:
            weight = In(node, leaf)
        elif graph.name.get(node) == "aten::add" and node != graph.producer(rsqrt):  # Gemma's 1 + w
            constant = scalar_values(graph, node)
            cast = graph.producer(node)
            if constant and graph.name.get(cast) == "aten::_to_copy" and leaf_input(graph, cast) == 0:
                weight, offset = In(cast, 0), constant[0]
            elif constant and (leaf := leaf_input(graph, node)) >= 0:
                weight, offset = In(node, leaf), constant[0]
    if weight is None:
        return "the norm has no weight the kernel can take"
    dtype = (graph.column("output_dtypes", ()).get(out) or ("",))[0]
    after_scale = graph.only_consumer(scale)
    upcast = offset == 0.0 and graph.name.get(after_scale) == "aten::mul" and graph.name.get(out) == "aten::_to_copy"
    return rsqrt, [x, weight, eps[0], offset, dtype, upcast], out


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `rms_norm(x, weight, ε, offset)` in place of the chain, cast to the chain's output dtype. A match that took
    the post-norm's residual add (`absorbed_add`) binds the add too, the residual as the kernel's operand, its result
    in place of the add's; its fallback is the chain alone (the add stays), for a captured graph that refuses the wider
    group."""
    found = norm_operands(graph, match)
    if isinstance(found, str):
        return found
    _rsqrt, args, out = found
    absorbed = absorbed_add(graph, out)
    if absorbed is None or absorbed[0] not in match.nodes:
        return Binding(fused_rms_norm, tuple(args), (out,), match.nodes)
    add, residual = absorbed
    plain = Binding(fused_rms_norm, tuple(args), (out,), tuple(n for n in match.nodes if n != add))
    return Binding(fused_rms_norm, (*args, In(add, residual)), (add,), match.nodes, fallback=plain)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, dtype: str,
                   upcast: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The chain's result in `dtype` (its output dtype's name; "" when the graph did not record it). `upcast` (see
    `norm_operands`): one `weight_in_fp32` launch that reads x as it is and rounds once to `dtype`, no cast kernels.
    `residual`: `residual + norm` in the same launch (the residual has the chain's output dtype: `absorbed_add`);
    should the kernel's own result dtype not be that (a cast the chain ends in), the norm is cast and then added, as
    the model does: exact, two launches."""
    import torch

    from fusionscope.kernels import rms_norm
    from fusionscope.kernels.rms_norm import output_dtype

    if upcast:
        to = getattr(torch, dtype) if dtype else None
        return rms_norm(x, weight, eps, offset, weight_in_fp32=True, dtype=to, residual=residual)
    if residual is not None and output_dtype(x.dtype, weight.dtype, offset) == residual.dtype:
        return rms_norm(x, weight, eps, offset, residual=residual)
    out = rms_norm(x, weight, eps, offset)
    out = out if not dtype or str(out.dtype).removeprefix("torch.") == dtype else out.to(getattr(torch, dtype))
    return out if residual is None else residual + out


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, hidden) of the normalised activation, with the residual operand
    when the match took the post-norm's add."""
    from fusionscope.bench.cases import rms_norm_case

    residual = any(is_residual_add(graph, n) for n in match.nodes)  # the post-norm's add, taken with the norm
    return row_micro_case(graph, match, "aten::pow", partial(rms_norm_case, residual=residual))


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Swap the forward of each RMSNorm instance at `paths` for one `fusionscope.kernels.rms_norm` call, cast as its
    class casts (`fusionscope.apply.layers.NORMS`: ε attribute, Gemma's offset 1)."""
    import fusionscope.kernels as kernels  # here, not at import: the catalogue stays importable without triton

    result = {}
    for path in paths:
        try:
            norm, spec = _site(patcher, path)
        except NotPatchable as why:
            result[path] = Support.no(str(why))
            continue
        patcher.set_forward(norm, _forward(spec, kernels), KEY)
        result[path] = Support.yes()
    return result


def _site(patcher: Patcher, path: str) -> tuple[nn.Module, NormSpec]:
    norm = patcher.module(path)
    if norm is None:
        raise NotPatchable(f"no module at {path!r}")
    replaced = forward_replaced(norm, patcher)
    if replaced:
        raise NotPatchable(replaced)
    shared: NormState | None = patcher.state.get("add_rms_norm")
    if shared is not None and id(norm) in shared.fused:
        raise NotPatchable("add_rms_norm already fuses this norm with the residual add before it")
    return norm, norm_spec(norm, patcher)


def _forward(spec: NormSpec, kernels: Any) -> Callable[..., torch.Tensor]:
    """The norm's forward as one kernel call (eval mode; in training mode, the class's forward)."""
    eps_attr, offset = spec.eps_attr, spec.offset

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(hidden_states, self.weight, getattr(self, eps_attr), offset)

    return unless_training(forward)
