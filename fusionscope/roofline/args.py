"""One op event's recorded arguments, read as a cost function needs them: `_Args` over the parallel `Input Dims`,
`Input type` and `Concrete Inputs` lists (tensors as shape + dtype, scalars parsed), broadcasting, the result dtype
(`torch.result_type`'s rules), the numel left by a reduction, and `_Malformed`, raised when the arguments do not fit
the op's schema (`op_cost` turns it into "no model").

Kept apart from the cost functions because the dataflow inference reads arguments the same way (`op_outputs`,
`order_graph`: an op's output shapes and dtypes from its inputs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from fusionscope.roofline.dtypes import (
    _DEFAULT_FLOAT,
    _KIND_DEFAULT,
    _SCALAR_TYPE_CODES,
    _kind,
    _promote,
    dtype_name,
    element_size,
)


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
