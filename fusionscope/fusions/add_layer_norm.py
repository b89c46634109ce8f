"""add_layer_norm: a residual add and the LayerNorm that reads it (GPT-2's blocks) → one
`fusionscope.kernels.add_layer_norm` launch that writes both the new residual and the normalised output.

Pattern: `aten::add(x, residual)` (tensor + tensor) feeding `aten::native_layer_norm` (what the recorder sees for
`F.layer_norm`; `aten::layer_norm` is accepted too). The add's output is read again by the next residual add, so it is
an intended output of the fused kernel, not an escaping intermediate. An `aten::clone` between the two whose only
input is the add, the add's only reader — GPT-2's embedding dropout in eval mode, a plain copy — is folded in: the
fused kernel's residual write replaces it. GPT-2 thus matches every LayerNorm: ln_1 and ln_2 of each block and ln_f,
2·L + 1 per step (ln_1 of block 0 reads wte + wpe, through the dropout copy). Bytes per row of N (size s): unfused
5·N·s (add reads 2, writes 1; layer_norm reads 1, writes 1; plus 8 bytes of statistics), 7·N·s with the copy;
fused 4·N·s (reads x and residual, writes the residual and the output).

GPT-NeoX's parallel block normalises the sum twice, once for attention and once for the MLP: when exactly two
LayerNorms with a weight, a bias and one ε read it, the match holds the add and both, and the graph patch calls
`add_layer_norm_pair` (statistics once, both outputs written from registers): unfused 7·N·s in three launches (the
add 3, each norm 2), fused 5·N·s in one. Where the captured graph refuses the pair's wider span, the add and the
first norm are patched alone (`Binding.fallback`).

Patching (`patch`): GPT-2's blocks are rewritten per instance, carrying the residual across the block boundary
(`fusionscope.apply.gpt2`): 2·L of the 2·L + 1 sites — block 0's ln_1 reads the embedding sum made inline in the
model's forward and stays unfused. BERT-style post-LN outputs (`dense → dropout → LayerNorm(h + input_tensor)`, a
module with exactly those three children, whose forward is `POST_NORM`, statement for statement) get a forward that
calls the kernel for the add and the norm; a forward that adds elsewhere (`LayerNorm(h) + input_tensor`) is refused
at the statement that differs. In training mode every rewritten module runs its class's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Support
from fusionscope.apply.source import difference, forward_replaced, read_source, template, unless_training
from fusionscope.fusions.base import Binding, Graph, In, Match, row_micro_case, scalar_values
from fusionscope.fusions.rms_norm import is_residual_add

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "add_layer_norm"
KERNEL = "add_layer_norm"
FAMILIES = ("gpt2", "bert", "gpt_neox", "starcoder2")
TITLE = "residual add + LayerNorm → one kernel, two outputs"
LAYER_NORMS = ("aten::native_layer_norm", "aten::layer_norm")


def find(graph: Graph) -> list[Match]:
    matches = []
    taken: set[int] = set()
    for norm in (n for n, name in graph.name.items() if name in LAYER_NORMS):
        if norm in taken:
            continue
        residual = graph.producer(norm)  # the tensor the kernel writes as the new residual
        add = residual
        if graph.name.get(residual) == "aten::clone" and graph.only_consumer(graph.producer(residual)) == residual:
            add = graph.producer(residual)
        if not is_residual_add(graph, add):
            continue
        norms = _pair(graph, residual, norm) or (norm,)
        taken.update(norms)
        inner = _inner_add(graph, add) if len(norms) == 2 and add == residual else None
        group = {add, residual, *norms} | ({inner[0]} if inner else set())
        phase, step = graph.where(norm)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[norm],
                             escaping=graph.escaping(group, {residual, *norms})))  # fmt: skip
    return matches


def _pair(graph: Graph, residual: int, norm: int) -> tuple[int, int] | None:
    """`norm` and a second LayerNorm of the same sum (GPT-NeoX's parallel block: one for attention, one for the
    MLP), both with a weight, a bias and one ε, as `add_layer_norm_pair` takes them; None when there is not exactly
    one such second norm."""
    others = [c for c in dict.fromkeys(graph.consumers.get(residual, ()))
              if c != norm and graph.name.get(c) in LAYER_NORMS and graph.producer(c) == residual]  # fmt: skip
    if len(others) != 1:
        return None
    shapes = graph.column("input_shapes", ())
    if any(len(shapes.get(n) or ()) != 3 for n in (norm, others[0])):
        return None
    if scalar_values(graph, norm)[-1:] != scalar_values(graph, others[0])[-1:]:
        return None
    return (norm, others[0])


def _inner_add(graph: Graph, add: int) -> tuple[int, int] | None:
    """(the add that makes one operand of the residual add `add`, that operand's position) where the pair's kernel
    can take it too (`add_layer_norm_pair`'s addend): GPT-NeoX's `mlp + attention + hidden`, whose first add is read
    only by the second, tensor + tensor, alpha 1, one shape and dtype (no broadcast, no promotion). None otherwise."""
    shapes, dtypes = graph.column("input_shapes", ()), graph.column("input_dtypes", ())
    outer = tuple(tuple(s) for s in shapes.get(add) or ())
    for position, inner in enumerate(graph.inputs.get(add, ())):
        if inner < 0 or graph.only_consumer(inner) != add or not is_residual_add(graph, inner):
            continue
        if any(s.startswith("alpha=") and float(s.removeprefix("alpha=")) != 1.0
               for s in graph.column("scalars", ()).get(inner) or ()):  # fmt: skip
            continue
        own = tuple(tuple(s) for s in shapes.get(inner) or ())
        if (
            len(own) == 2
            and len(outer) == 2
            and own[0] == own[1] == outer[0] == outer[1]
            and len(set(dtypes.get(inner) or ()) | set(dtypes.get(add) or ())) == 1
        ):
            return inner, position
    return None


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `add_layer_norm(a, b, weight, bias, ε)` in place of the residual add (and its clone) and the LayerNorm:
    its results replace the norm's output and the new residual. With two LayerNorms of the sum, one
    `add_layer_norm_pair` replaces both, and the add that made one operand of the sum (`_inner_add`) where the match
    holds it."""
    norms = [n for n in match.nodes if graph.name.get(n) in LAYER_NORMS]
    norm = norms[0] if norms else -1
    residual = graph.producer(norm)
    add = graph.producer(residual) if graph.name.get(residual) == "aten::clone" else residual
    shapes = graph.column("input_shapes", ()).get(add) or ()
    dtypes = graph.column("input_dtypes", ()).get(add) or ()
    if len(shapes) != 2 or shapes[0] != shapes[1] or len(set(dtypes)) != 1:
        return "the residual add broadcasts or mixes dtypes; the kernel adds two tensors of one shape and dtype"
    norm_shapes = graph.column("input_shapes", ()).get(norm) or ()
    if len(norm_shapes) != 3:
        return "the LayerNorm has no weight and bias the kernel can take"
    eps = scalar_values(graph, norm)
    if not eps:
        return "ε is not a constant of the LayerNorm"
    args = (In(add, 0), In(add, 1), In(norm, 1), In(norm, 2), eps[-1])
    inner = _inner_add(graph, add) if len(norms) == 2 else None
    inner_node = inner[0] if inner is not None and inner[0] in match.nodes else -1
    # the first norm alone (where the graph refuses the pair's wider span) leaves the sum's first add as it was
    single = Binding(fused_add_layer_norm, args, (norm, residual),
                     tuple(n for n in match.nodes if n not in norms[1:] and n != inner_node))  # fmt: skip
    if len(norms) != 2:
        return single
    pair = (*args[:4], In(norms[1], 1), In(norms[1], 2), eps[-1])
    if inner is not None and inner_node >= 0:  # the sum's first add too: its two operands, then the residual
        position = inner[1]
        pair = (In(inner_node, 0), In(add, 1 - position), *pair[2:], In(inner_node, 1))
    return Binding(fused_add_layer_norm_pair, pair, (norm, norms[1], residual), match.nodes, fallback=single)


def fused_add_layer_norm(a: Any, b: Any, weight: Any, bias: Any, eps: float) -> tuple[Any, Any]:
    from fusionscope.kernels import add_layer_norm

    return add_layer_norm(a, b, weight, bias, eps)


def fused_add_layer_norm_pair(a: Any, b: Any, weight: Any, bias: Any, weight2: Any, bias2: Any,
                              eps: float, addend: Any = None) -> tuple[Any, Any, Any]:  # fmt: skip
    from fusionscope.kernels import add_layer_norm_pair

    return add_layer_norm_pair(a, b, weight, bias, weight2, bias2, eps, addend=addend)


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: (rows, hidden) of the residual add; the pair's with two norms."""
    from fusionscope.bench.cases import add_layer_norm_case, add_layer_norm_pair_case

    pair = sum(graph.name.get(n) in LAYER_NORMS for n in match.nodes) == 2
    return row_micro_case(graph, match, "aten::add", add_layer_norm_pair_case if pair else add_layer_norm_case)


# BertSelfOutput / BertOutput and their copies: the children, and the forward's body
POST_NORM_CHILDREN = ("dense", "dropout", "LayerNorm")
POST_NORM = """
    hidden_states = self.dense(hidden_states)
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.LayerNorm(hidden_states + input_tensor)
    return hidden_states
"""


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Fuse the residual add into each LayerNorm at `paths` (the norms' module paths); one Support per path."""
    try:
        from fusionscope.kernels import add_layer_norm as kernel
    except ImportError as error:
        return {path: Support.no(f"the add_layer_norm kernel does not load here: {error}") for path in paths}
    from fusionscope.apply import gpt2

    results: dict[str, Support] = {}
    stacks: dict[str, dict[gpt2.Site, str]] = {}
    for path in paths:
        if patcher.module(path) is None:
            results[path] = Support.no("the model has no module at this path")
        elif (site := gpt2.site_of(patcher, path)) is not None:
            stacks.setdefault(site.stack, {})[site] = path
        else:
            results[path] = _patch_post_norm(patcher, path, kernel)
    for stack, sites in stacks.items():
        results.update(gpt2.patch_stack(patcher, stack, sites, kernel))
    return {path: results[path] for path in paths}


def _patch_post_norm(patcher: Patcher, path: str, kernel: Callable[..., tuple]) -> Support:
    """A post-LN output module (`LayerNorm(dropout(dense(h)) + input_tensor)`) whose LayerNorm is at `path`."""
    from fusionscope.apply.gpt2 import layer_norm_refusal

    parent_path, _, name = path.rpartition(".")
    parent = patcher.module(parent_path)
    if parent is None:
        return Support.no("the LayerNorm has no parent module whose forward could make the add")
    children = tuple(sorted(n for n, _ in parent.named_children()))
    if name != "LayerNorm" or children != tuple(sorted(POST_NORM_CHILDREN)):
        return Support.no(
            "the residual add before this LayerNorm is not in a module layout the patch knows (a GPT-2 block's "
            "ln_1 / ln_2 / ln_f, or a BERT-style dense → dropout → LayerNorm(h + input_tensor) output); it runs "
            "inline in its parent's forward"
        )
    refusal = forward_replaced(parent, patcher) or layer_norm_refusal(parent.LayerNorm, "LayerNorm", patcher)
    if not refusal:
        refusal = _post_norm_difference(type(parent))
    if refusal:
        return Support.no(refusal)
    patcher.set_forward(parent, _post_norm_forward(kernel), owner=KEY)
    return Support.yes()


def _post_norm_difference(cls: type) -> str:
    """'' when `cls.forward` is BertSelfOutput's (`POST_NORM`); else the reason, naming the statement that differs."""
    name = f"{cls.__name__}.forward"
    source = read_source(cls.forward)
    if source is None:
        return f"the source of {name} cannot be read"
    if source.signature != (("self", "hidden_states", "input_tensor"), None, (), None, ()):
        return f"{name} takes ({', '.join(source.params)}), not (hidden_states, input_tensor)"
    return difference(source, template(POST_NORM), name, "BertSelfOutput.forward")


def _post_norm_forward(kernel: Callable[..., tuple]) -> Callable[..., torch.Tensor]:
    """BertSelfOutput.forward with the residual add and the LayerNorm in one kernel call (the class's own forward in
    training mode: the kernel keeps no autograd history)."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        h = self.dropout(self.dense(hidden_states))
        norm = self.LayerNorm
        out, _ = kernel(h, input_tensor, norm.weight, norm.bias, norm.eps)
        return out

    return unless_training(forward)
