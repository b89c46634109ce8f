"""The weight-streaming floor of a decode step: the least time one step can take on this device.

At small batch a decode step must read every weight once and the KV cache written so far, and does little
arithmetic on each byte, so bytes ÷ the measured copy bandwidth bounds it from below whatever the kernels, the
launches or the host do. `profile` shows it per decode phase, so a user sees how far eager decode is from it before
applying anything; `apply --graphs` shows every variant as a multiple of it.
"""

from __future__ import annotations

from torch import nn


def weight_floor(model: nn.Module, batch: int, kv_len: float, copy_gbps: float) -> dict[str, float]:
    """The weight-streaming floor of one decode step: every weight read once (the input embedding only for the
    batch's rows, unless the LM head shares it), plus the KV cache read at `kv_len` positions, at the measured copy
    bandwidth. bytes / (GB/s) gives µs per 1e3 bytes."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and head is not None and embed.weight is head.weight
    seen: set[int] = set()
    weights = 0
    # packed weights (a quantised Linear's qweight, scales, zeros) are persistent buffers, read every step as well
    persistent = [b for m in model.modules() for n, b in m.named_buffers(recurse=False)
                  if n not in m._non_persistent_buffers_set]  # fmt: skip
    for p in [*model.parameters(), *persistent]:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if embed is not None and p is embed.weight and not tied:
            weights += batch * p.shape[-1] * p.element_size()
            continue
        weights += p.numel() * p.element_size()
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    element = next(model.parameters()).element_size()
    kv = 2 * config.num_hidden_layers * batch * kv_heads * head_dim * kv_len * element
    total = weights + kv
    return {"weight_bytes": float(weights), "kv_bytes": float(kv), "bytes": float(total), "kv_len": float(kv_len),
            "copy_gbps": copy_gbps, "ms": total / (copy_gbps * 1e6) if copy_gbps else None}  # fmt: skip
