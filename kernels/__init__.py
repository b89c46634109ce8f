"""fusionscope's fused Triton kernels, installed as ``fusionscope.kernels``.

Run from the repository root (pytest's ``pythonpath``, ``python -m``), this folder is also importable as a top-level
``kernels``, and that name belongs to Hugging Face's ``kernels`` distribution, which transformers imports at load time
(``from kernels import CUDAProperties``). Imported under the bare name, this package therefore steps aside: where that
distribution is installed elsewhere on ``sys.path`` it is loaded and left in ``sys.modules["kernels"]``, which is what
the import statement returns; where it is not, the import does nothing. Either way no triton import and no
``torch.library`` registration happen under the bare name (ops would register twice), so the kernel modules load only
under the ``fusionscope.kernels`` name.

Each public function lives in the module of the same name; the functions, not the modules, answer to these names
(``from fusionscope.kernels import rms_norm`` gives the function).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any


def _hand_over_bare_name() -> bool:
    """Load the ``kernels`` distribution installed outside this checkout into ``sys.modules["kernels"]``.

    The repository root is left out of the search, since there this folder answers to the name; the import machinery
    hands the caller whatever ``sys.modules`` holds once this package's code has run, so the caller gets the real
    package, and its submodules (``kernels.layer.mode``) resolve through the real package's ``__path__``. The module is
    registered before its code runs because that code imports its own submodules. A folder named ``kernels`` without an
    ``__init__.py`` (a namespace portion) is no distribution and is not taken. If the real package fails to import, the
    error propagates and the import machinery drops the name, as for any failing import. Returns whether it handed
    over.
    """
    here = Path(__file__).resolve()
    root = here.parent.parent

    def elsewhere(entry: object) -> bool:
        if not isinstance(entry, str):
            return False
        try:
            return Path(entry or ".").resolve() != root
        except (OSError, RuntimeError):
            return True

    spec = importlib.machinery.PathFinder.find_spec("kernels", [p for p in sys.path if elsewhere(p)])
    if spec is None or spec.loader is None or spec.origin is None or Path(spec.origin).resolve() == here:
        return False
    real = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = real
    spec.loader.exec_module(real)
    return True


_PUBLIC: dict[str, str] = {  # public name -> module that defines it
    "rms_norm": "rms_norm", "rms_norm_reference": "rms_norm",
    "add_rms_norm": "add_rms_norm", "add_rms_norm_reference": "add_rms_norm",
    "silu_and_mul": "silu_and_mul", "silu_and_mul_reference": "silu_and_mul",
    "gelu_and_mul": "gelu_and_mul", "gelu_and_mul_reference": "gelu_and_mul",
    "bias_gelu": "bias_gelu", "bias_gelu_reference": "bias_gelu",
    "add_layer_norm": "add_layer_norm", "add_layer_norm_reference": "add_layer_norm",
    "add_layer_norm_pair": "add_layer_norm", "add_layer_norm_pair_reference": "add_layer_norm",
    "rope": "rope", "rope_reference": "rope", "rope_and_cache": "rope", "rope_and_cache_reference": "rope",
    "decode_attention": "decode_attention", "decode_attention_reference": "decode_attention",
    "linear_act": "linear_act", "linear_act_reference": "linear_act", "linear_act_unfused": "linear_act",
    "w4a16_gemm": "w4a16_gemm", "w4a16_reference": "w4a16_gemm", "quantize_w4": "w4a16_gemm",
    "sample": "sample", "sample_reference": "sample", "kept_probs_reference": "sample",
    "fuse_linears": "horizontal", "FusedLinear": "horizontal",
    "gemv": "gemv", "gemv_reference": "gemv", "gemv_gated": "gemv", "gemv_gated_reference": "gemv",
}  # fmt: skip
__all__ = sorted(_PUBLIC)

if __name__ == "kernels":
    _hand_over_bare_name()

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
