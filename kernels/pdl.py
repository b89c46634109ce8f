"""Programmatic dependent launch (PDL): a decode step's kernels start while the one before them finishes.

A replayed decode step is a chain of ~370 kernels, most of them a few µs long; between two of them the GPU spends
~0.4 µs idle, and each kernel spends its first ~1 µs filling the memory pipeline (the GEMV's fit: ~3.3 µs per call
plus its bytes, `reports/gemv/`). On Hopper a kernel launched with the PDL attribute may start as soon as every
program of the kernel before it has signalled (`gdc_launch_dependents`) or exited: its programs become resident and
do what needs nothing from that kernel (the GEMV loads its first tile of weights) and then block in `gdc_wait` until
the kernel before has finished and its writes are visible. CUDA graph capture keeps the overlap (a programmatic edge).

The rule every kernel here keeps when `PDL` is set: `gdc_wait()` before its first load of anything another kernel
writes (activations, caches, counters) and before its first store; constant inputs (weights) may be read before it.
It signals its dependents right after the wait, so at most one kernel runs ahead of the one that is working, and
those that wait hold no resources that the working one's programs need (all of its programs are resident by then).
A kernel that signals early is harmless to a dependent launched the usual way (cuBLAS, torch's): that one starts
after the whole kernel, as without PDL.

`launch_options(t)` gives a launch `{"PDL": True, "launch_pdl": True}` only for a plain eager call on an sm90+ GPU
(what a captured graph records) with a Triton that has both; otherwise `{"PDL": False}`: in the interpreter (which
has no grid dependency control), under torch.compile (whose launcher is Inductor's) and on older GPUs the kernels
are what they were. `PDL["enabled"] = False` (or `FUSIONSCOPE_PDL=0`) switches it off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from fusionscope.kernels.dispatch import Tunables, eager_launch

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed triton

    @triton.jit
    def gdc_wait() -> None:  # never reached: `launch_options` keeps PDL off without the real one
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass

    _HAS_GDC = False
else:
    _HAS_GDC = True


@triton.jit
def wait_for_previous(PDL: tl.constexpr) -> None:
    """With `PDL`: wait until the kernel before has finished and its writes are visible, then let the next kernel
    launch (module docstring: the rule). Every PDL kernel calls this before its first load of another kernel's
    output and its first store."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _has_launch_option() -> bool:
    """Whether Triton's CUDA launcher takes `launch_pdl`."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - depends on the installed triton
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


PDL = Tunables(enabled=os.environ.get("FUSIONSCOPE_PDL", "1") != "0" and _HAS_GDC and _has_launch_option())
_OFF: dict[str, Any] = {"PDL": False}
_ON: dict[str, Any] = {"PDL": True, "launch_pdl": True}


@functools.cache
def _hopper_or_later(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(t: torch.Tensor) -> dict[str, Any]:
    """The PDL constexpr and launch option for a kernel on `t`'s device (module docstring)."""
    if not PDL["enabled"] or not t.is_cuda or not eager_launch():
        return _OFF
    return _ON if _hopper_or_later(t.device.index if t.device.index is not None else 0) else _OFF
