"""GPT-2's residual adds fused with the LayerNorms that read them, by rewriting each block instance's forward.

A GPT-2 block is pre-LN: `h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))`. The add before ln_2 sits in the block, so
the rewritten forward calls `add_layer_norm(attn_out, x)` once for both. The add before ln_1 of block i + 1 (and
before `ln_f`) is block i's last line, on the other side of a module boundary: as vLLM's decoder layers do
(`forward(positions, hidden_states, residual)` returning both), block i leaves `(mlp_out, h)` in a carry and returns
`mlp_out` unsummed; block i + 1 (or `ln_f`), recognising that very tensor, calls `add_layer_norm(mlp_out, h)` for its
norm and gets the new residual with it. Block 0's ln_1 reads `wte(ids) + wpe(positions)`, an add made inline in
`GPT2Model.forward`: no module boundary carries it, so that site stays unfused.

Where the carry's contract cannot hold, the exact unfused computation runs instead: a consumer handed any other
tensor discards the carry (an identity check, not a shape check); a block in training mode, or given
`encoder_hidden_states` (cross-attention), sums a carried input back and runs its class's own forward; while
transformers records per-layer hidden states (`output_hidden_states=True`, read by its output-capturing hooks), no
block carries, so every recorded state is the true sum. The limit: a block whose forward carries returns `mlp_out`,
not the hidden state, to whoever called it — GPT2Model's own loop hands it to the next block or `ln_f`, which is what
the carry relies on; code that calls a patched block itself, or reads its output through a forward hook of its own,
sees `mlp_out`. The carry is Python state, set and read in program order: a CUDA graph captured from the patched
forward bakes in the branch taken at capture (the same at every replay, since the identity holds at capture); under
torch.compile dynamo traces the identity check and the carry's writes (not exercised by the CPU tests).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusionscope.apply.patching import Patcher, Support

OWNER = "add_layer_norm"
# The block's parameters after hidden_states, as GPT2Block.forward names them in transformers 5.17 (the cache is
# `past_key_values`) and 5.24 (`cache`); the attention gets all of them but the encoder ones, as the original passes.
CACHE_NAMES = ("cache", "past_key_values")
BLOCK_PARAMS = ("attention_mask", "encoder_hidden_states", "encoder_attention_mask", "use_cache")
ENCODER_PARAMS = ("encoder_hidden_states", "encoder_attention_mask")
# The names GPT2Block.forward reads, the same in 5.17 and 5.24: a block class whose forward reads anything else
# (a scaled residual, another module) is not the computation this rewrite reproduces.
BLOCK_NAMES = ("ln_1", "attn", "hasattr", "ValueError", "ln_cross_attn", "crossattention", "ln_2", "mlp")

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Carry:
    """The unsummed output of a block: `x` (its MLP output, what it returned) and `residual` (the hidden state the
    MLP's output is still to be added to)."""

    x: torch.Tensor
    residual: torch.Tensor


@dataclass
class Stack:
    """One GPT-2 stack (`<path>.h` and `<path>.ln_f`) and the carry in flight between two of its modules."""

    path: str
    carry: Carry | None = None

    def take(self, hidden_states: torch.Tensor) -> Carry | None:
        """The carry if `hidden_states` is the tensor it was made for (then it is consumed); a stale carry is
        dropped either way."""
        carry, self.carry = self.carry, None
        return carry if carry is not None and hidden_states is carry.x else None


@dataclass
class BlockPlan:
    """What one block's rewritten forward does: which of its adds it fuses and whether it hands its last add on."""

    stack: Stack
    names: tuple[str, ...]  # the positional parameters after hidden_states
    defaults: dict[str, Any] = field(default_factory=dict)  # of those the attention is given
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


def block_signature(block: nn.Module) -> tuple[tuple[str, ...], dict[str, Any]] | str:
    """(positional parameter names after hidden_states, the defaults of those the attention gets), or why this
    block's forward is not the GPT-2 block this rewrite reproduces."""
    for name, kind in (("ln_1", nn.LayerNorm), ("attn", nn.Module), ("ln_2", nn.LayerNorm), ("mlp", nn.Module)):
        if not isinstance(getattr(block, name, None), kind):
            return f"{type(block).__name__} has no {name} {kind.__name__}: not a GPT-2 block"
    if inspect.unwrap(type(block).forward).__code__.co_names != BLOCK_NAMES:
        return f"{type(block).__name__}.forward reads other names than GPT2Block.forward {BLOCK_NAMES}"
    params = list(inspect.signature(type(block).forward).parameters.values())[2:]  # after self, hidden_states
    names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    cache = [n for n in names if n in CACHE_NAMES]
    if (
        len(cache) != 1
        or set(names) != {cache[0], *BLOCK_PARAMS}
        or params[-1].kind is not inspect.Parameter.VAR_KEYWORD
    ):
        return f"{type(block).__name__}.forward{tuple(p.name for p in params)} is not GPT2Block's signature"
    defaults = {p.name: p.default for p in params if p.name in names and p.name not in ENCODER_PARAMS}
    return names, defaults


def hidden_states_recorded() -> bool:
    """Whether transformers is collecting per-layer hidden states (its output-capturing hooks read each block's
    output). Both 5.17 and 5.24 keep the collector in `transformers.utils.output_capturing`; where it is missing,
    `patch_stack` lets no block carry."""
    collector = _output_collector()
    collected = collector.get() if collector is not None else None
    return bool(collected) and "hidden_states" in collected


@functools.cache
def _output_collector() -> Any:
    """transformers' context variable of the outputs being captured, looked up once (each block asks at decode)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def block_forward(plan: BlockPlan, kernel: Kernel) -> Callable[..., torch.Tensor]:
    """GPT2Block.forward with the in-block add + ln_2 as one kernel call, the incoming carried add + ln_1 as another,
    and (carry_out) the last add handed to the next consumer. Arguments reach `self.attn` as the original passes
    them; returns a tensor, as GPT2Block does in 5.17 and 5.24."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > len(plan.names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(plan.names) + 1} positional arguments")
        kwargs.update(zip(plan.names, args))
        if "past_key_values" in kwargs and "past_key_values" not in plan.names:  # 5.24's renamed keyword
            kwargs.setdefault("cache", kwargs.pop("past_key_values"))
        carried = plan.stack.take(hidden_states)
        if self.training or kwargs.get("encoder_hidden_states") is not None:
            # no history through the kernels; cross-attention adds a residual this rewrite does not handle
            if carried is not None:
                hidden_states = carried.residual + carried.x
            return type(self).forward(self, hidden_states, **kwargs)
        attn_kwargs = {**plan.defaults, **{k: v for k, v in kwargs.items() if k not in ENCODER_PARAMS}}
        if carried is not None and plan.fuse_ln_1:
            ln_1 = self.ln_1
            h, residual = kernel(carried.x, carried.residual, ln_1.weight, ln_1.bias, ln_1.eps)
        else:
            residual = carried.residual + carried.x if carried is not None else hidden_states
            h = self.ln_1(residual)
        attn_output, _ = self.attn(h, **attn_kwargs)
        if plan.fuse_ln_2:
            ln_2 = self.ln_2
            h, residual = kernel(attn_output, residual, ln_2.weight, ln_2.bias, ln_2.eps)
        else:
            residual = attn_output + residual
            h = self.ln_2(residual)
        mlp_out = self.mlp(h)
        if plan.carry_out and not hidden_states_recorded():
            plan.stack.carry = Carry(mlp_out, residual)
            return mlp_out
        return residual + mlp_out

    return forward


def final_norm_forward(stack: Stack, kernel: Kernel) -> Callable[..., torch.Tensor]:
    """ln_f's forward: the last block's carried add and this norm in one kernel call; any other input is normalised
    by the LayerNorm's own forward."""

    def forward(self: nn.LayerNorm, hidden_states: torch.Tensor) -> torch.Tensor:
        carried = stack.take(hidden_states)
        if carried is None:
            return type(self).forward(self, hidden_states)
        out, _ = kernel(carried.x, carried.residual, self.weight, self.bias, self.eps)
        return out

    return forward


def patch_stack(patcher: Patcher, stack_path: str, sites: dict[Site, str], kernel: Kernel) -> dict[str, Support]:
    """Rewrite the blocks (and ln_f) of one stack for its `sites` ({site: path}); one Support per path. A block
    whose next consumer fuses is rewritten to carry even when none of its own norms is a site."""
    transformer = patcher.module(stack_path)
    blocks = list(transformer.h)
    signatures = [block_signature(block) for block in blocks]
    wrong = next((s for s in signatures if isinstance(s, str)), None)
    if wrong is not None or not blocks:
        reason = wrong or "the stack has no blocks: no residual add to fuse"
        return {path: Support.no(reason) for path in sites.values()}
    stack = Stack(stack_path)
    plans = [BlockPlan(stack, *signature) for signature in signatures]
    results: dict[str, Support] = {}
    for site, path in sites.items():
        carried = site.index is None or (site.norm == "ln_1" and site.index > 0)
        if carried and _output_collector() is None:
            results[path] = Support.no(
                "this transformers has no output-capturing collector to tell when block outputs are recorded, "
                "so no block may carry its residual"
            )
            continue
        if site.index is None:
            plans[-1].carry_out = True
            patcher.set_forward(transformer.ln_f, final_norm_forward(stack, kernel), owner=OWNER)
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
    patcher.state.setdefault(OWNER, []).append(stack)
    return results
