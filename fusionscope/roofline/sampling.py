"""Sampling and random numbers: `multinomial`, `topk`, `sort` and the RNG factories (`rand`, `randint`,
`randperm`). Comparisons count no FLOPs; the int64 indices they write count as bytes.
"""

from __future__ import annotations

from fusionscope.roofline.args import _Args, _Malformed, _parse_int
from fusionscope.roofline.copies import _size_arg, _write_only
from fusionscope.roofline.dtypes import _DEFAULT_FLOAT, element_size
from fusionscope.roofline.opcost import OpCost, _cost


def _multinomial(a: _Args) -> OpCost:
    """``multinomial(probs (..., V), num_samples)``: read probs (normalise + scan ≈ 2 FLOPs/element), write the
    sampled int64 indices."""
    p = a.need(0)
    k = _parse_int(a.value(1))
    if k is None or k < 0 or not p.shape:
        raise _Malformed("multinomial")
    rows = p.numel // p.shape[-1] if p.shape[-1] else 0
    return _cost(2.0 * p.numel, p.nbytes + rows * k * 8, "sampling")


def _topk(a: _Args) -> OpCost:
    """``topk(self, k, dim)``: read self, write k values + k int64 indices per slice (comparisons: no FLOPs)."""
    x = a.need(0)
    k = _parse_int(a.value(1))
    dim = _parse_int(a.value(2))
    dim = -1 if dim is None else dim
    if k is None or k < 0 or not x.shape or not -len(x.shape) <= dim < len(x.shape) or k > x.shape[dim]:
        raise _Malformed("topk")
    size = x.shape[dim]
    n = (x.numel // size) * k if size else 0
    return _cost(0, x.nbytes + n * (element_size(x.dtype) + 8), "sampling")


def _sort(a: _Args) -> OpCost:
    """``sort``: read self, write sorted values and int64 indices."""
    x = a.need(0)
    return _cost(0, x.nbytes + x.numel * (element_size(x.dtype) + 8), "sampling")


def _rng_factory(a: _Args) -> OpCost:
    """``rand(size, dtype, ...)`` / ``randn``: write ``prod(size)`` elements."""
    return _write_only(_size_arg(a, 0), a.dtype_code(1) or _DEFAULT_FLOAT, "sampling")


def _randint(a: _Args) -> OpCost:
    """``randint(high, size, dtype, ...)`` / ``randint.low(low, high, size, dtype, ...)``: write ``prod(size)``."""
    pos = 1 if a.types[1:2] == ["ScalarList"] else 2
    return _write_only(_size_arg(a, pos), a.dtype_code(pos + 1) or "int64", "sampling")


def _randperm(a: _Args) -> OpCost:
    n = _parse_int(a.value(0))
    if n is None or n < 0:
        raise _Malformed("randperm n")
    return _write_only(n, a.dtype_code(1) or "int64", "sampling")
