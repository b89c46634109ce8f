"""fusionscope's fused Triton kernels, installed as ``fusionscope.kernels``.

Run from the repository root, this folder is also importable as a top-level ``kernels``, and transformers imports
whatever answers to that name at import time (when no distribution owns it) to read its version. Imported that way it
must do nothing: no triton import, no ``torch.library`` registration (or ops would register twice). So the kernel
modules load only under the ``fusionscope.kernels`` name.

Each public function lives in the module of the same name; the functions, not the modules, answer to these names
(``from fusionscope.kernels import rms_norm`` gives the function).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC: dict[str, str] = {  # public name -> module that defines it
    "rms_norm": "rms_norm", "rms_norm_reference": "rms_norm",
    "add_rms_norm": "add_rms_norm", "add_rms_norm_reference": "add_rms_norm",
    "silu_and_mul": "silu_and_mul", "silu_and_mul_reference": "silu_and_mul",
    "gelu_and_mul": "gelu_and_mul", "gelu_and_mul_reference": "gelu_and_mul",
    "bias_gelu": "bias_gelu", "bias_gelu_reference": "bias_gelu",
    "add_layer_norm": "add_layer_norm", "add_layer_norm_reference": "add_layer_norm",
    "rope": "rope", "rope_reference": "rope", "rope_and_cache": "rope", "rope_and_cache_reference": "rope",
    "decode_attention": "decode_attention", "decode_attention_reference": "decode_attention",
    "linear_act": "linear_act", "linear_act_reference": "linear_act", "linear_act_unfused": "linear_act",
    "w4a16_gemm": "w4a16_gemm", "w4a16_reference": "w4a16_gemm", "quantize_w4": "w4a16_gemm",
    "sample": "sample", "sample_reference": "sample", "kept_probs_reference": "sample",
    "fuse_linears": "horizontal", "FusedLinear": "horizontal",
}  # fmt: skip
__all__ = sorted(_PUBLIC)


if __name__ == "fusionscope.kernels":
    # Bind every public name now: a submodule import sets the package attribute of its name to the module, and the
    # function must win whichever import comes first.
    for _name, _module in _PUBLIC.items():
        globals()[_name] = getattr(importlib.import_module(f"{__name__}.{_module}"), _name)
    del _name, _module


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_PUBLIC) if __name__ == "fusionscope.kernels" else []
