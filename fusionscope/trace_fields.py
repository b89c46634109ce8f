"""Numbers read from a trace, parsed defensively: the one place every integer and float field of a trace event
(ids, streams, devices, correlations, timestamps, durations, ranks, step numbers) is converted.

Traces written by other programs do not always hold JSON numbers where Kineto on CUDA does: ROCm traces write
streams, devices and correlation ids as hex strings (`"0x0"`), some tools write floats as strings (`"12.5"`), and
fields go missing. Each value becomes a number or the caller's default, never an exception:

- int: a JSON int; a float with an integral value; a string in decimal, hex (`0x`), octal (`0o`) or binary (`0b`),
  signed or not, or a decimal float string with an integral value (`"7.0"`); anything else (missing, not a number,
  a fraction, a list) is the default. A bool is 0 or 1.
- float: a JSON number; a string a float reads (`"12.5"`, `"1e3"`) or an integer string in any base above.

The array forms take a fast path when every value already is a number of the kind asked for (the common case,
one pass in C) and otherwise parse each distinct value once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def to_int(value: object, default: int = -1) -> int:
    """`value` as an int (module docstring), or `default`."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if INT64_MIN <= value <= INT64_MAX else default
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else default
    parsed = _int_text(value)
    return default if parsed is None else parsed


def to_float(value: object, default: float = math.nan) -> float:
    """`value` as a float (module docstring), or `default`."""
    if isinstance(value, int | float):
        return float(value)
    text = _text(value)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        parsed = _int_text(text)  # hex, octal, binary
        return default if parsed is None else float(parsed)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value.strip().replace("_", "") if isinstance(value, str) else None


def _int_text(value: object) -> int | None:
    """An integer string in any base `int(text, 0)` reads (or decimal with leading zeros), or a float string with
    an integral value, within int64; else None."""
    text = _text(value)
    if not text:
        return None
    try:
        parsed = int(text, 0)  # 12, -3, 0x1f, 0o17, 0b101
    except ValueError:
        try:
            parsed = int(text, 10)  # "012", which base 0 refuses
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                return None
            if not (math.isfinite(number) and number.is_integer()):
                return None
            parsed = int(number)
    return parsed if INT64_MIN <= parsed <= INT64_MAX else None


def int_array(values: Sequence | np.ndarray, default: int = -1) -> np.ndarray:
    """`to_int` of every value, as an int64 array."""
    array = _objects(values)
    if pd.api.types.infer_dtype(array, skipna=False) == "integer":
        try:
            return array.astype(np.int64)
        except OverflowError:  # an int beyond int64: parsed one by one below
            pass
    return _per_distinct(array, lambda v: to_int(v, default), np.int64, default)


def float_array(values: Sequence | np.ndarray, default: float = math.nan) -> np.ndarray:
    """`to_float` of every value, as a float64 array."""
    array = _objects(values)
    if pd.api.types.infer_dtype(array, skipna=False) in ("floating", "integer", "mixed-integer-float"):
        return array.astype(float)
    return _per_distinct(array, lambda v: to_float(v, default), float, default)


def _objects(values: Sequence | np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        return values
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _per_distinct(array: np.ndarray, parse, dtype: type, default: object) -> np.ndarray:
    """`parse` of each distinct value once (values that cannot be hashed, one by one)."""
    try:
        codes, uniques = pd.factorize(array, use_na_sentinel=True)
    except TypeError:  # a list or dict among the values
        return np.fromiter((parse(v) for v in array.tolist()), dtype=dtype, count=len(array))
    parsed = np.fromiter((parse(v) for v in uniques), dtype=dtype, count=len(uniques))
    out = np.full(len(array), default, dtype=dtype)
    known = codes >= 0  # None and NaN are the sentinel
    out[known] = parsed[codes[known]]
    return out
