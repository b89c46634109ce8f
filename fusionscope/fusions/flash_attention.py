"""flash_attention: eager attention (`attn_implementation="eager"`) → one fused attention call. No kernel of ours: it is
served by PyTorch's fused `scaled_dot_product_attention` (flash / memory-efficient backends) or flash-attn, i.e.
switching the model to `attn_implementation="sdpa"` (the Hugging Face default) or `"flash_attention_2"`.

Pattern (Hugging Face's `eager_attention_forward`), on the dataflow:
    repeat_kv(k), repeat_kv(v)       unsqueeze → expand → clone → _unsafe_view   (absent when kv heads = heads)
    q @ kᵀ                           transpose, expand/view of both sides → bmm → view   (`matmul` of 4-D tensors)
    · scale                          mul (or div), then Gemma-2's softcapping div/tanh/mul where present
    + mask                           add (the mask is built once per step in `model`, outside the group)
    softmax(fp32)                    _to_copy fp32 → _softmax → _to_copy back (no casts in fp32 models)
    dropout                          eval: `aten::dropout(train=False)` runs as an `aten::clone`
    probs @ v                        expand/view of both sides → bmm → view
With the default sdpa implementation the model already dispatches one `aten::_scaled_dot_product_*` op: 0 matches.
Per step: L matches (one per attention layer). Bytes per layer and step, for H heads, K kv heads, q length m, kv
length n, head dim d, size s: unfused ≈ 2·(H/K − 1)·K·n·d·s·2 (repeat_kv copies, read + write, k and v) + H·m·n·
(2s for scores + 2s scale + 2s mask add + (s + 4) + 8 softmax + (4 + s) + 2s dropout copy + s probs read) +
(H·m·d + 2·K·n·d + H·m·d)·s for the matmul operands/outputs; fused (H·m·d + 2·K·n·d + H·m·d)·s + the mask read once:
the m×n score matrix never reaches memory.

Not in the group (misses): the causal mask construction in `model` (arange/le/where, once per step), the cache cats
(taken by `rope` as its cache write), and the `transpose(1, 2).contiguous()` after the second matmul.
"""

from __future__ import annotations

from fusionscope.fusions.base import Graph, Match

KEY = "flash_attention"
KERNEL = None  # served by torch's fused SDPA / flash-attn: attn_implementation="sdpa" or "flash_attention_2"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
TITLE = "eager attention → one fused attention call (PyTorch SDPA / flash-attn; no kernel of ours)"

_SHAPE_OPS = frozenset({"aten::view", "aten::expand", "aten::unsqueeze", "aten::clone", "aten::_unsafe_view",
                        "aten::transpose", "aten::_reshape_alias"})  # fmt: skip
_SCORE_OPS = frozenset({"aten::mul", "aten::div", "aten::add", "aten::tanh", "aten::_to_copy", "aten::view"})
_PROB_OPS = frozenset({"aten::_to_copy", "aten::clone", "aten::expand", "aten::view"})


def _operand(graph: Graph, node: int, module: str) -> set[int]:
    """The reshaping ops (repeat_kv, transpose, matmul's expand/view) feeding `node` in `module` that only the
    attention reads, walked up until a producer that computes something."""
    found: set[int] = set()
    while graph.name.get(node) in _SHAPE_OPS and graph.module.get(node) == module:
        if graph.only_consumer(node) < 0:
            break
        found.add(node)
        node = graph.producer(node)
    return found


def find(graph: Graph) -> list[Match]:
    matches = []
    for softmax in (n for n, op in graph.name.items() if op in ("aten::_softmax", "aten::softmax")):
        module = graph.module[softmax]
        scores: set[int] = set()
        node = graph.producer(softmax)
        while graph.name.get(node) in _SCORE_OPS and graph.module.get(node) == module:
            scores.add(node)
            node = graph.producer(node)
        qk = node
        probs: set[int] = set()
        node = graph.only_consumer(softmax)
        while graph.name.get(node) in _PROB_OPS and graph.module.get(node) == module:
            probs.add(node)
            node = graph.only_consumer(node)
        pv = node
        if graph.name.get(qk) != "aten::bmm" or graph.name.get(pv) != "aten::bmm" or graph.producer(pv) not in probs:
            continue
        group = {qk, pv, softmax} | scores | probs
        for mm in (qk, pv):
            for i in range(len(graph.inputs[mm])):
                if graph.producer(mm, i) not in group:
                    group |= _operand(graph, graph.producer(mm, i), module)
        out = pv
        after = graph.only_consumer(pv)
        if graph.name.get(after) == "aten::view" and graph.module.get(after) == module:
            group.add(after)
            out = after
        phase, step = graph.where(softmax)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), module,
                             escaping=graph.escaping(group, {out})))  # fmt: skip
    return matches
