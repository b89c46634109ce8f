"""What an aten op returns — the shape and dtype of each output — from the arguments a profiler trace records.

A Kineto trace holds an op's inputs (`Input Dims`, `Input type`, `Concrete Inputs`), never its outputs. The dataflow
that `fusionscope.order_graph` infers without tensor identities links a reader to a producer whose output has the
shape and dtype the reader took in, so each producer's outputs are re-derived here from its schema, as meta tensors
would: broadcasting for elementwise ops, (M, N) for a GEMM, the reduced dims for a reduction, the target shape for a
view (its `as_strided` child in the trace, or its size argument), the dtype code for `_to_copy`. The argument parsing
is `fusionscope.roofline`'s (the cost model re-derives outputs the same way to count their bytes).

`None` means "not known": the op is not modelled here and its arguments do not say. A dtype of `None` (a
`TensorList` member, whose dtype the trace does not record) matches any dtype.
"""

from __future__ import annotations

import math
from functools import cache

from fusionscope.roofline.args import (
    _T,
    _Args,
    _broadcast,
    _parse_int,
    _parse_int_list,
    _result_dtype,
    _shape,
)
from fusionscope.roofline.dtypes import _DEFAULT_FLOAT, _kind, dtype_name
from fusionscope.roofline.elementwise import _ELEMENTWISE

Sig = tuple[tuple[int, ...], str | None]

# Elementwise ops that are not in the cost model's table, or that keep their first input's shape and dtype.
_SAME_AS_INPUT = """
clone contiguous detach alias lift_fresh lift_fresh_copy resolve_conj resolve_neg flip roll cumsum cumprod
logcumsumexp native_dropout dropout masked_fill masked_scatter index_put index_copy index_add scatter scatter_add
scatter_reduce tril triu nan_to_num bernoulli _softmax _log_softmax _safe_softmax softmax log_softmax fill
zeros_like ones_like empty_like rand_like randn_like full_like gelu_backward threshold_backward
"""
SAME_AS_INPUT = frozenset(_SAME_AS_INPUT.split())
# Reductions: (position of the `dim` argument, position of `keepdim`, output dtype: None keeps the input's).
REDUCTIONS: dict[str, tuple[int, int, str | None]] = {
    "sum": (1, 2, None), "mean": (1, 2, None), "prod": (1, 2, None), "nansum": (1, 2, None),
    "amax": (1, 2, None), "amin": (1, 2, None), "logsumexp": (1, 2, None),
    "argmax": (1, 2, "int64"), "argmin": (1, 2, "int64"), "any": (1, 2, "bool"), "all": (1, 2, "bool"),
    "var": (1, 3, None), "std": (1, 3, None), "linalg_vector_norm": (2, 3, None), "norm": (2, 3, None),
    "count_nonzero": (1, -1, "int64"),
}  # fmt: skip
PIECES = ("chunk", "split", "split_with_sizes", "unbind")  # views, one per piece
ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention_forward", "_efficient_attention_forward",
                      "_cudnn_attention_forward")  # fmt: skip


_dtype = cache(dtype_name)


class Arguments(_Args):
    """The cost model's argument view, its dtype lookups cached (tens of thousands of ops, a handful of types)."""

    def tensor(self, i: int) -> _T | None:
        if i >= len(self.types) or i >= len(self.dims):
            return None
        t = self.types[i]
        dt = _dtype(t) if isinstance(t, str) else None
        return None if dt is None else _T(_shape(self.dims[i]), dt)


def short_name(name: str) -> str:
    """`aten::add` → `add`; other namespaces keep their name."""
    return name.removeprefix("aten::").split(".", 1)[0]


def op_outputs(name: str, args: _Args, strided: tuple[int, ...] | None = None,
               device_kind: str = "cuda") -> list[Sig] | None:  # fmt: skip
    """The outputs of one op, or None when they cannot be told. `strided` is the size argument of the last
    `as_strided` the op ran in the trace (what a view op returns); `args` the op's recorded arguments; `device_kind`
    where it ran ("cpu" or "cuda": a LayerNorm's statistics differ)."""
    try:
        return _outputs(short_name(name), args, strided, device_kind)
    except (ValueError, TypeError, LookupError, ArithmeticError):  # arguments the op's rules cannot read
        return None
    except Exception as exc:  # roofline's _Malformed: arguments that do not fit the schema
        if type(exc).__name__ == "_Malformed":
            return None
        raise


def _first(args: _Args) -> Sig:
    t = args.need(0)
    return t.shape, t.dtype


def _sized(args: _Args, size: list[int] | None, base: tuple[int, ...]) -> tuple[int, ...] | None:
    """A view's size argument with `-1` resolved against the element count of `base`."""
    if size is None:
        return None
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size = [math.prod(base) // known if s == -1 and known else s for s in size]
    return tuple(size)


def _outputs(n: str, args: _Args, strided: tuple[int, ...] | None, device_kind: str = "cuda") -> list[Sig] | None:
    if n.endswith("_") and args.tensor(0) is not None and n not in ("resize_",):
        return [_first(args)]  # in place: the output is the written input
    if strided is not None and args.tensor(0) is not None and n not in PIECES:  # one view (a split's are several)
        return [(strided, args.need(0).dtype)]
    if n in ("view", "_unsafe_view", "_reshape_alias", "reshape", "expand"):
        x = args.need(0)
        size = _sized(args, _parse_int_list(args.value(1)), x.shape)
        if n == "expand" and size is not None:
            size = tuple(x.shape[i - len(size) + len(x.shape)] if s == -1 else s for i, s in enumerate(size))
        return [(size, x.dtype)] if size is not None else None
    if n in _ELEMENTWISE or n in ("where", "masked_fill"):
        return [_elementwise(n, args)]
    if n in SAME_AS_INPUT:
        shape, dtype = _first(args)
        if n in ("_softmax", "_log_softmax") and str(args.value(2)).strip() == "True":
            dtype = "float32"  # half_to_float
        return [(shape, dtype)]
    if n == "_to_copy":
        x = args.need(0)
        return [(x.shape, args.dtype_code(1) or x.dtype)]
    if n in REDUCTIONS:
        return [_reduced(n, args)]
    if n in ("max", "min") and args.tensor(1) is None and len(args) >= 2:
        shape, dtype = _reduced(n, args)[0], args.need(0).dtype
        return [(shape, dtype), (shape, "int64")]
    if n in ("mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "matmul"):
        return [_gemm(n, args)]
    if n in ("cat", "stack"):
        return [_cat(n, args)]
    if n == "embedding":
        w, idx = args.need(0), args.need(1)
        return [((*idx.shape, w.shape[-1]), w.dtype)]
    if n == "index_select":
        x, idx = args.need(0), args.need(2)
        dim = _parse_int(args.value(1)) % len(x.shape)
        return [((*x.shape[:dim], math.prod(idx.shape), *x.shape[dim + 1 :]), x.dtype)]
    if n == "gather":
        return [(args.need(2).shape, args.need(0).dtype)]
    if n.startswith(ATTENTION_PREFIXES):
        q, v = args.need(0), args.need(2)
        out = [((*q.shape[:-1], v.shape[-1]), q.dtype)]
        if n == "_scaled_dot_product_flash_attention_for_cpu":  # and the logsumexp, (B, H, L_q) in fp32
            out.append((q.shape[:-1], "float32"))
        return out
    if n in ("native_layer_norm", "_fused_rms_norm"):
        return _normalized(n, args, device_kind)
    if n in ("topk", "sort"):
        x = args.need(0)
        if n == "sort":
            return [(x.shape, x.dtype), (x.shape, "int64")]
        k, dim = _parse_int(args.value(1)), _parse_int(args.value(2))
        dim = (dim if dim is not None else -1) % len(x.shape)
        shape = (*x.shape[:dim], k, *x.shape[dim + 1 :])
        return [(shape, x.dtype), (shape, "int64")]
    if n == "multinomial":
        p = args.need(0)
        return [((*p.shape[:-1], _parse_int(args.value(1))), "int64")]
    if n in PIECES:
        return _pieces(n, args)
    if n in ("zeros", "ones", "empty", "full", "rand", "randn", "empty_strided", "scalar_tensor"):
        size = () if n == "scalar_tensor" else tuple(_parse_int_list(args.value(0)) or ())
        code = {"full": 2, "scalar_tensor": 1, "empty_strided": 2}.get(n, 1)
        return [(size, args.dtype_code(code) or _DEFAULT_FLOAT)]
    if n == "arange":
        return [_arange(args)]
    if n in ("_local_scalar_dense", "item", "result_type", "size", "stride", "is_nonzero"):
        return []
    return None


def _arange(args: _Args) -> Sig:
    """`arange(end, …)`, `arange(start, end, …)`, `arange(start, end, step, …)`: told apart by arity, as the cost
    model does; the out= forms write into their last argument."""
    n = len(args)
    out = args.tensor(n - 1) if n else None
    if out is not None:
        return out.shape, out.dtype
    count = {5: 1, 6: 2, 7: 3}.get(n)
    if count is None:  # no recorded arguments (`record_shapes=False`), or an arity no overload has
        raise ValueError(f"arange with {n} arguments")
    nums = [args.value(i) for i in range(count)]
    vals = [float(v) for v in nums]
    start, end, step = (0.0, vals[0], 1.0) if count == 1 else (vals[0], vals[1], vals[2] if count == 3 else 1.0)
    dtype = args.dtype_code(count) or ("int64" if all(_parse_int(v) is not None for v in nums) else _DEFAULT_FLOAT)
    return (max(0, math.ceil((end - start) / step)),), dtype


def _elementwise(n: str, args: _Args) -> Sig:
    ts = args.tensors()
    shape = _broadcast(t.shape for t in ts)
    rule = _ELEMENTWISE.get(n, (1.0, "self" if n == "masked_fill" else "where"))[1]
    if rule == "bool":
        return shape, "bool"
    if rule == "self":
        return shape, args.need(0).dtype
    dtype = _result_dtype(args, skip=0 if rule == "where" else -1) or ts[0].dtype
    if rule == "float" and _kind(dtype) < 2:
        dtype = _DEFAULT_FLOAT
    return shape, dtype


def _normalized(n: str, args: _Args, device_kind: str) -> list[Sig]:
    """A norm's output, then its per-row statistics (LayerNorm's mean and rstd; RMSNorm's rstd), of shape
    (…, 1, …, 1) over the normalised dims: in fp32 for a half input, but for LayerNorm's on the CPU, which keeps the
    input's dtype (as torch 2.13 does)."""
    x = args.need(0)
    dims = len(_parse_int_list(args.value(1)) or [x.shape[-1]])
    layer_norm = n == "native_layer_norm"
    full = x.dtype in ("float32", "float64") or (layer_norm and device_kind == "cpu")
    stats = ((*x.shape[: len(x.shape) - dims], *(1,) * dims), x.dtype if full else "float32")
    return [(x.shape, x.dtype), *[stats] * (2 if layer_norm else 1)]


def _reduced(n: str, args: _Args) -> Sig:
    x = args.need(0)
    dim_pos, keep_pos, dtype = REDUCTIONS.get(n, (1, 2, None))
    dims = _parse_int_list(args.value(dim_pos)) if len(args) > dim_pos else None
    keep = keep_pos >= 0 and str(args.value(keep_pos)).strip() == "True"
    nd = len(x.shape)
    reduced = set(range(nd)) if not dims else {d % nd for d in dims}
    shape = tuple(1 if i in reduced else s for i, s in enumerate(x.shape) if keep or i not in reduced)
    return shape, dtype or x.dtype


def _gemm(n: str, args: _Args) -> Sig:
    off = 1 if n in ("addmm", "_addmm_activation", "baddbmm") else 0
    x, w = args.need(off), args.need(off + 1)
    return (*x.shape[:-1], w.shape[-1]), x.dtype


def _cat(n: str, args: _Args) -> Sig:
    members = args.tensor_list(0) or []
    dim = _parse_int(args.value(1)) or 0
    shapes = [t.shape for t in members if n == "stack" or len(t.shape) > 1 or t.shape != (0,)]
    first = list(shapes[0])
    if n == "stack":
        first.insert(dim % (len(first) + 1), len(shapes))
        return tuple(first), None
    dim %= len(first)
    first[dim] = sum(s[dim] for s in shapes)
    return tuple(first), None


def _pieces(n: str, args: _Args) -> list[Sig]:
    x = args.need(0)
    if n == "unbind":
        dim = (_parse_int(args.value(1)) or 0) % len(x.shape)
        rest = (*x.shape[:dim], *x.shape[dim + 1 :])
        return [(rest, x.dtype)] * x.shape[dim]
    dim = (_parse_int(args.value(2)) or 0) % len(x.shape)
    total = x.shape[dim]
    if n == "split_with_sizes":
        sizes = _parse_int_list(args.value(1)) or []
    elif n == "chunk":
        parts = _parse_int(args.value(1))
        step = -(-total // parts)
        sizes = [min(step, total - i) for i in range(0, total, step)]
    else:
        step = _parse_int(args.value(1))
        sizes = [min(step, total - i) for i in range(0, total, step)]
    return [((*x.shape[:dim], s, *x.shape[dim + 1 :]), x.dtype) for s in sizes]
