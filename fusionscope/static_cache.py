"""A transformers static KV cache for fusionscope's decode steps, and its write counters.

transformers' `StaticCache` allocates every layer's K and V for `max_len` positions once and writes each step's rows in
place, which is what a CUDA graph needs (`apply --graphs`) and what a serving engine runs; `--cache static` makes the
profiled, timed and checked decode steps run on one too (`capture.run_sequence`, `apply.numerics.reference`), so the
predictions for a captured step come from the step it captures. Its layers keep their own write position (a device
counter, plus a Python int in a sliding-window layer) that every call advances whatever `cache_position` says, so
whoever starts a sequence over puts the counters back to zero (`empty`), and a capture puts them back to where they
were (`cache_state`, `restore_state`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def static_cache(model: nn.Module, max_len: int) -> Any:
    """A transformers StaticCache for `model`, `max_len` positions; its tensors are allocated on the first write.

    A sliding-window layer (`StaticSlidingWindowLayer`) keeps its length in a Python int beside the device counter,
    and transformers 5.17's Gemma-2 forward takes the step's positions and the sliding mask's query offset from it
    (`get_seq_length`), its mask sizes and its write branch too: a captured graph froze all three at the capture's
    value (Gemma-2's graph variants failed the teacher-forced check on the H200, 2026-12-02), and torch.compile,
    guarding on the int, recompiled every step until its limit and ran slower than eager. A layer whose window holds
    all `max_len` positions never rolls, and then computes exactly what a plain `StaticLayer` of `max_len` rows does
    (the same writes, mask sizes `(max_len, 0)`, and a window mask that masks nothing here), so this cache holds a
    `StaticLayer` in its place; the cache is ours, no transformers class is changed. A layer that can roll stays
    (a capture is refused: `window_overrun`)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    layers = getattr(cache, "layers", [])
    for index, layer in enumerate(layers):
        # exactly the sliding-window layer: a subclass (a hybrid with linear-attention state) keeps its own
        if type(layer) is StaticSlidingWindowLayer and layer.max_cache_len >= max_len:
            layers[index] = StaticLayer(max_cache_len=max_len)
    return cache


def _is_counter(name: str, value: object) -> bool:
    """A cache layer's write counter: a ≤ 1-element tensor (`cumulative_length`), or the Python int twin of one that
    transformers' `StaticSlidingWindowLayer` keeps to pick its branch (`cumulative_length_int`)."""
    if isinstance(value, torch.Tensor):
        return value.numel() <= 1
    return type(value) is int and name.startswith("cumulative")


def cache_state(cache: Any) -> list[dict[str, Any]]:
    """Copies of every write counter (`_is_counter`) each cache layer holds."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(layer).items() if _is_counter(k, v)}
            for layer in getattr(cache, "layers", [])]  # fmt: skip


def restore_state(cache: Any, state: list[dict[str, Any]]) -> None:
    """Put the counters `cache_state` copied back: tensors in place (a captured graph holds their addresses), ints
    by assignment."""
    for layer, saved in zip(getattr(cache, "layers", []), state):
        for name, value in saved.items():
            if isinstance(value, torch.Tensor):
                getattr(layer, name).copy_(value)
            else:
                setattr(layer, name, value)


def zeroed(state: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`state` with every counter at zero: an empty cache."""
    return [{k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in s.items()} for s in state]


def window_overrun(cache: Any, positions: int) -> str:
    """Why a graph of this cache would compute the wrong thing over `positions` rows ('' when it would not): a
    sliding-window layer picks between writing in place and rolling its rows by a Python int at call time, so a
    captured step keeps the branch it took at capture, right only while the sequence fits the window."""
    for layer in getattr(cache, "layers", []):
        window = getattr(layer, "max_cache_len", None) if getattr(layer, "is_sliding", False) else None
        if window is not None and positions > window:
            return (f"a sliding-window cache layer ({window} rows) would roll past its window within {positions} "
                    "positions, a branch a captured step cannot take")  # fmt: skip
    return ""


def empty(cache: Any) -> None:
    """Every write counter of `cache` back to zero: the next write is a new sequence's first row."""
    restore_state(cache, zeroed(cache_state(cache)))
