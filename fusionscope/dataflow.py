"""The real dataflow between aten ops: which op produced each input tensor, which ops read each output.

The fusion catalogue needs this because adjacency lies: two ops next to each other in the trace need not be connected,
and a group of ops is fusable only if none of its intermediates is read outside the group (a residual add feeds both
the next norm and the next residual add). The profiler records shapes, not tensor identities, so the dataflow is
recorded in a pass of its own under a `TorchDispatchMode` — never in the timed pass, as a Python callback on every op
inflates host time — and then joined op by op to the timed pass (`join_dataflow`), which gives each node its `op_id`,
and through it its kernels and times.

What the two passes see differs. The profiler records every op that goes through the dispatcher, nested: composites
(`aten::linear` → `aten::t` + `aten::matmul` → `aten::view` + `aten::mm` + `aten::_unsafe_view`; `aten::to` →
`aten::_to_copy`) and the ops kernels call themselves (`aten::_to_copy` → `aten::empty_strided` + `aten::copy_`,
`aten::mean` → `aten::sum` + `aten::div_`, a Python scalar operand wrapped by `aten::to`). The dispatch mode sees one
level: under `inference_mode` (which `run_sequence` uses) composites arrive whole, and whatever an op's kernel calls
stays hidden. The recorder decomposes composites itself, as eager execution does, so that nodes are the ops kernels
hang off (`aten::mm`, not `aten::linear`); the join then keeps, on the profiler side, the outermost ops whose names
the recorder also saw, and aligns the two sequences step by step.
"""

from __future__ import annotations

import contextlib
import difflib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from fusionscope import capture
from fusionscope.dataflow_nodes import LEAF, METADATA_OPS, NODE_COLUMNS, VIEW_LIKE_OPS, one_rank
from fusionscope.dataflow_nodes import op_owners as op_owners
from fusionscope.models import Workload

# Profiler names that stand for a recorder name. `reshape` of a viewable tensor calls `aten::_reshape_alias`, unless a
# Python dispatch mode is active (a "tensor subclass-like" context), where it calls `aten::view`: the recorder itself
# changes that one op, so the two are the same node.
PROFILER_ALIASES = {"aten::_reshape_alias": "aten::view"}
_PRUNE_EVERY = 4096  # in-place writes between sweeps of dead storages out of the last-writer map


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Op:
    """What the recorder needs per (OpOverload, device type), computed once: its profiler name, its schema's alias
    facts, and whether the eager run would execute it as a CompositeImplicitAutograd decomposition."""

    __slots__ = ("decompose", "inplace", "is_view", "mutated", "name")

    def __init__(self, func: torch._ops.OpOverload, device_type: str) -> None:
        schema = func._schema
        # Under inference_mode, composite ops reach the Python key whole (`aten::linear`, `aten::to`); outside it they
        # arrive decomposed. Eager execution runs the decomposition unless the backend has a kernel of its own
        # (`_fused_rms_norm` on CUDA), and the kernels hang off the decomposed ops, so that is what is recorded.
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        self.decompose = has(func.name(), "CompositeImplicitAutograd") and not has(func.name(), device_type.upper())
        self.name = "aten::" + func.overloadpacket.__name__ if func.namespace == "aten" else schema.name
        # Positions (args) and names (kwargs) of arguments the op writes to: in-place `self`, `out=` tensors.
        self.mutated: tuple[tuple[int, str], ...] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        self.inplace = bool(self.mutated) or self.name.endswith("_")
        self.is_view = (bool(func.is_view) and not self.mutated) or self.name in VIEW_LIKE_OPS


class _Recorder(TorchDispatchMode):
    """Records one row per dispatched op, and the producer of every tensor it reads.

    Producers are kept in a `WeakTensorKeyDictionary` keyed by the tensor object (never keeping it alive). In-place
    writes also go to a last-writer map keyed by storage, held through `StorageWeakRef`s: a write through one alias
    (`copy_` into a slice of a cache) must become the producer of every other alias of that storage read later. A
    tensor's producer is the later of its own producer and its storage's last writer; a freshly allocated tensor that
    reuses a dead storage's memory is unaffected, as its own producer is always newer than any earlier write.
    """

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.rows: list[tuple] = []
        # the model's parameters and buffers, by storage: a leaf read through any alias of one is a parameter
        tensors = [*module.parameters(), *module.buffers()] if module is not None else []
        self.param_storages = {key for t in tensors if (key := self._storage_key(t)) is not None}
        self.step = -1
        self.phase = ""
        self.module_stack: list[str] = []
        self.producer: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.writer: dict[int, tuple[StorageWeakRef, int]] = {}
        self._writes = 0
        self._ops: dict[Any, _Op] = {}

    def _storage_key(self, t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # sparse or otherwise storage-less tensors
            return None

    def _producer_of(self, t: torch.Tensor) -> int:
        own = self.producer.get(t, LEAF)
        if self.writer:
            key = self._storage_key(t)
            entry = self.writer.get(key) if key is not None else None
            if entry is not None and not entry[0].expired() and entry[1] > own:
                return entry[1]
        return own

    def _mark_written(self, t: torch.Tensor, node: int) -> None:
        self.producer[t] = node
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self.writer[storage._cdata] = (StorageWeakRef(storage), node)
        self._writes += 1
        if self._writes % _PRUNE_EVERY == 0:
            self.writer = {k: v for k, v in self.writer.items() if not v[0].expired()}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors: list[torch.Tensor] = []
        scalars: list[str] = []
        for value in args:
            _split(value, tensors, scalars, "")
        for key, value in kwargs.items():
            _split(value, tensors, scalars, key + "=")
        device = tensors[0].device.type if tensors else str(kwargs.get("device") or "cpu").split(":")[0]
        op = self._ops.get((func, device))
        if op is None:
            op = self._ops[(func, device)] = _Op(func, device)
        if op.decompose:
            # The mode is popped while it handles an op; re-entered, it records the parts. Under a dispatch mode the
            # C++ composites do not quite behave as in eager execution: every tensor counts as a subclass
            # (`reshape` calls `aten::view`, not `aten::_reshape_alias`; see PROFILER_ALIASES) and views lose
            # `requires_grad`, which C++ `matmul` uses to decide on folding (a [1, 1, H] slice into `lm_head` went
            # `expand` + `bmm` here, `mm` in eager). `decompose` prefers torch's Python decomposition where one is
            # registered (`aten::matmul` has one), which folds like eager does for these inputs.
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        inputs = tuple(self._producer_of(t) for t in tensors)
        params = tuple(p == LEAF and self._storage_key(t) in self.param_storages for p, t in zip(inputs, tensors))
        in_shapes = tuple(tuple(t.shape) for t in tensors)
        in_dtypes = tuple(_dtype_name(t.dtype) for t in tensors)

        out = func(*args, **kwargs)

        node = len(self.rows)
        outs: list[torch.Tensor] = []
        _split(out, outs, [], "")
        same = {id(t) for t in tensors}
        for t in outs:
            # An op that hands back an input object unchanged (and does not write it) leaves its producer alone.
            if id(t) not in same or op.mutated:
                self.producer[t] = node
        for pos, name in op.mutated:
            target = args[pos] if pos < len(args) else kwargs.get(name)
            written: list[torch.Tensor] = []
            _split(target, written, [], "")
            for t in written:
                self._mark_written(t, node)
        self.rows.append(
            (
                node,
                self.step,
                self.phase,
                self.module_stack[-1] if self.module_stack else "",
                op.name,
                inputs,
                in_shapes,
                in_dtypes,
                tuple(tuple(t.shape) for t in outs),
                tuple(_dtype_name(t.dtype) for t in outs),
                tuple(scalars),
                op.is_view,
                op.inplace,
                params,
            )
        )
        return out


def _split(value: Any, tensors: list[torch.Tensor], scalars: list[str], prefix: str) -> None:
    """Tensors (also inside lists, e.g. `cat`'s) go to `tensors` in order; everything else to `scalars` as text."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        for v in value:
            _split(v, tensors, scalars, prefix)
    else:
        scalars.append(prefix + str(value))


def _module_stack(root: torch.nn.Module, stack: list[str]) -> contextlib.AbstractContextManager[None]:
    """Keep `stack[-1]` the innermost running module, labelled as `capture.module_ranges` labels its ranges (the root
    by its class name), so that node and timed op agree on `module`."""
    return capture.around_modules(root, stack.append, lambda: stack.pop() if stack else None)


def node_frame(rows: list[tuple]) -> pd.DataFrame:
    """The recorder's rows as the node table (NODE_COLUMNS), each node's consumers filled in."""
    consumers: list[list[int]] = [[] for _ in rows]
    for row in rows:
        for p in set(row[5]):
            if p >= 0:
                consumers[p].append(row[0])
    frame = pd.DataFrame([(*row[:11], tuple(c), *row[11:]) for row, c in zip(rows, consumers)], columns=NODE_COLUMNS)
    return frame.astype({"node": np.int64, "step": np.int64, "is_view": bool, "inplace": bool})


def record_dataflow(workload: Workload) -> pd.DataFrame:
    """Run the workload's sequence once under the recorder; one row per dispatched aten op (columns: NODE_COLUMNS).

    Steps are numbered as `capture` numbers them (each `run_step` call is one step, from 0), so that a node and its
    timed op share (phase, step). `.attrs["record_s"]` holds the wall time of the pass.
    """
    recorder = _Recorder(workload.module)
    step = 0

    def run_step(phase: str, fn: Callable[[], Any]) -> Any:
        nonlocal step
        recorder.step, recorder.phase = step, phase
        try:
            return fn()
        finally:
            step += 1
            recorder.step, recorder.phase = -1, ""

    t0 = time.perf_counter()
    with _module_stack(workload.module, recorder.module_stack), recorder:
        capture.run_sequence(workload, run_step)
    elapsed = time.perf_counter() - t0
    frame = node_frame(recorder.rows)
    frame.attrs["record_s"] = elapsed
    return frame


def _visible_ops(ops: pd.DataFrame, vocab: set[str]) -> pd.DataFrame:
    """The profiler's ops that correspond to recorder nodes: the outermost ones whose names the recorder also saw.

    Composite parents (`aten::linear`, `aten::to`, `aten::matmul`) never appear among the nodes, so they are looked
    through; whatever runs inside a visible op (`aten::_to_copy` → `aten::empty_strided` + `aten::copy_`, a scalar
    operand wrapped by `aten::to`, `aten::mean` → `aten::sum` + `aten::div_`) is the kernel's business, not a node.
    """
    ops = ops[(ops["step"] >= 0) & (ops["phase"] != "")]
    ops = ops.assign(name=ops["name"].map(lambda n: PROFILER_ALIASES.get(n, n)))
    # Parents before children: by thread, start, and longest first (the order trace.py's sweep uses).
    ops = ops.sort_values(["tid", "ts_us", "dur_us"], ascending=[True, True, False], kind="stable")
    covered: dict[int, bool] = {}  # op_id → a visible op encloses it or it is visible itself
    keep = np.zeros(len(ops), dtype=bool)
    for i, (op_id, parent, name) in enumerate(zip(ops["op_id"].tolist(), ops["parent_op"].tolist(), ops["name"])):
        inside = covered.get(parent, False)
        keep[i] = not inside and name in vocab
        covered[op_id] = inside or keep[i]
    return ops[keep]


def _align(a: list[str], b: list[str]) -> list[tuple[int, int]]:
    """Index pairs (i, j) with a[i] == b[j], in order, covering as much of both as a diff does.

    The two sequences are nearly always identical, so the common prefix and suffix are taken first in linear time and
    only the differing middle goes to `SequenceMatcher`, which is quadratic on repetitive sequences like these.
    """
    n = min(len(a), len(b))
    pre = 0
    while pre < n and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < n - pre and a[len(a) - 1 - suf] == b[len(b) - 1 - suf]:
        suf += 1
    pairs = [(i, i) for i in range(pre)]
    mid_a, mid_b = a[pre : len(a) - suf], b[pre : len(b) - suf]
    if mid_a and mid_b:
        matcher = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=False)
        for block in matcher.get_matching_blocks():
            pairs.extend((pre + block.a + k, pre + block.b + k) for k in range(block.size))
    pairs.extend((len(a) - suf + k, len(b) - suf + k) for k in range(suf))
    return pairs


def _align_step(names: tuple[list[str], list[str]], modules: tuple[list[str], list[str]]) -> list[tuple[int, int]]:
    """Align one step's nodes (index 0 of each pair) with its visible timed ops (index 1).

    First on (name, module): far fewer repeats than names alone (an 8B decode step has ~5000 ops but 32 layers' worth
    of each name), which keeps the diff near-linear and rules out a `mul` of one layer pairing with the next layer's.
    Then the stretches left between two matches are aligned on names alone, so an op whose module the two passes
    attribute differently is still found (and shows up as a module disagreement rather than as a miss).
    """
    (na, nb), (ma, mb) = names, modules
    keyed = _align([n + "\0" + m for n, m in zip(na, ma)], [n + "\0" + m for n, m in zip(nb, mb)])
    pairs: list[tuple[int, int]] = []
    prev_i = prev_j = -1
    for i, j in [*keyed, (len(na), len(nb))]:
        if i - prev_i > 1 and j - prev_j > 1:
            gap = _align(na[prev_i + 1 : i], nb[prev_j + 1 : j])
            pairs.extend((prev_i + 1 + x, prev_j + 1 + y) for x, y in gap)
        if i < len(na):
            pairs.append((i, j))
        prev_i, prev_j = i, j
    return pairs


def join_dataflow(nodes: pd.DataFrame, ops: pd.DataFrame, rank: int | None = None) -> pd.DataFrame:
    """Give every node the `op_id` of its op in the timed pass (`Timeline.ops`), -1 where none matched.

    Both passes run the same sequence, so within each (phase, step) the recorder's nodes and the profiler's visible
    ops (`_visible_ops`, names after `PROFILER_ALIASES`) are aligned in order (`_align_step`). Shapes are not used, so
    that matched shapes are a check of the join; `.attrs["join_rate"]` holds `join_rate(result)`. Of several ranks,
    the ops of `rank` (default: the lowest) are used.
    """
    visible = _visible_ops(one_rank(ops, rank), set(nodes["name"]))
    op_ids = np.full(len(nodes), -1, dtype=np.int64)
    node_cols = nodes["name"].to_numpy(), nodes["module"].to_numpy()
    op_cols = visible["name"].to_numpy(), visible["module"].to_numpy()
    visible_ids = visible["op_id"].to_numpy()
    by_step = visible.groupby(["phase", "step"], sort=False).indices
    for key, rows in nodes.groupby(["phase", "step"], sort=False).indices.items():
        timed = by_step.get(key)
        if timed is None:
            continue
        names = node_cols[0][rows].tolist(), op_cols[0][timed].tolist()
        modules = node_cols[1][rows].tolist(), op_cols[1][timed].tolist()
        for i, j in _align_step(names, modules):
            op_ids[rows[i]] = visible_ids[timed[j]]
    joined = nodes.assign(op_id=op_ids)
    joined.attrs = {**nodes.attrs, "join_rate": join_rate(joined)}
    return joined


def join_rate(joined: pd.DataFrame) -> float:
    """Share of nodes that found their timed op, among those that do work: views and metadata ops are left out,
    since a fused kernel absorbs them and the catalogue ranks groups by the time of the others."""
    counted = joined[~joined["is_view"] & ~joined["name"].isin(METADATA_OPS)]
    return float((counted["op_id"] >= 0).mean()) if len(counted) else 1.0


def through_views(nodes: pd.DataFrame, node: int) -> int:
    """The first producer at or above `node` that is not a view (`LEAF` if the chain ends at a parameter or input).

    Fusion looks through views — a kernel reads the base with other strides — so "who made this data" is the question
    that matters for a group's boundary, not "which `aten::view` handed it over". `nodes` is indexed by node id, as
    `record_dataflow` and `join_dataflow` return it.
    """
    while node >= 0 and nodes.at[node, "is_view"]:
        inputs = nodes.at[node, "inputs"]
        node = inputs[0] if inputs else LEAF
    return node
