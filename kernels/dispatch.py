"""How a public kernel function reaches its Triton launch: through the registered op only when it must.

Each kernel registers its launcher with `torch.library.triton_op` as `fusionscope::<name>`, so torch.compile sees
the op in its graph (and can capture it in CUDA graphs). In eager mode the dispatcher round trip through
`torch.ops.fusionscope.<name>` costs 80–110 µs of host time per call on the H200 (torch 2.11), against ~20 µs for
the Triton launch itself — at decode sizes that host cost is the whole story. So eager calls go straight to the
launcher; traced and compiled calls go through the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def run(name: str, launcher: Callable[..., None], *args: Any) -> None:
    """Call `fusionscope::<name>` under torch.compile, the plain launcher otherwise (same arguments, same effect)."""
    if torch.compiler.is_compiling():
        getattr(torch.ops.fusionscope, name)(*args)
    else:
        launcher(*args)
