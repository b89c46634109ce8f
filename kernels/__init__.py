"""fusionscope's fused Triton kernels, installed as ``fusionscope.kernels``.

Run from the repository root, this folder is also importable as a top-level ``kernels``, and transformers imports
whatever answers to that name at import time (when no distribution owns it) to read its version. Imported that way it
must do nothing: no triton import, no ``torch.library`` registration. So this file imports nothing eagerly; kernel
modules load on first attribute access, and only under the ``fusionscope.kernels`` name.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC: dict[str, str] = {}  # public function name -> submodule that defines it


def __getattr__(name: str) -> Any:
    if __name__ != "fusionscope.kernels" or name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)


def __dir__() -> list[str]:
    return sorted(_PUBLIC) if __name__ == "fusionscope.kernels" else []
