"""GEMMs and their relatives (`mm`, `addmm`, `bmm`, `baddbmm`, FP8 `_scaled_mm`, `mv`, `dot`): 2·M·K·N FLOPs, each
operand read once and the product written once. A bias add is no FLOPs (as `torch.utils.flop_counter` counts it).
"""

from __future__ import annotations

from fusionscope.roofline.args import _Args, _Malformed
from fusionscope.roofline.dtypes import element_size
from fusionscope.roofline.opcost import OpCost, _cost


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
