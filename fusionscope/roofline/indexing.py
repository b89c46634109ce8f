"""Embedding lookups, indexing, gather and scatter: what the indices select is read and written, not the whole
table. The two ops whose indices the trace does not record (`index`, `index_put_`) are estimates, said where.
"""

from __future__ import annotations

from fusionscope.roofline.args import _Args, _Malformed, _parse_bool, _parse_int
from fusionscope.roofline.dtypes import element_size
from fusionscope.roofline.opcost import OpCost, _cost


def _embedding(a: _Args) -> OpCost:
    """``embedding(weight (V,W), indices)``: read the ids and only the gathered rows, write (ids, W)."""
    w, idx = a.need(0), a.need(1)
    if len(w.shape) != 2:
        raise _Malformed("embedding weight")
    rows, width = w.shape
    es = element_size(w.dtype)
    n = idx.numel
    return _cost(0, idx.nbytes + min(n, rows) * width * es + n * width * es, "embedding")


def _index_select(a: _Args) -> OpCost:
    """``index_select(self, dim, index)``: read the index and the selected slices, write them."""
    x, idx = a.need(0), a.need(2)
    dim = _parse_int(a.value(1))
    if dim is None or not x.shape or not -len(x.shape) <= dim < len(x.shape):
        raise _Malformed("index_select dim")
    size = x.shape[dim]
    slice_numel = x.numel // size if size else 0
    n = idx.numel * slice_numel
    es = element_size(x.dtype)
    return _cost(0, idx.nbytes + min(n, x.numel) * es + n * es, "embedding")


def _gather(a: _Args) -> OpCost:
    """``gather(self, dim, index)``: output has index's shape; read index + gathered elements, write output."""
    x, idx = a.need(0), a.need(2)
    es = element_size(x.dtype)
    return _cost(0, idx.nbytes + min(idx.numel, x.numel) * es + idx.numel * es, "copy")


def _scatter(a: _Args, *, inplace: bool, slices: bool = False) -> OpCost:
    """``scatter(self, dim, index, src|value)``: index has self's rank and each index element moves one element.
    ``index_add``/``index_copy(self, dim, index, source)`` (``slices=True``): each index element moves a slice, so
    source's numel elements move. In place: read index and the moved part of src, write as many elements into self.
    Out of place additionally copies self (read + write)."""
    x, idx = a.need(0), a.need(2)
    src = a.tensor(3)
    es = element_size(x.dtype)
    n = src.numel if slices and src is not None else idx.numel
    moved = idx.nbytes + (min(n, src.numel) * element_size(src.dtype) if src is not None else 0) + n * es
    return _cost(0, moved + (0 if inplace else 2 * x.nbytes), "copy")


def _index(a: _Args) -> OpCost:
    """``index(self, indices)``. The trace does not record ``Tensor?[] indices``, so the gathered size is unknown;
    estimate it as self's size (read self, write a self-sized result). Exact when indices select everything, an
    overestimate of the traffic for narrow selections."""
    x = a.need(0)
    return _cost(0, 2 * x.nbytes, "copy")


def _index_put(a: _Args, *, inplace: bool) -> OpCost:
    """``index_put_(self, indices, values, accumulate)``: read values, write as many elements into self (and read
    them first when accumulating). The unrecorded indices are not counted; out of place also copies self."""
    x, vals = a.need(0), a.need(2)
    es = element_size(x.dtype)
    accumulate = bool(_parse_bool(a.value(3)))
    n = vals.numel
    nbytes = vals.nbytes + n * es * (2 if accumulate else 1) + (0 if inplace else 2 * x.nbytes)
    return _cost(n if accumulate else 0, nbytes, "copy")
