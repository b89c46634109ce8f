"""How a public kernel function reaches its Triton launch: through the registered op only when it must.

Each kernel registers its launcher with `torch.library.triton_op` as `fusionscope::<name>`, so torch.compile sees
the op in its graph (and can capture it in CUDA graphs). Launchers call `wrap_triton(kernel)[grid](...)`, which is
what lets the op be traced. In eager mode both of the obvious paths are slow:
- through `torch.ops.fusionscope.<name>`: the dispatcher round trip costs 80–110 µs of host time per call on the
  H200 (torch 2.11);
- calling the launcher directly: `wrap_triton` is enabled by default, so every launch goes through the
  `triton_kernel_wrapper_mutation` higher-order op's Python dispatch — 222–593 µs per call measured there
  (`reports/bench/`), against ~17 µs for a plain `kernel[grid](...)`.
So plain eager calls — no torch.compile, no dispatch mode (make_fx, FakeTensorMode, ...) active, every tensor
argument a plain `torch.Tensor` or `nn.Parameter` — run the launcher with `wrap_triton` switched off for the call
(what `triton_op` itself does for its eager implementation): `wrap_triton(kernel)` then returns the kernel,
launched the usual way. Everything else goes through the op, which traces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:  # private, but stable since torch 2.6; without it eager calls take the op path (correct, slower)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the installed torch
    set_wrap_triton_enabled = None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a model's weights are Parameters; other subclasses may trace


def _plain_eager(args: tuple) -> bool:
    if set_wrap_triton_enabled is None or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


def run(name: str, launcher: Callable[..., None], *args: Any) -> None:
    """Call the plain launcher in plain eager mode, `fusionscope::<name>` otherwise (same arguments, same effect)."""
    if not _plain_eager(args):
        getattr(torch.ops.fusionscope, name)(*args)
        return
    with set_wrap_triton_enabled(False):
        launcher(*args)
