"""Which cost function prices which aten op, and `op_cost`, the one entry point: a profiler op event in, its `OpCost`
out (None where no model fits).

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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

from fusionscope.roofline.args import _Args
from fusionscope.roofline.attention import _ATTENTION, _attention
from fusionscope.roofline.copies import (
    _arange,
    _assert_async,
    _cat,
    _constant_pad_nd,
    _copy_,
    _copy_like,
    _factory,
    _fill_inplace,
    _like_factory,
    _local_scalar_dense,
    _new_factory,
    _repeat,
    _repeat_interleave,
    _scalar_tensor,
    _scatter_into,
    _to_copy,
)
from fusionscope.roofline.dtypes import _DEFAULT_FLOAT, dtype_name
from fusionscope.roofline.elementwise import _ELEMENTWISE, _NO_INPLACE, _elementwise, _isin
from fusionscope.roofline.gemm import _bmm, _dot, _mm, _mv, _scaled_mm
from fusionscope.roofline.indexing import _embedding, _gather, _index, _index_put, _index_select, _scatter
from fusionscope.roofline.opcost import _VIEW, CostFn, OpCost, _view
from fusionscope.roofline.reductions import _max_min, _norm, _reduction, _softmax
from fusionscope.roofline.sampling import _multinomial, _randint, _randperm, _rng_factory, _sort, _topk

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
