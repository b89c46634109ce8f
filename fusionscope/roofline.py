"""Roofline cost model for aten ops, and roofline classification of timed kernels.

Two halves:

* :func:`op_cost` turns one profiler op event (name, ``Input Dims``, ``Input type``, ``Concrete Inputs``) into an
  :class:`OpCost`: the floating-point work and the *minimal* DRAM traffic of the op. Minimal means compulsory:
  every input tensor read once and every output tensor written once. A real kernel can only move more (re-reads,
  spills, multi-pass algorithms), so the achieved bandwidth computed from this model is a lower bound on what the
  hardware moved, and "fraction of roof" measures how close the kernel is to the best any implementation could do.

* :func:`classify` / :func:`classify_kernels` place timed kernels against a device's measured roofs and label each
  one ``compute``, ``memory``, ``latency`` or ``unmodeled``.

Why inputs alone are enough
---------------------------
``torch.profiler`` with ``record_shapes=True`` records only the arguments of an op, never its results. That loses
nothing the cost model needs: an aten op's output shapes and dtypes are a function of its input shapes, dtypes and
scalar arguments (that is how meta/fake tensors work). Each cost function here re-derives the outputs it needs from
the op's schema: broadcasting for elementwise ops, ``(M, N)`` for a GEMM, the reduced dims (from the ``dim``
concrete argument) for a reduction, ``k`` for ``topk``, the dtype code for ``_to_copy``, and so on. The few things a
trace cannot tell us are documented where they matter:

* ``Tensor?[]`` arguments (the indices of ``index`` / ``index_put_``) are not recorded at all, so those two ops are
  estimates (see their cost functions).
* ``TensorList`` arguments (``cat`` / ``stack``) are recorded with shapes but without a dtype; ``op_cost`` assumes
  ``default_dtype`` for them (``float32`` unless the caller knows better, e.g. the model's dtype).

Composite ops
-------------
Ops that never run code of their own on any backend cost ``OpCost(0, 0, "view")``: their children in the trace
carry the cost. These are the ``CompositeImplicitAutograd`` ops, decomposed by the dispatcher before any backend
sees them (``matmul``, ``linear``, ``to``, ``contiguous``, ``scaled_dot_product_attention``, ``dropout``,
``softmax`` -> ``_softmax``, ``log_softmax`` -> ``_log_softmax``, ``layer_norm`` -> ``native_layer_norm``,
``rms_norm`` -> ``_fused_rms_norm``, and aliases such as ``divide`` -> ``div`` or ``concat`` -> ``cat``).

Some ops with a kernel of their own may still re-dispatch part or all of their work, depending on the backend:
``clone`` / ``_to_copy`` -> ``copy_``, ``embedding`` -> ``index_select``, ``stack`` -> ``cat``, ``zeros`` ->
``zero_``, ``masked_fill`` -> ``masked_fill_``, and on CPU ``_fused_rms_norm``, ``mean`` and ``multinomial``
decompose into elementwise ops. These keep their full cost (it is right wherever they launch the kernel), so costs
are meant to be charged to the *innermost* costed op: on GPU the op that launched the kernel; on CPU an op none of
whose descendants has a non-view cost. Summed over a whole call tree they double-count.

Attention and causal masks
--------------------------
For fused attention ops FLOPs are ``2·B·Hq·Sq·Skv·(D + Dv)`` (QKᵀ and PV), scaled by the fraction of (query, key)
pairs a causal mask leaves. ``is_causal`` is taken to be aligned to the bottom-right corner (the flash-attention
convention; it coincides with PyTorch's top-left convention when ``Sq == Skv``, the prefill case, and keeps a
decode step with ``Sq = 1`` at full cost). ``_efficient_attention_forward``'s ``custom_mask_type`` distinguishes
the two alignments explicitly and is honoured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

__all__ = [
    "CATEGORIES",
    "OpCost",
    "classify",
    "classify_kernels",
    "dtype_name",
    "element_size",
    "op_cost",
    "op_dtype",
]

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

# ---------------------------------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------------------------------

# Trace dtype strings are c10's demangled type names (``caffe2::TypeMeta::name()``); canonical names are torch's.
_TRACE_DTYPES: dict[str, str] = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "long int": "int64",
    "long": "int64",
    "long long": "int64",
    "__int64": "int64",
    "int": "int32",
    "short int": "int16",
    "short": "int16",
    "signed char": "int8",
    "unsigned char": "uint8",
    "bool": "bool",
    "short unsigned int": "uint16",
    "unsigned short": "uint16",
    "unsigned int": "uint32",
    "long unsigned int": "uint64",
    "unsigned long": "uint64",
    "c10::complex<c10::Half>": "complex32",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "c10::qint8": "qint8",
    "c10::quint8": "quint8",
    "c10::qint32": "qint32",
    "c10::quint4x2": "quint4x2",
    "c10::quint2x4": "quint2x4",
    "c10::bits8": "bits8",
    "c10::bits16": "bits16",
}

_ELEMENT_SIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,  # two fp4 values packed per byte; the tensor's numel counts bytes
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits8": 1,
    "bits16": 2,
}

# c10::ScalarType enum values, as they appear in ``Concrete Inputs`` for ``ScalarType? dtype`` arguments.
_SCALAR_TYPE_CODES: dict[int, str] = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "float16",
    6: "float32",
    7: "float64",
    8: "complex32",
    9: "complex64",
    10: "complex128",
    11: "bool",
    12: "qint8",
    13: "quint8",
    14: "qint32",
    15: "bfloat16",
    16: "quint4x2",
    17: "quint2x4",
    21: "bits8",
    22: "bits16",
    23: "float8_e5m2",
    24: "float8_e4m3fn",
    25: "float8_e5m2fnuz",
    26: "float8_e4m3fnuz",
    27: "uint16",
    28: "uint32",
    29: "uint64",
    44: "float8_e8m0fnu",
    45: "float4_e2m1fn_x2",
}

_DEFAULT_FLOAT = "float32"  # torch's default dtype: what a Python float scalar promotes an integer tensor to


def dtype_name(type_str: str) -> str | None:
    """Canonical dtype name (``"bfloat16"``, ``"int64"``, ...) for a trace ``Input type`` string.

    Returns ``None`` for entries that are not tensors (``"Scalar"``, ``"ScalarList"``, ``"TensorList"``, ``""``,
    ...). Canonical names and ``torch.``-prefixed names map to themselves, so the function is idempotent.
    """
    if not isinstance(type_str, str):
        return None
    s = type_str.strip()
    if s in _TRACE_DTYPES:
        return _TRACE_DTYPES[s]
    if s.startswith("torch."):
        s = s[len("torch.") :]
    if s in _ELEMENT_SIZE:
        return s
    if s.startswith("c10::Float8_") or s.startswith("c10::Float4_"):  # future float8/float4 variants
        return s[len("c10::") :].lower()
    return None


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype (canonical name, trace string or ``torch.`` name). Raises ``ValueError``."""
    name = dtype_name(dtype) if dtype not in _ELEMENT_SIZE else dtype
    if name in _ELEMENT_SIZE:
        return _ELEMENT_SIZE[name]
    if name is not None and name.startswith(("float8_", "float4_")):
        return 1
    raise ValueError(f"unknown dtype {dtype!r}")


def _is_float(dtype: str | None) -> bool:
    return dtype is not None and (dtype.startswith("float") or dtype == "bfloat16")


def _is_int(dtype: str | None) -> bool:
    return dtype is not None and (dtype.startswith(("int", "uint", "qint", "quint", "bits")))


def _kind(dtype: str) -> int:
    """Type-promotion category: bool < integer < floating < complex."""
    if dtype == "bool":
        return 0
    if dtype.startswith("complex"):
        return 3
    if _is_float(dtype):
        return 2
    return 1


def op_dtype(input_types: list) -> str | None:
    """Compute dtype of an op: the canonical dtype of its first floating-point tensor input (``None`` if none)."""
    if not isinstance(input_types, (list, tuple)):
        return None
    for t in input_types:
        name = dtype_name(t) if isinstance(t, str) else None
        if _is_float(name):
            return name
    return None


# ---------------------------------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------------------------------


class _Malformed(Exception):
    """Raised inside cost functions when the recorded arguments do not fit the op's schema."""


class _T(NamedTuple):
    """A tensor argument: shape and canonical dtype."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)


def _shape(dims: Any) -> tuple[int, ...]:
    if not isinstance(dims, (list, tuple)):
        raise _Malformed(f"dims {dims!r}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise _Malformed(f"dims {dims!r}")
        out.append(d)
    return tuple(out)


def _parse_int(s: Any) -> int | None:
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return s
    if not isinstance(s, str):
        return None
    try:
        return int(s.strip())
    except ValueError:
        return None


def _parse_float(s: Any) -> float | None:
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    if not isinstance(s, str) or not s.strip():
        return None
    try:
        return float(s.strip())
    except ValueError:
        return None


def _parse_bool(s: Any) -> bool | None:
    if isinstance(s, bool):
        return s
    if isinstance(s, str):
        v = s.strip()
        if v in ("True", "true", "1"):
            return True
        if v in ("False", "false", "0"):
            return False
    return None


def _parse_int_list(s: Any) -> list[int] | None:
    """``"[1, -1]"`` -> ``[1, -1]``; a bare int ``"-1"`` -> ``[-1]``; anything else -> ``None``."""
    if isinstance(s, (list, tuple)):
        vals = [_parse_int(x) for x in s]
        return None if any(v is None for v in vals) else vals  # type: ignore[return-value]
    if not isinstance(s, str):
        return None
    v = s.strip()
    if v.startswith("[") and v.endswith("]"):
        body = v[1:-1].strip()
        if not body:
            return []
        vals = [_parse_int(x) for x in body.split(",")]
        return None if any(x is None for x in vals) else vals  # type: ignore[return-value]
    i = _parse_int(v)
    return None if i is None else [i]


class _Args:
    """Positional view over one event's parallel ``Input Dims`` / ``Input type`` / ``Concrete Inputs`` lists."""

    def __init__(self, dims: list, types: list, concrete: list | None, default_dtype: str) -> None:
        if not isinstance(dims, (list, tuple)) or not isinstance(types, (list, tuple)):
            raise _Malformed("dims/types are not lists")
        self.dims = list(dims)
        self.types = list(types)
        self.concrete = list(concrete) if isinstance(concrete, (list, tuple)) else []
        self.default_dtype = default_dtype

    def __len__(self) -> int:
        return max(len(self.dims), len(self.types))

    def tensor(self, i: int) -> _T | None:
        """The tensor at position ``i``, or ``None`` if that argument is absent, a scalar or ``None``."""
        if i >= len(self.types) or i >= len(self.dims):
            return None
        t = self.types[i]
        dt = dtype_name(t) if isinstance(t, str) else None
        if dt is None:
            return None
        return _T(_shape(self.dims[i]), dt)

    def need(self, i: int) -> _T:
        t = self.tensor(i)
        if t is None:
            raise _Malformed(f"argument {i} is not a tensor")
        return t

    def tensors(self) -> list[_T]:
        return [t for i in range(len(self)) if (t := self.tensor(i)) is not None]

    def tensor_list(self, i: int) -> list[_T] | None:
        """The shapes of a ``TensorList`` argument, typed ``default_dtype`` (the trace records no dtype)."""
        if i >= len(self.dims):
            return None
        d = self.dims[i]
        if not isinstance(d, (list, tuple)) or not all(isinstance(x, (list, tuple)) for x in d):
            return None
        return [_T(_shape(x), self.default_dtype) for x in d]

    def value(self, i: int) -> Any:
        return self.concrete[i] if i < len(self.concrete) else None

    def is_scalar(self, i: int) -> bool:
        return i < len(self.types) and self.types[i] == "Scalar"

    def dtype_code(self, i: int) -> str | None:
        code = _parse_int(self.value(i))
        return _SCALAR_TYPE_CODES.get(code) if code is not None else None


def _broadcast(shapes: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    out: list[int] = []
    for shape in shapes:
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for j, d in enumerate(shape):
            k = len(out) - len(shape) + j
            if out[k] == 1:
                out[k] = d
            elif d not in (1, out[k]):
                raise _Malformed(f"shapes do not broadcast: {shape} vs {out}")
    return tuple(out)


def _promote_same_kind(dtypes: list[str]) -> str:
    """Promote dtypes of one kind (torch rules, simplified)."""
    uniq = set(dtypes)
    if len(uniq) == 1:
        return dtypes[0]
    if {"float16", "bfloat16"} <= uniq and not uniq & {"float32", "float64"}:
        return "float32"
    if {"uint8", "int8"} <= uniq and not uniq & {"int16", "int32", "int64"}:
        return "int16"
    return max(uniq, key=lambda d: (_ELEMENT_SIZE.get(d, 1), d in ("float32", "float64", "bfloat16", "int64")))


def _promote(dtypes: list[str]) -> str | None:
    if not dtypes:
        return None
    top = max(_kind(d) for d in dtypes)
    return _promote_same_kind([d for d in dtypes if _kind(d) == top])


def _scalar_kind(s: Any) -> int | None:
    if not isinstance(s, str) or not s.strip():
        return None
    v = s.strip()
    if v in ("True", "False"):
        return 0
    if _parse_int(v) is not None:
        return 1
    if _parse_float(v) is not None:
        return 2
    return 3 if "j" in v else None


_KIND_DEFAULT = {1: "int64", 2: _DEFAULT_FLOAT, 3: "complex64"}


def _result_dtype(a: _Args, skip: int = -1) -> str | None:
    """``torch.result_type`` over the tensor and Scalar arguments (position ``skip`` excluded).

    Zero-dim tensors and Scalars only promote across kinds, like in torch; a zero-dim ``double`` (how the trace shows a
    Python float that was wrapped into a tensor) promotes an integer tensor to the default dtype, not to float64.
    """
    dimmed: list[str] = []
    zero_dim: list[str] = []
    scalar_kinds: list[int] = []
    for i in range(len(a)):
        if i == skip:
            continue
        t = a.tensor(i)
        if t is not None:
            (dimmed if t.shape else zero_dim).append(t.dtype)
        elif a.is_scalar(i):
            k = _scalar_kind(a.value(i))
            if k is not None:
                scalar_kinds.append(k)
    result = _promote(dimmed)
    z = _promote(zero_dim)
    if z is not None and (result is None or _kind(z) > _kind(result)):
        result = {"float64": _DEFAULT_FLOAT, "complex128": "complex64"}.get(z, z) if result is not None else z
    if result is not None and scalar_kinds and max(scalar_kinds) > _kind(result):
        result = _KIND_DEFAULT[max(scalar_kinds)]
    return result


def _reduced_numel(shape: tuple[int, ...], dims: list[int] | None) -> int:
    """Numel after reducing ``dims`` (``None`` / ``[]`` reduce everything; keepdim does not change numel)."""
    nd = len(shape)
    if not dims or nd == 0:
        return 1
    norm = set()
    for d in dims:
        if not -nd <= d < nd:
            return 1  # not a dim after all (e.g. a dtype code): assume a full reduction
        norm.add(d % nd)
    return math.prod(s for j, s in enumerate(shape) if j not in norm)


# ---------------------------------------------------------------------------------------------------------------------
# cost functions
# ---------------------------------------------------------------------------------------------------------------------

CostFn = Callable[[_Args], "OpCost | None"]


def _cost(flops: float, nbytes: float, category: str) -> OpCost:
    return OpCost(float(flops), float(nbytes), category)


def _view(a: _Args) -> OpCost:
    return _VIEW


def _elementwise(a: _Args, *, flops_per: float, out: str = "promote", inplace: bool = False) -> OpCost:
    """Output = broadcast of the tensor inputs (or the first input, in place); read every tensor input once."""
    ts = a.tensors()
    if not ts:
        raise _Malformed("no tensor inputs")
    shape = _broadcast(t.shape for t in ts)
    if inplace:
        self_t = a.need(0)
        if math.prod(shape) != self_t.numel:
            raise _Malformed("in-place result does not match self")
        shape, out_dtype = self_t.shape, self_t.dtype
    elif out == "bool":
        out_dtype = "bool"
    elif out == "self":
        out_dtype = a.need(0).dtype
    else:
        out_dtype = _result_dtype(a, skip=0 if out == "where" else -1) or ts[0].dtype
        if out == "float" and _kind(out_dtype) < 2:
            out_dtype = _DEFAULT_FLOAT
    numel = math.prod(shape)
    return _cost(flops_per * numel, sum(t.nbytes for t in ts) + numel * element_size(out_dtype), "elementwise")


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


# --- GEMM ------------------------------------------------------------------------------------------------------------


def _gemm(m: int, k: int, n: int, batch: int, in_bytes: int, out_dtype: str) -> OpCost:
    return _cost(2.0 * batch * m * k * n, in_bytes + batch * m * n * element_size(out_dtype), "gemm")


def _mm(
    a: _Args, *, bias_pos: int | None = None, out_dtype_pos: int | None = None, out_dtype: str | None = None
) -> OpCost:
    """``mm(a (M,K), b (K,N))``: 2·M·K·N FLOPs; read A, B (and the bias, for addmm), write C.

    The bias add of ``addmm`` is not counted as FLOPs (same convention as ``torch.utils.flop_counter``).
    """
    off = 0 if bias_pos is None else 1
    x, w = a.need(off), a.need(off + 1)
    if len(x.shape) != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[0]:
        raise _Malformed("mm shapes")
    bias = a.tensor(bias_pos) if bias_pos is not None else None
    (m, k), n = x.shape, w.shape[1]
    in_bytes = x.nbytes + w.nbytes + (bias.nbytes if bias is not None else 0)
    dt = out_dtype or (a.dtype_code(out_dtype_pos) if out_dtype_pos is not None else None) or x.dtype
    return _gemm(m, k, n, 1, in_bytes, dt)


def _bmm(a: _Args, *, bias: bool = False) -> OpCost:
    """``bmm(a (B,M,K), b (B,K,N))``: 2·B·M·K·N FLOPs; ``baddbmm`` also reads its ``self`` (the addend)."""
    off = 1 if bias else 0
    x, w = a.need(off), a.need(off + 1)
    if len(x.shape) != 3 or len(w.shape) != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise _Malformed("bmm shapes")
    b, m, k = x.shape
    add = a.tensor(0) if bias else None
    in_bytes = x.nbytes + w.nbytes + (add.nbytes if add is not None else 0)
    return _gemm(m, k, w.shape[2], b, in_bytes, x.dtype)


def _scaled_mm(a: _Args) -> OpCost:
    """``_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, ...)`` (FP8 GEMM)."""
    x, w = a.need(0), a.need(1)
    if len(x.shape) != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[0]:
        raise _Malformed("_scaled_mm shapes")
    in_bytes = sum(t.nbytes for i in range(6) if (t := a.tensor(i)) is not None)
    return _gemm(x.shape[0], x.shape[1], w.shape[1], 1, in_bytes, a.dtype_code(6) or x.dtype)


def _mv(a: _Args, *, bias: bool = False) -> OpCost:
    """``mv(mat (M,N), vec (N,))`` / ``addmv(self, mat, vec)``: 2·M·N FLOPs."""
    off = 1 if bias else 0
    mat, vec = a.need(off), a.need(off + 1)
    if len(mat.shape) != 2 or len(vec.shape) != 1 or mat.shape[1] != vec.shape[0]:
        raise _Malformed("mv shapes")
    add = a.tensor(0) if bias else None
    in_bytes = mat.nbytes + vec.nbytes + (add.nbytes if add is not None else 0)
    return _gemm(mat.shape[0], mat.shape[1], 1, 1, in_bytes, mat.dtype)


def _dot(a: _Args) -> OpCost:
    x, y = a.need(0), a.need(1)
    if len(x.shape) != 1 or x.shape != y.shape:
        raise _Malformed("dot shapes")
    return _cost(2.0 * x.numel, x.nbytes + y.nbytes + element_size(x.dtype), "gemm")


# --- attention -------------------------------------------------------------------------------------------------------


def _causal_pairs(sq: float, skv: float, mode: str) -> float:
    """(query, key) pairs computed under a causal mask: ``mode`` is ``"none"``, ``"bottom_right"`` or ``"top_left"``.

    Bottom-right alignment (query i sees keys ``<= i + Skv - Sq``) leaves ``Sq·Skv − Sq·(Sq−1)/2`` pairs when
    ``Sq <= Skv``; top-left alignment (query i sees keys ``<= i``) leaves ``Sq·(Sq+1)/2``.
    """
    if mode == "none":
        return sq * skv
    if mode == "top_left":
        return sq * (sq + 1) / 2 if sq <= skv else skv * (skv + 1) / 2 + (sq - skv) * skv
    return sq * skv - sq * (sq - 1) / 2 if sq <= skv else skv * (skv + 1) / 2


def _attention(
    a: _Args,
    *,
    layout: str,
    causal_pos: int,
    mask_pos: int | None = None,
    cu_seq_pos: int | None = None,
    causal_is_mask_type: bool = False,
    window_pos: int | None = None,
) -> OpCost:
    """Fused attention: q (B,Hq,Sq,D), k (B,Hk,Skv,D), v (B,Hk,Skv,Dv) for ``layout="bhsd"``, (B,S,H,D) for
    ``"bshd"``; varlen (T,H,D) with ``cu_seqlens`` (B+1,). FLOPs ``2·B·Hq·pairs·(D+Dv)``; bytes q+k+v(+mask)+out."""
    q, k, v = a.need(0), a.need(1), a.need(2)
    cu = a.tensor(cu_seq_pos) if cu_seq_pos is not None else None
    if len(q.shape) == 4 and len(k.shape) == 4 and len(v.shape) == 4:
        if layout == "bhsd":
            (b, hq, sq, d), skv, dv = q.shape, k.shape[2], v.shape[3]
            ok = k.shape[3] == d and v.shape[2] == skv
        else:
            (b, sq, hq, d), skv, dv = q.shape, k.shape[1], v.shape[3]
            ok = k.shape[3] == d and v.shape[1] == skv
        nseq, sq_f, skv_f = b, float(sq), float(skv)
    elif len(q.shape) == 3 and len(k.shape) == 3 and len(v.shape) == 3 and cu is not None and cu.numel >= 2:
        # variable-length packing: average sequence lengths (exact when all sequences have the same length)
        (tq, hq, d), tk, dv = q.shape, k.shape[0], v.shape[2]
        nseq = cu.numel - 1
        sq_f, skv_f = tq / nseq, tk / nseq
        ok = k.shape[2] == d and v.shape[0] == tk
    else:
        raise _Malformed("attention shapes")
    if not ok:
        raise _Malformed("attention q/k/v mismatch")
    if causal_is_mask_type:
        mode = {0: "none", 1: "top_left", 2: "bottom_right"}.get(_parse_int(a.value(causal_pos)) or 0, "none")
    else:
        mode = "bottom_right" if _parse_bool(a.value(causal_pos)) else "none"
    pairs = _causal_pairs(sq_f, skv_f, mode)
    if window_pos is not None:  # sliding-window attention: each query sees at most window+1 keys
        w = _parse_int(a.value(window_pos))
        if w is not None and w >= 0:
            pairs = min(pairs, sq_f * min(skv_f, w + 1.0))
    flops = 2.0 * nseq * hq * pairs * (d + dv)
    mask = a.tensor(mask_pos) if mask_pos is not None else None
    out_bytes = (q.numel // d) * dv * element_size(q.dtype) if d else 0
    nbytes = q.nbytes + k.nbytes + v.nbytes + (mask.nbytes if mask is not None else 0) + out_bytes
    return _cost(flops, nbytes, "attention")


# --- norms, softmax, reductions --------------------------------------------------------------------------------------


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


# --- indexing, gather/scatter, embedding ------------------------------------------------------------------------------


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


def _isin(a: _Args) -> OpCost:
    """``isin(elements, test_elements)``: read both, write a bool per element (a Scalar on either side is free)."""
    ts = a.tensors()
    elements = a.tensor(0) or (ts[0] if ts else None)
    if elements is None:
        raise _Malformed("isin without tensors")
    return _cost(elements.numel, sum(t.nbytes for t in ts) + elements.numel, "elementwise")


def _scatter_into(a: _Args) -> OpCost:
    """``slice_scatter(self, src, ...)`` and friends: copy self (read + write) and read src."""
    x, src = a.need(0), a.need(1)
    return _cost(0, 2 * x.nbytes + src.nbytes, "copy")


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


# --- sampling --------------------------------------------------------------------------------------------------------


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


def _assert_async(a: _Args) -> OpCost:
    """Device-side check of one value: read it."""
    return _cost(0, a.need(0).nbytes, "other")


# ---------------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------------

# Ops that cost nothing: metadata-only views, allocation without initialisation, host-side queries, and
# CompositeImplicitAutograd ops (including aliases such as divide -> div) whose work is done, and priced, by the
# aten ops they decompose into.
_VIEW_OPS = """
view view_as reshape reshape_as _reshape_alias _unsafe_view as_strided as_strided_ transpose transpose_ t t_ permute
expand expand_as broadcast_to unsqueeze unsqueeze_ squeeze squeeze_ slice select narrow split split_with_sizes
unsafe_split tensor_split chunk unbind unfold diagonal movedim moveaxis swapaxes swapdims flatten unflatten alias
detach detach_ lift_fresh lift resolve_conj resolve_neg conj _conj _neg_view view_as_real view_as_complex real imag
positive result_type can_cast promote_types empty empty_strided empty_like new_empty new_empty_strided
empty_permuted set_ resize_ resize_as_ to type_as linear matmul einsum scaled_dot_product_attention
_scaled_dot_product_attention_math _fused_sdp_choice dropout feature_dropout alpha_dropout feature_alpha_dropout
contiguous pad is_nonzero item size stride dim numel sym_size sym_stride sym_numel sym_storage_offset
storage_offset is_contiguous is_floating_point is_complex is_same_size _has_compatible_shallow_copy_type
_assert_tensor_metadata _nested_tensor_from_mask_left_aligned record_stream _version retain_grad requires_grad_
set_requires_grad _shape_as_tensor output_nr
softmax log_softmax layer_norm rms_norm argsort nanmean isfinite pin_memory concat concatenate fliplr flipud
divide divide_ true_divide true_divide_ multiply multiply_ subtract subtract_ negative negative_ square square_
greater greater_ greater_equal greater_equal_ less less_ less_equal less_equal_ not_equal not_equal_ clip clip_
relu6 relu6_ selu selu_ float_power float_power_ __and__ __or__ __xor__ __iand__ __ior__ __ixor__
""".split()  # noqa: SIM905 (a word list reads better than a 100-line list literal)

# Elementwise ops: FLOPs per output element, and how the output dtype is chosen. ``promote``: torch type promotion
# of the inputs; ``float``: promotion, then integer results become float32 (true division, transcendentals);
# ``bool``: comparisons and predicates; ``self``: the first argument's dtype; ``where``: promotion of args 1 and 2.
# FLOP constants: 1 for add/mul/compare/select-like ops; 2 for (r)sqrt; ~4 for a transcendental (exp, log, tanh, ...:
# range reduction + polynomial on the special-function unit); activations are the sum of their parts, e.g.
# silu = x·sigmoid(x) ≈ 5, gelu (erf or tanh form) ≈ 8.
_ELEMENTWISE: dict[str, tuple[float, str]] = {
    **dict.fromkeys(["add", "sub", "rsub", "mul"], (1.0, "promote")),
    **dict.fromkeys(["div", "reciprocal"], (1.0, "float")),
    **dict.fromkeys(["floor_divide", "remainder", "fmod"], (2.0, "promote")),
    **dict.fromkeys(["neg", "abs", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac"], (1.0, "promote")),
    **dict.fromkeys(["relu", "hardtanh", "clamp", "clamp_min", "clamp_max"], (1.0, "promote")),
    **dict.fromkeys(["maximum", "minimum", "fmax", "fmin", "copysign", "nan_to_num", "heaviside"], (1.0, "promote")),
    **dict.fromkeys(["bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not"], (1.0, "promote")),
    **dict.fromkeys(["bitwise_left_shift", "bitwise_right_shift"], (1.0, "promote")),
    **dict.fromkeys(["eq", "ne", "lt", "le", "gt", "ge"], (1.0, "bool")),
    **dict.fromkeys(["logical_and", "logical_or", "logical_xor", "logical_not"], (1.0, "bool")),
    **dict.fromkeys(["isnan", "isinf", "isneginf", "isposinf", "signbit"], (1.0, "bool")),
    "where": (1.0, "where"),
    "masked_fill": (1.0, "self"),
    "triu": (1.0, "promote"),
    "tril": (1.0, "promote"),
    **dict.fromkeys(["sqrt", "rsqrt"], (2.0, "float")),
    **dict.fromkeys(["exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan"], (4.0, "float")),
    **dict.fromkeys(["tanh", "sigmoid", "erf", "erfc", "erfinv", "asin", "acos", "atan", "atan2"], (4.0, "float")),
    **dict.fromkeys(["sinh", "cosh", "asinh", "acosh", "atanh", "pow", "xlogy"], (4.0, "float")),
    **dict.fromkeys(["lerp", "addcmul", "addcdiv", "hardsigmoid"], (3.0, "promote")),
    **dict.fromkeys(["leaky_relu"], (2.0, "promote")),
    **dict.fromkeys(["silu", "elu", "celu", "logit", "hardswish"], (5.0, "float")),
    **dict.fromkeys(["softplus"], (6.0, "float")),
    **dict.fromkeys(["gelu"], (8.0, "float")),
    **dict.fromkeys(["mish"], (10.0, "float")),
    "native_dropout": (2.0, "promote"),
}

# Ops whose in-place form (name + "_") is not a plain elementwise op, or has no in-place form.
_NO_INPLACE = {"where", "native_dropout", "isnan", "isinf", "isneginf", "isposinf", "signbit"}

_ATTENTION: dict[str, dict[str, Any]] = {
    # name: layout and positions in the schema (see module docstring)
    "_scaled_dot_product_flash_attention": {"layout": "bhsd", "causal_pos": 4},
    "_scaled_dot_product_flash_attention_for_cpu": {"layout": "bhsd", "causal_pos": 4, "mask_pos": 5},
    "_scaled_dot_product_cudnn_attention": {"layout": "bhsd", "causal_pos": 6, "mask_pos": 3},
    "_cudnn_attention_forward": {"layout": "bhsd", "causal_pos": 10, "mask_pos": 3, "cu_seq_pos": 4},
    "_scaled_dot_product_efficient_attention": {"layout": "bhsd", "causal_pos": 6, "mask_pos": 3},
    "_scaled_dot_product_fused_attention_overrideable": {"layout": "bhsd", "causal_pos": 5, "mask_pos": 3},
    "_scaled_dot_product_attention_math_for_mps": {"layout": "bhsd", "causal_pos": 5, "mask_pos": 3},
    "_flash_attention_forward": {"layout": "bshd", "causal_pos": 8, "cu_seq_pos": 3, "window_pos": 11},
    "_efficient_attention_forward": {
        "layout": "bshd",
        "causal_pos": 9,
        "causal_is_mask_type": True,
        "mask_pos": 3,
        "cu_seq_pos": 4,
        "window_pos": 13,
    },
}


def _build_registry() -> dict[str, CostFn]:
    reg: dict[str, CostFn] = {}

    def add(names: Iterable[str] | str, fn: CostFn) -> None:
        for n in [names] if isinstance(names, str) else names:
            reg[n] = fn

    add(_VIEW_OPS, _view)

    for name, (fl, out) in _ELEMENTWISE.items():
        add(name, partial(_elementwise, flops_per=fl, out=out))
        if name not in _NO_INPLACE:
            add(name + "_", partial(_elementwise, flops_per=fl, inplace=True))

    # GEMM
    add("mm", partial(_mm, out_dtype_pos=2))
    add(["addmm", "_addmm_activation"], partial(_mm, bias_pos=0))
    add("_int_mm", partial(_mm, out_dtype="int32"))
    add("bmm", _bmm)
    add("baddbmm", partial(_bmm, bias=True))
    add("_scaled_mm", _scaled_mm)
    add("mv", _mv)
    add("addmv", partial(_mv, bias=True))
    add(["dot", "vdot"], _dot)

    # attention
    for name, kw in _ATTENTION.items():
        add(name, partial(_attention, **kw))

    # norms and softmax (layer norm ≈ 8 FLOPs/element: mean, variance, normalise, affine; RMS norm ≈ 4)
    add("native_layer_norm", partial(_norm, flops_per=8.0, bias_pos=3))
    add("_fused_rms_norm", partial(_norm, flops_per=4.0))
    add(["_softmax", "_safe_softmax", "_log_softmax"], _softmax)

    # reductions (FLOPs per input element: 1 for sum/max-like, 3 for var/std, 4 for var_mean, 6 for logsumexp)
    add(["sum", "prod", "nansum"], partial(_reduction, min_args_for_dim=3, int_accumulates=True))
    add("mean", partial(_reduction, min_args_for_dim=3))
    add(["amax", "amin"], _reduction)
    add(["argmax", "argmin"], partial(_reduction, out="int64"))
    add(["any", "all"], partial(_reduction, out="bool"))
    add(["max", "min"], _max_min)
    add("aminmax", partial(_reduction, out="pair"))
    add(["var", "std"], partial(_reduction, flops_per=3.0, min_args_for_dim=3))
    add(["var_mean", "std_mean"], partial(_reduction, flops_per=4.0, out="pair", min_args_for_dim=3))
    add("logsumexp", partial(_reduction, flops_per=6.0))
    add("linalg_vector_norm", partial(_reduction, flops_per=2.0, dim_pos=2, min_args_for_dim=3))
    add("count_nonzero", partial(_reduction, out="int64"))

    # copies, casts, fills
    add(["copy_", "_copy_from", "_copy_from_and_resize"], _copy_)
    add("_to_copy", _to_copy)
    add(["clone", "lift_fresh_copy", "_reshape_copy", "flip", "roll"], _copy_like)
    add("_pin_memory", _copy_like)
    add(["slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter"], _scatter_into)
    add(["cat", "stack", "_cat", "_stack"], _cat)
    add("_local_scalar_dense", _local_scalar_dense)
    add(["fill_", "zero_"], _fill_inplace)
    add(["ones", "zeros"], _factory)
    add("full", partial(_factory, dtype_pos=2, fill_pos=1))
    add(["new_ones", "new_zeros"], _new_factory)
    add("new_full", partial(_new_factory, dtype_pos=3))
    add(["ones_like", "zeros_like"], _like_factory)
    add("full_like", partial(_like_factory, dtype_pos=2))
    add("scalar_tensor", _scalar_tensor)
    add("arange", _arange)
    add("repeat", _repeat)
    add("repeat_interleave", _repeat_interleave)
    add("constant_pad_nd", _constant_pad_nd)
    add("_assert_async", _assert_async)
    add("isin", _isin)

    # indexing
    add("embedding", _embedding)
    add("index_select", _index_select)
    add("gather", _gather)
    add(["scatter", "scatter_add", "scatter_reduce"], partial(_scatter, inplace=False))
    add(["scatter_", "scatter_add_", "scatter_reduce_"], partial(_scatter, inplace=True))
    add(["index_add", "index_copy"], partial(_scatter, inplace=False, slices=True))
    add(["index_add_", "index_copy_"], partial(_scatter, inplace=True, slices=True))
    add("index", _index)
    add(["index_put_", "_index_put_impl_"], partial(_index_put, inplace=True))
    add("index_put", partial(_index_put, inplace=False))

    # sampling and RNG. In-place RNG fills only write (they never read the old values); FLOPs per element: uniform
    # 1 (scale + shift), exponential 4 (a log), normal 6 (Box-Muller: log, sqrt, sin/cos), bernoulli 2.
    add("multinomial", _multinomial)
    add("topk", _topk)
    add("sort", _sort)
    add(["cumsum", "cumprod", "logcumsumexp"], partial(_copy_like, category="sampling", flops_per=1.0))
    add(["uniform_", "random_", "cauchy_", "geometric_"], partial(_fill_inplace, category="sampling", flops_per=1.0))
    add(["exponential_", "log_normal_"], partial(_fill_inplace, category="sampling", flops_per=4.0))
    add("normal_", partial(_fill_inplace, category="sampling", flops_per=6.0))
    add("bernoulli_", partial(_fill_inplace, category="sampling", flops_per=2.0))
    add("bernoulli", partial(_copy_like, category="sampling", flops_per=2.0))
    add(["rand", "randn"], _rng_factory)
    add(["rand_like", "randn_like"], partial(_like_factory, category="sampling"))
    add("randint", _randint)
    add("randperm", _randperm)
    return reg


_REGISTRY: dict[str, CostFn] = _build_registry()


def _normalise_name(name: str) -> str:
    if name.startswith("aten::"):
        name = name[len("aten::") :]
    return name.split(".", 1)[0]


def op_cost(
    name: str,
    input_dims: list,
    input_types: list,
    concrete_inputs: list | None = None,
    *,
    default_dtype: str = _DEFAULT_FLOAT,
) -> OpCost | None:
    """Cost of one aten op event from a profiler trace, or ``None`` when there is no model for the op.

    ``name`` is the event name (``"aten::mm"``; a bare ``"mm"`` works too). ``input_dims``, ``input_types`` and
    ``concrete_inputs`` are the event's ``Input Dims``, ``Input type`` and ``Concrete Inputs`` lists.
    ``default_dtype`` is the dtype assumed for ``TensorList`` members (``cat``/``stack``), whose dtype the trace
    does not record. Never raises: arguments that do not fit the op's schema give ``None``.
    """
    try:
        fn = _REGISTRY.get(_normalise_name(name))
        if fn is None:
            return None
        if fn is _view:
            return _VIEW
        cost = fn(_Args(input_dims, input_types, concrete_inputs, dtype_name(default_dtype) or _DEFAULT_FLOAT))
        if cost is None or not (math.isfinite(cost.flops) and math.isfinite(cost.bytes)):
            return None
        return cost
    except Exception:  # malformed or unexpected arguments: no model rather than a crash
        return None


# ---------------------------------------------------------------------------------------------------------------------
# roofline classification
# ---------------------------------------------------------------------------------------------------------------------

LATENCY_US = 10.0  # kernels shorter than this are launch/latency bound whatever their arithmetic
LATENCY_FRACTION = 0.4  # ... and so are kernels that reach less than this fraction of both roofs


def _classify_arrays(
    dur_us: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, peak_tflops: np.ndarray, bandwidth_gbps: float
) -> dict[str, np.ndarray]:
    with np.errstate(divide="ignore", invalid="ignore"):
        dur = np.where(dur_us > 0, dur_us, np.nan)
        intensity = np.where(nbytes > 0, flops / nbytes, np.nan)
        achieved_gbps = nbytes / dur / 1e3  # B/µs -> GB/s
        achieved_tflops = flops / dur / 1e6  # FLOP/µs -> TFLOP/s
        compute_only = (nbytes == 0) & (flops > 0)
        attainable = np.where(
            np.isnan(intensity),
            np.where(compute_only, peak_tflops, np.nan),
            np.minimum(peak_tflops, bandwidth_gbps * intensity / 1e3),
        )
        frac_bandwidth = achieved_gbps / bandwidth_gbps
        frac_compute = achieved_tflops / peak_tflops
        modeled = ~np.isnan(flops) & ~np.isnan(nbytes)
        achieved_frac = np.where(flops > 0, achieved_tflops / attainable, frac_bandwidth)
        achieved_frac = np.where(modeled, achieved_frac, np.nan)
        ridge = peak_tflops * 1e3 / bandwidth_gbps  # FLOP/byte where the two roofs meet
        latency = (dur_us < LATENCY_US) | (
            modeled & (frac_bandwidth < LATENCY_FRACTION) & (frac_compute < LATENCY_FRACTION)
        )
        memory = modeled & (intensity < ridge)  # NaN intensity (bytes == 0) compares False -> compute
    bound = np.select([latency, ~modeled, memory], ["latency", "unmodeled", "memory"], "compute").astype(object)
    return {
        "intensity": intensity,
        "achieved_gbps": achieved_gbps,
        "achieved_tflops": achieved_tflops,
        "peak_tflops": np.broadcast_to(peak_tflops, intensity.shape).astype(float),
        "attainable_tflops": attainable,
        "frac_bandwidth": frac_bandwidth,
        "frac_compute": frac_compute,
        "achieved_frac": achieved_frac,
        "bound": bound,
    }


def _as_float(x: Any) -> float:
    try:
        return float("nan") if x is None else float(x)
    except (TypeError, ValueError):
        return float("nan")


def classify(
    dur_us: float, flops: float | None, bytes: float | None, peak_tflops: float, bandwidth_gbps: float
) -> dict[str, Any]:
    """Roofline placement of one kernel.

    Returns ``intensity`` (FLOP/byte), ``achieved_gbps``, ``achieved_tflops``, ``peak_tflops``,
    ``attainable_tflops`` (``min(peak, bandwidth·intensity)``), ``frac_bandwidth``, ``frac_compute``,
    ``achieved_frac`` (achieved / attainable; ``frac_bandwidth`` when the kernel does no FLOPs) and ``bound``
    (``compute`` / ``memory`` / ``latency`` / ``unmodeled``), with the same rules as :func:`classify_kernels`.
    ``flops``/``bytes`` of ``None`` or NaN mean "unmodeled".
    """
    if not bandwidth_gbps or bandwidth_gbps <= 0:
        raise ValueError("bandwidth_gbps must be positive")
    res = _classify_arrays(
        np.array([_as_float(dur_us)]),
        np.array([_as_float(flops)]),
        np.array([_as_float(bytes)]),
        np.array([_as_float(peak_tflops)]),
        float(bandwidth_gbps),
    )
    return {k: (str(v[0]) if k == "bound" else float(v[0])) for k, v in res.items()}


def _peak_for(dtype: Any, table: dict[str, float], fallback: float) -> float:
    if not isinstance(dtype, str):
        return fallback
    name = dtype if dtype in table else (dtype_name(dtype) or dtype)
    if name == "bool" or _is_int(name):
        return fallback
    return float(table.get(name, fallback))


def classify_kernels(
    kernels: pd.DataFrame, bandwidth_gbps: float, peak_tflops_by_dtype: dict[str, float]
) -> pd.DataFrame:
    """Vectorised :func:`classify` over a kernel table.

    ``kernels`` needs ``dur_us``, ``flops``, ``bytes`` (NaN = unmodeled) and ``dtype`` (canonical name, None/NaN if
    unknown). The peak for a row is ``peak_tflops_by_dtype[dtype]``; integer, bool, unknown and missing dtypes use
    the ``"float32"`` entry. Returns a copy with the columns ``intensity``, ``achieved_gbps``, ``achieved_tflops``,
    ``peak_tflops``, ``attainable_tflops``, ``frac_bandwidth``, ``frac_compute``, ``achieved_frac`` and ``bound``:

    * ``latency``: shorter than 10 µs, or modeled and under 40% of both roofs;
    * ``unmodeled``: otherwise, when flops or bytes is NaN;
    * ``memory``: intensity below the ridge point ``peak_tflops·1000 / bandwidth_gbps`` FLOP/byte;
    * ``compute``: otherwise (including bytes == 0 with flops > 0).
    """
    if not bandwidth_gbps or bandwidth_gbps <= 0:
        raise ValueError("bandwidth_gbps must be positive")
    if "float32" not in peak_tflops_by_dtype:
        raise ValueError("peak_tflops_by_dtype needs a 'float32' entry (the fallback peak)")
    fallback = float(peak_tflops_by_dtype["float32"])
    out = kernels.copy()
    n = len(out)
    if "dtype" in out.columns:
        codes, uniques = pd.factorize(out["dtype"], use_na_sentinel=True)
        peaks_u = np.array([_peak_for(u, peak_tflops_by_dtype, fallback) for u in uniques] + [fallback], dtype=float)
        peak = peaks_u[codes]  # code -1 (None/NaN) picks the appended fallback
    else:
        peak = np.full(n, fallback)

    def col(name: str) -> np.ndarray:
        return pd.to_numeric(out[name], errors="coerce").to_numpy(dtype=float, na_value=np.nan)

    res = _classify_arrays(col("dur_us"), col("flops"), col("bytes"), peak, float(bandwidth_gbps))
    for k, v in res.items():
        out[k] = v
    return out
