"""A dataflow for a trace without tensor identities: nodes from the op tree, edges inferred from op order, shapes
and module/op nesting, in the table `fusionscope.dataflow` records, so that the fusion catalogue's matchers and
estimates run on it unchanged (`analyze`).

Nodes are the ops the dataflow recorder would see: the outermost ops that run a kernel of their own. An op whose
every schema overload is CompositeImplicitAutograd (`aten::linear`, `aten::to`, `aten::matmul`, `aten::reshape`,
`aten::scaled_dot_product_attention`) is looked through to its children, as eager execution decomposes it; one with
no children did nothing (`.to(dtype)` of a tensor already in that dtype); whatever runs inside a node (`copy_` inside
`_to_copy`) belongs to it. A node's outputs are re-derived from its arguments (`fusionscope.op_outputs`).

An input's producer is an earlier node of the same thread and step whose output has the input's shape and dtype,
chosen among those a Python program could still hold there — a value made inside a module (or a composite op) and
read there is private to it: nothing outside reads it again; what a module leaves unread is what it returns — by
these rules, in order (each is how eager PyTorch code reads; each has the Llama decoder's case that shows it):

1. A view reads a variable, not a pending product of it and another tensor (of any dtype: bf16 q · fp32 cos is
   fp32): `x·cos + rotate_half(x)·sin` slices x, not x·cos. The slices of one partition (`x[..., :r]`, then
   `x[..., r:]`) slice one x. cos and sin in one scope take one angle (`cos = emb.cos() * s; sin = emb.sin() * s`).
2. A value nothing has read yet, the newest first (expression temporaries are consumed last-made, first-used); but
   of unread views of different values made in one scope the oldest (`q, k, v = …; rope(q, k)`), of values one op
   made side by side the oldest (`cos = …; sin = …`), of a sub-module's results the first, and a module's own view
   of what its sub-modules returned in the order they were made (OLMo-2: `q = q_norm(q_proj(x))`, `k = …`,
   `v = v_proj(x)`, then `q.view(…)`, `k.view(…)`, `v.view(…)`). Exceptions, where q and k share a shape: an op that
   repeats an earlier one of its scope on another tensor does not take that op's pending result (`k·cos` after
   `q_embed = q·cos + …` reads k), the first module call of a repeated pair takes what its twin read when the pending
   value is the twin's result carried on and the parent reads it later itself (`k_proj(x)` after
   `q_norm(q_proj(x))`), and a KV-cache append (a `cat` onto a tensor of another length) takes the newest pending
   value, the second append (values) none made side by side with the first's (so k_embed, then v, not q_embed).
3. What the previous sibling module (or composite op) read at the same place: q, k and v projections read one input;
   what the sibling made or had already read there maps to this instance's own (`k_norm`'s `x · rsqrt` multiplies
   the k its `pow` read, not the q `q_norm`'s did).
4. Of values already read: one the reader's module already took in, or made itself, before one from outside it not
   yet read there (a module reads its arguments), then one it made itself before one a sub-module returned
   (`h + mlp(norm(h))` adds h, not the norm's output), then the one read longest ago (`x · rsqrt(mean(x²))`
   multiplies x, read once by `pow`, not `x²`).
The module nesting is fusionscope's `nn.Module: <path>` ranges or, in a trace captured elsewhere with
`with_stack=True`, the Python tracer's `nn.Module: <Class>_<N>` calls (`fusionscope.trace`); without either, only
composite ops give scopes and the rules have far less to go on.
An elementwise op whose inputs all have its output's shape and dtype (`h = h + attn(h)`) and an in-place op
replace what they read. The edges can be wrong where two values share shape and dtype and these rules pick the
wrong one, so matches on them carry a lower confidence (basis "op order"); `fusionscope.execution_trace` gives exact
edges where PyTorch's execution trace was captured beside the Kineto trace.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import pandas as pd

from fusionscope import aten_schema
from fusionscope.dataflow_nodes import LEAF, NODE_COLUMNS, VIEW_LIKE_OPS
from fusionscope.op_outputs import Arguments, Sig, op_outputs, short_name
from fusionscope.roofline.dtypes import dtype_name
from fusionscope.roofline.elementwise import _ELEMENTWISE

BASIS_DATAFLOW = "dataflow"
BASIS_ORDER = "op order"
BASIS_EXECUTION_TRACE = "execution trace"
NOT_TENSORS = frozenset({"Scalar", "ScalarList", "", "GenericList", "TensorList", "Device", "Layout", "MemoryFormat"})
PRODUCT_WINDOW = 16  # values of one shape looked back over for a pending product (rule 1)
ANGLE_OPS = ("aten::cos", "aten::sin")  # of one angle, side by side
TWINNED = ("aten::cat", "aten::stack")  # made side by side by a cache update, never one into the other
WRAPPED = ("float64", "int64")  # how the trace types a Python float or int operand of an elementwise op
dtype_of = cache(dtype_name)  # a handful of distinct type strings, looked up once per tensor argument


@cache
def schema_facts(name: str, device_kind: str) -> tuple[bool, bool]:
    """(composite, view) for an op name: composite when every overload torch knows is CompositeImplicitAutograd
    without a kernel for the device (decomposed in eager mode), view when an overload returns an alias of its input.
    Names torch does not know (other namespaces, TorchScript builtins) are neither. Answered from `aten_schema`'s
    table where the installed torch is the one it was written from (importing torch for its dispatcher costs
    `analyze` a second), else by the dispatcher (`dispatcher_facts`)."""
    if not name.startswith("aten::"):
        return False, False
    composite = aten_schema.COMPOSITE.get(device_kind)
    if composite is None or _installed_torch() != aten_schema.TORCH:
        return dispatcher_facts(name, device_kind)
    short = short_name(name)
    return short in composite, short in aten_schema.VIEWS


@cache
def _installed_torch() -> str:
    from fusionscope.device import torch_versions

    return torch_versions()[0]


def dispatcher_facts(name: str, device_kind: str) -> tuple[bool, bool]:
    """`schema_facts` as torch's dispatcher answers it (what `aten_schema`'s table is written from)."""
    import torch

    if not name.startswith("aten::"):
        return False, False
    packet = getattr(torch.ops.aten, short_name(name), None)
    if packet is None:
        return False, False
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    composite, total, view = 0, 0, short_name(name) in {n.removeprefix("aten::") for n in VIEW_LIKE_OPS}
    for overload in packet.overloads():
        if "out" in overload.split("_"):
            continue
        qualified = name if overload == "default" else f"{name}.{overload}"
        try:
            cia = has(qualified, "CompositeImplicitAutograd") and not has(qualified, device_kind.upper())
            returns = getattr(packet, overload)._schema.returns
        except (RuntimeError, AttributeError):
            continue  # TorchScript-only overloads (`aten::add.t`) are not in the dispatcher
        total += 1
        composite += cia
        alias = returns[0].alias_info if returns else None
        view = view or (alias is not None and not alias.is_write)
    return total > 0 and composite == total, view


class _Value:
    """One output of one node, as the rules see it."""

    __slots__ = (
        "chain",
        "derived",
        "dtype",
        "elementwise",
        "id",
        "last_read",
        "max_shared",
        "modules",
        "node",
        "op",
        "operands",
        "pos",
        "reads",
        "seen_by",
        "shape",
        "source",
        "superseded",
        "view",
    )  # fmt: skip

    def __init__(self, vid: int, node: int, op: str, sig: Sig, chain: tuple, view: bool, elementwise: bool,
                 derived: tuple[int, ...], modules: tuple) -> None:  # fmt: skip
        self.id, self.node, self.pos, self.op, self.chain, self.view = vid, node, node, op, chain, view
        self.modules = modules  # `_modules(chain)`: a composite op returns its last child's value: only modules nest
        self.shape, self.dtype = sig
        self.elementwise, self.derived = elementwise, derived
        self.source = -1  # a view's: the value it views
        self.seen_by: set = set()  # the module instances (at every level) of its readers
        self.reads, self.last_read, self.max_shared, self.superseded = 0, -1, 0, False


def _first_newest(values: list[_Value]) -> _Value | None:
    """`max(values, key=pos)`: the first value of the newest node. A pool lists values in the order they were made
    (positions never decrease), so it is found from the end."""
    if not values:
        return None
    k = len(values) - 1
    pos = values[k].pos
    while k and values[k - 1].pos == pos:
        k -= 1
    return values[k]


def _modules(chain: tuple) -> tuple:
    return tuple(level for level in chain if level[0] != "op")


def _common(a: tuple, b: tuple) -> int:
    """The length of the common prefix of two chains."""
    if a is b:
        return len(a)
    i = 0
    for x, y in zip(a, b):
        if x is not y and x != y:
            return i
        i += 1
    return i


Tensors = list[tuple[tuple[int, ...], str | None]]


def tensor_inputs(dims: object, types: object, elementwise: bool) -> tuple[Tensors, list[tuple[int, int]], list[int]]:
    """The tensor arguments in order (a TensorList's members flattened, dtype unknown), where each sits (argument
    position, member index or -1), and the positions of the other arguments. A zero-dim double or int64 operand of
    an elementwise op is a Python number the dispatcher wrapped (`variance + eps`), which the recorder sees as a
    scalar."""
    tensors: Tensors = []
    where: list[tuple[int, int]] = []
    others: list[int] = []
    if not isinstance(dims, list | tuple) or not isinstance(types, list | tuple):
        return tensors, where, others
    for i, (d, t) in enumerate(zip(dims, types)):
        dtype = dtype_of(t) if isinstance(t, str) and t not in NOT_TENSORS else None
        if t == "TensorList" and isinstance(d, list | tuple):
            members = [m for m in d if isinstance(m, list | tuple)]
            tensors.extend((tuple(m), None) for m in members)
            where.extend((i, j) for j in range(len(members)))
        elif (
            dtype is not None and isinstance(d, list | tuple) and not (elementwise and i and not d and dtype in WRAPPED)
        ):
            tensors.append((tuple(d), dtype))
            where.append((i, -1))
        else:
            others.append(i)
    return tensors, where, others


class _Segment:
    """The inference over one thread's nodes in one step."""

    def __init__(self) -> None:
        self.values: list[_Value] = []
        self.by_sig: dict[tuple, list[_Value]] = {}
        self.by_shape: dict[tuple, list[_Value]] = {}
        self.chosen: dict[int, list[int]] = {}  # node → value id per tensor input (-1: none)
        self.instance_nodes: dict[object, list[int]] = {}
        self.children: dict[object, list[object]] = {}
        self.parent: dict[object, object] = {}
        self.name: dict[int, str] = {}
        self.signature: dict[int, tuple] = {}  # node → its tensor inputs' shapes and dtypes
        self.made: dict[int, list[int]] = {}  # node → the ids of the values it made, in order
        self.angle: dict[tuple, int] = {}  # scope → the value the last cos or sin in it read
        self.appended: dict[tuple, list[_Value]] = {}  # (scope, input shapes) → what cache appends there took in
        self.repeats: dict[tuple, set[int]] = {}  # (scope, op name, input shapes) → the nodes that ran it there
        self.cuts: dict[int, tuple[int, int, int]] = {}  # slice node → (dim, start, end)
        self.last_cut: dict[tuple, tuple[int, int, int]] = {}  # scope → the last slice's (dim, end, value id read)
        # (reader node, module instance, value) → whether a node of that instance's own (not of a sub-module's)
        # after the reader takes in a tensor of the value's shape and dtype (`infer_dataflow` looks ahead)
        self.later_reads: Callable[[int, object, _Value], bool] | None = None

    def pool(self, shape: tuple, dtype: str | None, chain: tuple) -> list[_Value]:
        """Values of this shape (and dtype) the reader can still see; dead ones are dropped for good."""
        key = (shape, dtype) if dtype is not None else shape
        listed = (self.by_sig if dtype is not None else self.by_shape).get(key, [])
        alive = []
        for v in listed:
            m = v.max_shared  # private to a scope the reader is outside of: its first m levels are not the reader's
            if v.superseded or (m and v.chain[:m] != chain[:m]):
                continue  # replaced, or private to a scope the reader is outside of: no later reader sees it
            alive.append(v)
        listed[:] = alive
        return alive

    def pick(
        self, node: int, which: int, chain: tuple, view: bool, pool: list[_Value], modules: tuple
    ) -> _Value | None:
        """The value an input reads among those it can see (`pool`), by the rules of the module docstring;
        `modules` is `_modules(chain)`."""
        if not pool:
            return None
        unread = [v for v in pool if v.reads == 0]
        if self.name[node] in TWINNED:  # keys then values: the second cat appends the values, not the first's result
            unread = [v for v in unread if v.op != self.name[node] or self.signature[v.node] != self.signature[node]]
        cut = self.cuts.get(node)  # rule 1: the pieces of one partition (`x[..., :r]`, then `x[..., r:]`) slice one x
        if cut is not None and which == 0:
            before = self.last_cut.get(chain)
            if before is not None and before[:2] == cut[:2] and any(v.id == before[2] for v in pool):
                return self.values[before[2]]
        if self.name[node] in ANGLE_OPS:  # rule 1: cos and sin of one angle (rotary tables: `emb.cos() * s; emb.sin()`)
            angle = self.angle.get(chain)
            if angle is not None and any(v.id == angle for v in pool):
                return self.values[angle]
        signature = self.signature[node]
        if self.name[node] in TWINNED and which and signature[0][0] != signature[which][0]:  # a cache append
            appended = self.appended.setdefault((chain, signature), [])
            twins = {(v.op, v.chain) for v in appended}
            fresh = [v for v in unread if (v.op, v.chain) not in twins]
            chosen = _first_newest(fresh)
            if chosen is not None:
                appended.append(chosen)
                return chosen
        newest = _first_newest(unread)
        if view:  # rule 1, the pending product of any dtype (bf16 q · fp32 cos is fp32): its operand of this dtype
            product = self.pending_product(pool[0].shape, chain, newest)
            if product is not None:
                ids = {v.id for v in pool}
                source = next((self.values[d] for d in product.operands if d in ids), None)
                if source is not None:
                    return source
        if newest is not None:  # rule 2
            depth = _common(newest.modules, modules)
            if view and len(newest.modules) > depth == len(modules):  # a module's own view of what its sub-modules
                # returned: in the order they were made (OLMo-2's `q_norm(…)`, `k_norm(…)`, `v_proj(…)`, then q.view)
                call = next(v.modules[depth] for v in unread if len(v.modules) > depth and v.modules[:depth] == modules)
                return next(v for v in unread if len(v.modules) > depth and v.modules[depth] == call)
            if newest.view:  # of views of different values made in one scope, the oldest; of one value's, the newest
                views = [v for v in unread if v.view and v.chain == newest.chain]
                return next(v for v in views if v is newest or v.source != newest.source)  # the oldest: pools are in
                # the order values were made
            if len(newest.modules) > depth:  # returned by a module the reader is outside of: its results in order
                call = newest.modules[depth]
                returned = next(v for v in unread if len(v.modules) > depth and v.modules[depth] == call)
                return self.pending(node, which, chain, pool, returned, call) or returned
            # values made side by side by one op in one scope (cos and sin, keys and values) are read in order
            side = next(v for v in unread if v.op == newest.op and v.chain == newest.chain)
            return self.repeated(node, chain, unread, side) or side
        analog = self.analog(node, which, chain, {v.id for v in pool})  # rule 3
        if analog is not None:
            return analog
        home = modules[-1] if modules else None

        def rank(v: _Value) -> tuple:
            meet = _common(v.modules, modules)
            new_argument = meet < len(modules) and home not in v.seen_by  # from outside, not yet read in here
            returned = len(v.modules) > meet == len(modules)  # a sub-module of the reader's module returned it
            return new_argument, returned, v.last_read, v.pos

        return min(pool, key=rank)

    def pending_product(self, shape: tuple, chain: tuple, newest: _Value | None) -> _Value | None:
        """The newest unread product of two tensors of this shape, in any dtype, that the reader can see, where it
        is at least as new as `newest` (the newest unread value of the reader's own shape and dtype); among the last
        `PRODUCT_WINDOW` values of that shape (a pending temporary is a recent one)."""
        listed = self.by_shape.get(shape, [])
        for v in reversed(listed[-PRODUCT_WINDOW:]):
            if newest is not None and v.pos < newest.pos:
                return None
            m = v.max_shared
            if v.reads or v.superseded or (m and v.chain[:m] != chain[:m]):
                continue
            return v if v.elementwise and not v.view and v.operands else None
        return None

    def repeated(self, node: int, chain: tuple, unread: list[_Value], candidate: _Value) -> _Value | None:
        """Rule 2's exception for an op that repeats an earlier one of its scope (same name, same input shapes) on
        another tensor: not a value made from that op's result, but the oldest unread view made from none
        (`q·cos + rotate_half(q)·sin`, then `k·cos`: k, not the pending q_embed, where q and k share a shape)."""
        earlier = self.repeats.get((chain, self.name[node], self.signature[node]))
        if not earlier or not self.descends(candidate, earlier):
            return None
        return next((v for v in unread if v.view and v.chain == chain and not self.descends(v, earlier)), None)

    def descends(self, value: _Value, nodes: set[int], depth: int = 8) -> bool:
        """Whether `value` was made by one of `nodes`, or from one of their results by elementwise ops of its shape
        (`derived`), within `depth` links."""
        if value.node in nodes:
            return True
        return depth > 0 and any(self.descends(self.values[d], nodes, depth - 1) for d in value.derived)

    def pending(self, node: int, which: int, chain: tuple, pool: list[_Value], returned: _Value,
                call: object) -> _Value | None:  # fmt: skip
        """Rule 2's exception: the value rule 3 gives (what the earlier sibling that ran this op here read), where
        the unread value a sibling module `call` returned is that earlier sibling's result carried on, and the parent
        module itself reads a value of its shape and dtype later: a result held in a variable, not this call's
        argument (OLMo-2's `q = q_norm(q_proj(x)); k = k_norm(k_proj(x))`: k_proj reads x while q waits for the
        attention's `view`). None where that is not so."""
        found = self.analog_of(node, which, chain, {v.id for v in pool})
        if found is None or found[0] is returned or self.parent.get(found[1]) != self.parent.get(call):
            return None
        value, sibling = found
        made = set(self.instance_nodes[sibling])
        if not any(r >= 0 and self.values[r].node in made for n in self.instance_nodes[call] for r in self.chosen[n]):
            return None  # `call` did not take in the sibling's result: not that sibling's result carried on
        parent = self.parent.get(call)
        if parent is None or self.later_reads is None or not self.later_reads(node, parent, returned):
            return None
        return value

    def analog(self, node: int, which: int, chain: tuple, ids: set[int]) -> _Value | None:
        """What the node at the same place in the nearest earlier sibling instance that ran the same op there read
        (innermost level first): `up_proj` reads what `gate_proj` read, past the `act_fn` between them."""
        found = self.analog_of(node, which, chain, ids)
        return found[0] if found is not None else None

    def analog_of(self, node: int, which: int, chain: tuple, ids: set[int]) -> tuple[_Value, object] | None:
        """`analog`, with the sibling instance it followed."""
        for level in range(len(chain) - 1, -1, -1):
            instance = chain[level]
            siblings = self.children.get(self.parent.get(instance), [])
            offset = self.instance_nodes[instance].index(node)
            for earlier in reversed(siblings[: siblings.index(instance)]):  # the nearest one that ran this op here
                theirs = self.instance_nodes[earlier]
                if offset < len(theirs) and self.name[theirs[offset]] == self.name[node]:
                    read = self.chosen.get(theirs[offset], [])
                    if which < len(read) and read[which] >= 0:
                        mine = self.counterpart(read[which], theirs[:offset], self.instance_nodes[instance])
                        if mine in ids:
                            return self.values[mine], earlier
                    break
        return None

    def counterpart(self, vid: int, theirs: list[int], ours: list[int]) -> int:
        """The value that plays, for this instance's nodes `ours`, the part `vid` played for the sibling's nodes
        `theirs` (the sibling's nodes before the reader): one the sibling made or had already read there is this
        instance's own (`k_norm`'s `x · rsqrt` multiplies the k its `pow` read, not the q `q_norm`'s did); any
        other is what the sibling took in from outside, which this instance reads too (q, k and v read one input)."""
        made = self.values[vid].node
        for j, theirs_node in enumerate(theirs):
            if theirs_node == made:  # made by the sibling: the output of this instance's node at that place
                k = self.made[made].index(vid)
                own = self.made.get(ours[j], []) if j < len(ours) else []
                return own[k] if k < len(own) else -1
            read = self.chosen.get(theirs_node, [])
            if vid in read:  # read earlier by the sibling: what this instance read at that place
                own = self.chosen.get(ours[j], []) if j < len(ours) else []
                w = read.index(vid)
                return own[w] if w < len(own) else -1
        return vid

    def add_instance(self, chain: tuple, node: int) -> None:
        for level, instance in enumerate(chain):
            if instance not in self.instance_nodes:
                parent = chain[level - 1] if level else None
                self.instance_nodes[instance] = []
                self.parent[instance] = parent
                self.children.setdefault(parent, []).append(instance)
            self.instance_nodes[instance].append(node)

    def produce(self, node: int, sigs: list[Sig], chain: tuple, view: bool, elementwise: bool,
                read: list[_Value | None], modules: tuple) -> None:  # fmt: skip
        for sig in sigs:
            binary = elementwise and len(read) >= 2  # a product of two tensors (x·cos), not x + 1
            derived = tuple(r.id for r in read if r is not None and (r.shape, r.dtype) == sig) if binary else ()
            value = _Value(len(self.values), node, self.name[node], sig, chain, view, elementwise, derived, modules)
            value.operands = tuple(r.id for r in read if r is not None and r.shape == sig[0]) if binary else ()
            if view and read and read[0] is not None:
                value.source = read[0].id
            self.values.append(value)
            self.made.setdefault(node, []).append(value.id)
            self.by_sig.setdefault(sig, []).append(value)
            self.by_shape.setdefault(sig[0], []).append(value)


def node_ops(ops: pd.DataFrame, device_kind: str) -> pd.DataFrame:
    """The ops that are nodes, in execution order per thread (one rank: the lowest), with `composites` (the
    looked-through ops around each, outermost first) and `strided` (the size a view's last `as_strided` child
    took)."""
    ops = ops[(ops["step"] >= 0) & (ops["phase"] != "")]
    if "rank" in ops and len(ops):
        ops = ops[ops["rank"] == ops["rank"].min()]
    ops = ops.sort_values(["step", "tid", "ts_us", "dur_us"], ascending=[True, True, True, False], kind="stable")
    ids, parents, names = ops["op_id"].tolist(), ops["parent_op"].tolist(), ops["name"].tolist()
    concrete = ops["concrete_inputs"].tolist() if "concrete_inputs" in ops else [None] * len(ops)
    has_children = set(parents)
    status: dict[int, str] = {}  # op → "node", "inside" (a node's descendant), "composite" or "skip"
    owner: dict[int, int] = {}  # op inside a node → the node's op
    around: dict[int, tuple[int, ...]] = {}  # op → the composites around it
    strided: dict[int, tuple[int, ...]] = {}
    keep = np.zeros(len(ops), dtype=bool)
    for i, (op, parent, name) in enumerate(zip(ids, parents, names)):
        up = status.get(parent)
        if up in ("node", "inside"):
            status[op] = "inside"
            owner[op] = owner.get(parent, parent)
            if name == "aten::as_strided":
                size = _size(concrete[i])
                if size is not None:
                    strided[owner[op]] = size
            continue
        composite, _view = schema_facts(name, device_kind)
        around[op] = (*around.get(parent, ()), parent) if up == "composite" else around.get(parent, ())
        if composite:
            status[op] = "composite" if op in has_children else "skip"
            continue
        status[op] = "node"
        keep[i] = True
        if name == "aten::as_strided":
            size = _size(concrete[i])
            if size is not None:
                strided[op] = size
    nodes = ops[keep]
    return nodes.assign(
        composites=[around.get(op, ()) for op in nodes["op_id"]],
        strided=[strided.get(op) for op in nodes["op_id"]],
    )


def _cut(concrete: object, rank: int) -> tuple[int, int, int] | None:
    """A slice's (dim, start, end) from its recorded arguments (`slice(x, dim, start, end, step)`), dim counted
    from the front; None where they are not numbers."""
    from fusionscope.roofline.args import _parse_int

    if not isinstance(concrete, list | tuple) or len(concrete) < 4 or not rank:
        return None
    dim, start, end = (_parse_int(concrete[k]) for k in (1, 2, 3))
    if dim is None or start is None or end is None:
        return None
    return dim % rank, start, end


def _size(concrete: object) -> tuple[int, ...] | None:
    from fusionscope.roofline.args import _parse_int_list

    if isinstance(concrete, list | tuple) and len(concrete) > 1:
        size = _parse_int_list(concrete[1])
        return tuple(size) if size is not None else None
    return None


def _chains(modules: list[str], composites: list[tuple[int, ...]]) -> list[tuple]:
    """Each node's scope instances, outermost first: one per module path prefix (a run of consecutive nodes under
    it is one call), then its composite ops."""
    chains = []
    previous: list[tuple[str, int]] = []
    counter = 0
    split: dict[str, list[str]] = {}
    for module, around in zip(modules, composites):
        prefixes = split.get(module)
        if prefixes is None:
            parts = module.split(".") if module else []
            prefixes = split[module] = [".".join(parts[: j + 1]) for j in range(len(parts))]
        current = []
        for j, prefix in enumerate(prefixes):
            if j < len(previous) and previous[j][0] == prefix and (j == 0 or current[j - 1] == previous[j - 1]):
                current.append(previous[j])
            else:
                counter += 1
                current.append((prefix, counter))
        previous = current
        chains.append((*current, *(("op", c) for c in around)))
    return chains


def infer_dataflow(ops: pd.DataFrame, device_kind: str) -> pd.DataFrame:
    """The dataflow table (`fusionscope.dataflow.NODE_COLUMNS` plus `op_id`) of a timeline's ops, its edges inferred
    (module docstring). `.attrs["basis"]` is "op order"."""
    nodes = node_ops(ops, device_kind)
    n = len(nodes)
    cols = {c: nodes[c].tolist() for c in ("op_id", "name", "tid", "step", "phase", "module", "strided")}
    dims = nodes["input_dims"].tolist() if "input_dims" in nodes else [None] * n
    types = nodes["input_type"].tolist() if "input_type" in nodes else [None] * n
    concrete = nodes["concrete_inputs"].tolist() if "concrete_inputs" in nodes else [None] * n
    chains = _chains([m if isinstance(m, str) else "" for m in cols["module"]], nodes["composites"].tolist())
    rows = []
    arguments = _Arguments(device_kind)
    facts: dict[str, tuple[bool, str, bool]] = {}  # op name → (view, short name, elementwise)
    producer_of: dict[tuple[int, int], int] = {}  # (segment, value id) → node id

    def fact(name: str) -> tuple[bool, str, bool]:
        if name not in facts:
            short = short_name(name)
            facts[name] = (schema_facts(name, device_kind)[1], short,
                           short in _ELEMENTWISE or short.removesuffix("_") in _ELEMENTWISE)  # fmt: skip
        return facts[name]

    def later_reads(reader: int, instance: object, value: _Value) -> bool:
        """Whether a node of `instance`'s own after `reader` (in its step and thread) takes in a tensor of `value`'s
        shape and dtype."""
        where = (cols["step"][reader], cols["tid"][reader])
        for j in range(reader + 1, n):
            if (cols["step"][j], cols["tid"][j]) != where or instance not in chains[j]:
                return False
            if _modules(chains[j])[-1:] != (instance,):
                continue
            view_j, _short, elementwise_j = fact(cols["name"][j])
            strided_j = cols["strided"][j] if view_j else None
            taken = arguments.of(cols["name"][j], dims[j], types[j], concrete[j], strided_j, elementwise_j)[0]
            if any(shape == value.shape and dtype in (None, value.dtype) for shape, dtype in taken):
                return True
        return False

    segment, key = _Segment(), None
    segments = 0
    for i in range(n):
        name = cols["name"][i]
        if (cols["step"][i], cols["tid"][i]) != key:
            segment, key, segments = _Segment(), (cols["step"][i], cols["tid"][i]), segments + 1
            segment.later_reads = later_reads
        chain = chains[i]
        modules = _modules(chain)
        segment.add_instance(chain, i)
        segment.name[i] = name
        view, short, elementwise = fact(name)
        strided = cols["strided"][i] if view else None
        tensors, others, made = arguments.of(name, dims[i], types[i], concrete[i], strided, elementwise)
        segment.signature[i] = tuple(tensors)
        if name == "aten::slice" and tensors:
            cut = _cut(concrete[i], len(tensors[0][0]))
            if cut is not None:
                segment.cuts[i] = cut
        read: list[_Value | None] = []
        for which, (shape, dtype) in enumerate(tensors):
            pool = segment.pool(shape, dtype, chain)
            distinct = [v for v in pool if all(v is not r for r in read)] or pool if read else pool
            read.append(segment.pick(i, which, chain, view, distinct, modules))
        if elementwise:  # operands of one shape and dtype in the order they were made: `residual + h`
            for sig in {(v.shape, v.dtype) for v in read if v is not None}:
                slots = [j for j, v in enumerate(read) if v is not None and (v.shape, v.dtype) == sig]
                for j, v in zip(slots, sorted((read[j] for j in slots), key=lambda v: v.pos)):
                    read[j] = v
        segment.chosen[i] = [v.id if v is not None else -1 for v in read]
        if name in ANGLE_OPS and read and read[0] is not None:
            segment.angle[chain] = read[0].id
        if elementwise and len(tensors) >= 2:
            segment.repeats.setdefault((chain, name, segment.signature[i]), set()).add(i)
        if i in segment.cuts and read and read[0] is not None:
            dim, _start, end = segment.cuts[i]
            segment.last_cut[chain] = (dim, end, read[0].id)
        for v in {id(v): v for v in read if v is not None}.values():
            v.reads += 1
            v.last_read = i
            v.max_shared = max(v.max_shared, _common(v.chain, chain))
            v.seen_by.update(modules)
        known = next((v.dtype for v in read if v is not None and v.dtype is not None), None)
        tensors = [(shape, dtype or (v.dtype if v is not None else None) or known)  # a TensorList member's dtype
                   for (shape, dtype), v in zip(tensors, read)]  # fmt: skip
        inplace = short.endswith("_") and bool(tensors)
        sigs = [(s, d if d is not None else known) for s, d in made]
        if inplace and read and read[0] is not None:
            read[0].superseded = True
        elif elementwise and len(tensors) >= 2 and sigs and all(t == sigs[0] for t in tensors):
            for v in read:
                if v is not None:
                    v.superseded = True
        first = len(segment.values)
        segment.produce(i, sigs, chain, view, elementwise, read, modules)
        for vid in range(first, len(segment.values)):
            producer_of[(segments, vid)] = i
        inputs = tuple(producer_of[(segments, v.id)] if v is not None else LEAF for v in read)
        values = concrete[i] if isinstance(concrete[i], list | tuple) else []
        scalars = tuple(str(values[j]) for j in others if j < len(values))
        rows.append((i, cols["step"][i], cols["phase"][i], cols["module"][i] or "", name, inputs,
                     tuple(s for s, _d in tensors), tuple(d for _s, d in tensors), tuple(s for s, _d in sigs),
                     tuple(d for _s, d in sigs), scalars, view, inplace, cols["op_id"][i]))  # fmt: skip
    return dataflow_table(rows, BASIS_ORDER)


class _Arguments:
    """Each node's tensor inputs, other arguments and outputs (`tensor_inputs`, `op_outputs`), derived once per
    distinct (name, shapes, types, scalars, strided size): layers and steps repeat their ops' arguments. A trace
    decoded by `trace_events` shares one list object per distinct argument list, so the lookup is by identity
    first and by text (`repr`) only for an object not seen before."""

    def __init__(self, device_kind: str = "cuda") -> None:
        self.device_kind = device_kind  # where a LayerNorm's statistics stay in a half input's dtype (the CPU)
        self.by_text: dict[tuple, tuple] = {}
        self.by_identity: dict[tuple, tuple] = {}  # valid while the argument lists are alive (the caller's)

    def of(self, name: str, dims: object, types: object, concrete: object, strided: tuple | None,
           elementwise: bool) -> tuple[Tensors, list[int], list[Sig]]:  # fmt: skip
        identity = (name, id(dims), id(types), id(concrete), strided)
        known = self.by_identity.get(identity)
        if known is None:
            text = (name, repr(dims), repr(types), repr(concrete), strided)
            known = self.by_text.get(text)
            if known is None:
                tensors, _where, others = tensor_inputs(dims, types, elementwise)
                listed = [v if isinstance(v, list | tuple) else [] for v in (dims, types, concrete)]
                made = []  # without recorded shapes (`record_shapes=False`): no arguments, no outputs to derive
                if isinstance(dims, list | tuple):
                    made = (
                        op_outputs(
                            name, Arguments(listed[0], listed[1], listed[2], "float32"), strided, self.device_kind
                        )
                        or []
                    )
                known = self.by_text[text] = (tensors, others, made)
            self.by_identity[identity] = known
        return known


def dataflow_table(rows: list[tuple], basis: str) -> pd.DataFrame:
    """The rows as the recorder's table: consumers from the inputs, columns NODE_COLUMNS (less `input_params`:
    a trace does not say which leaves are parameters, and the matchers then take every leaf for one) + op_id."""
    consumers: list[list[int]] = [[] for _ in rows]
    for row in rows:
        for p in set(row[5]):
            if p >= 0:
                consumers[p].append(row[0])
    columns = [c for c in NODE_COLUMNS if c != "input_params"] + ["op_id"]
    frame = pd.DataFrame([(*row[:11], tuple(c), *row[11:]) for row, c in zip(rows, consumers)], columns=columns)
    frame = frame.astype({"node": np.int64, "step": np.int64, "is_view": bool, "inplace": bool, "op_id": np.int64})
    frame.attrs["basis"] = basis
    return frame
