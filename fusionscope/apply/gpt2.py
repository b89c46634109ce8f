"""GPT-2's residual adds fused with the LayerNorms that read them, by rewriting each block instance's forward.

A GPT-2 block is pre-LN: `h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))`. The add before ln_2 sits in the block, so
the rewritten forward calls `add_layer_norm(attn_out, x)` once for both. The add before ln_1 of block i + 1 (and
before `ln_f`) is block i's last line, on the other side of a module boundary: as vLLM's decoder layers do
(`forward(positions, hidden_states, residual)` returning both), block i hands `(mlp_out, h)` over to the stack's
carry (`fusionscope.apply.layers.Carry`, the one the decoder-layer rewrite uses) and returns `mlp_out` unsummed;
block i + 1 (or `ln_f`), recognising that very tensor, calls `add_layer_norm(mlp_out, h)` for its norm and gets the
new residual with it. Block 0's ln_1 reads `wte(ids) + wpe(positions)`, an add made inline in `GPT2Model.forward`: no
module boundary carries it, so that site stays unfused.

"The block computes this" is checked, not assumed: `read_block` accepts a block class only when its forward is,
statement for statement, GPT2Block's (`BLOCK`, written with the forward's own cache parameter: `past_key_values` in
transformers 5.17, `cache` in 5.24, whose `deprecate_kwarg` rename is made as the decorator makes it) — a block that
scales a branch or adds in another place is refused at the statement that differs. Its cross-attention branch may hold
anything: the rewrite never runs it (below).

Where the carry's contract cannot hold, the exact unfused computation runs instead: a consumer handed any other
tensor discards the carry (an identity check, not a shape check); a block given `encoder_hidden_states`
(cross-attention) adds a carried input back and runs its class's own forward, and so does every rewritten module in
training mode (`fusionscope.apply.source.unless_training`: the kernels have no backward); while the hidden states are
recorded (`fusionscope.apply.layers.hidden_states_recorded`: GPT2Model pops `output_hidden_states` before it calls
the blocks, so what tells is transformers' output capture, whose hooks read each block's output) no block carries,
so every recorded state is the true sum. The limit: a block whose forward carries returns `mlp_out`, not the hidden
state, to whoever called it — GPT2Model's own loop hands it to the next block or `ln_f`, which is what the carry
relies on; code that calls a patched block itself, or reads its output through a forward hook of its own, sees
`mlp_out`. The carry is Python state, set and read in program order: a CUDA graph captured from the patched forward
bakes in the branch taken at capture (the same at every replay, since the identity holds at capture); under
torch.compile dynamo traces the identity check and the carry's writes (not exercised by the CPU tests).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn

from fusionscope.apply.layers import Carry, hidden_states_recorded, output_collector
from fusionscope.apply.patcher import Patcher, Support
from fusionscope.apply.source import (
    deprecated_aliases,
    difference,
    forward_replaced,
    read_source,
    rename,
    template,
    unless_training,
)

OWNER = "add_layer_norm"
# The block's parameters after hidden_states, as GPT2Block.forward names them in transformers 5.17 (the cache is
# `past_key_values`) and 5.24 (`cache`); the attention gets all of them but the encoder ones, as the original passes.
CACHE_NAMES = ("cache", "past_key_values")
BLOCK_PARAMS = ("attention_mask", "encoder_hidden_states", "encoder_attention_mask", "use_cache")
ENCODER_PARAMS = ("encoder_hidden_states", "encoder_attention_mask")
# GPT2Block.forward's body in 5.17 and 5.24 ({cache}: the cache parameter, {kw}: the **kwargs); the
# cross-attention branch's body is free (`...`): whenever its test holds, the class's forward runs instead
BLOCK = """
    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    attn_output, _ = self.attn(
        hidden_states, {cache}={cache}, attention_mask=attention_mask, use_cache=use_cache, **{kw}
    )
    hidden_states = attn_output + residual
    if encoder_hidden_states is not None:
        ...
    residual = hidden_states
    hidden_states = self.ln_2(hidden_states)
    feed_forward_hidden_states = self.mlp(hidden_states)
    hidden_states = residual + feed_forward_hidden_states
    return hidden_states
"""

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockForm:
    """What the rewrite needs of a GPT-2 block class's forward: the positional parameters after hidden_states, the
    defaults of those the attention is given, and its decorators' keyword renames."""

    names: tuple[str, ...]
    defaults: dict[str, Any]
    aliases: tuple[tuple[str, str], ...]


@dataclass
class BlockPlan:
    """What one block's rewritten forward does: which of its adds it fuses and whether it hands its last add on."""

    carry: Carry  # the stack's
    form: BlockForm
    config: Any  # the stack's: where output_hidden_states is read
    fuse_ln_1: bool = False
    fuse_ln_2: bool = False
    carry_out: bool = False


@dataclass(frozen=True)
class Site:
    """A GPT-2 LayerNorm site: the stack's path, the block index (None for ln_f) and the norm's name."""

    stack: str
    index: int | None
    norm: str


def site_of(patcher: Patcher, path: str) -> Site | None:
    """The GPT-2 site a LayerNorm path names (`<stack>.h.<i>.ln_1|ln_2`, `<stack>.ln_f`), or None."""
    parts = path.split(".")
    if len(parts) >= 3 and parts[-1] in ("ln_1", "ln_2") and parts[-3] == "h" and parts[-2].isdigit():
        stack = ".".join(parts[:-3])
        return Site(stack, int(parts[-2]), parts[-1]) if _is_stack(patcher.module(stack)) else None
    if parts[-1] == "ln_f":
        stack = ".".join(parts[:-1])
        return Site(stack, None, "ln_f") if _is_stack(patcher.module(stack)) else None
    return None


def _is_stack(module: nn.Module | None) -> bool:
    return (
        module is not None
        and isinstance(getattr(module, "h", None), nn.ModuleList)
        and isinstance(getattr(module, "ln_f", None), nn.LayerNorm)
    )


def layer_norm_refusal(norm: nn.Module, name: str, patcher: Patcher | None = None) -> str:
    """Why the add_layer_norm kernel cannot stand in for the LayerNorm `norm` ('' when it can): it computes
    `nn.LayerNorm.forward` over the last dimension, from the instance's weight, bias and eps."""
    if type(norm).forward is not nn.LayerNorm.forward:
        return f"{name} is a {type(norm).__name__}, whose forward is not nn.LayerNorm's"
    if len(norm.normalized_shape) != 1:
        return f"{name} normalises over {len(norm.normalized_shape)} dimensions; the kernel normalises over the last"
    return forward_replaced(norm, patcher)


@cache
def read_block(cls: type) -> BlockForm | str:
    """The form of a GPT-2 block class whose forward is GPT2Block's (`BLOCK`); else the reason, naming the first
    statement that differs."""
    name = f"{cls.__name__}.forward"
    source = read_source(cls.forward)
    if source is None:
        return f"the source of {name} cannot be read"
    params = list(inspect.signature(cls.forward).parameters.values())[2:]  # after self, hidden_states
    names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    cache_names = [n for n in names if n in CACHE_NAMES]
    if (
        source.params[1:2] != ("hidden_states",)
        or len(cache_names) != 1
        or set(names) != {cache_names[0], *BLOCK_PARAMS}
        or not params
        or params[-1].kind is not inspect.Parameter.VAR_KEYWORD
        or source.varargs
        or source.kwonly
    ):
        return f"{name}{tuple(p.name for p in params)} is not GPT2Block's signature"
    aliases = deprecated_aliases(source.decorators)
    if isinstance(aliases, str):
        return f"{cls.__name__}: {aliases}"
    body = template(BLOCK.format(cache=cache_names[0], kw=source.varkw))
    reason = difference(source, body, name, "GPT2Block.forward")
    if reason:
        return reason
    defaults = {p.name: p.default for p in params if p.name in names and p.name not in ENCODER_PARAMS}
    return BlockForm(names, defaults, aliases)


def block_form(block: nn.Module, patcher: Patcher | None = None) -> BlockForm | str:
    """The form of a block instance the rewrite can take, or why this block is not the GPT-2 block it reproduces."""
    for name, kind in (("ln_1", nn.LayerNorm), ("attn", nn.Module), ("ln_2", nn.LayerNorm), ("mlp", nn.Module)):
        if not isinstance(getattr(block, name, None), kind):
            return f"{type(block).__name__} has no {name} {kind.__name__}: not a GPT-2 block"
    refusal = forward_replaced(block, patcher)
    for name in ("ln_1", "ln_2"):
        refusal = refusal or layer_norm_refusal(getattr(block, name), name, patcher)
    return refusal or read_block(type(block))


def block_forward(plan: BlockPlan, kernel: Kernel) -> Callable[..., torch.Tensor]:
    """GPT2Block.forward with the in-block add + ln_2 as one kernel call, the incoming carried add + ln_1 as another,
    and (carry_out) the last add handed to the next consumer. Arguments reach `self.attn` as the original passes
    them; returns a tensor, as GPT2Block does in 5.17 and 5.24. In training mode, the class's forward."""
    form, carry = plan.form, plan.carry

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > len(form.names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(form.names) + 1} positional arguments")
        kwargs.update(zip(form.names, args))
        rename(kwargs, form.aliases)
        carried = carry.take(hidden_states)
        if kwargs.get("encoder_hidden_states") is not None:  # cross-attention adds a residual this rewrite does not
            if carried is not None:
                hidden_states = carried[1] + carried[0]
            return type(self).forward(self, hidden_states, **kwargs)
        attn_kwargs = {**form.defaults, **{k: v for k, v in kwargs.items() if k not in ENCODER_PARAMS}}
        if carried is not None and plan.fuse_ln_1:
            ln_1 = self.ln_1
            h, residual = kernel(*carried, ln_1.weight, ln_1.bias, ln_1.eps)
        else:
            residual = carried[1] + carried[0] if carried is not None else hidden_states
            h = self.ln_1(residual)
        attn_output, _ = self.attn(h, **attn_kwargs)
        if plan.fuse_ln_2:
            ln_2 = self.ln_2
            h, residual = kernel(attn_output, residual, ln_2.weight, ln_2.bias, ln_2.eps)
        else:
            residual = attn_output + residual
            h = self.ln_2(residual)
        mlp_out = self.mlp(h)
        if plan.carry_out and not hidden_states_recorded(kwargs, plan.config):
            return carry.hand_over(mlp_out, residual)
        return residual + mlp_out

    return unless_training(forward, carry.restore)


def final_norm_forward(carry: Carry, kernel: Kernel) -> Callable[..., torch.Tensor]:
    """ln_f's forward: the last block's carried add and this norm in one kernel call; any other input is normalised
    by the LayerNorm's own forward (in training mode, the carried add first)."""

    def forward(self: nn.LayerNorm, hidden_states: torch.Tensor) -> torch.Tensor:
        carried = carry.take(hidden_states)
        if carried is None:
            return type(self).forward(self, hidden_states)
        out, _ = kernel(*carried, self.weight, self.bias, self.eps)
        return out

    return unless_training(forward, carry.restore)


def patch_stack(patcher: Patcher, stack_path: str, sites: dict[Site, str], kernel: Kernel) -> dict[str, Support]:
    """Rewrite the blocks (and ln_f) of one stack for its `sites` ({site: path}); one Support per path. A block
    whose next consumer fuses is rewritten to carry even when none of its own norms is a site."""
    transformer = patcher.module(stack_path)
    blocks = list(transformer.h)
    forms = [block_form(block, patcher) for block in blocks]
    wrong = next((s for s in forms if isinstance(s, str)), None)
    if wrong is not None or not blocks:
        reason = wrong or "the stack has no blocks: no residual add to fuse"
        return {path: Support.no(reason) for path in sites.values()}
    carry = Carry()
    config = getattr(transformer, "config", None)
    plans = [BlockPlan(carry, form, config) for form in forms]
    results: dict[str, Support] = {}
    for site, path in sites.items():
        carried = site.index is None or (site.norm == "ln_1" and site.index > 0)
        if carried and output_collector() is None:
            results[path] = Support.no(
                "this transformers has no output-capturing collector to tell when block outputs are recorded, "
                "so no block may carry its residual"
            )
            continue
        if site.index is None:
            refusal = layer_norm_refusal(transformer.ln_f, "ln_f", patcher)
            if refusal:
                results[path] = Support.no(refusal)
                continue
            plans[-1].carry_out = True
            patcher.set_forward(transformer.ln_f, final_norm_forward(carry, kernel), owner=OWNER)
        elif site.index >= len(blocks):
            results[path] = Support.no(f"{stack_path}.h has no block {site.index}")
            continue
        elif site.norm == "ln_2":
            plans[site.index].fuse_ln_2 = True
        elif site.index == 0:
            results[path] = Support.no(
                "block 0's ln_1 reads wte(ids) + wpe(positions), an add made inline in the model's forward: no "
                "module boundary to carry it across"
            )
            continue
        else:
            plans[site.index].fuse_ln_1 = True
            plans[site.index - 1].carry_out = True
        results[path] = Support.yes()
    for block, plan in zip(blocks, plans):
        if plan.fuse_ln_1 or plan.fuse_ln_2 or plan.carry_out:
            patcher.set_forward(block, block_forward(plan, kernel), owner=OWNER)
    patcher.state.setdefault(OWNER, []).append(carry)
    return results
