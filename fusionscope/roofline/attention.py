"""Fused attention ops (flash, memory-efficient, cuDNN, the CPU and MPS kernels, varlen): FLOPs for QKᵀ and PV over
the (query, key) pairs a causal mask or a sliding window leaves, bytes for q, k, v, the mask and the output.

Attention and causal masks
--------------------------
FLOPs are ``2·B·Hq·Sq·Skv·(D + Dv)`` (QKᵀ and PV), scaled by the fraction of (query, key) pairs a causal mask
leaves. ``is_causal`` is taken to be aligned to the bottom-right corner (the flash-attention convention; it coincides
with PyTorch's top-left convention when ``Sq == Skv``, the prefill case, and keeps a decode step with ``Sq = 1`` at
full cost). ``_efficient_attention_forward``'s ``custom_mask_type`` distinguishes the two alignments explicitly and is
honoured.
"""

from __future__ import annotations

from typing import Any

from fusionscope.roofline.args import _Args, _Malformed, _parse_bool, _parse_int
from fusionscope.roofline.dtypes import element_size
from fusionscope.roofline.opcost import OpCost, _cost


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
