"""What every catalogue entry shares: the dataflow graph it matches on, and the Match it returns.

A match is a set of nodes of the recorded dataflow (`fusionscope.dataflow`) that one fused kernel could replace.
Its intermediates must be private: a tensor made inside the group and read by a node outside it still has to be
written by the fused kernel. Such outputs are listed (`escaping`), which the byte accounting charges, and an entry may
reject the match instead, with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class Match:
    """One group of nodes that one fused kernel could replace."""

    fusion: str
    phase: str
    step: int
    nodes: tuple[int, ...]
    anchor_module: str
    escaping: tuple[int, ...] = ()  # nodes inside the group whose output is also read outside it
    rejected: str = ""  # non-empty: why this group cannot be fused as is
    # what replacing the group removes besides it (`fusionscope.fusions.replaced_with`): `bound`, nodes its kernel's
    # binding takes too (a static cache's writes, a partial rotary's re-join), whose work the kernel does; `dropped`,
    # nodes left without a reader (a mask only the attention read), whose work nobody does
    bound: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()

    @property
    def replaced(self) -> tuple[int, ...]:
        """The nodes the fused kernel does the work of: the group and what its binding takes too."""
        return self.nodes + self.bound if self.bound else self.nodes

    @property
    def counted(self) -> tuple[int, ...]:
        """The nodes whose time, launches and host ops the fused kernel removes."""
        return self.replaced + self.dropped if self.dropped else self.replaced


def rows_and_width(shape: tuple[int, ...] | None) -> tuple[int, int] | None:
    """A (..., N) activation as (rows, N): what the row-wise kernels and their bench cases take."""
    return (math.prod(shape[:-1]), shape[-1]) if shape else None


def row_micro_case(graph: Graph, match: Match, op: str, build: Callable[[int, int], Any]) -> Any:
    """The micro-measured case of a row-wise kernel: `build(rows, N)` on the first input of the group's `op` node
    (None when the group has no such node)."""
    shape = rows_and_width(graph.shape(match, op))
    return build(*shape) if shape else None


@dataclass
class Graph:
    """Fast access to a dataflow table (one row per node, see `fusionscope.dataflow`)."""

    nodes: pd.DataFrame
    name: dict[int, str] = field(init=False)
    inputs: dict[int, tuple[int, ...]] = field(init=False)
    consumers: dict[int, tuple[int, ...]] = field(init=False)
    module: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        ids = self.nodes["node"].tolist()
        self.name = dict(zip(ids, self.nodes["name"]))
        self.inputs = dict(zip(ids, map(tuple, self.nodes["inputs"])))
        self.consumers = dict(zip(ids, map(tuple, self.nodes["consumers"])))
        self.module = dict(zip(ids, self.nodes["module"]))
        self.row = dict(zip(ids, range(len(ids))))
        self._columns: dict[str, dict[int, Any]] = {}

    def named(self, op: str) -> Iterator[int]:
        return (n for n, name in self.name.items() if name == op)

    def producer(self, node: int, which: int = 0) -> int:
        """The node that produced input `which` of `node` (-1: a parameter, a model input, or out of range)."""
        ins = self.inputs.get(node, ())
        return ins[which] if which < len(ins) else -1

    def producers(self, node: int) -> tuple[int, ...]:
        return tuple(p for p in self.inputs.get(node, ()) if p >= 0)

    def only_consumer(self, node: int) -> int:
        """The single consumer of `node`'s output, or -1 when there are none or several."""
        consumers = self.consumers.get(node, ())
        return consumers[0] if len(set(consumers)) == 1 else -1

    def escaping(self, group: set[int], outputs: set[int]) -> tuple[int, ...]:
        """Nodes of `group`, other than its intended `outputs`, read by a node outside the group."""
        return tuple(sorted(n for n in group - outputs if any(c not in group for c in self.consumers.get(n, ()))))

    def column(self, name: str, default: object = None) -> dict[int, Any]:
        """{node: value} for one column of the table, built once: entries look nodes up in dictionaries, never in
        the DataFrame (a pandas row access costs ~50 µs; the 8B run has ~175k nodes)."""
        if name not in self._columns:
            values = self.nodes[name].tolist() if name in self.nodes else [default] * len(self.nodes)
            self._columns[name] = dict(zip(self.nodes["node"].tolist(), values))
        return self._columns[name]

    def shape(self, match: Match, op: str, which: int = 0) -> tuple[int, ...] | None:
        """Input `which`'s shape of the first node of `match` named `op` (None: no such node or input)."""
        shapes = self.column("input_shapes", ())
        node = next((n for n in match.nodes if self.name.get(n) == op), None)
        inputs = shapes.get(node) or () if node is not None else ()
        return tuple(inputs[which]) if which < len(inputs) else None

    def where(self, node: int) -> tuple[str, int]:
        return str(self.column("phase")[node]), int(self.column("step")[node])

    def through_views(self, node: int) -> int:
        """The first producer at or above `node` that is not a view (-1: the chain ends at a parameter or input)."""
        is_view = self.column("is_view", False)
        while node >= 0 and is_view.get(node, False):
            ins = self.inputs.get(node, ())
            node = ins[0] if ins else -1
        return node


# ------------------------------------------------------------------------------------------------------------ binding


# how transformers' StaticLayer writes a token's K and V rows into its buffers (`index_copy_` along the positions)
CACHE_WRITES = ("aten::index_copy_", "aten::index_copy")


@dataclass(frozen=True)
class In:
    """Tensor input `index` (in the order the recorder lists an op's tensors) of the group's node `node`."""

    node: int
    index: int
    through_views: bool = False  # a view made inside the group's own calls (`linear`'s `t`) is looked through


@dataclass(frozen=True)
class Out:
    """The output of the group's node `node`."""

    node: int


@dataclass(frozen=True)
class Binding:
    """How one match becomes one kernel call on a captured graph (`fusionscope.apply.rewrite`): `call(*args)` — args
    are `In` references or constants — replaces the ops `nodes`, and its results (one, or a tuple in this order)
    replace the outputs of `outputs`. `fallback`: a narrower binding of part of the match, tried when the captured
    graph refuses this one (a wide group spans more of the graph, so more can lie between its ops)."""

    call: Callable[..., Any]
    args: tuple[Any, ...]
    outputs: tuple[int, ...]
    nodes: tuple[int, ...]
    fallback: Binding | None = None


def scalar_values(graph: Graph, node: int) -> list[float]:
    """The plain numbers among `node`'s non-tensor arguments (ε of a norm's add, a multiply's constant), in order;
    keyword arguments (`alpha=1`) are left out."""
    values = []
    for text in graph.column("scalars", ()).get(node) or ():
        if "=" in text:
            continue
        try:
            values.append(float(text))
        except ValueError:
            continue
    return values


def leaf_input(graph: Graph, node: int) -> int:
    """The position of `node`'s first input that no recorded op made (a parameter or buffer), -1 for none."""
    return next((i for i, p in enumerate(graph.inputs.get(node, ())) if p < 0), -1)


def input_index(graph: Graph, node: int, producer: int) -> int:
    """The position of `producer`'s output among `node`'s inputs (-1: not an input)."""
    inputs = graph.inputs.get(node, ())
    return inputs.index(producer) if producer in inputs else -1


def gating_muls(graph: Graph, node: int) -> list[int]:
    """Readers of `node` that multiply it by another computed tensor (a GLU's gate × up)."""
    readers = sorted(set(graph.consumers.get(node, ())))
    return [c for c in readers if graph.name.get(c) == "aten::mul" and len(set(graph.producers(c)) - {node}) == 1]


def counter_slots(graph: Graph, k_write: int, v_write: int) -> tuple[int, ...] | None:
    """transformers' StaticLayer makes the write slots per layer and step from its write counter, then advances it:
    `slots = arange(S) + counter; counter.add_(S)`, two small launches besides the counter's own. The nodes of that
    (what hands the arange to the add, as a captured graph's `detach`, and the arange; the add; the counter's `add_`),
    when both writes read exactly those slots and the `add_` of a tensor no recorded op made (the counter: an input of
    the captured graph) follows the add at once in the same module, by S; None otherwise. `rope_and_cache` then reads
    the counter as the first slot (a 0-d `positions`)."""
    name, scalars = graph.name, graph.column("scalars", ())
    slots = graph.producer(k_write, 1)
    if name.get(slots) != "aten::add" or graph.producer(v_write, 1) != slots:
        return None
    ins = graph.inputs.get(slots, ())
    made = [slots]  # the arange and what hands it to the add (a captured graph's `detach`)
    while len(ins) in (1, 2) and name.get(ins[0]) in ("aten::detach", "aten::alias", "aten::arange"):
        if set(graph.consumers.get(ins[0], ())) != {made[-1]}:
            return None
        made.append(ins[0])
        if name[ins[0]] == "aten::arange":
            break
        ins = graph.inputs.get(ins[0], ())
    ins = graph.inputs.get(slots, ())
    arange = made[-1]
    if name.get(arange) != "aten::arange" or len(ins) != 2:
        return None
    if set(graph.consumers.get(slots, ())) != {k_write, v_write}:
        return None
    bump = slots + 1  # node ids follow the order the ops ran in
    bump_ins = graph.inputs.get(bump, ())
    length = (scalars.get(arange) or ("",))[0]
    if (name.get(bump) != "aten::add_" or graph.module.get(bump) != graph.module.get(slots) or len(bump_ins) != 1
            or bump_ins[0] != ins[1] or tuple(scalars.get(bump) or ()) != (length,)):  # fmt: skip
        return None
    return (*made[1:], slots, bump)
