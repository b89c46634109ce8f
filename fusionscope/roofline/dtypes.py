"""Dtypes as a trace writes them: c10's type names (`c10::BFloat16`, `long int`) to torch's canonical names, bytes per
element, the ScalarType codes of `Concrete Inputs`, and torch's type promotion (simplified).

Every cost function needs the bytes of what it reads and writes, so every one starts here; `op_dtype` is also what
the kernel table's `dtype` column (the peak a kernel is classed against) comes from.
"""

from __future__ import annotations

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


_KIND_DEFAULT = {1: "int64", 2: _DEFAULT_FLOAT, 3: "complex64"}
