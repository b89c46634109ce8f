"""Patching from the dataflow: capture the module, find the catalogue's groups on its graph, replace each group with
its bundled kernel, and run that graph.

Why: a patch that compares a forward's source with one family's layout (`fusionscope.apply.layers`, `.attention`)
gives up on every family it was not written for (Phi-3's fused projections, OLMo-2's norms after the branches, a
user's own GELU block), although the finder matches their groups on the dataflow. The finder's matches are sets of
aten ops joined by tensor identity; this module puts the kernel exactly where those ops were, on a captured graph,
so whatever the finder matches, the patch can follow.

How, per captured module (the smallest module holding every site to patch, so that a residual add at the end of one
decoder layer and the next layer's input norm are one graph):
1. **Capture.** `torch.compile(forward, backend=Rewriter, fullgraph=True)` bound on the instance
   (`Patcher.set_forward`, undone on restore; no class, no module global changes). TorchDynamo turns the forward into
   an FX graph of torch-level calls, with guards that recompile (and rewrite again) when a shape, a branch or a cache
   object changes, so Python control flow is never baked in unchecked. A forward dynamo cannot capture whole
   (data-dependent Python control flow) raises at the first call; `install` calls it once on an example input, so the
   failure is found before anything is measured, named in one line, and the patch falls back to the layout patchers.
2. **Record.** The backend runs the FX graph once under a `FakeTensorMode` (shapes and dtypes only: no data, no cache
   write, no counter bumped) below a `fusionscope.dataflow` recorder that also notes which FX node dispatched each aten
   op and which FX node handed over each tensor. That gives the same node table the profile's dataflow pass gives,
   so `fusionscope.fusions.find_matches` runs on it unchanged.
3. **Rewrite.** For each match of a fusion to patch (at a site the run found), the fusion module's `bind(graph,
   match)` says which kernel replaces which of the group's aten ops, and which tensors (an input of a group op, by
   position) and constants (ε, read off the op's scalars) it takes (`fusionscope.fusions.base.Binding`). The FX nodes
   that dispatched those ops are replaced by one call, inserted where every input exists and before any other reader
   of the outputs. A group is left unfused, with its reason, when an FX call spans its boundary (a traced call that
   computes both inside and outside the group), when an intermediate is read outside it, or when the bind refuses.
   Then two placed calls that an entry lists as one (`PROLOGUES`: a GLU kernel whose output only a down_proj's GEMV
   reads) become that one call (`fold_prologues`): a launch less, the same result; `results[FOLDED]` names the sites.
4. **Run.** The backend returns the rewritten graph module: eager Python over the graph's calls, the bundled kernels
   among them (their eager lean launch path). `compile_fused` hands the rewritten graph to Inductor instead, where
   the kernels are `torch.library.triton_op`s (fake implementations from their launchers), so they compile without
   graph breaks, and with `mode="reduce-overhead"` Inductor's CUDA graphs.

Limits: hooks registered on submodules after the capture do not run inside the compiled forward (a profile of the
patched model attributes the fused region's kernels to the captured module); a forward in training mode takes the
class's forward, since the kernels keep no autograd history; each new guard set (prefill, the first decode step,
then a decode of any length once dynamo marks it dynamic) costs one capture and rewrite.
"""

from __future__ import annotations

import itertools
import operator
import re
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import fx, nn

from fusionscope import dataflow
from fusionscope.fusions.base import Binding, Graph, In, Out

OWNER = "rewrite"  # the Patcher's owner name of a captured module's forward
# the results' entry {site: which fusion's call went into which other call} of the calls `fold_prologues` folded: their
# sites stay patched ('' under their fusion); only this entry's values are descriptions, not reasons
FOLDED = "folded"


class CaptureFailed(Exception):
    """The module's forward could not be captured as one graph: the reason, one line."""


# ------------------------------------------------------------------------------------------------------------ record


class _FxRecorder(dataflow._Recorder):
    """The dataflow recorder, plus per row: the FX node that dispatched it, its input tensors with the FX node that
    handed each over, and its output tensors."""

    def __init__(self) -> None:
        super().__init__(None)
        self.fx_node: fx.Node | None = None
        self.fx_of: dict[int, fx.Node] = {}  # id(tensor) -> the latest FX node whose output it is
        self.row_fx: dict[int, fx.Node | None] = {}
        self.row_inputs: dict[int, list[tuple[torch.Tensor, fx.Node | None]]] = {}
        self.row_outputs: dict[int, list[torch.Tensor]] = {}
        self.keep: list[Any] = []  # every tensor seen stays alive, so that ids are never reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "prim":  # device/layout queries of fake tensors, no computation
            return func(*args, **(kwargs or {}))
        tensors: list[torch.Tensor] = []
        dataflow._split(list(args) + list((kwargs or {}).values()), tensors, [], "")
        handed = [(t, self.fx_of.get(id(t))) for t in tensors]
        start = len(self.rows)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if start < len(self.rows) and start not in self.row_fx:  # this call's own row (a decomposition records parts)
            outs: list[torch.Tensor] = []
            dataflow._split(out, outs, [], "")
            self.row_fx[start] = self.fx_node
            self.row_inputs[start] = handed
            self.row_outputs[start] = outs
            self.keep.append((tensors, outs))
        return out

    def handed_over(self, node: fx.Node, value: Any) -> None:
        """`node` ran and returned `value`: its tensors are now handed over by `node`."""
        if isinstance(value, torch.Tensor):
            self.fx_of[id(value)] = node
            self.keep.append(value)


@dataclass
class Traced:
    """A captured graph's dataflow: the node table (`fusionscope.dataflow.NODE_COLUMNS`), and per row the FX node
    that dispatched it, its inputs as (tensor, FX node that handed it over), and its outputs' FX nodes."""

    nodes: pd.DataFrame
    row_fx: dict[int, fx.Node | None]
    row_inputs: dict[int, list[tuple[torch.Tensor, fx.Node | None]]]
    output_fx: dict[int, fx.Node | None]
    is_view: dict[int, bool] = field(default_factory=dict)
    traced_nodes: set[fx.Node] = field(default_factory=set)  # the graph's nodes when it was traced

    def rows_of(self, nodes: set[fx.Node]) -> set[int]:
        return {r for r, n in self.row_fx.items() if n in nodes}


def module_path(node: fx.Node, prefix: str) -> str:
    """The qualified module path (as the profile names modules) of the innermost module around `node`'s call;
    `prefix`: the captured module's own path ('' for the root, whose name is its class's). A module reached through a
    global (`G[...]`: transformers ≥ 5.25 makes `apply_rotary_pos_emb` a module-level `nn.Module` when Hugging Face's
    `kernels` package is installed) is no part of the model's tree, which is all the profile's module hooks see, so
    its ops count as the enclosing module's."""
    stack = [entry[0] for entry in (node.meta.get("nn_module_stack") or {}).values() if entry[0].startswith("L[")]
    if not stack:
        return prefix
    path = stack[-1]
    path = re.sub(r"^L\[[^\]]*\](\[\d+\])?", "", path)  # dynamo's name of the traced object: L['self'], L['args'][0]
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).replace("._modules.", ".")
    path = path.replace(".forward.__self__", "").strip(".")  # a forward bound on the instance names its module so
    return ".".join(p for p in (prefix, path) if p) or prefix


def fake_inputs(example_inputs: list[Any]) -> tuple[Any, list[Any], list[bool]]:
    """(a fake mode, fake copies of `example_inputs`, which of them are parameters): shapes, strides and dtypes, no
    data held. Parameters are told apart so that the dataflow's `input_params` tells a bias add from a residual
    add, as the profile's recorded dataflow does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = [isinstance(x, nn.Parameter) for x in example_inputs]
    return fake_mode, [_fake(fake_mode, x) for x in example_inputs], params


def trace_dataflow(gm: fx.GraphModule, fakes: tuple[Any, list[Any], list[bool]], prefix: str, root: str = "") -> Traced:
    """Run `gm` once on the fake inputs `fakes` (`fake_inputs`) under the recorder; the dataflow of its aten ops.
    `root`: how the profile names the captured module when it is the model itself (its class name)."""
    fake_mode, inputs, params = fakes
    recorder = _FxRecorder()
    recorder.param_storages = {recorder._storage_key(x) for x, p in zip(inputs, params) if p}
    modules = {n: module_path(n, prefix) or root for n in gm.graph.nodes}

    class _Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            recorder.fx_node = n
            recorder.module_stack[:] = [modules[n]]
            before = len(recorder.rows)
            value = super().run_node(n)
            # a call that computed nothing and returned a tensor it was given (`.to` of a tensor already of that
            # dtype) hands nothing over: the tensor's maker stays the call that made it
            if len(recorder.rows) > before or not isinstance(value, torch.Tensor) or id(value) not in recorder.fx_of:
                recorder.handed_over(n, value)
            return value

    with fake_mode, recorder, torch.inference_mode(False), torch.no_grad():
        _Run(gm).run(*inputs)
    frame = dataflow.node_frame(recorder.rows).assign(step=0, phase="graph", op_id=-1)
    output_fx: dict[int, fx.Node | None] = {}
    for row, outs in recorder.row_outputs.items():
        output_fx[row] = recorder.fx_of.get(id(outs[0])) if outs else None
    is_view = dict(zip(frame["node"], frame["is_view"]))
    return Traced(frame, recorder.row_fx, recorder.row_inputs, output_fx, is_view, set(gm.graph.nodes))


def _fake(mode: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value, static_shapes=True)
    if isinstance(value, torch.SymInt):
        return value.node.hint
    return value


# ------------------------------------------------------------------------------------------------------------ rewrite


def replace_group(gm: fx.GraphModule, traced: Traced, binding: Binding, taken: dict[fx.Node, fx.Node | None],
                  placed: list[fx.Node] | None = None) -> str:  # fmt: skip
    """Replace the FX nodes behind `binding.nodes` with one call of `binding.call`; '' when done, else why not (the
    graph is then unchanged). `taken`: FX nodes earlier replacements removed → the node now standing for their
    output (None: an intermediate); updated. `placed`: gets the new call appended."""
    rows = set(binding.nodes)
    group = {traced.row_fx.get(r) for r in rows}
    if None in group:
        return "an op of the group ran outside the captured graph's calls"
    group |= _idle_between(group, set(traced.row_fx.values()), traced.traced_nodes)
    if group & taken.keys():
        return "another fusion already replaced some of these ops"
    inside = traced.rows_of(group)
    for r in inside - rows:  # ops of the group's calls the match left out: views, or the calls' own internals
        name = traced.nodes.at[r, "name"]
        internal = set(traced.nodes.at[r, "consumers"]) <= inside
        if not traced.is_view.get(r) and name not in dataflow.METADATA_OPS and not internal:
            return f"a traced call computes both inside and outside the group ({traced.row_fx[r].name}: {name})"
    outputs = [traced.output_fx.get(r) for r in binding.outputs]
    if any(o is None or o not in group for o in outputs):
        return "an output of the group is not the result of a traced call"
    args = []
    for a in binding.args:
        if isinstance(a, In):
            node = _handed_over(traced, a, group)
            while node in taken:
                node = taken[node]
            if node is None:
                return f"input {a.index} of {traced.nodes.at[a.node, 'name']} is not handed over by a call outside it"
            args.append(node)
        elif isinstance(a, Out):
            return "a group's output cannot be its own input"
        else:
            args.append(a)
    for n in group - set(outputs):
        if any(u not in group for u in n.users):
            return f"an intermediate of the group ({n.name}) is read outside it"
    _hoist_late_inputs(gm, args, group, outputs)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    readers = [u for o in outputs for u in o.users if u not in group]
    first_reader = min((order[u] for u in readers), default=len(order))
    last_input = max((order[a] for a in args if isinstance(a, fx.Node)), default=-1)
    at = max(order[n] for n in group)
    if at >= first_reader:
        at = last_input
    if at >= first_reader or last_input > at:
        return "no place in the graph has every input before the outputs' first reader"
    span = (min(at, *(order[n] for n in group)), max(at, *(order[n] for n in group)))
    writer = _write_between(traced, rows, group, order, span)
    if writer:
        return f"an in-place write to an input of the group ({writer}) lies between its ops"
    anchor = list(gm.graph.nodes)[at]
    with gm.graph.inserting_after(anchor):
        call = gm.graph.call_function(binding.call, tuple(args))
    if placed is not None:
        placed.append(call)
    results = [call]
    if len(outputs) > 1:
        with gm.graph.inserting_after(call):
            results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in group and user not in results)
    for n in sorted(group, key=order.__getitem__, reverse=True):
        gm.graph.erase_node(n)
    taken.update(dict.fromkeys(group))
    taken.update(zip(outputs, results))
    return ""


def _in_place(node: fx.Node) -> bool:
    """A call that may write to what it reads: a `*_` method or function (`add_`, `index_copy_`), a setitem, a
    module call (unknown)."""
    if node.op == "call_module":
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or node.target in (operator.setitem, operator.iadd)


def _hoist_late_inputs(gm: fx.GraphModule, args: list[Any], group: set[fx.Node], outputs: list[fx.Node]) -> None:
    """Move the pure calls that make an input only after the group's outputs are first read up to just before that
    reader, so that one call can take the group's place: transformers 5.24's StaticLayer allocates its buffers and
    computes the write positions lazily, inside the captured graph, after OLMo-2's rope has cast its results
    (`q_embed.to(dtype)`), where the rope and the cache write become one call. Nothing moves when a call in place
    (or a module call) lies between, or an input comes from the group or from anything but plain calls."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    readers = [u for o in outputs for u in o.users if u not in group]
    if not readers:
        return
    first = min(readers, key=order.__getitem__)
    need: set[fx.Node] = set()
    stack = [a for a in args if isinstance(a, fx.Node) and order[a] > order[first]]
    while stack:
        node = stack.pop()
        if node in need or order[node] < order[first]:
            continue
        if node in group or node.op not in ("call_function", "call_method", "get_attr") or _in_place(node):
            return
        need.add(node)
        stack.extend(node.all_input_nodes)
    if not need:
        return
    last = max(order[n] for n in need)
    between = [n for n in list(gm.graph.nodes)[order[first] : last] if n not in need]
    if any(_in_place(n) for n in between):
        return
    for node in sorted(need, key=order.__getitem__):
        first.prepend(node)


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _write_between(traced: Traced, rows: set[int], group: set[fx.Node], order: dict[fx.Node, int],
                   span: tuple[int, int]) -> str:  # fmt: skip
    """The call that writes in place, strictly inside `span` (graph positions) and outside the group, to the storage
    of a tensor the group reads ('' for none): the one call that replaces the group would read it before or after
    that write, where the group's ops read it on both sides."""
    read = {_storage(t) for r in rows for t, _node in traced.row_inputs.get(r, [])} - {None}
    for r, node in traced.row_fx.items():
        if node is None or node in group or node not in order or not traced.nodes.at[r, "inplace"]:
            continue
        if span[0] < order[node] < span[1]:
            handed = traced.row_inputs.get(r, [])
            if handed and _storage(handed[0][0]) in read:
                return f"{node.name}: {traced.nodes.at[r, 'name']}"
    return ""


def _idle_between(group: set[fx.Node], busy: set[fx.Node], traced: set[fx.Node]) -> set[fx.Node]:
    """Calls that computed nothing (no aten op: `.to` of a tensor already of that dtype) read only by the group and
    reading from it: they go with the group. Calls an earlier replacement inserted are never idle."""
    idle: set[fx.Node] = set()
    changed = True
    while changed:
        changed = False
        for member in list(group | idle):
            for user in member.users:
                if user in group or user in idle or user in busy or user not in traced:
                    continue
                if user.op not in ("call_function", "call_method"):
                    continue
                if all(u in group or u in idle for u in user.users) and user.users:
                    idle.add(user)
                    changed = True
    return idle


def _handed_over(traced: Traced, ref: In, group: set[fx.Node]) -> fx.Node | None:
    """The FX node outside `group` that hands over the tensor `ref` names; None when there is none. With
    `ref.through_views`, a view made inside the group's calls is followed back to its base."""
    while True:
        handed = traced.row_inputs.get(ref.node, [])
        node = handed[ref.index][1] if ref.index < len(handed) else None
        if node is not None and node not in group:
            return node
        inputs = traced.nodes.at[ref.node, "inputs"]
        producer = inputs[ref.index] if ref.index < len(inputs) else -1
        if not ref.through_views or producer < 0 or not traced.is_view.get(producer):
            return None
        ref = In(producer, 0, True)


def fold_prologues(gm: fx.GraphModule, calls: dict[fx.Node, tuple[str, str]],
                   results: dict[str, dict[str, str]]) -> None:  # fmt: skip
    """Make each pair of placed calls that a catalogue entry's `PROLOGUES` lists ({(its call, the call that makes
    that call's first argument): one call of both, on the second's arguments followed by the first's after it}) that
    one call: a GLU kernel and the down_proj GEMV reading its output (`fusionscope.fusions.gemv`). Only where the
    producer's output is read by that call alone, as its first argument alone, and no call between the two may write
    in place (the one call, where the consumer stood, reads the producer's inputs later than it did). `calls`: each
    placed call → (fusion, site), updated; `results[FOLDED][producer's site]` says where it went. Found on the graph's
    dataflow (FX users), whatever the modules are called."""
    from fusionscope.fusions import fusion_modules

    folds: dict[tuple[Any, Any], Callable[..., Any]] = {}
    for module in fusion_modules().values():
        folds.update(getattr(module, "PROLOGUES", {}))
    for consumer in list(calls):
        producer = consumer.args[0] if consumer in calls and consumer.args else None
        if not isinstance(producer, fx.Node) or producer not in calls:
            continue
        fold = folds.get((consumer.target, producer.target))
        if fold is None or set(producer.users) != {consumer} or producer in consumer.args[1:]:
            continue
        if consumer.kwargs or producer.kwargs:
            continue
        nodes = list(gm.graph.nodes)
        if any(_in_place(n) for n in nodes[nodes.index(producer) + 1 : nodes.index(consumer)]):
            continue
        with gm.graph.inserting_before(consumer):
            both = gm.graph.call_function(fold, (*producer.args, *consumer.args[1:]))
        consumer.replace_all_uses_with(both)
        gm.graph.erase_node(consumer)
        gm.graph.erase_node(producer)
        fusion, site = calls.pop(consumer)
        inner, inner_site = calls.pop(producer)
        calls[both] = (fusion, site)
        results.setdefault(FOLDED, {})[inner_site] = f"{inner} folded into the {fusion} call at {site}"


def drop_dead(gm: fx.GraphModule, traced: Traced) -> None:
    """Remove the calls a replacement left without readers (a mask only the replaced attention read): only calls that
    dispatched ops, none of them writing in place. FX's own dead-code pass would also drop in-place method calls
    whose result nobody reads (a cache's `index_copy_`)."""
    pure: dict[fx.Node, bool] = {}
    for row, node in traced.row_fx.items():
        if node is not None:
            pure[node] = pure.get(node, True) and not traced.nodes.at[row, "inplace"]
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and node.op in ("call_function", "call_method") and pure.get(node):
            gm.graph.erase_node(node)


def rewrite_graph(gm: fx.GraphModule, fakes: tuple[Any, list[Any], list[bool]], prefix: str,
                  sites: dict[str, list[str]], results: dict[str, dict[str, str]], root: str = "") -> None:  # fmt: skip
    """Replace, in `gm`, the groups the finder matches on its dataflow at `sites` ({fusion: module paths}; a fusion
    with no paths: every site) with their kernels; `results[fusion][path]` gets '' (patched) or why not (a site
    patched in one graph stays reported as patched). Calls that fold into one (`fold_prologues`) are listed in
    `results[FOLDED]`."""
    from fusionscope.fusions import find_matches, fusion_modules

    traced = trace_dataflow(gm, fakes, prefix, root)
    graph = Graph(traced.nodes)
    modules = fusion_modules()
    taken: dict[fx.Node, fx.Node | None] = {}
    calls: dict[fx.Node, tuple[str, str]] = {}  # each call placed -> (fusion, site)
    matches = [m for m in find_matches(graph, among=sites) if not m.rejected]
    for fusion in modules:  # catalogue order, as the layout patchers
        for match in (m for m in matches if m.fusion == fusion):
            if sites[fusion] and match.anchor_module not in sites[fusion]:
                continue
            seen = results.setdefault(fusion, {})
            binding = modules[fusion].bind(graph, match)
            placed: list[fx.Node] = []
            why = binding if isinstance(binding, str) else replace_group(gm, traced, binding, taken, placed)
            while why and not isinstance(binding, str) and binding.fallback is not None:
                binding = binding.fallback
                why = replace_group(gm, traced, binding, taken, placed)
            if not why:
                calls[placed[-1]] = (fusion, match.anchor_module)
            if not seen.get(match.anchor_module):
                seen[match.anchor_module] = why
    fold_prologues(gm, calls, results)
    drop_dead(gm, traced)
    gm.graph.lint()
    gm.recompile()


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


@dataclass(frozen=True)
class Patch:
    """What the patched forward now running asks of the graphs: the sites to patch and the captured module's path (how
    its graph names modules); `results` collects, over the graphs this patch ran, per site '' (patched) or why not,
    and under FOLDED the sites whose call another took in (`fold_prologues`)."""

    sites: dict[str, list[str]]
    prefix: str
    root: str = ""  # the profile's name of the captured module when it is the model itself (its class name)
    results: dict[str, dict[str, str]] = field(default_factory=dict)
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def key(self) -> tuple:
        return self.prefix, tuple(sorted((f, tuple(p)) for f, p in self.sites.items()))

    def merge(self, results: dict[str, dict[str, str]]) -> None:
        """Add one graph's results: a site patched in any graph counts as patched."""
        for fusion, paths in results.items():
            seen = self.results.setdefault(fusion, {})
            for path, why in paths.items():
                if seen.get(path) != "":
                    seen[path] = why


_serials = itertools.count()
_running = threading.local()  # .patch: the Patch of the patched forward on this thread's stack (None outside one)


@dataclass
class _Variant:
    """One captured graph rewritten for one set of sites: what runs, what the rewrite said, and the patches that
    already took that in."""

    forward: Callable[..., Any]
    results: dict[str, dict[str, str]]
    told: set[int] = field(default_factory=set)


class Rewriter:
    """The dynamo backend, one per process. Each graph dynamo captures (one per guard set: prefill, decode, a
    batch, …) is kept as traced; what runs is its copy rewritten for the patch whose forward is running
    (`_running.patch`, set by the forward `install` binds), made on the first call under each set of sites and kept.
    So entering a patch again, with other fusions or on another model of the same class (apply enters one per fusion,
    per check, per timed round), costs a rewrite, never another trace: one backend object means dynamo's compiled
    entries, which it keys on the backend, serve every model whose guards they pass."""

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        fakes = fake_inputs(example_inputs)
        variants: dict[tuple, _Variant] = {}

        def run(*args: Any) -> Any:
            patch = _running.patch
            variant = variants.get(patch.key)
            if variant is None:
                rewritten, results = _copy(gm), {}
                try:
                    rewrite_graph(rewritten, fakes, patch.prefix, patch.sites, results, patch.root)
                    forward = rewritten.forward
                except Exception as error:  # a rewrite that fails leaves this graph as dynamo captured it
                    why = f"rewriting the captured graph failed: {_first_line(error)}"
                    results = {f: dict.fromkeys(paths, why) for f, paths in patch.sites.items()}
                    forward = gm.forward
                variant = variants[patch.key] = _Variant(forward, results)
            if patch.serial not in variant.told:
                patch.merge(variant.results)
                variant.told.add(patch.serial)
            return variant.forward(*args)

        return run


REWRITER = Rewriter()


def _trampoline(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` called through a frame of fusionscope's own: dynamo keeps compiled graphs on the code object of the
    frame it starts in, and a model's forward shares its code with others (transformers' decorators wrap every
    forward in one function), whose torch.compile would otherwise count the rewrite's graphs against its own
    recompile limit, and silently run eagerly past it."""

    def captured(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    return captured


_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}  # a forward function -> it under torch.compile(REWRITER)
RECOMPILE_LIMIT = 64  # graphs per forward while a patch is on: prefill and decode shapes, batches, caches, models


def _resolves(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:  # the profile names the model itself by its class name
        return False


def captured_module(model: nn.Module, paths: Iterable[str]) -> str:
    """The path of the smallest module holding every one of `paths` ('' the model itself), descending no further
    than a module whose forward is not plain (a `ModuleList` is walked past, never captured)."""
    split = [p.split(".") for p in paths if p and _resolves(model, p)]
    common: list[str] = []
    for parts in zip(*split) if split else ():
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    while common:
        module = model.get_submodule(".".join(common))
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and all(
            ".".join(p) != ".".join(common) for p in split
        ):
            break
        common.pop()
    return ".".join(common)


def install(patcher: Any, sites: dict[str, list[str]], example: Callable[[nn.Module], Any]) -> dict[str, dict]:
    """Capture the module holding `sites`, bound on its instance through `patcher`, and run `example(model)` once so
    that the first graphs are captured and rewritten now. Returns {fusion: {path: '' or why not}}; raises
    CaptureFailed (the forward left as it was) when the forward cannot be captured whole."""
    import torch._dynamo

    path = captured_module(patcher.model, [p for paths in sites.values() for p in paths])
    module = patcher.model.get_submodule(path) if path else patcher.model
    label = path or type(module).__name__
    original = module.forward
    if not isinstance(original, types.MethodType):
        raise CaptureFailed(f"{label}'s forward is not a method of the module; nothing to capture")
    function = original.__func__
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(_trampoline(function), backend=REWRITER, fullgraph=True)
    compiled = _COMPILED[function]
    patch = Patch({f: list(p) for f, p in sites.items()}, path, "" if path else type(module).__name__)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.training:  # the kernels have no backward
            return original(*args, **kwargs)
        outer = getattr(_running, "patch", None)
        _running.patch = patch
        try:
            return compiled(self, *args, **kwargs)
        finally:
            _running.patch = outer

    patcher.set_forward(module, forward, OWNER)
    # while the patch is on: room for its graphs, and constants (ε) kept constants — a float attribute that differs
    # between two models of one class would otherwise become a graph input the rewrite cannot read
    config = torch._dynamo.config
    saved = {"recompile_limit": config.recompile_limit, "specialize_float": config.specialize_float}
    config.recompile_limit = max(saved["recompile_limit"], RECOMPILE_LIMIT)
    config.specialize_float = True
    patcher.on_restore(lambda: [setattr(config, k, v) for k, v in saved.items()])
    try:
        example(patcher.model)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        raise CaptureFailed(f"rewriting the graph of {label} failed: {_first_line(error.inner_exception)}") from None
    except torch._dynamo.exc.TorchDynamoException as error:
        raise CaptureFailed(f"{label} ({type(module).__name__}) cannot be captured as one graph: "
                            f"{_first_line(error)}") from None  # fmt: skip
    except Exception as error:  # a recompile limit (FailOnRecompileLimitHit), a kernel the rewritten graph called
        raise CaptureFailed(f"the captured graph of {label} ({type(module).__name__}) raised "
                            f"{_first_line(error)}") from None  # fmt: skip
    return patch.results


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def compile_fused(model: nn.Module, sites: dict[str, list[str]], mode: str | None = "reduce-overhead") -> Any:
    """`model.forward` compiled by Inductor after the rewrite of `sites` ({fusion: paths}): the bundled kernels
    inside torch.compile's graph, as `triton_op`s (`mode` as torch.compile's: "reduce-overhead" adds Inductor's CUDA
    graphs; "eager" runs the rewritten graph without Inductor, what a CPU test can afford). Returns (compiled
    forward, results): {fusion: {path: '' or why not}}, filled in as graphs compile."""
    from torch._inductor.compile_fx import compile_fx

    # compiled in this process: Inductor's worker processes compile the generated code, which here also holds the
    # bundled Triton kernels' source, and report a failure there without its cause
    patches: dict[str, Any] = {"compile_threads": 1}
    if mode == "reduce-overhead":
        patches["triton.cudagraphs"] = True
    results: dict[str, dict[str, str]] = {}

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        rewrite_graph(gm, fake_inputs(example_inputs), "", sites, results, type(model).__name__)
        return gm.forward if mode == "eager" else compile_fx(gm, example_inputs, config_patches=patches)

    return torch.compile(model.forward, backend=backend, fullgraph=False, dynamic=False), results
