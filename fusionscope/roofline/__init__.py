"""Roofline cost model for aten ops, and roofline classification of timed kernels.

Two halves, one module per job:

* :func:`op_cost` (`registry`) turns one profiler op event (name, ``Input Dims``, ``Input type``, ``Concrete
  Inputs``) into an :class:`OpCost`: the floating-point work and the *minimal* DRAM traffic of the op. Minimal means
  compulsory: every input tensor read once and every output tensor written once. A real kernel can only move more
  (re-reads, spills, multi-pass algorithms), so the achieved bandwidth computed from this model is a lower bound on
  what the hardware moved, and "fraction of roof" measures how close the kernel is to the best any implementation
  could do. The cost functions are split by what they cost: `elementwise`, `copies` (copies, casts, fills,
  factories), `gemm`, `attention`, `reductions` (norms, softmax, reductions), `indexing` and `sampling`; each reads
  its op's arguments through `args` and sizes them with `dtypes`, and returns an `opcost.OpCost`.

* :func:`classify` / :func:`classify_kernels` / :func:`classify_against` (`classify`) place timed kernels against a
  device's measured roofs and label each one ``compute``, ``memory``, ``latency`` or ``unmodeled``.

Why inputs alone are enough
---------------------------
``torch.profiler`` with ``record_shapes=True`` records only the arguments of an op, never its results. That loses
nothing the cost model needs: an aten op's output shapes and dtypes are a function of its input shapes, dtypes and
scalar arguments (that is how meta/fake tensors work). Each cost function re-derives the outputs it needs from the
op's schema: broadcasting for elementwise ops, ``(M, N)`` for a GEMM, the reduced dims (from the ``dim`` concrete
argument) for a reduction, ``k`` for ``topk``, the dtype code for ``_to_copy``, and so on. The few things a trace
cannot tell us are documented where they matter:

* ``Tensor?[]`` arguments (the indices of ``index`` / ``index_put_``) are not recorded at all, so those two ops are
  estimates (see their cost functions in `indexing`).
* ``TensorList`` arguments (``cat`` / ``stack``) are recorded with shapes but without a dtype; ``op_cost`` assumes
  ``default_dtype`` for them (``float32`` unless the caller knows better, e.g. the model's dtype).

Which ops cost nothing (composites, views) and why costs go to the innermost costed op: `registry`. How causal masks
and sliding windows scale attention's FLOPs: `attention`.
"""

from __future__ import annotations

from fusionscope.roofline.classify import (
    LATENCY_FRACTION,
    LATENCY_US,
    NO_ROOF_COLUMNS,
    classify,
    classify_against,
    classify_kernels,
    peak_tflops,
)
from fusionscope.roofline.dtypes import dtype_name, element_size, op_dtype
from fusionscope.roofline.opcost import CATEGORIES, OpCost
from fusionscope.roofline.registry import op_cost

__all__ = [
    "CATEGORIES",
    "LATENCY_FRACTION",
    "LATENCY_US",
    "NO_ROOF_COLUMNS",
    "OpCost",
    "classify",
    "classify_against",
    "classify_kernels",
    "dtype_name",
    "element_size",
    "op_cost",
    "op_dtype",
    "peak_tflops",
]
