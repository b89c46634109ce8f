"""rope: Hugging Face's `apply_rotary_pos_emb` on q and k, plus the KV-cache write of one attention call → one
`fusionscope.kernels.rope_and_cache` launch that writes the rotated q and the new k/v rows into the cache.

Pattern, on the dataflow, for each of q and k (x = the head-split projection):
    mul(x, cos) ; slice(x, :d/2), slice(x, d/2:) → neg → cat(−x2, x1)  [rotate_half] → mul(·, sin) ; add(both muls)
The q and k chains that share the same cos/sin (the `unsqueeze`s in the attention module, which join the group) and
the same attention module are one match; a lone chain (only q or only k rotated) still matches. Where present, the
"cache write" joins the group: the `aten::cat(past, new, dim=-2)` that consumes the rotated k (DynamicCache growing),
and the `aten::cat` of v that follows it in the same module (same dim and shape); or a StaticCache's two
`index_copy_` writes of k and v, with the slot arithmetic from the cache's write counter (`arange`, `add`, the
counter's `add_`) where the slots come from it — all of which `bind` replaces. Per step: L matches (one per attention
layer).

How the cache write is counted: the cats are group nodes and their outputs are the group's intended outputs, so the
generic byte accounting charges the fused kernel with reading the past cache and writing the grown one — what a
DynamicCache costs, fused or not. A paged/static cache kernel writes only the new rows, so for the cache part the
estimate is conservative by 2·(2·n_past)·kv_heads·d·s bytes per layer; a StaticCache's in-place writes are charged
the rows they write (`opportunities.ROW_WRITES`). Bytes per token (head dim d, size s, H query and K kv heads), rope
part only: unfused ≈ 14·(H + K)·d·s (mul, 2 slices read, neg, cat, mul, add: each reads and writes), fused
(H + K)·d·s read + (H + K)·d·s written + cos/sin.

Not in the group (misses): the cos/sin generation in `model.rotary_emb` (arange/mul/cat/cos/sin/casts, once per step
and shared by all layers), the q/k/v projections and head-split views before the chains, partial rotary's split
and re-join (`X[..., :Dr]`, `cat([rotated, X[..., Dr:]], -1)`: an extra copy per tensor; the graph patch takes
it, see `bind`, and so the estimate counts it, as `Match.bound`, where the recorded dataflow lets `bind` see it),
GPT-NeoX/GPT-J interleaved rotation, and Qwen3's q/k norms before the rope — those stay separate ops. (The split
stays out of the match because analyze's op-order inference cannot yet tell which of a fused qkv projection's three
equal-width slices a partial-rotary split reads; the match must be the same there, and analyze's estimate of a
partial rotary leaves the re-join out.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.fusions.base import (
    CACHE_WRITES,
    Binding,
    Graph,
    In,
    Match,
    counter_slots,
    input_index,
    scalar_values,
)

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "rope"
KERNEL = "rope_and_cache"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "gpt_neox", "starcoder2")
TITLE = "rotary embedding on q and k + KV-cache write → one kernel"


def _consumer(graph: Graph, node: int, op: str) -> int:
    """The first reader of `node` named `op` (-1: none)."""
    return next((c for c in graph.consumers.get(node, ()) if graph.name.get(c) == op), -1)


class RopeChain(NamedTuple):
    """One rotated tensor: its ops, the tensor the kernel reads (`source`: the op and input position that read it),
    cos's and sin's producers, the two products that read them, and the op whose output is the rotated tensor."""

    nodes: set[int]
    source: In
    cos: int
    sin: int
    mul_cos: int
    mul_sin: int
    out: int


def rope_chain(graph: Graph, neg: int, split: bool = False) -> RopeChain | None:
    """The nodes of one `x·cos + rotate_half(x)·sin` around `neg`, with cos's and sin's producers and the final op;
    None when the neighbourhood is not a rotary chain. Intermediates may have other readers (then they escape).
    `split`: partial rotary's split and re-join (Phi-3, GPT-NeoX: `x = X[..., :Dr]`, then `cat([rotated,
    X[..., Dr:]], -1)`) join the chain, so the kernel reads X whole and copies its pass-through columns itself.
    The finder leaves them out (see the module docstring); `bind` takes them, on the captured graph's exact
    dataflow."""
    name = graph.name
    high = graph.producer(neg)
    x = graph.producer(high)
    cat = _consumer(graph, neg, "aten::cat")
    if name.get(high) != "aten::slice" or x < 0 or cat < 0 or len(graph.inputs[cat]) != 2:
        return None
    low = graph.inputs[cat][1]
    if graph.inputs[cat][0] != neg or name.get(low) != "aten::slice" or graph.producer(low) != x:
        return None
    mul_sin = _consumer(graph, cat, "aten::mul")
    add = _consumer(graph, mul_sin, "aten::add")
    if add < 0 or len(graph.inputs[add]) != 2:
        return None
    mul_cos = next((p for p in graph.inputs[add] if p != mul_sin), -1)
    if name.get(mul_cos) != "aten::mul" or x not in graph.inputs[mul_cos]:
        return None
    sin = next((p for p in graph.inputs[mul_sin] if p != cat), -1)
    cos = next((p for p in graph.inputs[mul_cos] if p != x), -1)
    nodes = {high, low, neg, cat, mul_sin, mul_cos, add}
    split_at = _partial_split(graph, x, add) if split else None
    if split_at is not None:
        return RopeChain(nodes | split_at[0], In(x, 0), cos, sin, mul_cos, mul_sin, split_at[1])
    return RopeChain(nodes, In(mul_cos, input_index(graph, mul_cos, x)), cos, sin, mul_cos, mul_sin, add)


def _partial_split(graph: Graph, x: int, add: int) -> tuple[set[int], int] | None:
    """`({x, pass, cat}, cat)` when x is `X[..., :Dr]` and the rotated x's one reader is `cat([rotated,
    X[..., Dr:]], -1)` that restores X's width; None otherwise (full rotary, or any other use of the pieces). With
    Dr = D (Phi-3) the split is still written: `X[..., :D]` is recorded as an `alias` and the pass part is empty."""
    name, shapes = graph.name, graph.column("input_shapes", ())
    readers = graph.consumers.get(add, ())
    if name.get(x) not in ("aten::slice", "aten::alias") or len(readers) != 1 or name.get(readers[0]) != "aten::cat":
        return None
    cat = readers[0]
    ins = graph.inputs.get(cat, ())
    if len(ins) != 2 or ins[0] != add or name.get(ins[1]) != "aten::slice":
        return None
    source, kept = graph.producer(x), ins[1]
    if source < 0 or graph.producer(kept) != source or set(graph.consumers.get(x, ())) & {kept, cat}:
        return None
    whole = tuple((shapes.get(x) or ((),))[0])
    parts = [tuple(s) for s in (shapes.get(cat) or ((), ()))[:2]]
    rank = len(whole)
    dims = scalar_values(graph, cat)
    on_last = bool(dims) and int(dims[0]) % max(rank, 1) == rank - 1
    cut = scalar_values(graph, x)
    whole_x = name[x] == "aten::alias"
    starts_at_0 = whole_x or (len(cut) >= 2 and int(cut[0]) % max(rank, 1) == rank - 1 and cut[1] == 0)
    widths = (
        len(parts) == 2 and all(len(p) == rank for p in parts) and rank and parts[0][-1] + parts[1][-1] == whole[-1]
    )
    if not (on_last and starts_at_0 and widths):
        return None
    return {x, kept, cat}, cat


def _cache_write(graph: Graph, k_out: int) -> set[int]:
    """DynamicCache's `cat([past_k, k], -2)` consuming the rotated k, and the `cat([past_v, v], -2)` after it."""
    k_cat = _consumer(graph, k_out, "aten::cat")
    if k_cat < 0 or graph.inputs[k_cat][-1] != k_out:
        return set()
    step_of, scalars = graph.column("step"), graph.column("scalars", ())
    step, module = step_of[k_cat], graph.module[k_cat]
    for n in range(k_cat + 1, k_cat + 8):  # DynamicLayer.update: keys, then values, back to back
        if n not in graph.name or graph.module[n] != module:
            break
        if graph.name[n] == "aten::cat":
            same = step_of[n] == step and tuple(scalars[n]) == tuple(scalars[k_cat])
            return {k_cat, n} if same and len(graph.inputs[n]) == 2 else {k_cat}
    return {k_cat}


def _static_cache_write(graph: Graph, k: RopeChain) -> set[int]:
    """StaticLayer's writes of the rotated k and of v (`static_cache_writes`, through the cast back to k's dtype where
    there is one), and, where the slots are the cache's `arange(S) + counter`, the ops that make them and advance the
    counter (`counter_slots`): what `bind` replaces besides the rotation, so that the estimate counts their launches."""
    cast = _cast_back(graph, k)
    writes = static_cache_writes(graph, cast or k.out) if cast is not None else None
    if writes is None:
        return set()
    return {*writes, *(counter_slots(graph, *writes) or ()), *({cast} - {0})}


def _views(graph: Graph, node: int, group: set[int], module: str) -> set[int]:
    """cos/sin's `unsqueeze` views in the attention module, when the group alone reads them."""
    own = graph.name.get(node) == "aten::unsqueeze" and graph.module.get(node) == module
    return {node} if own and set(graph.consumers.get(node, ())) <= group else set()


def find(graph: Graph) -> list[Match]:
    calls: dict[tuple, list[RopeChain]] = {}
    for neg in graph.named("aten::neg"):
        chain = rope_chain(graph, neg)
        if chain is not None:
            calls.setdefault((graph.where(chain.out), graph.module[chain.out], chain.cos, chain.sin), []).append(chain)
    matches = []
    for (_where, module, cos, sin), chains in calls.items():
        for pair in (chains[i : i + 2] for i in range(0, len(chains), 2)):  # q then k, per attention call
            group = set().union(*(c.nodes for c in pair))
            outputs = {c.out for c in pair}
            cache = (
                (_cache_write(graph, pair[-1].out) or _static_cache_write(graph, pair[-1])) if len(pair) == 2 else set()
            )
            if cache:
                group |= cache
                outputs = (outputs - {pair[-1].out}) | cache
            group |= _views(graph, cos, group, module) | _views(graph, sin, group, module)
            phase, step = graph.where(pair[0].out)
            matches.append(Match(KEY, phase, step, tuple(sorted(group)), module,
                                 escaping=graph.escaping(group, outputs)))  # fmt: skip
    return matches


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `rope(q, k, cos, sin)` in place of the q and k chains (and cos/sin's `unsqueeze`s when they are the
    group's own); a DynamicCache's growing `cat`s stay, reading the rotated k the call returns. Under partial rotary
    the split and the `cat` that re-joins the pass-through columns go too (Phi-3 runs that code with Dr = D: its
    `cat` with an empty tensor is a copy per tensor and layer that the match alone would leave). Under a static cache
    the writes of the rotated k and of v go too: one `rope_and_cache` launch instead of a rope and two `index_copy_`
    (the finder leaves those writes out of the match, as the module docstring says); where the slots are the cache's
    `arange(S) + counter` (`counter_slots`), those ops go too: the kernel reads the counter as the first slot and
    advances it (the counter's `add_` goes too)."""
    chains = [c for neg in sorted(match.nodes) if graph.name.get(neg) == "aten::neg" and
              (c := rope_chain(graph, neg, split=True)) is not None]  # fmt: skip
    if len(chains) != 2:
        return "only one of q and k is rotated here; the kernel rotates both in one launch"
    refs: list[tuple[In, int]] = []
    casts: set[int] = set()
    shapes = graph.column("input_shapes", ())
    for chain in chains:
        x_shape = tuple((shapes.get(chain.source.node) or ((),))[chain.source.index])
        mul_cos, mul_sin = chain.mul_cos, chain.mul_sin
        cos_at = next(i for i, p in enumerate(graph.inputs[mul_cos]) if p == chain.cos)
        cos_shape = tuple((shapes.get(mul_cos) or ((), ()))[cos_at])
        # the kernel takes x as (B, H, S, D) and cos as (B, 1, S, Dr), (B, S, Dr) or (S, Dr): positions on dim 2
        if len(x_shape) != 4 or not (len(cos_shape) in (2, 3) or (len(cos_shape) == 4 and cos_shape[1] == 1)):
            return "q and k are not (batch, heads, positions, dim) with cos/sin broadcast over the heads"
        cast = _cast_back(graph, chain)
        if cast is None:
            return "the rotation's result is read in the dtype cos/sin promote it to; the kernel returns q's dtype"
        refs.append((chain.source, cast or chain.out))
        casts.add(cast)
        trig = [_unsqueezed(graph, mul_cos, chain.cos, match), _unsqueezed(graph, mul_sin, chain.sin, match)]
    views = {n for n in match.nodes if graph.name.get(n) == "aten::unsqueeze"}
    nodes = set().union(*(c.nodes for c in chains)) | views | (casts - {0})
    (q, q_out), (k, k_out) = refs
    writes = static_cache_writes(graph, k_out)
    if writes is not None:
        k_write, v_write = writes
        args = (q, k, *trig, In(v_write, 2), In(k_write, 0), In(v_write, 0), In(k_write, 1))
        cached = Binding(fused_rope_and_cache, args, (q_out, k_write, v_write), tuple(sorted(nodes | set(writes))))
        counted = counter_slots(graph, k_write, v_write)
        if counted is None:
            return cached
        slots, bump = counted[-2:]
        return Binding(fused_rope_and_cache_counted, (*args[:-1], In(slots, 1)), (q_out, k_write, v_write, bump),
                       tuple(sorted(nodes | set(writes) | set(counted))), fallback=cached)  # fmt: skip
    return Binding(fused_rope, (q, k, *trig), (q_out, k_out), tuple(sorted(nodes)))


def _cast_back(graph: Graph, chain: RopeChain) -> int | None:
    """0 when the rotated tensor keeps x's dtype; where fp32 cos/sin promoted it (OLMo-2: bf16 q, fp32 tables), the
    `.to(x.dtype)` that is its one reader (the kernel computes in fp32 and rounds once, as that cast does); None when
    the promoted result is read otherwise."""
    in_dtypes, out_dtypes = graph.column("input_dtypes", ()), graph.column("output_dtypes", ())
    x_dtype = (in_dtypes.get(chain.source.node) or (None,) * (chain.source.index + 1))[chain.source.index]
    out_dtype = (out_dtypes.get(chain.out) or (None,))[0]
    if out_dtype == x_dtype:
        return 0
    readers = graph.consumers.get(chain.out, ())
    if len(readers) != 1 or graph.name.get(readers[0]) not in ("aten::_to_copy", "aten::to"):
        return None
    return readers[0] if (out_dtypes.get(readers[0]) or (None,))[0] == x_dtype else None


def static_cache_writes(graph: Graph, k_out: int) -> tuple[int, int] | None:
    """transformers' StaticLayer write of the rotated k and of v (`keys.index_copy_(2, positions, k)`, then
    `values.index_copy_(2, positions, v)`): the two writes, when the rotated k's one reader is the first and the
    second writes the same positions along the same dim in the same module; None otherwise (a DynamicCache, or a k
    read elsewhere too)."""
    name, scalars = graph.name, graph.column("scalars", ())
    readers = graph.consumers.get(k_out, ())
    if len(readers) != 1 or name.get(readers[0]) not in CACHE_WRITES:
        return None
    k_write = readers[0]
    ins = graph.inputs.get(k_write, ())
    if len(ins) != 3 or ins[2] != k_out:
        return None
    later = (n for n in sorted(graph.name) if n > k_write and name[n] in CACHE_WRITES)
    v_write = next((n for n in later if graph.module.get(n) == graph.module.get(k_write)
                    and len(graph.inputs[n]) == 3 and graph.inputs[n][1] == ins[1]
                    and tuple(scalars.get(n) or ()) == tuple(scalars.get(k_write) or ())), -1)  # fmt: skip
    return (k_write, v_write) if v_write >= 0 else None


def fused_rope_and_cache_counted(q: Any, k: Any, cos: Any, sin: Any, v: Any, k_cache: Any, v_cache: Any,
                                 counter: Any) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """`fused_rope_and_cache` with the slots read from the static cache's write counter on the device (token s at
    counter + s), and the counter advanced by S as the cache does, by the same launch when it is a 0-d int64 (the
    kernel's tickets, `kernels/rope.py: _slot`): the slots' arange and add and the counter's `add_` are gone."""
    import torch

    advance = counter.dim() == 0 and counter.dtype == torch.int64
    q_rot, k_cache, v_cache = fused_rope_and_cache(q, k, cos, sin, v, k_cache, v_cache, counter, advance)
    return q_rot, k_cache, v_cache, counter if advance else counter.add_(k.shape[2])


def fused_rope_and_cache(q: Any, k: Any, cos: Any, sin: Any, v: Any, k_cache: Any, v_cache: Any,
                         positions: Any, advance: bool = False) -> tuple[Any, Any, Any]:  # fmt: skip
    """`rope_and_cache`: q rotated (returned), the rotated k and v written into the static cache in place; the caches
    are returned too, standing for the two writes' results in the graph."""
    from fusionscope.kernels import rope_and_cache

    if cos.dim() == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    return rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, positions, advance=advance), k_cache, v_cache


def _unsqueezed(graph: Graph, mul: int, producer: int, match: Match) -> In:
    """cos or sin as `mul` reads it, or before its `unsqueeze` when that view is the group's own."""
    if graph.name.get(producer) == "aten::unsqueeze" and producer in match.nodes:
        return In(producer, 0)
    return In(mul, input_index(graph, mul, producer))


def fused_rope(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    """`rope` on cos/sin as the chain read them: (B, 1, S, D) broadcast over heads becomes the kernel's (B, S, D)."""
    from fusionscope.kernels import rope

    if cos.dim() == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    return rope(q, k, cos, sin)


def micro_case(graph: Graph, match: Match) -> Case | None:
    """HF's rope vs `rope` on this match's q and k: (B, H, S, D/2) halves at the `neg` of each chain, q's first.
    The cache write is left out of the timing: DynamicCache's growing `cat` costs the same fused or not."""
    from fusionscope.bench.cases import rope_case

    shapes = [graph.column("input_shapes")[n][0] for n in match.nodes if graph.name.get(n) == "aten::neg"]
    if not shapes or any(len(s) != 4 for s in shapes):
        return None
    (batch, heads, seq, half), kv_heads = shapes[0], shapes[-1][1]
    return rope_case(batch, seq, heads, kv_heads, 2 * half)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Rewrite each attention module at `paths` (`model.layers.i.self_attn`) so that q and k are rotated by one
    `fusionscope.kernels.rope` launch (`fusionscope.apply.attention`). Under a DynamicCache the cache write stays with
    the cache object (a growing `torch.cat`); under transformers' StaticCache (`apply --graphs`), once its first write
    allocated the rows, the rotation and the K/V write are one `rope_and_cache` launch. Attention forwards that
    differ from the Llama shape (Phi-3's fused qkv_proj, ...) are refused with the statement that differs; in training
    mode the class's forward runs."""
    from fusionscope.apply.attention import patch_rope

    results = {}
    for path in paths:
        try:
            results[path] = patch_rope(patcher, path, KEY)
        except ImportError as error:
            results[path] = Support.no(f"the rope kernel does not load here: {error}")
    return results
