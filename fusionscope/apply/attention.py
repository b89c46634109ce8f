"""The attention forward the rope fusion binds on one attention instance: Hugging Face's Llama-shape forward with
`apply_rotary_pos_emb` replaced by one `fusionscope.kernels.rope` launch, every other step as the class computes it.

Why a rewrite: the class's forward looks `apply_rotary_pos_emb` up as a module global at call time, so the only way
in that touches one instance alone is that instance's forward (rebinding the global would change every model of the
family in the process).

"As the class computes it" is checked, not assumed: `read_attention(cls)` parses the class's forward and accepts it
only when each statement is one this rewrite reproduces — the q/k/v/o projections called as modules (so the qkv
fusion's swap of them runs), the head split `view(..., -1, head_dim).transpose(1, 2)`, Qwen3's q_norm/k_norm on the
head-split projections before the transpose, the cache update in the form the installed transformers writes
(5.17: `past_key_values.update(k, v, layer_idx)`; 5.24: `cache.update(k, v, layer_idx, kwargs=kwargs)`: the parameter
name and the `kwargs=` are read from the source), and the attention function looked up exactly as Hugging Face does,
`ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)` with the module's
own globals read at call time, given the same keywords (dropout, scaling, Mistral/Qwen's sliding_window, Gemma-2's
softcap), each read from the instance as the source reads it. Any other statement (Phi-3's fused qkv_proj, a partial
rotary split, a keyword not in the table) refuses the site with the statement that differs (the source is read by
`fusionscope.apply.source`, docstrings and comments aside). An instance whose forward is already its own is refused,
and in training mode the class's forward runs (`unless_training`: the kernel has no backward).

KV cache: under a DynamicCache the update is a `torch.cat` of the past and the new rows, which no kernel fuses with the
rotation; `rope_and_cache` writes the new rows into a *static* cache in place and needs one (`--graphs` runs with a
StaticCache). This forward always rotates with `rope` and leaves the update to the cache object, so the "cache write"
half of the rope catalogue entry is not served by it.
"""

from __future__ import annotations

import ast
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.apply.source import (
    Source,
    deprecated_aliases,
    expression_key,
    forward_replaced,
    kernel_dtypes,
    read_source,
    rename,
    statement_key,
    unless_training,
)

# ------------------------------------------------------------------------------------------------ the class's forward

_HEAD = ("input_shape = hidden_states.shape[:-1]", "hidden_shape = (*input_shape, -1, self.head_dim)")
_QUERY = {
    "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)": False,
    "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)": True,
}
_KEY = {
    "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)": False,
    "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)": True,
}
_VALUE = "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)"
_ROTATION = (
    "cos, sin = position_embeddings",
    "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
)
_UPDATE = (
    "if {cache} is not None:\n"
    "    key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx{more})"
)
_LOOKUP = (
    "attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, "
    "eager_attention_forward)"
)
_CALL = (
    "attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask, "
    "**kwargs)"
)
_TAIL = (
    "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
    "attn_output = self.o_proj(attn_output)",
    "return (attn_output, attn_weights)",
)
_PARAMS = ("self", "hidden_states", "position_embeddings", "attention_mask")


def _dropout(module: nn.Module) -> float:
    return module.attention_dropout if module.training else 0.0


# (keyword, its expression in the source) -> how to read it from the instance at call time
ARGUMENTS: dict[tuple[str, str], Callable[[nn.Module], Any]] = {
    ("dropout", "0.0 if not self.training else self.attention_dropout"): _dropout,
    ("dropout", "self.attention_dropout if self.training else 0.0"): _dropout,
    ("scaling", "self.scaling"): lambda m: m.scaling,
    ("sliding_window", "self.sliding_window"): lambda m: m.sliding_window,
    ("sliding_window", "getattr(self.config, 'sliding_window', None)"):
        lambda m: getattr(m.config, "sliding_window", None),
    ("softcap", "self.attn_logit_softcapping"): lambda m: m.attn_logit_softcapping,
}  # fmt: skip
_ARGUMENT_KEYS = {(name, expression_key(text)): read for (name, text), read in ARGUMENTS.items()}


@dataclass(frozen=True)
class AttentionShape:
    """What one attention class's forward does where families and transformers versions differ."""

    cache_name: str  # the forward's KV-cache parameter: "past_key_values" (5.17) or "cache" (5.24)
    aliases: tuple[tuple[str, str], ...]  # (old, new) keyword names its `deprecate_kwarg` decorators rename
    update_kwargs: bool  # the cache update passes `kwargs=kwargs` (5.24)
    qk_norm: bool  # q_norm / k_norm on the head-split projections before the transpose (Qwen3)
    arguments: tuple[tuple[str, Callable[[nn.Module], Any]], ...]  # the attention function's named keywords


def _interface_call(statement: ast.stmt) -> tuple[tuple[str, Callable[[nn.Module], Any]], ...] | str:
    """The named keywords of the `attention_interface(...)` call, each as a reader of the instance; a reason when the
    call is not the one the rewrite makes or a keyword's expression is not in `ARGUMENTS`."""
    call = getattr(statement, "value", None)
    if not isinstance(statement, ast.Assign) or not isinstance(call, ast.Call):
        return f"`{ast.unparse(statement)}` is not the attention call the rewrite makes"
    bare = copy.copy(statement)
    bare.value = copy.copy(call)
    bare.value.keywords = [k for k in call.keywords if k.arg is None]  # the call without its named keywords
    if ast.dump(bare) != statement_key(_CALL):
        return f"`{ast.unparse(statement)}` is not the attention call the rewrite makes"
    readers = []
    for keyword in (k for k in call.keywords if k.arg is not None):
        reader = _ARGUMENT_KEYS.get((keyword.arg, ast.dump(keyword.value)))
        if reader is None:
            return (f"it passes {keyword.arg}={ast.unparse(keyword.value)} to the attention function, which the "
                    "rewrite does not read")  # fmt: skip
        readers.append((keyword.arg, reader))
    return tuple(readers)


@cache
def read_attention(cls: type) -> AttentionShape | str:
    """The shape of `cls.forward` when every statement is one the rewrite reproduces (module docstring); else the
    reason, naming the first statement that differs."""
    source = read_source(cls.forward)
    if source is None:
        return f"the source of {cls.__name__}.forward cannot be read"
    return attention_shape(source, f"{cls.__name__}.forward")


def attention_shape(source: Source, name: str) -> AttentionShape | str:
    """`read_attention` on a parsed forward (`name` for the reasons)."""
    params = source.params
    if params[:4] != _PARAMS or len(params) != 5 or source.varargs or source.kwonly or source.varkw != "kwargs":
        return (f"{name} takes ({', '.join(params)}), not (hidden_states, position_embeddings, attention_mask, cache, "
                "**kwargs)")  # fmt: skip
    aliases = deprecated_aliases(source.decorators)
    if isinstance(aliases, str):
        return aliases
    cache = params[4]
    updates = {_UPDATE.format(cache=cache, more=""): False, _UPDATE.format(cache=cache, more=", kwargs=kwargs"): True}
    # per statement: {template: what it tells}, a single template, or None for the attention call
    expected: list[dict[str, Any] | str | None] = [*_HEAD, _QUERY, _KEY, _VALUE, *_ROTATION, updates, _LOOKUP, None,
                                                   *_TAIL]  # fmt: skip
    chosen: list[Any] = []
    arguments: tuple | str = ()
    for i, want in enumerate(expected):
        if i >= len(source.statements):
            return f"{name} ends after {i} statements, before the Llama-shape attention's output projection"
        if want is None:
            arguments = _interface_call(source.statements[i])
            if isinstance(arguments, str):
                return arguments
            continue
        accepted = {statement_key(t): tag for t, tag in (want.items() if isinstance(want, dict) else [(want, None)])}
        if source.key(i) not in accepted:
            return f"{name} differs from the Llama-shape attention at `{source.text(i).splitlines()[0]}`"
        if isinstance(want, dict):
            chosen.append(accepted[source.key(i)])
    if len(source.statements) > len(expected):
        return f"{name} goes on after the Llama-shape attention's return"
    q_norm, k_norm, update_kwargs = chosen
    if q_norm != k_norm:
        return f"{name} normalises only one of q and k"
    return AttentionShape(cache, aliases, update_kwargs, q_norm, arguments)


# ---------------------------------------------------------------------------------------------------- the instance


def modeling_module(module: nn.Module) -> ModuleType:
    """The module that defines the instance's class (its globals are what the class's forward reads)."""
    return sys.modules[type(module).__module__]


def _rotation_matches(modeling: ModuleType) -> str:
    """'' when the module's `apply_rotary_pos_emb` computes what `rope_reference` does (HF's rotate_half rotation,
    full rotary), bit for bit on a small fp32 probe; else the reason. Catches a global someone else rebound."""
    from fusionscope.kernels import rope_reference

    rotate = getattr(modeling, "apply_rotary_pos_emb", None)
    if rotate is None:
        return f"{modeling.__name__} has no apply_rotary_pos_emb"
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 3, 8, generator=gen)
    cos, sin = torch.randn(1, 3, 8, generator=gen), torch.randn(1, 3, 8, generator=gen)
    try:
        got = rotate(q, k, cos, sin)
    except Exception as error:  # a rebound global may need other devices or arguments
        return f"{modeling.__name__}.apply_rotary_pos_emb fails on a CPU probe ({type(error).__name__}: {error})"
    want = rope_reference(q, k, cos, sin)
    if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
        return f"{modeling.__name__}.apply_rotary_pos_emb is not Hugging Face's rotate_half rotation"
    return ""


def attention_support(module: nn.Module | None, patcher: Patcher | None = None) -> AttentionShape | str:
    """The shape of an attention instance the rewrite can take, or why not. An instance whose forward this patch's
    attention rewrite already holds (another part of it bound first) is taken as it is."""
    if module is None:
        return "the model has no module at this path"
    if patcher is None or id(module) not in patcher.state.get(PARTS, {}):
        replaced = forward_replaced(module, patcher)
        if replaced:
            return replaced
    shape = read_attention(type(module))
    if isinstance(shape, str):
        return shape
    parts = ("q_proj", "k_proj", "v_proj", "o_proj") + (("q_norm", "k_norm") if shape.qk_norm else ())
    missing = [p for p in (*parts, "head_dim", "layer_idx", "config") if not hasattr(module, p)]
    if missing:
        return f"this {type(module).__name__} has no {', '.join(missing)}"
    dtype = getattr(getattr(module.q_proj, "weight", getattr(module.q_proj, "scales", None)), "dtype", None)
    if dtype not in kernel_dtypes():
        return f"the kernels take fp32, fp16 or bf16 activations; the projections are {dtype}"
    modeling = modeling_module(module)
    absent = [n for n in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward", "apply_rotary_pos_emb")
              if not hasattr(modeling, n)]  # fmt: skip
    if absent:
        return f"{modeling.__name__} has no {', '.join(absent)}"
    return shape


def rope_support(module: nn.Module | None, patcher: Patcher | None = None) -> AttentionShape | str:
    """The shape of an attention instance the rope rewrite can take, or why not."""
    shape = attention_support(module, patcher)
    if isinstance(shape, str):
        return shape
    return _rotation_matches(modeling_module(module)) or shape


PARTS = "attention"  # Patcher.state key: {id(attention module): its rewrite's parts} for the instances rewritten


def attention_forward(shape: AttentionShape, modeling: ModuleType, parts: dict[str, Callable[..., Any]]
                      ) -> Callable[..., Any]:  # fmt: skip
    """The forward of one attention instance: the class's forward (see `read_attention`), in eval mode
    (`unless_training`), with what `parts` holds at call time in place of its steps — several fusions share one
    rewrite of the same instance, each adding its part:
    - `rope`: `rope(q, k, cos, sin)` in place of `apply_rotary_pos_emb` (else the module's global, as the class);
    - `rope_and_cache`: under a static cache (`static_layer`) the rotation and the cache write in one launch: the
      rotated k and v go straight into the cache's rows at its counter, which advances as `StaticLayer.update`
      advances it (a device op, so a CUDA graph replays it);
    - `decode`: for one query token against a static cache layer, `decode(q, keys, values, length, scale)` in
      place of the attention function: the whole cache read once, up to the layer's own counter (`length`, a
      device tensor: the rows written so far), so neither the repeat_kv copies nor the mask of the static-cache
      path exist. Taken only without sliding window, soft-capping or dropout, which the kernel does not do.
    hidden_states: (B, S, hidden); returns (attn_output, attn_weights)."""
    names = dict(shape.arguments)

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rename(kwargs, shape.aliases)  # as the class's deprecate_kwarg decorators do
        if len(args) > 1:
            raise TypeError(f"forward takes at most 4 positional arguments after self, got {3 + len(args)}")
        cache = args[0] if args else kwargs.pop(shape.cache_name, None)
        rope, rope_and_cache, decode = parts.get("rope"), parts.get("rope_and_cache"), parts.get("decode")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        if shape.qk_norm:
            query = self.q_norm(query)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if shape.qk_norm:
            key = self.k_norm(key)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        layer = static_layer(cache, self.layer_idx) if cache is not None and rope_and_cache is not None else None
        if layer is not None and layer.keys.dtype == query.dtype:
            new_tokens = query.shape[1]
            # The counter is the first new token's slot, and the kernel advances it once every program has read it:
            # no arange, add or add_ launch per layer.
            counter = layer.cumulative_length
            advance = counter.dim() == 0 and counter.dtype == torch.int64
            positions = counter if advance else torch.arange(new_tokens, device=counter.device) + counter
            query = rope_and_cache(query.transpose(1, 2), key.transpose(1, 2), value, cos, sin, layer.keys,
                                   layer.values, positions, advance=advance)  # fmt: skip
            if not advance:
                counter.add_(new_tokens)
            key, value = layer.keys, layer.values
        else:
            rotate = rope or modeling.apply_rotary_pos_emb
            query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
            if cache is not None:
                more = {"kwargs": kwargs} if shape.update_kwargs else {}
                key, value = cache.update(key, value, self.layer_idx, **more)
        named = {name: read(self) for name, read in names.items()}
        layer = static_layer(cache, self.layer_idx) if decode is not None and cache is not None else None
        if layer is not None and query.shape[2] == 1 and key is layer.keys and _plain(named):
            scale = named.get("scaling") or self.head_dim**-0.5
            attn_output = decode(query, layer.keys, layer.values, layer.cumulative_length, scale)
            attn_weights = None
        else:
            interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, modeling.eager_attention_forward
            )
            attn_output, attn_weights = interface(self, query, key, value, attention_mask, **named, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    return unless_training(forward)


def _plain(named: dict[str, Any]) -> bool:
    """No sliding window, soft-capping or dropout among the attention function's keywords: what `decode` computes."""
    return not named.get("sliding_window") and not named.get("softcap") and not named.get("dropout")


def bind_part(patcher: Patcher, module: nn.Module, shape: AttentionShape, owner: str,
              part: dict[str, Callable[..., Any]]) -> None:  # fmt: skip
    """Give `module`'s attention rewrite `part`: bind the rewrite on the instance when no fusion of this patch did
    yet, else add the part to the one bound; the part leaves again when the patch is restored."""
    bound = patcher.state.setdefault(PARTS, {})
    parts = bound.get(id(module))
    if parts is None:
        parts = bound[id(module)] = {}
        patcher.set_forward(module, attention_forward(shape, modeling_module(module), parts), owner=owner)
    parts.update(part)
    patcher.on_restore(lambda: [parts.pop(name, None) for name in part])


def patch_rope(patcher: Patcher, path: str, owner: str) -> Support:
    """Give the attention instance at `path` the rope part, or say why not."""
    module = patcher.module(path)
    shape = rope_support(module, patcher)
    if isinstance(shape, str):
        return Support.no(shape)
    from fusionscope.kernels import rope, rope_and_cache

    bind_part(patcher, module, shape, owner, {"rope": rope, "rope_and_cache": rope_and_cache})
    return Support.yes()


def static_layer(cache: Any, layer_idx: int) -> Any:
    """The cache layer `layer_idx` when it is transformers' own `StaticLayer`, already allocated (its first write,
    the prefill, allocates it through `update`): a fixed (B, Hk, S_max, D) keys/values pair written where its device
    counter `cumulative_length` says, the semantics `rope_and_cache` reproduces (transformers 5.17 and 5.24 alike).
    None for anything else — a DynamicCache, a sliding-window layer, a subclass — whose own `update` then runs."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is not StaticLayer or not getattr(layer, "is_initialized", False):
        return None
    return layer


@cache
def looks_up_interface(cls: type) -> bool:
    """Whether `cls.forward` picks its attention function from `self.config._attn_implementation` as Hugging Face's
    attention classes do (the flash_attention patch swaps only that config)."""
    source = read_source(cls.forward)
    return source is not None and any(source.key(i) == statement_key(_LOOKUP) for i in range(len(source.statements)))
