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

import copy
from typing import TYPE_CHECKING

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.fusions.base import Graph, Match

if TYPE_CHECKING:
    import torch
    from torch import nn

KEY = "flash_attention"
KERNEL = None  # served by torch's fused SDPA / flash-attn: attn_implementation="sdpa" or "flash_attention_2"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")  # not Gemma-2: SDPA has no soft-capping
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


# ------------------------------------------------------------------------------------------------------------ patch


def _sdpa_refusal(module: nn.Module, config: object) -> str:
    """Why SDPA cannot compute what this eager attention computes ('' when it can). Hugging Face's sdpa path
    (integrations/sdpa_attention.py) has no soft-capping (5.24 raises, 5.17 silently drops `softcap`), returns no
    attention weights, and on CUDA runs a fused kernel only where one accepts the head dim and dtype with the
    additive mask the eager model builds."""
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is None:
        softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"SDPA has no attention-logit soft-capping (attn_logit_softcapping={softcap})"
    if getattr(config, "output_attentions", False):
        return "the model returns attention weights (output_attentions), which SDPA does not compute"
    weight = getattr(getattr(module, "q_proj", None), "weight", None)
    head_dim = getattr(module, "head_dim", None)
    if weight is not None and weight.is_cuda and isinstance(head_dim, int) and not _cuda_fused_sdpa(weight, head_dim):
        return f"no fused SDPA kernel takes head_dim={head_dim} in {weight.dtype} with a mask on this GPU (math path)"
    return ""


def _cuda_fused_sdpa(weight: torch.Tensor, head_dim: int) -> bool:
    """Whether a fused SDPA backend (memory-efficient, cuDNN or flash) accepts (1, 1, 2, head_dim) q/k/v in the
    weight's dtype with an additive float mask, as the eager model's attention calls it; True when torch cannot say."""
    import torch

    cuda = torch.backends.cuda
    try:
        q = torch.zeros(1, 1, 2, head_dim, dtype=weight.dtype, device=weight.device)
        mask = torch.zeros(1, 1, 2, 2, dtype=weight.dtype, device=weight.device)
        params = cuda.SDPAParams(q, q, q, mask, 0.0, False, False)
        checks = [getattr(cuda, n) for n in ("can_use_efficient_attention", "can_use_cudnn_attention",
                                             "can_use_flash_attention") if hasattr(cuda, n)]  # fmt: skip
        return any(check(params) for check in checks) if checks else True
    except (AttributeError, TypeError, RuntimeError):  # an older or newer torch without this API shape
        return True


def patch_attention(patcher: Patcher, path: str) -> Support:
    """Give the eager attention at `path` its own shallow copy of the config with `_attn_implementation="sdpa"`: its
    forward looks the attention function up there at call time. The shared config object is left untouched (the
    internal field is set on the copy directly: the property's setter would also write the sub-configs, which a
    shallow copy shares). The mask is still built by the model for eager attention (a float additive mask), which
    SDPA takes as it is."""
    from fusionscope.apply.attention import looks_up_interface, modeling_module

    module = patcher.module(path)
    config = getattr(module, "config", None)
    if module is None or config is None:
        return Support.no("the model has no attention module with a config at this path")
    if getattr(config, "_attn_implementation", None) != "eager":
        return Support.no(f"its attention runs {getattr(config, '_attn_implementation', None)!r}, not eager")
    if not looks_up_interface(type(module)):
        return Support.no(f"{type(module).__name__}.forward does not pick its attention function from the config")
    functions = getattr(modeling_module(module), "ALL_ATTENTION_FUNCTIONS", None)
    if functions is None or "sdpa" not in functions:
        return Support.no("transformers has no sdpa attention function registered here")
    reason = _sdpa_refusal(module, config)
    if reason:
        return Support.no(reason)
    own = copy.copy(config)
    if "_attn_implementation_internal" in vars(own):
        vars(own)["_attn_implementation_internal"] = "sdpa"
    elif not getattr(own, "sub_configs", None):
        own._attn_implementation = "sdpa"
    if own._attn_implementation != "sdpa" or config._attn_implementation != "eager":
        return Support.no("this config does not let one attention module switch its implementation alone")
    patcher.set_attr(module, "config", own)
    return Support.yes()


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Each eager attention module at `paths` → torch's fused `scaled_dot_product_attention` (Hugging Face's sdpa
    path), per instance; refused with the reason where SDPA cannot compute the same thing (`_sdpa_refusal`). A call
    that asks for `output_attentions=True` at run time gets no attention weights back from a patched layer."""
    return {path: patch_attention(patcher, path) for path in paths}
