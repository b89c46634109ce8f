"""What every cost function returns: `OpCost` (FLOPs, compulsory bytes, category), the categories the kernel table
groups time by, and the free cost of a view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fusionscope.roofline.args import _Args

CATEGORIES: tuple[str, ...] = (
    "gemm",
    "attention",
    "norm",
    "softmax",
    "elementwise",
    "reduction",
    "embedding",
    "copy",
    "sampling",
    "view",
    "other",
)


@dataclass(frozen=True)
class OpCost:
    """Work and compulsory memory traffic of one op.

    ``flops`` counts floating-point operations (a multiply-add is 2). ``bytes`` is the minimal DRAM traffic: every
    input tensor read once plus every output tensor written once. ``category`` is one of :data:`CATEGORIES`.
    """

    flops: float
    bytes: float
    category: str


_VIEW = OpCost(0.0, 0.0, "view")


CostFn = Callable[[_Args], "OpCost | None"]


def _cost(flops: float, nbytes: float, category: str) -> OpCost:
    return OpCost(float(flops), float(nbytes), category)


def _view(a: _Args) -> OpCost:
    return _VIEW
