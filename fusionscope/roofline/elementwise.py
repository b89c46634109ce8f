"""Elementwise ops: FLOPs per output element from one table, the output's shape by broadcasting and its dtype by
torch's promotion; every tensor input read once, the output written once (in place: written over the first input).

The table is also what the dataflow inference takes for "an elementwise op" (`op_outputs`, `order_graph`,
`execution_trace`).
"""

from __future__ import annotations

import math

from fusionscope.roofline.args import _Args, _broadcast, _Malformed, _result_dtype
from fusionscope.roofline.dtypes import _DEFAULT_FLOAT, _kind, element_size
from fusionscope.roofline.opcost import OpCost, _cost

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


def _isin(a: _Args) -> OpCost:
    """``isin(elements, test_elements)``: read both, write a bool per element (a Scalar on either side is free)."""
    ts = a.tensors()
    elements = a.tensor(0) or (ts[0] if ts else None)
    if elements is None:
        raise _Malformed("isin without tensors")
    return _cost(elements.numel, sum(t.nbytes for t in ts) + elements.numel, "elementwise")
