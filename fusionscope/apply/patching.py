"""Put bundled kernels into a model where the finder found them, and take them out again exactly.

`patch(model, where)` is a context manager. `where` is what a run found — the opportunity dicts of a summary.json
(`fusion` + `module_paths`) or `Match` objects — or a list of fusion names, in which case the finder is run on a short
dataflow pass of the model itself. Each fusion module's `patch(patcher, paths)` turns its matches into changes of
exactly those module instances and says, per path, `Support.yes()` or `Support.no(reason)`.

Every change goes through a `Patcher` (`apply.patcher`), which keeps an undo log: forwards are bound on the instance
(never on a class), attributes are set on the instance, and everything is put back in reverse order on exit — so no
transformers class and no module global is ever touched, and after the `with` block the model computes bit-for-bit
what it did before.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusionscope.apply.patcher import Patcher, Support
from fusionscope.errors import UsageError
from fusionscope.fusions import fusion_modules


@dataclass
class PatchResult:
    """What a patch did: per fusion the module paths patched, and per fusion why the rest were not."""

    applied: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # fusion -> reason (a site's path is named in it)
    skipped_paths: dict[str, dict[str, str]] = field(default_factory=dict)  # fusion -> {path: reason}
    rewritten: list[str] = field(default_factory=list)  # fusions patched on the captured graph (from the dataflow)
    capture: str = ""  # why the captured-graph patch fell back to the layout patchers ('' when it did not)
    folded: dict[str, str] = field(default_factory=dict)  # site -> which other site's call took its call in

    def note(self, fusion: str, path: str, support: Support) -> None:
        if support.ok:
            self.applied.setdefault(fusion, []).append(path)
        else:
            self.skipped_paths.setdefault(fusion, {})[path] = support.reason

    def finish(self) -> None:
        for fusion, paths in self.skipped_paths.items():
            reasons = sorted(set(paths.values()))
            where = ", ".join(sorted(paths)[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            self.skipped[fusion] = f"{'; '.join(reasons)} ({where or 'model'})"


def sites_by_fusion(where: Iterable[Any]) -> dict[str, list[str]]:
    """{fusion: module paths} from opportunity dicts, `Match` objects or (fusion, paths) pairs; order kept."""
    sites: dict[str, list[str]] = {}
    for item in where:
        if isinstance(item, dict):
            fusion, paths = item["fusion"], item.get("module_paths") or []
        elif hasattr(item, "anchor_module"):
            fusion, paths = item.fusion, [item.anchor_module]
        else:
            fusion, paths = item
        if isinstance(paths, str):
            paths = paths.split()
        known = sites.setdefault(fusion, [])
        known.extend(p for p in paths if p not in known)
    return sites


def check_fusion_names(names: Iterable[str]) -> None:
    """Unknown fusion names are a usage error naming the catalogue."""
    known = fusion_modules()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown fusion(s) {', '.join(unknown)}; the catalogue has {', '.join(known)}")


@contextmanager
def patch(model: nn.Module, where: Iterable[Any] | None = None, only: Iterable[str] | None = None,
          sampler: Any = None, example: Callable[[nn.Module], Any] | None = None,
          rewrite: bool = True) -> Iterator[PatchResult]:  # fmt: skip
    """Patch `model` at the sites in `where` (see the module docstring; None: every fusion the finder finds in it) for
    the fusions in `only` (default: every fusion found); yield a `PatchResult`; restore the model on exit, also when
    the block raises.

    Fusions whose module can `bind` a match are patched on the captured graph of the module holding their sites
    (`fusionscope.apply.rewrite`), following the finder's matches on that graph; `example(model)` runs the model once
    so that the graph is captured and rewritten before this returns (default: a causal LM's 4-token prompt and one
    decode step). A model whose forward cannot be captured whole falls back to the layout patchers, and
    `result.capture` says why. `rewrite=False` uses the layout patchers only. The other fusions (weight
    concatenation, the attention and sampling swaps) keep their layout patchers.

    `sampler`: the workload's token picker (`fusionscope.apply.sampler`), which the sampling fusion swaps."""
    where = list(where) if where is not None else None
    if where is None:
        sites = find_sites(model)
    elif where and all(isinstance(w, str) for w in where):
        check_fusion_names(where)
        sites = {k: v for k, v in find_sites(model).items() if k in where}
        for name in where:
            sites.setdefault(name, [])
    else:
        sites = sites_by_fusion(where)
    wanted = set(only) if only is not None else None
    if wanted is not None:
        check_fusion_names(wanted)
    modules = fusion_modules()
    no_kernels = kernels_unavailable(model)
    rewrite = rewrite and not _sharded_ranks()
    patcher = Patcher(model)
    patcher.state["sampler"] = sampler
    result = PatchResult()
    try:
        on_graph: dict[str, list[str]] = {}
        for fusion in modules:  # catalogue order: patches that compose (a layer rewrite, then its parts) are stable
            if fusion not in sites or (wanted is not None and fusion not in wanted):
                continue
            paths = sites[fusion]
            module = modules[fusion]
            if not paths:
                result.note(fusion, "", Support.no("the finder found no match for it in this model"))
            elif getattr(module, "KERNEL", None) is None and not hasattr(module, "patch"):
                for path in paths:
                    result.note(fusion, path, Support.no(getattr(module, "NO_PATCH", "no bundled kernel yet")))
            elif no_kernels and getattr(module, "KERNEL", None) is not None:
                for path in paths:
                    result.note(fusion, path, Support.no(no_kernels))
            elif rewrite and hasattr(module, "bind"):
                on_graph[fusion] = list(paths)
            elif not hasattr(module, "patch"):
                for path in paths:
                    result.note(fusion, path, Support.no("this fusion has no patcher yet"))
            else:
                _layout_patch(patcher, result, module, fusion, paths)
        if on_graph:
            _graph_patch(patcher, result, on_graph, modules, example)
        result.finish()
        yield result
    finally:
        patcher.restore()


def _layout_patch(patcher: Patcher, result: PatchResult, module: types.ModuleType, fusion: str,
                  paths: list[str]) -> None:  # fmt: skip
    if not hasattr(module, "patch"):
        for path in paths:
            result.note(fusion, path, Support.no("this fusion has no layout patcher"))
        return
    for path, support in module.patch(patcher, list(paths)).items():
        result.note(fusion, path, support)


def _graph_patch(patcher: Patcher, result: PatchResult, on_graph: dict[str, list[str]],
                 modules: dict[str, types.ModuleType], example: Callable[[nn.Module], Any] | None) -> None:  # fmt: skip
    """Patch `on_graph` ({fusion: paths}) on the captured graph; on a capture that fails, undo it and fall back to
    each fusion's layout patcher, saying why in `result.capture`."""
    from fusionscope.apply import rewrite

    mark = patcher.checkpoint()
    try:
        outcome = rewrite.install(patcher, on_graph, example or default_example)
    except rewrite.CaptureFailed as why:
        patcher.rollback(mark)
        result.capture = str(why)
        for fusion, paths in on_graph.items():
            _layout_patch(patcher, result, modules[fusion], fusion, paths)
        return
    for fusion, paths in on_graph.items():
        seen = outcome.get(fusion, {})
        for path in paths:
            why = seen.get(path)
            if why is None:
                why = "the captured graph holds no such group at this site"
            result.note(fusion, path, Support.yes() if why == "" else Support.no(why))
        if fusion in result.applied:
            result.rewritten.append(fusion)
    result.folded.update(outcome.get(rewrite.FOLDED, {}))


def _sharded_ranks() -> bool:
    """Tensor-parallel ranks (`apply --nproc N`, N > 1) keep the layout patchers: a captured graph of DTensor
    shards and their collectives is not what the rewrite was checked on."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def default_example(model: nn.Module) -> None:
    """A causal LM's 4-token prompt and one decode step, as `find_sites` runs them: the graphs every generation
    starts with (prefill, then the first decode step), captured and rewritten when the patch is made."""
    from fusionscope import capture

    capture.run_sequence(_short_workload(model, 4), lambda _phase, fn: fn())


def _short_workload(model: nn.Module, prompt_len: int) -> Any:
    from fusionscope.models import ModelSpec, Workload

    param = next(model.parameters())
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise UsageError("patching by fusion name needs a causal LM with a config; pass the matches of a run and "
                         "an example call instead")  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (1, prompt_len), device=param.device)
    return Workload(spec=ModelSpec(name="patch", source="module"), module=model, device=param.device,
                    dtype=param.dtype, phases=("prefill", "decode"), prompt_len=prompt_len, decode_steps=1,
                    inputs=(ids,))  # fmt: skip


def kernels_unavailable(model: nn.Module) -> str:
    """Why the bundled Triton kernels cannot run on this model's device ('' when they can): a CUDA GPU, or a CPU with
    the Triton interpreter chosen (TRITON_INTERPRET=1, before the kernels were imported)."""
    import os

    param = next(model.parameters(), None)
    if param is None or param.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return ""
    return f"the kernels need a CUDA device, or TRITON_INTERPRET=1 on a CPU; this model is on {param.device}"


def find_sites(model: nn.Module, prompt_len: int = 4) -> dict[str, list[str]]:
    """{fusion: module paths} found by the catalogue on a short dataflow pass of `model` (a causal LM: a prompt of
    `prompt_len` random ids and one decode step). Used when `patch` is given fusion names, or nothing, instead of
    matches."""
    from fusionscope import dataflow
    from fusionscope.fusions import Graph, find_matches

    nodes = dataflow.record_dataflow(_short_workload(model, prompt_len))
    nodes = nodes.assign(op_id=-1)
    return sites_by_fusion(m for m in find_matches(Graph(nodes)) if not m.rejected)
