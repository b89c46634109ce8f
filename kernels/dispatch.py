"""How a public kernel function reaches its Triton launch: through the registered op only when it must.

Each kernel registers its launcher with `torch.library.triton_op` as `fusionscope::<name>`, so torch.compile sees
the op in its graph (and can capture it in CUDA graphs). Launchers call `wrap_triton(kernel)[grid](...)`, which is
what lets the op be traced. In eager mode both of the obvious paths are slow:
- through `torch.ops.fusionscope.<name>`: the dispatcher round trip costs 80–110 µs of host time per call on the
  H200 (torch 2.11);
- calling the launcher directly: `wrap_triton` is enabled by default, so every launch goes through the
  `triton_kernel_wrapper_mutation` higher-order op's Python dispatch — 290–610 µs per call measured there
  (`reports/bench/`), against ~17 µs for a plain `kernel[grid](...)`.
So eager calls run the launcher with `wrap_triton` switched off for the call (what `triton_op` itself does for its
eager implementation): `wrap_triton(kernel)` then returns the kernel, launched the usual way. Traced and compiled
calls go through the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:  # private, but stable since torch 2.6; without it eager calls take the op path (correct, slower)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the installed torch
    set_wrap_triton_enabled = None


def run(name: str, launcher: Callable[..., None], *args: Any) -> None:
    """Call `fusionscope::<name>` under torch.compile, the plain launcher otherwise (same arguments, same effect)."""
    if torch.compiler.is_compiling() or set_wrap_triton_enabled is None:
        getattr(torch.ops.fusionscope, name)(*args)
        return
    with set_wrap_triton_enabled(False):
        launcher(*args)
