"""`apply()`: profile (or read an earlier run's predictions), patch each fusion found alone and all together, check the
numerics against the unpatched model and an fp32 copy, measure before and after, and set every measured speedup
beside its prediction with the error. Writes one run folder: everything `profile` writes, plus `apply.csv` and
`summary.json["apply"]`, and the report's apply section.

Order of work, and why:
1. Predictions come from a profile in this process (one model, one device, one host) or from `--from RUN_DIR`.
2. Numerics first, per fusion alone: a fusion outside tolerance is rolled back (its patch is left) and reported as
   failed with its figures; it is left out of everything measured after.
3. Timing, interleaved round by round, in one set: the baseline, each passing fusion alone and "all found" (every
   fusion that passed numerics: what applying blindly gives). "All together" is, per phase, all found less the
   fusions that were clearly slower alone in that phase (`clearly_slower`; in an eager, host-bound decode a launch
   that replaces two aten ops can lose while the same fusion pays in prefill); where it differs from all found it is
   timed in a second set with its own baseline. One profiled pass per variant gives GPU time and kernels per step.
4. On a CPU the kernels run in the Triton interpreter: numerics are checked, timing is not measured (it would time
   the interpreter), and the run says so.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from fusionscope.apply.lockstep import agree, in_ranks
from fusionscope.errors import UsageError
from fusionscope.pipeline import Settings, prepare, profile_stages
from fusionscope.run_folder import Run, command_line, finish_run_folder, load_run, staged_dir

BASELINE = "baseline"
ALL_FOUND = "all found"
ALL_TOGETHER = "all together"
WEIGHT_FUSING = ("qkv", "gate_up")  # layout patches that build a fused weight (no `bind`: no graph can hold it)
# The keys of a workload that an earlier run's predictions must share with this one (`--from`).
MATCHING_KEYS = ("name", "dtype", "batch", "prompt_len", "decode_steps", "sampling", "cache")


@dataclass
class ApplyRun(Run):
    """A finished apply run: the run folder, its summary (with `summary["apply"]`) and the per-variant table."""

    outcomes: pd.DataFrame | None = None

    @property
    def apply(self) -> dict:
        return self.summary.get("apply", {})


def parse_fusions(fusions: str | list[str] | None) -> list[str] | None:
    """`all` / None → None (every fusion found); `a,b` or a list → the names, checked against the catalogue."""
    from fusionscope.apply.patching import check_fusion_names

    if fusions is None or fusions == "all" or fusions == ["all"]:
        return None
    names = [n.strip() for n in (fusions.split(",") if isinstance(fusions, str) else fusions) if n.strip()]
    if not names:
        raise UsageError("--fusions needs fusion names (comma-separated) or 'all'")
    check_fusion_names(names)
    return names


def apply(
    model: str = "tiny-llama",
    *,
    fusions: str | list[str] | None = "all",
    from_run: str | Path | None = None,
    repeats: int = 3,
    out: str | Path | None = None,
    batch: int = 1,
    prompt_len: int = 128,
    decode_steps: int = 16,
    dtype: str = "auto",
    device: str = "auto",
    warmup: int = 1,
    remeasure: bool = False,
    sample: bool = False,
    temperature: float = 0.7,
    top_k: int = 50,
    top_p: float = 0.9,
    graphs: bool = False,
    graphs_only: bool = False,
    graphs_together: bool = False,
    quantize: str | None = None,
    nproc: int | None = None,
    cache: str = "auto",
    on_stage: Callable[[str], None] | None = None,
) -> ApplyRun:
    """Profile MODEL (or take `from_run`'s predictions), patch the fusions found (`fusions`: "all", "a,b" or a list),
    check numerics, measure `repeats` interleaved rounds (`graphs`: also the decode step in a CUDA graph, beside
    torch.compile, Liger and the weight-streaming floor; `graphs_only`: with `graphs`, the eager model is timed
    unpatched and with all passing fusions only, not each fusion alone; `graphs_together`: with `graphs`, the graph
    alone and fused + graph are captured, not each fusion + graph), and write the run folder. Returns an
    `ApplyRun`.

    `quantize` ("w4", "w4:<group>", "w4:channel") first quantises the model's Linears to int4 (not the embedding or
    the LM head): before profiling, so the finder sees the unfused dequantise + GEMM chain and `dequant_gemm` is
    measured against it like any fusion. `summary["quantize"]` holds what was swapped; the quantisation's own error
    against the float model is `summary["apply"]["quantization"]`, apart from each fusion's.

    `nproc=N` runs it on N tensor-parallel ranks (`fusionscope.distributed`): every rank patches and runs its shard
    in step with the others, rank 0 decides (`lockstep.agree`) and writes the run folder.

    `cache`: the KV cache the profiled, checked and timed decode steps run on, "dynamic" or "static"; "auto" is
    `from_run`'s, else static with `graphs` (the step the graph captures, so its predictions start from that step),
    else dynamic."""
    options = ApplyOptions(parse_fusions(fusions), repeats, graphs, graphs_only, graphs_together, quantize)
    check_options(options, decode_steps, nproc, from_run)
    earlier = load_run(from_run) if from_run is not None else None
    if cache == "auto":
        cache = earlier_cache(earlier) or ("static" if graphs else "dynamic")
    settings = Settings(model, batch, prompt_len, decode_steps, dtype, device, warmup, remeasure, sample, temperature,
                        top_k, top_p, cache=cache)  # fmt: skip
    if nproc is not None:
        from fusionscope.launch import launch_tp

        done = launch_tp(dataclasses.replace(settings, nproc=nproc), out, on_stage, options,
                         check=lambda dev: prepare_kernels(dev, options))  # fmt: skip
        outcomes = pd.DataFrame(done.summary["apply"]["rows"])
        return ApplyRun(out_dir=done.out_dir, summary=done.summary, kernels=done.kernels, outcomes=outcomes)
    note = on_stage or (lambda _msg: None)
    t_start = time.perf_counter()
    out_dir, spec, dev, torch_dtype = prepare(settings, out)
    prepare_kernels(dev, options)
    if earlier is not None:
        check_same_workload(earlier.summary, spec.name, settings, str(torch_dtype).removeprefix("torch."), dev.type,
                            device_name(dev))  # fmt: skip
        check_same_quantize(earlier.summary, options)
    with staged_dir(out_dir) as tmp:
        summary, kernels = apply_stages(settings, spec, dev, torch_dtype, tmp, note, options, earlier)
        finish_run_folder(tmp, summary, kernels, t_start, note)
    outcomes = pd.DataFrame(summary["apply"]["rows"])
    return ApplyRun(out_dir=out_dir, summary=summary, kernels=kernels, outcomes=outcomes)


def earlier_cache(earlier: Run | None) -> str | None:
    """The cache an earlier run decoded on ("dynamic" for runs made before it was recorded); None without a run or
    with a summary that is not one (`check_same_workload` says so in its line)."""
    summary = earlier.summary if earlier is not None else None
    model = summary.get("model") if isinstance(summary, dict) else None
    return (model.get("cache") or "dynamic") if isinstance(model, dict) else None


@dataclass(frozen=True)
class ApplyOptions:
    """What `apply` adds to `profile`'s settings (the fields of `apply()` of the same names); a tensor-parallel
    launch hands them to every rank."""

    wanted: list[str] | None = None  # fusion names; None: every fusion found
    repeats: int = 3
    graphs: bool = False
    graphs_only: bool = False
    graphs_together: bool = False
    quantize: str | None = None

    @property
    def group(self) -> int | None:
        """The quantisation's group size (-1 per channel), None without `quantize`."""
        if self.quantize is None:
            return None
        from fusionscope.apply.quantize import parse_quantize

        return parse_quantize(self.quantize)


def check_options(options: ApplyOptions, decode_steps: int, nproc: int | None, from_run: Any) -> None:
    """One line for each combination of options that cannot run, before anything is built."""
    if options.repeats < 1:
        raise UsageError("--repeats must be ≥ 1")
    if options.graphs and decode_steps < 1:
        raise UsageError("--graphs measures the decode step: give --decode-steps ≥ 1")
    if options.graphs_only and not options.graphs:
        raise UsageError("--graphs-only narrows what --graphs measures in eager mode: give --graphs too")
    if options.graphs_together and not options.graphs:
        raise UsageError("--graphs-together narrows which graphs --graphs captures: give --graphs too")
    if nproc is None:
        return
    if from_run is not None:
        raise UsageError("--from takes an earlier run's predictions for one process; with --nproc the ranks profile "
                         "their own shards: leave out --from")  # fmt: skip
    if nproc > 1 and options.graphs:
        raise UsageError("--graphs with --nproc > 1 is not measured: a captured step would hold the ranks' "
                         "all-reduces, which fusionscope does not capture; use --nproc 1 or leave out "
                         "--graphs")  # fmt: skip
    if nproc > 1 and options.quantize is not None:
        raise UsageError("--quantize with --nproc > 1 is not supported: the int4 Linears replace the sharded ones; "
                         "use --nproc 1 or leave out --quantize")  # fmt: skip


def prepare_kernels(dev: Any, options: ApplyOptions) -> None:
    """Choose the interpreter on a CPU (before any kernel is imported), then check the quantisation spec."""
    if dev.type == "cpu":
        use_interpreter()
    options.group  # noqa: B018 (raises a UsageError for a bad --quantize, after the interpreter is chosen)


def check_same_quantize(earlier: dict, options: ApplyOptions) -> None:
    earlier_group = (earlier.get("quantize") or {}).get("group_size")
    if earlier_group != options.group:

        def made(g: int | None) -> str:
            return "without --quantize" if g is None else f"with --quantize w4:{'channel' if g == -1 else g}"

        raise UsageError(f"--from run was made {made(earlier_group)}, this one is {made(options.group)}")


def apply_stages(settings: Settings, spec: Any, dev: Any, torch_dtype: Any, tmp: Path,
                 note: Callable[[str], None], options: ApplyOptions, earlier: Run | None = None,
                 build: Callable[..., Any] | None = None) -> tuple[dict, pd.DataFrame]:  # fmt: skip
    """Profile (or take `earlier`'s predictions), then the apply stages, into the staged folder `tmp`: the trace,
    tables and apply.csv written, the summary (with `apply`) and kernel table returned for `finish_run_folder`.
    `build` stands in for `models.build_workload` (a tensor-parallel rank builds its shard)."""
    from fusionscope import models

    group = options.group
    quantized: dict[str, Any] = {}

    def build_quantized(*args: Any, **kwargs: Any) -> Any:
        """The workload, then (with `quantize`) the Linears quantised and the quantisation's error taken."""
        workload = (build or models.build_workload)(*args, **kwargs)
        if group is not None:
            from fusionscope.apply.quantize import quantize_workload

            note(f"quantising the Linears to int4 ({options.quantize}) and measuring the quantisation's own error")
            quantized["report"], quantized["numerics"] = quantize_workload(workload, group)
        return workload

    if earlier is None:
        profiled = profile_stages(settings, spec, dev, torch_dtype, tmp, note, keep_workload=True,
                                  build=build_quantized)  # fmt: skip
        summary, kernels, workload = profiled.summary, profiled.kernels, profiled.workload
    else:
        note(f"taking the predictions of {earlier.out_dir}")
        for name in ("trace.json.gz", "kernels.csv", "ops.csv", "opportunities.csv"):
            if (earlier.out_dir / name).is_file():
                shutil.copy2(earlier.out_dir / name, tmp / name)
        summary, kernels = dict(earlier.summary), earlier.kernels
        summary["predictions_from"] = str(earlier.out_dir)
        note(f"building {spec.name} on {dev.type} in {str(torch_dtype).removeprefix('torch.')}")
        workload = build_quantized(spec, dev, torch_dtype, batch=settings.batch, prompt_len=settings.prompt_len,
                                   decode_steps=settings.decode_steps, sampling=settings.sampling,
                                   cache=settings.cache)  # fmt: skip
    if options.graphs and workload.phases != ("prefill", "decode"):
        raise UsageError(f"--graphs needs a generation model with a decode phase; {spec.name} has none")
    if quantized:
        summary["quantize"] = quantized["report"]
    summary["apply"] = run_apply(workload, summary, options.wanted, options.repeats, tmp, note, options.graphs,
                                 options.graphs_only, options.graphs_together)  # fmt: skip
    if quantized:
        from fusionscope.apply import numerics

        summary["apply"]["quantization"] = {
            "spec": str(options.quantize).strip(),
            "group_size": group,
            "against": f"the {str(torch_dtype).removeprefix('torch.')} model before quantisation",
            "numerics": numerics.json_safe(quantized["numerics"]),
        }
    pd.DataFrame(summary["apply"]["rows"]).to_csv(tmp / "apply.csv", index=False, float_format="%.6g")
    summary["command"] = command_line() or summary.get("command", "")
    return summary, kernels


def device_name(dev: Any) -> str | None:
    """The name summary.json records for a device (`device.name`): the GPU's name; None for a CPU, whose name the
    roofs give and which a CPU run does not time anyway."""
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None


def use_interpreter() -> None:
    """On a CPU the Triton kernels run in the interpreter, which must be chosen before any kernel is defined."""
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "fusionscope.kernels" in sys.modules:
        raise UsageError("on a CPU the kernels need TRITON_INTERPRET=1, set before fusionscope.kernels is imported")
    os.environ["TRITON_INTERPRET"] = "1"


def check_same_workload(earlier: dict, name: str, settings: Settings, dtype: str, device_kind: str,
                        device_name: str | None = None) -> None:  # fmt: skip
    """`--from RUN_DIR` must hold predictions for this model, workload and device; one line says what differs."""
    if not isinstance(earlier, dict) or not isinstance(earlier.get("model"), dict) or "opportunities" not in earlier:
        raise UsageError("--from folder's summary.json holds no profile predictions (model and opportunities)")
    model = earlier["model"]
    now = {
        "name": name,
        "dtype": dtype,
        "batch": settings.batch,
        "prompt_len": settings.prompt_len,
        "decode_steps": settings.decode_steps,
        "sampling": dict(zip(("temperature", "top_k", "top_p"), settings.sampling)) if settings.sampling else None,
        "cache": settings.cache,
    }
    model = {"cache": "dynamic", **model}  # a run made before the option decoded on the dynamic cache
    if model.get("prompt_len") is None:  # a factory model: one forward phase, no prompt or decode steps
        now.update(prompt_len=None, decode_steps=None, cache=None)
        model["cache"] = None
    diffs = [f"{k} {model.get(k)!r} there, {now[k]!r} here" for k in MATCHING_KEYS if model.get(k) != now[k]]
    device = earlier.get("device") if isinstance(earlier.get("device"), dict) else {}
    if device.get("kind") != device_kind:
        diffs.append(f"device {device.get('kind')!r} there, {device_kind!r} here")
    elif device_name is not None and device.get("name") != device_name:
        diffs.append(f"device {device.get('name')!r} there, {device_name!r} here")
    if diffs:
        raise UsageError(f"--from run was made for another workload: {'; '.join(diffs)}")


def sites_to_patch(opportunities: list[dict], wanted: list[str] | None) -> tuple[dict[str, list[str]], dict[str, str]]:
    """{fusion: module paths} over all phases for the fusions to apply, and {fusion: reason} for those left out
    before patching (rejected by the finder, or asked for but not found)."""
    from fusionscope.apply.patching import sites_by_fusion

    usable = [o for o in opportunities if o.get("confidence") != "low"]
    sites = sites_by_fusion(usable)
    left_out = {
        o["fusion"]: f"the finder rejected it: {o.get('reason')}"
        for o in opportunities
        if o.get("confidence") == "low" and o["fusion"] not in sites
    }
    if wanted is not None:
        for name in wanted:
            if name not in sites and name not in left_out:
                left_out[name] = "the finder found no match for it in this model"
        sites = {k: v for k, v in sites.items() if k in wanted}
        left_out = {k: v for k, v in left_out.items() if k in wanted}
    return sites, left_out


def run_apply(
    workload: Any,
    summary: dict,
    wanted: list[str] | None,
    repeats: int,
    tmp: Path,
    note: Callable[[str], None],
    graphs: bool = False,
    graphs_only: bool = False,
    graphs_together: bool = False,
) -> dict:
    """The apply stages on a built workload; returns `summary["apply"]`. `graphs_only`: the eager model is timed
    unpatched and with all passing fusions only, not each fusion alone (what `--graphs` needs, in less time);
    `graphs_together`: no fusion + graph of one fusion alone, only the graph alone and fused + graph."""
    import torch

    from fusionscope.apply import numerics
    from fusionscope.apply.patching import patch
    from fusionscope.apply.sampler import Sampler

    summary = agree(summary)  # tensor-parallel ranks: the fusions found on rank 0, patched on every rank
    sites, left_out = sites_to_patch(summary.get("opportunities", []), wanted)
    if not sites:
        why = "; ".join(f"{k}: {v}" for k, v in left_out.items()) or "the finder found no fusion"
        raise UsageError(f"nothing to apply in {workload.spec.name}: {why}")
    model = workload.module
    sampler = Sampler(workload.sampling, workload.device)
    forward_only = workload.phases == ("forward",)  # a factory model: its forward on its own inputs

    def reference(of: Any) -> Any:
        if forward_only:
            return numerics.forward_reference(of, workload.inputs)
        return numerics.reference(of, workload.inputs[0], workload.decode_steps, cache=workload.cache)

    dtype = workload.dtype
    gpu = workload.device.type == "cuda"
    real_weights = workload.spec.weights is not None  # random weights: near-flat distributions, top-1 not judged

    def example(_model: Any) -> None:
        """The workload's own first steps (its prompt, its cache, one decode step): the graphs the timed and checked
        runs take are the ones a patch captures and rewrites when it is made."""
        from dataclasses import replace

        from fusionscope import capture

        capture.run_sequence(replace(workload, decode_steps=min(workload.decode_steps, 1)), lambda _p, fn: fn())

    def enter(fusions: list[str]) -> Any:
        where = [{"fusion": f, "module_paths": sites[f]} for f in fusions]
        return patch(model, where, sampler=sampler, example=example) if fusions else nullcontext(None)

    note("numerics: the unpatched model, and an fp32 copy of it")
    ref = reference(model)
    if dtype == torch.float32:
        ref32 = ref
    else:
        copy32 = numerics.fp32_copy(model)
        ref32 = reference(copy32)
        del copy32
        if gpu:
            torch.cuda.empty_cache()
    eager_raw = numerics.compare(ref, ref32)
    eager_vs_fp32 = numerics.json_safe(eager_raw)

    def check(fusions: list[str]) -> tuple[Any, tuple[dict, dict, bool, str] | None]:
        """Patch `fusions` together once: what the patch did (its PatchResult), and the numerics of what it patched
        (vs eager, vs fp32, passed, reason; None when nothing was patched). A patched forward that raises, or logits
        that are not finite, fail the check with the reason."""
        with enter(fusions) as patched:
            if not any(patched.applied.get(f) for f in fusions):
                return patched, None
            try:
                test = reference(model)
                draws = numerics.check_draws(sampler, ref) if "sampling" in fusions else None
            except Exception as exc:  # a patched forward that raises is a failed fusion, not a failed run
                if in_ranks():  # ... except on tensor-parallel ranks: the others wait in this forward's all-reduce
                    raise
                why = f"the patched model raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
                return patched, ({}, {}, False, why)
        fig, fig32 = numerics.compare(test, ref), numerics.compare(test, ref32)
        ok, why = numerics.judge(fig, fig32, eager_raw, dtype, real_weights)
        if draws is not None:
            fig["draws"] = draws
            ok, why = (ok and draws["passed"], f"{why}; {draws['reason']}")
        ok, why = agree((ok, why))  # rank 0's judgement: every rank patches the same fusions from here on
        return patched, (numerics.json_safe(fig), numerics.json_safe(fig32), ok, why)

    def site_row(fusion: str, patched: Any) -> dict:
        """One fusion's row from what a patch did with it: its sites patched, skipped (and why), and how."""
        applied = patched.applied.get(fusion, [])
        row = {"fusion": fusion, "sites_found": len(sites[fusion]), "sites_patched": len(applied),
               "applied": applied, "skipped": patched.skipped.get(fusion, ""),
               "patched_by": "graph" if fusion in patched.rewritten else "layout" if applied else ""}  # fmt: skip
        folded = {path: patched.folded[path] for path in applied if path in patched.folded}
        if folded:  # patched, its call taken into another fusion's (`rewrite.fold_prologues`)
            row["folded"] = folded
        if patched.capture:
            row["capture_fallback"] = patched.capture
            note(f"{fusion}: {patched.capture}; the layout patchers were used")
        if not applied:
            row.update(status="skipped", reason=row["skipped"] or "nothing patched")
        return row

    def each_alone() -> tuple[dict[str, dict], list[str]]:
        rows: dict[str, dict] = {}
        passed: list[str] = []
        for fusion in sites:
            note(f"numerics: {fusion} alone")
            patched, figures = check([fusion])
            rows[fusion] = row = site_row(fusion, patched)
            if figures is not None:
                row["numerics"], row["numerics_vs_fp32"], ok, why = figures
                row.update(status="passed" if ok else "failed", reason=why)
                if ok:
                    passed.append(fusion)
        return rows, passed

    def together(fusions: list[str], label: str) -> tuple[dict[str, Any], Any]:
        note(f"numerics: {label} together")
        patched, figures = check(fusions)
        fig, fig32, ok, why = figures if figures is not None else ({}, {}, False, "nothing patched")
        return {"fusions": list(fusions), "numerics": fig, "numerics_vs_fp32": fig32, "passed": ok,
                "reason": why}, patched  # fmt: skip

    # Each fusion is checked alone, then the passing ones together. With --graphs-together (nothing is timed alone)
    # every fusion found is checked together first, and alone only when that fails: one patch and one teacher-forced
    # run instead of one per fusion, which on an 8B model is most of this stage's minutes.
    fusion_rows: dict[str, dict] = {}
    passing: list[str] = []
    together_numerics: dict[str, Any] = {}
    if graphs_together and len(sites) > 1:
        first, patched = together(list(sites), "every fusion found")
        rows = {f: site_row(f, patched) for f in sites}
        if first["passed"]:
            passing = [f for f in sites if rows[f]["sites_patched"]]
            first["fusions"] = passing
            for fusion in passing:
                rows[fusion].update(status="passed", numerics=first["numerics"],
                                    numerics_vs_fp32=first["numerics_vs_fp32"], checked="together",
                                    reason=f"checked together with the others: {first['reason']}")  # fmt: skip
            fusion_rows, together_numerics = rows, (first if len(passing) > 1 else {})
        elif not any(row["sites_patched"] for row in rows.values()):
            fusion_rows = rows  # nothing was patched, so nothing to check alone: the rows say why
        else:
            note(f"every fusion together failed numerics ({first['reason']}): checking each alone")
    if not fusion_rows:
        fusion_rows, passing = each_alone()
    if not any(row["sites_patched"] for row in fusion_rows.values()):
        why = "; ".join(f"{k}: {v['reason']}" for k, v in fusion_rows.items())
        raise UsageError(f"nothing could be patched in {workload.spec.name}: {why}")
    for fusion, why in left_out.items():
        fusion_rows[fusion] = {"fusion": fusion, "sites_found": 0, "sites_patched": 0, "applied": [], "skipped": why,
                               "status": "skipped", "reason": why}  # fmt: skip
    if len(passing) > 1 and not together_numerics:
        together_numerics, _ = together(passing, "all passing fusions")

    result = {
        "fusions": list(fusion_rows.values()),
        "eager_vs_fp32": eager_vs_fp32,
        "tolerances": numerics.tolerance_table(),
        "together_numerics": together_numerics,
        "repeats": repeats,
        "timing": None,
        "timing_note": "",
        "rows": [],
    }
    graph_args = (workload, summary, passing, enter, ref, ref32, eager_raw, real_weights, repeats, note,
                  not graphs_together, tmp / "kernels.csv")  # fmt: skip
    if not gpu:
        result["timing_note"] = (
            "not measured: on a CPU the kernels run in the Triton interpreter, so a timing "
            "would measure the interpreter, not the kernels"
        )
        result["rows"] = numerics_rows(fusion_rows)
        if graphs:
            result["graphs"] = graph_variants(*graph_args, timing=None)
        return result
    if together_numerics and not together_numerics["passed"]:
        note("all passing fusions together failed numerics: measuring each alone only")
    result["timing"] = measure_variants(
        workload,
        summary,
        passing,
        enter,
        sampler,
        repeats,
        tmp,
        note,
        together_ok=not together_numerics or together_numerics["passed"],
        applied={f: row["applied"] for f, row in fusion_rows.items()},
        alone=not graphs_only,
    )
    result["rows"] = variant_rows(result["timing"], fusion_rows)
    if graphs:
        result["graphs"] = graph_variants(*graph_args, timing=result["timing"])
    if forward_only:  # no decode step for --graphs: the forward beside torch.compile (`forward_compile`)
        from fusionscope.apply.forward_compile import compare_compiled

        result["compiled"] = compare_compiled(workload, compile_sites(summary, passing), ref, ref32, eager_raw,
                                              real_weights, repeats, note)  # fmt: skip
    return result


def compile_sites(summary: dict, fusions: list[str]) -> dict[str, list[str]]:
    """{fusion: paths} of `fusions` that fused + compile rewrites into the graph Inductor compiles: those whose module
    can `bind` a match."""
    from fusionscope.apply.patching import fusion_modules

    rewritable = [f for f in fusions if hasattr(fusion_modules().get(f), "bind")]
    sites = sites_to_patch(summary.get("opportunities", []), rewritable)[0] if rewritable else {}
    if sites and "gemv" in sites and set(fusions) & set(WEIGHT_FUSING):
        # qkv and gate_up concatenate weights when patched, which the graph torch.compile compiles cannot hold:
        # there the GEMV takes every one-row Linear the finder matches on the captured graph, theirs included
        sites["gemv"] = []
    return sites


def graph_variants(workload: Any, summary: dict, passing: list[str], enter: Callable[[list[str]], Any], ref: Any,
                   ref32: Any, eager_raw: dict, real_weights: bool, repeats: int, note: Callable[[str], None],
                   each: bool, kernels_csv: Path | None, timing: dict | None) -> dict:  # fmt: skip
    """`apply --graphs`: the graph alone, each passing fusion + graph (unless `each` is False), and fused + graph
    (every passing fusion: under a graph the host cost that can make a fusion slower in eager mode is gone, and each
    fusion + graph is measured on its own beside it), beside the peers (`graphs.run_graphs`), with the step model's
    predictions: a graph alone removes `cuda_graph_share_unfused` of the eager step, a graph after the fusions
    `cuda_graph_share` of the fused step, so fused + graph runs at the fused GPU time and its gain over the graph
    alone is the all-together GPU speedup. Greedy decoding (a graph step picks by argmax), so the sampling fusion
    takes no part. `kernels_csv` (the profile's kernel table) is what the graph alone's replayed step is compared
    with (`step_drift`): the predictions' baseline."""
    from fusionscope.apply import graphs, step_drift

    together = [f for f in passing if f != "sampling"]
    eager_ms = None
    if timing is not None:
        eager_ms = timing["variants"][BASELINE]["phases"].get("decode", {}).get("wall_ms")
    variants = {graphs.GRAPH: [], **{f"{f} + graph": [f] for f in together if each}}
    if together:
        variants[graphs.FUSED_GRAPH] = together
    fused_sites = compile_sites(summary, together) or None
    out = graphs.run_graphs(workload, variants, enter, ref, ref32, eager_raw, real_weights, repeats,
                            summary.get("roofs"), eager_ms, note, fused_sites)  # fmt: skip
    if not each and together:  # say which variants were not measured
        left = f"not measured (--graphs-together): {', '.join(f'{f} + graph' for f in together)}"
        out["timing_note"] = "; ".join(filter(None, [out.get("timing_note"), left]))
    plan = summary.get("cumulative", {}).get("decode") or {}
    share = plan.get("cuda_graph_share_unfused")
    pred = predicted(summary, "decode", together) if together else {}
    fused_gpu = pred.get("speedup_gpu")
    # a replayed graph runs at the step's GPU time plus the device's idle time between two of its kernels
    # (`roofs.graph_gap_us`) per kernel: the profiled step (graph alone), less what the fusions save (fused + graph)
    gpu_us = (plan.get("step_model") or {}).get("gpu_us")
    gap = (summary.get("roofs") or {}).get("graph_gap_us") or 0.0
    kernels = summary.get("phases", {}).get("decode", {}).get("kernels_per_step") or 0.0
    fused_kernels = kernels - (pred.get("kernels_removed") or 0.0) + (pred.get("launches_added") or 0.0)
    out["predicted"] = {
        "graph_vs_eager": 1 / (1 - share) if share is not None and share < 1 else None,
        "fused_graph_vs_graph": fused_gpu,
        "cuda_graph_share": plan.get("cuda_graph_share"),
        "cuda_graph_share_unfused": share,
        "graph_gap_us": gap or None,
        "graph_ms": (gpu_us + kernels * gap) / 1e3 if gpu_us else None,
        "fused_graph_ms": (gpu_us - (pred.get("saved_gpu_us") or 0.0) + fused_kernels * gap) / 1e3
        if gpu_us and fused_gpu
        else None,
    }
    if out["predicted"]["graph_ms"] and out["predicted"]["fused_graph_ms"]:
        fused_gpu = out["predicted"]["fused_graph_vs_graph"] = (
            out["predicted"]["graph_ms"] / out["predicted"]["fused_graph_ms"]
        )
    for name, key in ((graphs.GRAPH, "graph_ms"), (graphs.FUSED_GRAPH, "fused_graph_ms")):
        row = out["variants"].get(name)
        if row is not None:
            row["predicted_ms"] = out["predicted"][key]
            ms = row.get("ms_per_token")
            row["error_vs_predicted"] = ms / out["predicted"][key] - 1 if ms and out["predicted"][key] else None
    measured = out.get("fused_vs_graph")
    out["error_fused_vs_graph"] = measured / fused_gpu - 1 if measured and fused_gpu else None
    replayed = ((out["variants"].get(graphs.GRAPH) or {}).get("replay") or {}).get("breakdown")
    if replayed and kernels_csv is not None:
        out["step_drift"] = step_drift.step_drift(step_drift.profiled_step(kernels_csv), replayed)
    graph_ms = out["variants"].get(graphs.GRAPH, {}).get("ms_per_token")
    out["graph_vs_eager"] = eager_ms / graph_ms if eager_ms and graph_ms else None
    want = out["predicted"]["graph_vs_eager"]
    out["error_graph_vs_eager"] = out["graph_vs_eager"] / want - 1 if out["graph_vs_eager"] and want else None
    return out


def numerics_rows(fusion_rows: dict[str, dict]) -> list[dict]:
    """apply.csv rows for a run without timing: one per fusion, its status and numerics."""
    rows = []
    for fusion, row in fusion_rows.items():
        fig = row.get("numerics") or {}
        rows.append(
            {
                "variant": fusion,
                "phase": "",
                "status": row["status"],
                "sites_patched": row["sites_patched"],
                "max_abs": fig.get("max_abs"),
                "kl_mean": fig.get("kl_mean"),
                "top1": fig.get("top1"),
                "first_divergence": fig.get("first_divergence"),
                "reason": row.get("reason", ""),
            }
        )
    return rows


def measure_variants(
    workload: Any,
    summary: dict,
    passing: list[str],
    enter: Callable[[list[str]], Any],
    sampler: Any,
    repeats: int,
    tmp: Path,
    note: Callable[[str], None],
    together_ok: bool,
    applied: dict[str, list[str]] | None = None,
    alone: bool = True,
) -> dict:
    """Interleaved timing and one profiled pass per variant; per variant and phase the measured figures beside the
    predicted ones (for the sites `applied`: fusion → paths), each ratio against the baseline of its own set.

    The first set holds the baseline, each fusion alone and "all found" (every passing fusion), so the fusions alone
    and together are compared under the same host drift. "All together" in a phase leaves out the fusions that were
    clearly slower alone there; a choice that differs from all found is timed in a second set with its own baseline,
    one variant per distinct choice, named after the phases that chose it. `all_together` maps each phase to the
    variant that is its "all together". `alone=False` (`--graphs-only`) times the baseline and all found only."""
    from fusionscope.apply import measure

    phases = [p for p in workload.phases if p in summary.get("phases", {})]
    first = {BASELINE: [], **({f: [f] for f in passing} if alone else {})}
    if together_ok and (len(passing) > 1 or (passing and not alone)):
        first[ALL_FOUND] = list(passing)
    timed = _timed_set(workload, first, enter, sampler, repeats, note)
    choice: dict[str, list[str]] = {}  # phase -> its all-together fusions
    if ALL_FOUND in first:
        choice = {ph: [f for f in passing if f not in timed or not clearly_slower(timed[f], timed[BASELINE], ph)]
                  for ph in phases}  # fmt: skip
    choice = agree(choice)  # rank 0's timings choose: every rank then times the same second set
    distinct = [c for c in dict.fromkeys(tuple(c) for c in choice.values()) if c and list(c) != passing]
    second = {f"{ALL_TOGETHER} ({', '.join(ph for ph in phases if tuple(choice[ph]) == c)})": list(c) for c in distinct}
    timed_second = _timed_set(workload, {BASELINE: [], **second}, enter, sampler, repeats, note) if second else {}
    found_label = ALL_FOUND if second else ALL_TOGETHER  # all found is all together when no phase left one out
    # a phase where every fusion was clearly slower alone has nothing to put together: its best is the baseline
    all_together = {ph: BASELINE if not choice[ph] else next((n for n, f in second.items() if f == choice[ph]),
                                                             found_label) for ph in choice}  # fmt: skip
    variants = {**first, **second}
    gpu: dict[str, dict] = {}
    for name, fusions in variants.items():
        note(f"GPU time and kernels per step: profiling {name}")
        with enter(fusions):
            gpu[name] = measure.gpu_figures(workload, tmp, f".profile-{len(gpu)}", sampler)
    out: dict[str, Any] = {"variants": {}, "sets": [list(first), [BASELINE, *second]] if second else [list(first)],
                           "all_together": all_together}  # fmt: skip
    for name, fusions in variants.items():
        own = timed_second if name in second else timed
        per_phase = {
            phase: phase_figures(summary, phase, fusions, own[name], own[BASELINE], gpu[name].get(phase, {}),
                                 gpu[BASELINE].get(phase, {}), applied)
            for phase in phases
        }  # fmt: skip
        label = found_label if name == ALL_FOUND else name
        out["variants"][label] = {"fusions": fusions, "peak_mib": own[name].peak_mib, "phases": per_phase}
    out["sets"][0] = [found_label if n == ALL_FOUND else n for n in out["sets"][0]]
    return out


def clearly_slower(variant: Any, baseline: Any, phase: str) -> bool:
    """Whether a fusion measured slower alone in `phase` beyond the host's noise: its fastest round slower than the
    baseline's fastest, and its median slower than the baseline's median. (The host's slow spells can land on
    either side; a fusion that loses only to a spell keeps one of the two.)"""
    base, var = baseline.wall_ms.get(phase) or [], variant.wall_ms.get(phase) or []
    if not base or not var:
        return False
    return min(var) > min(base) and statistics.median(var) > statistics.median(base)


def _timed_set(workload: Any, variants: dict[str, list[str]], enter: Callable[[list[str]], Any], sampler: Any,
               repeats: int, note: Callable[[str], None]) -> dict:  # fmt: skip
    from fusionscope.apply import measure

    note(f"timing {len(variants)} variants × {repeats} interleaved rounds: {', '.join(variants)}")
    return measure.interleaved(
        workload,
        measure.measured_variants(list(variants), lambda n: enter(variants[n])),
        repeats,
        sampler,
        on_round=lambda r, n: note(f"round {r + 1}/{repeats}: {n}"),
    )


def patched_share(opportunity: dict, applied: dict[str, list[str]] | None) -> float:
    """The share of an opportunity's sites that the patch reached (1 without `applied`): a prediction is for what was
    patched, so a site skipped with its reason leaves the estimate with it rather than counting as a miss."""
    paths = opportunity.get("module_paths") or []
    if applied is None or not paths:
        return 1.0
    return len(set(paths) & set(applied.get(opportunity["fusion"], []))) / len(paths)


def predicted(summary: dict, phase: str, fusions: list[str],
              applied: dict[str, list[str]] | None = None) -> dict[str, float | None]:  # fmt: skip
    """The estimate for `fusions` applied together in `phase`: per-step savings summed over their opportunities (each
    scaled to the share of its sites that were patched, `applied`: fusion → paths) and put through the step model
    (one fusion alone, fully patched: its own `speedup_*` figures)."""
    from fusionscope import amdahl

    rows = [o for o in summary.get("opportunities", []) if o["phase"] == phase and o["fusion"] in fusions]
    if not rows:
        return {"speedup_gpu": None, "speedup_wall": None, "saved_gpu_us": None}
    share = {id(r): patched_share(r, applied) for r in rows}
    saved = sum((r.get("saved_us") or 0.0) * share[id(r)] for r in rows)
    model = amdahl.step_model(summary["phases"].get(phase, {}), summary.get("roofs", {}))
    if model is None:  # a CPU run: the ops are the timeline, so the profiled step is their sum (as `profile` says)
        wall = 1e3 * (summary["phases"].get(phase, {}).get("wall_ms_per_step") or 0.0)
        return {"speedup_gpu": None, "speedup_wall": wall / max(wall - saved, 1e-9) if wall else None,
                "saved_gpu_us": None}  # fmt: skip
    ops = sum((r.get("ops_now") or 0.0) * share[id(r)] for r in rows)
    launches = sum((r.get("launches_fused") or 0.0) * share[id(r)] for r in rows)
    kernels_removed = sum((r.get("launches_now") or 0.0) * share[id(r)] for r in rows)
    # profiled host time of the groups; runs written before it was recorded have none (ops × mean cost stand in)
    host = (
        sum((r.get("host_now_us") or 0.0) * share[id(r)] for r in rows)
        if all("host_now_us" in r for r in rows)
        else None
    )
    gain = amdahl.speedup(model, saved, ops, launches, host)
    return {
        "speedup_gpu": gain.gpu,
        "speedup_wall": gain.wall,
        "saved_gpu_us": saved,
        "saved_host_us": gain.saved_host_us,
        "paced_by": model.paced_by,
        "ops_removed": ops,
        "host_removed_us": gain.saved_host_us + launches * model.launch_us,
        "launches_added": launches,
        "kernels_removed": kernels_removed,
        "host_us_per_op": model.host_us_per_op,
        "launch_us": model.launch_us,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def phase_figures(summary: dict, phase: str, fusions: list[str], m: Any, base: Any, gpu: dict, gpu_base: dict,
                  applied: dict[str, list[str]] | None = None) -> dict:  # fmt: skip
    """Measured vs predicted for one variant in one phase (wall from the interleaved rounds, GPU from the profiled
    pass), with the error measured ÷ predicted − 1 and the step-model term that was further off."""
    from fusionscope.apply.measure import fastest_speedup

    wall, wall_base = m.wall(phase), base.wall(phase)
    row: dict[str, Any] = {
        "wall_ms": wall,
        "wall_ms_spread": m.spread(phase),
        "baseline_wall_ms": wall_base,
        "gpu_ms": gpu.get("gpu_ms"),
        "baseline_gpu_ms": gpu_base.get("gpu_ms"),
        "kernels": gpu.get("kernels"),
        "baseline_kernels": gpu_base.get("kernels"),
        "wall_ms_rounds": list(m.wall_ms.get(phase) or []),
        "baseline_wall_ms_rounds": list(base.wall_ms.get(phase) or []),
        "measured_speedup_wall": fastest_speedup(base, m, phase),
        "measured_speedup_gpu": _ratio(gpu_base.get("gpu_ms"), gpu.get("gpu_ms")),
    }
    if not fusions:
        return row
    pred = predicted(summary, phase, fusions, applied)
    row.update(predicted_speedup_wall=pred["speedup_wall"], predicted_speedup_gpu=pred["speedup_gpu"])
    for kind in ("wall", "gpu"):
        meas, est = row[f"measured_speedup_{kind}"], row[f"predicted_speedup_{kind}"]
        row[f"error_{kind}"] = meas / est - 1 if meas and est else None
    if pred.get("saved_gpu_us") is not None and row["gpu_ms"] is not None and row["baseline_gpu_ms"] is not None:
        row["predicted_saved_gpu_us"] = pred["saved_gpu_us"]
        row["measured_saved_gpu_us"] = 1e3 * (row["baseline_gpu_ms"] - row["gpu_ms"])
    if pred.get("saved_host_us") is not None and wall is not None and wall_base is not None:
        row["predicted_saved_host_us"] = pred["saved_host_us"]
        row["measured_saved_wall_us"] = 1e3 * (wall_base - wall)
    row["term_off"] = term_off(row, pred.get("paced_by"))
    implied = implied_launch_us(summary, phase, pred, wall, wall_base)
    if implied is not None:
        row["model_us_per_fused_launch"] = pred["launch_us"]
        row["implied_us_per_fused_launch"] = implied
    return row


def implied_launch_us(summary: dict, phase: str, pred: dict, wall_ms: float | None,
                      baseline_wall_ms: float | None) -> float | None:  # fmt: skip
    """The host µs per fused call that a measurement implies, to set beside the step model's. In a host-paced step,
    wall after = wall before − host time removed + calls added × cost per call; the host time removed is the model's,
    rescaled to the measured baseline of the same interleaved set (the host's speed differs between the profile and
    the rounds). None where the step is not host-paced or a figure is missing."""
    if pred.get("paced_by") != "host" or not wall_ms or not baseline_wall_ms or not pred.get("launches_added"):
        return None
    model_wall = 1e3 * (summary["phases"][phase].get("wall_ms_per_step_unprofiled")
                        or summary["phases"][phase].get("wall_ms_per_step") or 0.0)  # fmt: skip
    if "host_removed_us" in pred and model_wall:
        removed = pred["host_removed_us"] * 1e3 * baseline_wall_ms / model_wall
    else:  # runs recorded before host spans: ops × the baseline's mean cost per op
        removed = pred["ops_removed"] * 1e3 * baseline_wall_ms / max(float(summary["phases"][phase].get("ops_per_step")
                                                                           or 0.0), 1.0)  # fmt: skip
    return (1e3 * wall_ms - (1e3 * baseline_wall_ms - removed)) / pred["launches_added"]


def term_off(row: dict, paced_by: str | None) -> str:
    """Which term of the step model missed most: the GPU term (kernel time saved) or the host term (host work saved,
    which sets a host-bound step's wall time). Empty when neither figure is there."""
    misses = {}
    if row.get("predicted_saved_gpu_us") is not None:
        misses["gpu"] = abs(row["measured_saved_gpu_us"] - row["predicted_saved_gpu_us"])
    if row.get("predicted_saved_host_us") is not None and paced_by == "host":
        misses["host"] = abs(row["measured_saved_wall_us"] - row["predicted_saved_host_us"])
    return max(misses, key=misses.get) if misses else ""


def variant_rows(timing: dict, fusion_rows: dict[str, dict]) -> list[dict]:
    """apply.csv: one row per variant and phase (status and numerics from the fusion rows where it is one fusion)."""
    rows = []
    for name, variant in timing["variants"].items():
        fusion = fusion_rows.get(name, {})
        fig = fusion.get("numerics") or {}
        for phase, figures in variant["phases"].items():
            rows.append(
                {
                    "variant": name,
                    "phase": phase,
                    "fusions": " ".join(variant["fusions"]),
                    "status": fusion.get("status", "measured"),
                    "sites_patched": fusion.get("sites_patched"),
                    **{k: v for k, v in figures.items() if k != "wall_ms_spread"},
                    "wall_ms_min": (figures.get("wall_ms_spread") or (None, None))[0],
                    "wall_ms_max": (figures.get("wall_ms_spread") or (None, None))[1],
                    "peak_mib": variant["peak_mib"],
                    "max_abs": fig.get("max_abs"),
                    "kl_mean": fig.get("kl_mean"),
                    "top1": fig.get("top1"),
                    "first_divergence": fig.get("first_divergence"),
                }
            )
    for name, fusion in fusion_rows.items():
        if name not in timing["variants"]:
            fig = fusion.get("numerics") or {}
            rows.append(
                {
                    "variant": name,
                    "phase": "",
                    "fusions": name,
                    "status": fusion["status"],
                    "sites_patched": fusion["sites_patched"],
                    "max_abs": fig.get("max_abs"),
                    "kl_mean": fig.get("kl_mean"),
                    "top1": fig.get("top1"),
                    "first_divergence": fig.get("first_divergence"),
                    "reason": fusion.get("reason", ""),
                }
            )
    return rows
