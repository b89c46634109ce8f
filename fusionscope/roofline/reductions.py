"""Norms, softmax and reductions: the input read once, its normalised copy or the reduced output written; the
reduced dims come from the `dim` argument (a total reduction when it cannot be read).
"""

from __future__ import annotations

from fusionscope.roofline.args import _Args, _parse_int, _parse_int_list, _reduced_numel
from fusionscope.roofline.dtypes import _DEFAULT_FLOAT, _kind, element_size
from fusionscope.roofline.elementwise import _elementwise
from fusionscope.roofline.opcost import OpCost, _cost


def _norm(a: _Args, *, flops_per: float, weight_pos: int = 2, bias_pos: int | None = None) -> OpCost:
    """Read x, weight (and bias), write y (x's shape and dtype). Saved statistics (mean/rstd: one value per row)
    are not counted."""
    x = a.need(0)
    extra = sum(t.nbytes for p in (weight_pos, bias_pos) if p is not None and (t := a.tensor(p)) is not None)
    return _cost(flops_per * x.numel, 2 * x.nbytes + extra, "norm")


def _softmax(a: _Args, *, flops_per: float = 5.0) -> OpCost:
    """Read x, write y (≈ 5 FLOPs/element: max, subtract, exp, sum, divide). Arg 2 is ``half_to_float``
    (``_softmax``; ``True`` means a float32 result) or a ScalarType code (``_safe_softmax``)."""
    x = a.need(0)
    flag = a.value(2)
    half_to_float = isinstance(flag, str) and flag.strip() == "True"
    out_dtype = _DEFAULT_FLOAT if half_to_float else (a.dtype_code(2) or x.dtype)
    return _cost(flops_per * x.numel, x.nbytes + x.numel * element_size(out_dtype), "softmax")


def _reduction(
    a: _Args,
    *,
    flops_per: float = 1.0,
    out: str = "same",
    dim_pos: int = 1,
    min_args_for_dim: int = 2,
    int_accumulates: bool = False,
) -> OpCost:
    """Read x once, write the reduced output. The reduced dims come from the ``dim`` concrete argument; when it is
    absent or unparsable the reduction is taken to be total (a one-element output). ``out`` picks the outputs:
    ``same`` (x's dtype), ``int64`` (indices), ``bool``, ``values_indices`` (max.dim), ``pair`` (aminmax, var_mean)."""
    x = a.need(0)
    dims = _parse_int_list(a.value(dim_pos)) if len(a) >= min_args_for_dim else None
    n = _reduced_numel(x.shape, dims)
    same = "int64" if int_accumulates and _kind(x.dtype) < 2 else x.dtype  # integer sums produce int64
    per_out = {
        "same": element_size(same),
        "int64": 8,
        "bool": 1,
        "values_indices": element_size(x.dtype) + 8,
        "pair": 2 * element_size(x.dtype),
    }[out]
    return _cost(flops_per * x.numel, x.nbytes + n * per_out, "reduction")


def _max_min(a: _Args) -> OpCost:
    """``max``/``min``: ``(self, other)`` is elementwise, ``(self, dim, keepdim)`` returns values + indices,
    ``(self)`` is a full reduction."""
    if a.tensor(1) is not None:
        return _elementwise(a, flops_per=1.0)
    if len(a) >= 2 and _parse_int(a.value(1)) is not None:
        return _reduction(a, out="values_indices")
    return _reduction(a, min_args_for_dim=99)
