"""decode_attention: one query token's attention over the KV cache → one `fusionscope.kernels.decode_attention` launch
that reads the cache once, whatever the GQA ratio, with no mask.

Pattern, on the dataflow: a fused attention op (`aten::scaled_dot_product_attention` or the
`aten::_scaled_dot_product_*` backend op it dispatches to) whose query has one position (or is such a query's GQA
groups packed into the position dim, as transformers 5.24 passes a masked one), in a decode step; where K
and V reach it through Hugging Face's `repeat_kv` (unsqueeze → expand → clone/_unsafe_view, in the same module),
those copies join the group. Per step: L matches (one per attention layer).

Why it pays most under a static cache: transformers' SDPA path hands GQA to the backend (`enable_gqa`) only when no
mask is passed. A DynamicCache at decode passes none, so eager decode already runs one backend call per layer and the
saving is that call's own inefficiency (two kernels; cuDNN's reduction pass). A StaticCache — what `generate`'s
compile path and `apply --graphs` use — always passes a mask over the whole cache length, so each layer expands K and
V to every query head (`repeat_kv`: two copies of H/K × the cache, read and written), builds and applies the mask, and
attends over the full allocated length. On llama-3.1-8b at batch 1 on the H200 those copies alone were 437 µs of a
5.3 ms replayed step (reports/apply/). The kernel instead reads each layer's K and V rows once, up to the cache's own
write counter (a device tensor, so one CUDA graph serves every step).

Bytes per layer and step, batch B, H query and K kv heads, head dim d, size s, n cached rows (N allocated):
unfused (static cache) ≈ 2·(2·(H/K)·K·N·d·s)   repeat_kv copies of k and v, read + write
                        + 2·H·N·d·s + mask reads + B·H·d·s·2      the attention reading the expanded cache
fused                   ≈ 2·K·n·d·s + 2·B·H·d·s                   each cached row read once, q read, out written
The estimate here is the generic one of the matched group (what the profiled step held: under a DynamicCache just
the backend call), so it understates the static-cache saving; `apply --graphs` measures that.

Not served (the patch refuses or falls back, per call): a query of more than one position (prefill), a cache that is
not transformers' `StaticLayer` (a DynamicCache, a sliding-window layer), sliding windows, soft-capping (Gemma-2),
dropout in training. The kernel attends to every written row: batches with left padding (a 2-D attention mask with
zeros) are not what it computes — fusionscope's workloads and `generate` on unpadded prompts are.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.fusions.base import CACHE_WRITES, Binding, Graph, In, Match, counter_slots

if TYPE_CHECKING:
    from fusionscope.bench.cases import Case

KEY = "decode_attention"
KERNEL = "decode_attention"
FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "phi3",
    "olmo2",
    "gpt_neox",
    "starcoder2",
)  # not Gemma-2: soft-capping
TITLE = "one query token's attention over the KV cache (GQA, no repeat_kv, no mask) → one kernel"

_REPEAT_KV = ("aten::unsqueeze", "aten::expand", "aten::clone", "aten::_unsafe_view", "aten::reshape", "aten::view")


def is_attention(name: str) -> bool:
    return name == "aten::scaled_dot_product_attention" or name.startswith("aten::_scaled_dot_product_")


def _repeat_kv(graph: Graph, node: int, module: str) -> set[int]:
    """The `repeat_kv` chain that feeds `node` (an expanded k or v) in `module`: walk up through its view/expand/clone
    nodes while each is read only by the chain; empty when `node` is not an expanded copy."""
    chain: set[int] = set()
    while node >= 0 and graph.name.get(node) in _REPEAT_KV and graph.module.get(node) == module:
        chain.add(node)
        node = graph.producer(node)
    return chain if any(graph.name.get(n) in ("aten::clone", "aten::expand") for n in chain) else set()


def _one_position(graph: Graph, node: int, query: tuple, shapes: dict) -> bool:
    """Whether the attention's query is one token's: (B, H, 1, d), or (B, K, H/K, d) reshaped from such a query
    (transformers 5.24 packs a one-position GQA query that way, `pack_gqa`, instead of repeating K and V)."""
    if len(query) != 4:
        return False
    if query[2] == 1:
        return True
    up = graph.producer(node)
    while up >= 0 and graph.name.get(up) in ("aten::reshape", "aten::view", "aten::_unsafe_view"):
        source = (shapes.get(up) or ((),))[0]
        if len(source) == 4 and source[2] == 1 and source[1] == query[1] * query[2]:
            return True
        up = graph.producer(up)
    return False


def find(graph: Graph) -> list[Match]:
    shapes = graph.column("input_shapes", ())
    matches = []
    for node, name in graph.name.items():
        if not is_attention(name):
            continue
        phase, step = graph.where(node)
        query = (shapes.get(node) or ((),))[0]
        # a captured graph ("graph", `fusionscope.apply.rewrite`) and a trace without fusionscope's phase ranges (one
        # phase, "trace": `fusionscope.analyze`, prefill and decode steps alike) are judged by their shapes alone
        if phase not in ("decode", "graph", "trace") or not _one_position(graph, node, query, shapes):
            continue
        module = graph.module[node]
        group = {node}
        for which in (1, 2):
            group |= _repeat_kv(graph, graph.producer(node, which), module)
        escaping = graph.escaping(group, {node})
        rejected = "an expanded k or v is read outside the attention" if escaping else ""
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), module, escaping=escaping, rejected=rejected))
    return matches


def _cache_input(graph: Graph, match: Match, node: int, which: int) -> tuple[In, int]:
    """Input `which` of the attention followed up through the group's own `repeat_kv` copies: the reference to the
    cache tensor as written, and its writer (-1 none)."""
    while graph.producer(node, which) in match.nodes:
        node, which = graph.producer(node, which), 0
    return In(node, which), graph.producer(node, which)


def bind(graph: Graph, match: Match) -> Binding | str:
    """One `decode_attention(q, k_cache, v_cache, length, scale)` in place of the attention (and its `repeat_kv`
    copies), where K and V are a static cache's whole buffers written in place (`index_copy_` at the token's
    position, as transformers' StaticLayer writes): `length` is that position + 1, read on the device."""
    attention = next((n for n in match.nodes if is_attention(graph.name.get(n, ""))), -1)
    (k, k_writer), (v, v_writer) = _cache_input(graph, match, attention, 1), _cache_input(graph, match, attention, 2)
    if graph.name.get(k_writer) not in CACHE_WRITES or graph.name.get(v_writer) not in CACHE_WRITES:
        return "K and V are not a static cache written in place (a DynamicCache grows by cat): the kernel reads one"
    scale = None
    for text in graph.column("scalars", ()).get(attention) or ():
        if text.startswith("scale=") and text != "scale=None":
            scale = float(text.removeprefix("scale="))
    # the rows written so far: the last slot + 1; where the slots come from the cache's write counter (which
    # `rope`'s binding folds into its kernel, so the slots tensor may not exist), the counter once advanced
    counted = counter_slots(graph, k_writer, v_writer)
    length = In(counted[-1], 0) if counted else In(k_writer, 1)
    args = (In(attention, 0), k, v, length, scale)
    return Binding(fused_decode_attention, args, (attention,), match.nodes)


def fused_decode_attention(q: Any, k_cache: Any, v_cache: Any, positions: Any, scale: float | None) -> Any:
    """The kernel on the attention's operands: q (B, H, 1, d), or transformers 5.24's packed one-token query
    (B, K, H/K, d), whose result is packed back the same way; the result in the attention output's layout.
    `positions`: the step's cache slots, or (0-d) the cache's write counter after the step's write."""
    from fusionscope.kernels import decode_attention

    b, heads, rows, d = q.shape
    packed = rows != 1
    query = q.reshape(b, heads * rows, 1, d) if packed else q
    # the rows written so far: the token's position is the last one; a counter already counts them
    length = positions[-1:] + 1 if positions.dim() else positions.reshape(1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = decode_attention(query, k_cache, v_cache, length, scale)  # (B, 1, H, d)
    return out.view(b, heads, rows, d) if packed else out.transpose(1, 2)


def micro_case(graph: Graph, match: Match) -> Case | None:
    """The bench case on this match's shape: batch, heads, kv heads, head dim and cached rows of the attention."""
    from fusionscope.bench import cases

    build = getattr(cases, "decode_attention_case", None)
    node = next((n for n in match.nodes if is_attention(graph.name.get(n, ""))), None)
    shapes = graph.column("input_shapes", ()).get(node) or ()
    if build is None or len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        return None
    (batch, heads, _, dim), (_, kv_heads, rows, _) = shapes[0], shapes[1]
    kv_heads = kv_heads if heads % kv_heads == 0 else heads
    return build(batch, heads, kv_heads, dim, rows, 1.0)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Give each attention module at `paths` (`model.layers.i.self_attn`) the decode part of the attention rewrite
    (`fusionscope.apply.attention`): for one query token against transformers' StaticLayer, one
    `fusionscope.kernels.decode_attention` launch in place of the attention function; every other call (prefill, a
    DynamicCache, a sliding window) runs the attention function as the class does. Modules whose forward differs
    from the Llama shape are refused with the statement that differs; soft-capping models are refused outright."""
    from fusionscope.apply.attention import attention_support, bind_part

    results = {}
    for path in paths:
        module = patcher.module(path)
        shape = attention_support(module, patcher)
        if isinstance(shape, str):
            results[path] = Support.no(shape)
            continue
        if any(name == "softcap" for name, _ in shape.arguments) and getattr(module, "attn_logit_softcapping", None):
            results[path] = Support.no("attention logits are soft-capped, which the decode kernel does not do")
            continue
        try:
            from fusionscope.kernels import decode_attention
        except ImportError as error:
            results[path] = Support.no(f"the decode_attention kernel does not load here: {error}")
            continue
        bind_part(patcher, module, shape, KEY, {"decode": decode_attention})
        results[path] = Support.yes()
    return results
