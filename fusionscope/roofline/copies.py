"""Ops that move data without arithmetic: copies and casts, concatenation, fills and factories (`zeros`, `full`,
`arange`), repeats and pads, scatters into a copy, `.item()`: what each reads and writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fusionscope.roofline.args import _T, _Args, _Malformed, _parse_float, _parse_int, _parse_int_list, _scalar_kind
from fusionscope.roofline.dtypes import _DEFAULT_FLOAT, _KIND_DEFAULT, element_size
from fusionscope.roofline.opcost import OpCost, _cost


def _copy_like(
    a: _Args, *, out_numel: Callable[[_T], int] | None = None, category: str = "copy", flops_per: float = 0.0
) -> OpCost:
    """Read ``self`` (arg 0) once, write an output of ``out_numel(self)`` elements of the same dtype."""
    x = a.need(0)
    n = out_numel(x) if out_numel else x.numel
    return _cost(flops_per * n, x.nbytes + n * element_size(x.dtype), category)


def _copy_(a: _Args) -> OpCost:
    """``copy_(dst, src)``: read src (its own numel: it may broadcast), write dst; a cast costs no FLOPs."""
    dst = a.need(0)
    src = a.tensor(1)
    return _cost(0, dst.nbytes + (src.nbytes if src is not None else 0), "copy")


def _to_copy(a: _Args) -> OpCost:
    """``_to_copy(self, dtype, ...)``: read self, write a copy in ``dtype`` (ScalarType code) or self's dtype."""
    x = a.need(0)
    out_dtype = a.dtype_code(1) or x.dtype
    return _cost(0, x.nbytes + x.numel * element_size(out_dtype), "copy")


def _local_scalar_dense(a: _Args) -> OpCost:
    """Device -> host copy of one value (``.item()``): read the element, write it."""
    x = a.need(0)
    return _cost(0, 2 * element_size(x.dtype), "copy")


def _cat(a: _Args) -> OpCost:
    """``cat`` / ``stack``: read every list member once, write their concatenation."""
    ts = a.tensor_list(0)
    if ts is None:
        raise _Malformed("cat without a TensorList")
    total = sum(t.nbytes for t in ts)
    return _cost(0, 2 * total, "copy")


def _write_only(n: int, dtype: str, category: str = "copy", flops_per: float = 0.0) -> OpCost:
    return _cost(flops_per * n, n * element_size(dtype), category)


def _fill_inplace(a: _Args, *, category: str = "copy", flops_per: float = 0.0) -> OpCost:
    """``fill_`` / ``zero_`` / RNG fills: write self; a tensor-valued second argument is read too."""
    x = a.need(0)
    extra = sum(t.nbytes for i in range(1, len(a)) if (t := a.tensor(i)) is not None)
    return _cost(flops_per * x.numel, x.nbytes + extra, category)


def _size_arg(a: _Args, i: int) -> int:
    sizes = _parse_int_list(a.value(i))
    if sizes is None or any(s < 0 for s in sizes):
        raise _Malformed(f"size argument {a.value(i)!r}")
    return math.prod(sizes)


def _factory(a: _Args, *, size_pos: int = 0, dtype_pos: int = 1, fill_pos: int | None = None) -> OpCost:
    """``ones`` / ``zeros`` / ``full`` / ``rand*``: write ``prod(size)`` elements (nothing is read)."""
    n = _size_arg(a, size_pos)
    dtype = a.dtype_code(dtype_pos)
    if dtype is None and fill_pos is not None:
        k = _scalar_kind(a.value(fill_pos))
        dtype = "bool" if k == 0 else _KIND_DEFAULT.get(k or 2, _DEFAULT_FLOAT)
    return _write_only(n, dtype or _DEFAULT_FLOAT)


def _new_factory(a: _Args, *, dtype_pos: int = 2) -> OpCost:
    """``new_zeros(self, size, dtype, ...)`` and friends: write ``prod(size)`` elements of self's (or given) dtype."""
    x = a.need(0)
    return _write_only(_size_arg(a, 1), a.dtype_code(dtype_pos) or x.dtype)


def _like_factory(a: _Args, *, dtype_pos: int = 1, category: str = "copy") -> OpCost:
    """``zeros_like(self, dtype, ...)`` and friends: write self's numel (self is not read)."""
    x = a.need(0)
    return _write_only(x.numel, a.dtype_code(dtype_pos) or x.dtype, category)


def _scalar_tensor(a: _Args) -> OpCost:
    return _write_only(1, a.dtype_code(1) or _DEFAULT_FLOAT)


def _arange(a: _Args) -> OpCost:
    """``arange`` overloads, told apart by arity: (end, dtype, layout, device, pin) / (start, end, dtype, ...) /
    (start, end, step, dtype, ...) / out= forms (start, end, step, out) and (end, out)."""
    n = len(a)
    out_t = a.tensor(n - 1) if n else None
    if out_t is not None:  # arange.out(end, out) / arange.start_out(start, end, step, out)
        nums, dtype = [a.value(i) for i in range(n - 1)], out_t.dtype
    else:
        nscalar = {5: 1, 6: 2, 7: 3}.get(n)
        if nscalar is None:
            raise _Malformed("arange arity")
        nums, dtype = [a.value(i) for i in range(nscalar)], a.dtype_code(nscalar)
    vals = [_parse_float(v) for v in nums]
    if not vals or any(v is None for v in vals):
        raise _Malformed("arange bounds")
    start, end, step = (0.0, vals[0], 1.0) if len(vals) == 1 else (vals[0], vals[1], vals[2] if len(vals) > 2 else 1.0)
    if not step:
        raise _Malformed("arange step 0")
    count = max(0, math.ceil((end - start) / step))  # type: ignore[operator]
    if dtype is None:
        dtype = "int64" if all(_parse_int(v) is not None for v in nums) else _DEFAULT_FLOAT
    return _write_only(count, dtype)


def _repeat(a: _Args) -> OpCost:
    reps = _parse_int_list(a.value(1))
    if reps is None or any(r < 0 for r in reps):
        raise _Malformed("repeat")
    return _copy_like(a, out_numel=lambda x: x.numel * math.prod(reps))


def _repeat_interleave(a: _Args) -> OpCost:
    reps = _parse_int(a.value(1)) if a.is_scalar(1) else None
    if reps is None or reps < 0:
        raise _Malformed("repeat_interleave with tensor repeats: output size unknown")
    return _copy_like(a, out_numel=lambda x: x.numel * reps)


def _constant_pad_nd(a: _Args) -> OpCost:
    pad = _parse_int_list(a.value(1))
    if pad is None or len(pad) % 2:
        raise _Malformed("pad")

    def out_numel(x: _T) -> int:
        shape = list(x.shape)
        for j in range(len(pad) // 2):
            if j >= len(shape):
                raise _Malformed("pad longer than dims")
            shape[-1 - j] = max(0, shape[-1 - j] + pad[2 * j] + pad[2 * j + 1])
        return math.prod(shape)

    return _copy_like(a, out_numel=out_numel)


def _scatter_into(a: _Args) -> OpCost:
    """``slice_scatter(self, src, ...)`` and friends: copy self (read + write) and read src."""
    x, src = a.need(0), a.need(1)
    return _cost(0, 2 * x.nbytes + src.nbytes, "copy")


def _assert_async(a: _Args) -> OpCost:
    """Device-side check of one value: read it."""
    return _cost(0, a.need(0).nbytes, "other")
