"""sampling: `generate(do_sample=True)`'s next-token pick → one `fusionscope.kernels.sample` launch.

Pattern, on the dataflow of one step (anchored on `aten::multinomial`; outside the model, module ""):
    logits[:, -1, :] → _to_copy fp32 → div T                                     (TemperatureLogitsWarper)
    → topk → select/unsqueeze (k-th value) → lt → masked_fill -inf                (TopKLogitsWarper)
    → sort → _softmax → cumsum → le 1-p → slice + fill_ (keep one) → scatter → masked_fill -inf  (TopPLogitsWarper)
    → _softmax → multinomial
The group is every ancestor of the multinomial in the same step that no model module ran, except the views that
only slice the logits (the fused kernel reads the last row in place) and allocations (`lift_fresh`). Which warpers
are present does not matter (the kernel takes T, k, p); an op the kernel does not implement (a repetition penalty,
min-p, ...) or more than one draw per row rejects the group. Bytes per row of V logits of s bytes (counted in
`kernels/sample.py`): unfused ≈ (s + 98)·V in ~13 launches, fused s·V + 8 (the row read once, one id written). The
estimate is bytes-bound; the kernel itself is latency-bound at small batch (one program per row: slower than the
unfused chain at B = 1 on an H200), which the estimate does not see.

Patching (`patch`): the run's token picker, a `fusionscope.apply.sampler.Sampler` in `patcher.state["sampler"]`,
gets a `pick` attribute that calls the kernel with the sampler's T, k, p and generator; a greedy run has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fusionscope.apply.patcher import Support
from fusionscope.dataflow_nodes import METADATA_OPS
from fusionscope.fusions.base import Graph, Match

if TYPE_CHECKING:
    import torch

    from fusionscope.apply.patcher import Patcher
    from fusionscope.bench.cases import Case

KEY = "sampling"
KERNEL = "sample"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2")
TITLE = "temperature → top-k → top-p → softmax → multinomial → one kernel"
ANCHOR = "sampling"  # the ops run outside every module (module ""); the report lists this label instead of ""

# What `fusionscope.kernels.sample` implements: the three warpers as transformers writes them (its older top-p wrote
# gt/lt where 5.x writes le), softmax and the draw. Views are accepted besides.
KNOWN_OPS = frozenset({
    "aten::_to_copy", "aten::div", "aten::topk", "aten::lt", "aten::gt", "aten::le", "aten::ge", "aten::masked_fill",
    "aten::masked_fill_", "aten::sort", "aten::_softmax", "aten::softmax", "aten::cumsum", "aten::fill_",
    "aten::scatter", "aten::multinomial",
})  # fmt: skip


def find(graph: Graph) -> list[Match]:
    is_view = graph.column("is_view", False)
    step_of = graph.column("step")
    matches = []
    for draw in graph.named("aten::multinomial"):
        if graph.module.get(draw):
            continue  # a model that samples inside its own forward is not generate()'s loop
        group = _chain(graph, draw, step_of)
        # the logits slice: views fed from outside the group (the fused kernel indexes the last row itself)
        group -= {n for n in group if is_view.get(n, False) and not set(graph.producers(n)) & group}
        if len(group) < 2:
            continue  # a draw from probabilities made elsewhere: nothing to fuse
        phase, step = graph.where(draw)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), ANCHOR, escaping=graph.escaping(group, {draw}),
                             rejected=_rejected(graph, draw, group, is_view)))  # fmt: skip
    return matches


def _chain(graph: Graph, draw: int, step_of: dict) -> set[int]:
    """Ancestors of `draw` in its step that ran outside every module (module ""), allocations left out."""
    group, todo = set(), [draw]
    while todo:
        node = todo.pop()
        if node in group or graph.module.get(node, "?") != "" or step_of.get(node) != step_of[draw]:
            continue
        if graph.name.get(node) in METADATA_OPS:
            continue
        group.add(node)
        todo.extend(graph.producers(node))
    return group


def _rejected(graph: Graph, draw: int, group: set[int], is_view: dict) -> str:
    if graph.name.get(graph.producer(draw)) not in ("aten::_softmax", "aten::softmax"):
        return "the draw's probabilities are not a softmax of the warped logits"
    scalars = graph.column("scalars", ())[draw]
    if scalars and str(scalars[0]) != "1":
        return f"{scalars[0]} draws per row; the kernel draws one"
    unknown = sorted({graph.name[n] for n in group if graph.name[n] not in KNOWN_OPS and not is_view.get(n, False)})
    if unknown:
        return f"the chain holds ops the sample kernel does not implement: {', '.join(unknown)}"
    return ""


def micro_case(graph: Graph, match: Match) -> Case | None:
    """HF's warper chain + multinomial vs `sample` on this match's (B, V) logits and its T, k and p, read from the
    recorded scalars (`div` by T, `topk` k, `le` 1 − p); a warper that is absent gets its neutral value."""
    from fusionscope.bench.cases import sample_case

    shape = graph.shape(match, "aten::multinomial")
    if not shape or len(shape) != 2:
        return None
    scalars = graph.column("scalars", ())

    def scalar(op: str, neutral: float) -> float:
        node = next((n for n in match.nodes if graph.name.get(n) == op), None)
        values = scalars.get(node, ()) if node is not None else ()  # recorded as text
        try:
            return float(values[0])
        except (IndexError, ValueError):
            return neutral

    settings = {"temperature": scalar("aten::div", 1.0), "top_k": int(scalar("aten::topk", 0)),
                "top_p": 1.0 - scalar("aten::le", 0.0)}  # fmt: skip
    return sample_case(shape[0], shape[1], settings)


def patch(patcher: Patcher, paths: list[str]) -> dict[str, Support]:
    """Swap the sampler's `pick` for the fused draw; one Support per path (the finder's anchor, "sampling")."""
    sampler = patcher.state.get("sampler")
    if sampler is None or getattr(sampler, "sampling", None) is None:
        return {path: Support.no("greedy run: no sampling pipeline") for path in paths}
    try:
        from fusionscope.kernels import sample
    except ImportError as error:
        return {path: Support.no(f"the sample kernel does not load here: {error}") for path in paths}
    patcher.set_attr(sampler, "pick", fused_pick(sampler, sample))
    return {path: Support.yes() for path in paths}


def fused_pick(
    sampler: Any, sample: Callable[..., torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`pick(ids, last)` → (B, 1) int64: one draw per row of `last: (B, V)` from the sampler's Temperature → TopK →
    TopP distribution, seeded from its generator (so `reset()` replays the same tokens). `ids` is the warpers'
    argument, which the kernel does not need."""
    temperature, top_k, top_p = float(sampler.temperature), int(sampler.top_k), float(sampler.top_p)

    def pick(_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return sample(last, temperature, top_k, top_p, generator=sampler.generator).unsqueeze(1)

    return pick
