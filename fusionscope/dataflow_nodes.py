"""The dataflow's node table as the fusion catalogue reads it, without torch: its columns, the producer id of a leaf,
the ops that compute nothing, and each timed op's owning node. `fusionscope.dataflow` records such a table under
torch's dispatcher and joins it to a timed pass; `fusionscope.order_graph` infers one from a trace (`analyze`, which
so never imports torch).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

NODE_COLUMNS = [
    "node",
    "step",
    "phase",
    "module",
    "name",
    "inputs",
    "input_shapes",
    "input_dtypes",
    "output_shapes",
    "output_dtypes",
    "scalars",
    "consumers",
    "is_view",
    "inplace",
    "input_params",
]
LEAF = -1  # producer id of a tensor no recorded op made: parameters, buffers, model inputs, state from before
# `input_params` tells those leaves apart: per input, True when it is a parameter or buffer of the model (or shares
# one's storage), False for a model input, state from before, or a tensor a recorded op made. A residual add reads an
# activation and, in a block stack whose first block adds its input, a model input; a bias add reads a parameter.
# Ops that compute nothing, besides the views (`is_view`): allocations and autograd bookkeeping. With the views they are
# left out of the join rate: a fused kernel absorbs them for free, and the catalogue ranks groups by the others' time.
METADATA_OPS = frozenset({"aten::lift_fresh", "aten::detach_", "aten::empty", "aten::empty_strided"})
# Ops that return a view without saying so in their schema (`_unsafe_view` ends `aten::matmul`'s decomposition).
VIEW_LIKE_OPS = frozenset({"aten::_unsafe_view"})


def one_rank(ops: pd.DataFrame, rank: int | None) -> pd.DataFrame:
    """Each rank runs its own copy of the sequence (and numbers its ops on its own): join to one, the lowest unless
    told."""
    if "rank" not in ops or ops.empty:
        return ops
    return ops[ops["rank"] == (ops["rank"].min() if rank is None else rank)]


def op_owners(joined: pd.DataFrame, ops: pd.DataFrame, rank: int | None = None) -> pd.Series:
    """For every timed op (index: `op_id`), the node that owns it: the node matched to the op itself or to its nearest
    matched ancestor, -1 for none.

    A kernel's `op_id` is the innermost op around its launch, often one the recorder never saw (`aten::copy_` inside a
    node's `aten::_to_copy`, `aten::_cudnn_attention_forward` inside `aten::_scaled_dot_product_cudnn_attention`), so
    `kernels["op_id"].map(op_owners(joined, ops))` is how a node gets all of its kernels. `rank` as in `join_dataflow`.
    """
    hit = joined[joined["op_id"] >= 0]
    matched = dict(zip(hit["op_id"].tolist(), hit["node"].tolist()))
    ops = one_rank(ops, rank).sort_values(["tid", "ts_us", "dur_us"], ascending=[True, True, False], kind="stable")
    owner: dict[int, int] = {}
    for op_id, parent in zip(ops["op_id"].tolist(), ops["parent_op"].tolist()):
        owner[op_id] = matched.get(op_id, owner.get(parent, LEAF))
    return pd.Series(owner, name="node", dtype=np.int64).rename_axis("op_id")
