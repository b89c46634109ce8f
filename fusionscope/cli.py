"""The `fusionscope` command: thin typer commands over the Python API in `fusionscope.run`.

Expected mistakes (`UsageError`) end as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.status import Status
from rich.table import Table

from fusionscope.errors import UsageError
from fusionscope.kernel_names import short_kernel_name

if TYPE_CHECKING:
    import pandas as pd

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find what to fuse in a PyTorch model, estimate what it is worth, and prove it on the GPU.",
)
PIPED_WIDTH = 1000  # columns for stdout when it is not a terminal: wider than any table printed here


class StdoutConsole(Console):
    """stdout. At a terminal, tables fit its width. Piped into a file or a CI log rich would cut them to 80 columns
    (`fusi…`, `laun…`); there they are printed at their own width, so a saved table keeps its names and numbers
    whole (tables do not expand, and plain lines are not padded)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(max(size.width, PIPED_WIDTH), size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = Console(stderr=True)
out = StdoutConsole()


@contextmanager
def usage_errors() -> Iterator[None]:
    """An expected mistake becomes one line on stderr and exit status 2 (also under typer's CliRunner)."""
    try:
        yield
    except UsageError as exc:
        typer.echo(f"fusionscope: error: {exc}", err=True)
        raise typer.Exit(2) from None


class StageLog:
    """Shows the running stage in the spinner and logs each finished stage with its duration.

    A stage is logged only once it has finished, so a run that fails on bad input prints its one error line alone.
    """

    def __init__(self, status: Status) -> None:
        self.status = status
        self.current: str | None = None
        self.since = time.perf_counter()

    def start(self, message: str | None) -> None:
        now = time.perf_counter()
        if self.current is not None:
            console.log(f"{self.current}  [dim]{now - self.since:.1f} s[/dim]")
        self.current, self.since = message, now
        if message is not None:
            self.status.update(f"{message}…")


# The workload options `profile` and `apply` share: one definition each, so the two commands cannot drift apart.
ModelArg = Annotated[str, typer.Argument(help="preset name, Hugging Face folder, or path/to/file.py:factory")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="run folder to create (must not exist)")]
BatchOpt = Annotated[int, typer.Option(help="sequences per step")]
PromptOpt = Annotated[int, typer.Option(help="prompt tokens (prefill length)")]
DecodeOpt = Annotated[int, typer.Option(help="decode steps (one new token each); 0: prefill only")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu or cuda")]
WarmupOpt = Annotated[int, typer.Option(help="unrecorded passes over the exact timed lengths")]
RemeasureOpt = Annotated[bool, typer.Option(help="measure the device's roofs again instead of using the cache")]
SampleOpt = Annotated[
    bool, typer.Option("--sample/--greedy", help="pick tokens as generate(do_sample=True) does, or by argmax")
]
TemperatureOpt = Annotated[float, typer.Option(help="--sample: logits divided by this")]
TopKOpt = Annotated[int, typer.Option(help="--sample: keep the k most likely tokens")]
TopPOpt = Annotated[float, typer.Option(help="--sample: keep the smallest set holding this probability")]
CacheOpt = Annotated[
    str, typer.Option(help="the KV cache decode runs on: dynamic (transformers' default) or static (as CUDA graphs)")
]
NprocOpt = Annotated[
    int | None,
    typer.Option(help="shard the model over N tensor-parallel ranks (torchrun; NCCL on GPUs, gloo on the CPU)"),
]


def run_with_progress(what: str, run: Callable[..., Any], **kwargs: Any) -> Any:
    """Call `run(**kwargs, on_stage=...)` under a spinner that logs each finished stage; usage errors become one
    line and exit 2."""
    with usage_errors(), console.status(f"{what}…") as status:
        progress = StageLog(status)
        result = run(**kwargs, on_stage=progress.start)
        progress.start(None)
    return result


@app.command()
def profile(
    model: ModelArg = "tiny-llama",
    out_dir: OutOpt = None,
    batch: BatchOpt = 1,
    prompt_len: PromptOpt = 128,
    decode_steps: DecodeOpt = 16,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    warmup: WarmupOpt = 1,
    remeasure: RemeasureOpt = False,
    sample: SampleOpt = False,
    temperature: TemperatureOpt = 0.7,
    top_k: TopKOpt = 50,
    top_p: TopPOpt = 0.9,
    nproc: NprocOpt = None,
    cache: CacheOpt = "dynamic",
) -> None:
    """Capture MODEL under torch.profiler, classify every kernel against the measured roofs, write a run folder."""
    from fusionscope.run import profile as run_profile

    t0 = time.perf_counter()
    run = run_with_progress("profiling", run_profile, model=model, out=out_dir, batch=batch, prompt_len=prompt_len,
                            decode_steps=decode_steps, dtype=dtype, device=device, warmup=warmup, remeasure=remeasure,
                            sample=sample, temperature=temperature, top_k=top_k, top_p=top_p,
                            nproc=nproc, cache=cache)  # fmt: skip
    print_summary(run.summary)
    out.print(f"report: {run.report_path}   ({time.perf_counter() - t0:.1f} s in all)")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run folder written by `fusionscope profile`")]) -> None:
    """Re-render RUN_DIR/report.html from the run's saved data (summary.json, kernels.csv)."""
    from fusionscope.run_folder import load_run, rerender

    with usage_errors():
        path = rerender(run_dir)
        print_summary(load_run(run_dir).summary)
    out.print(f"report: {path}")


@app.command()
def bench(
    kernels: Annotated[list[str] | None, typer.Argument(help="kernels to benchmark (default: all)")] = None,
    list_cases: Annotated[
        bool, typer.Option("--list", help="list the kernels, shapes and tolerances; no GPU needed")
    ] = False,
    quick: Annotated[bool, typer.Option(help="one decode and one prefill shape per kernel")] = False,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    variant: Annotated[
        list[str] | None, typer.Option("--variant", help="time only this variant (repeatable), e.g. fusionscope")
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="folder to create (default reports/bench-<time>)")
    ] = None,
) -> None:
    """Time each bundled kernel against eager, torch.compile, PyTorch's fused op and Liger-Kernel on the GPU."""
    from fusionscope.bench import check_variants, kernel_names

    with usage_errors():
        if list_cases:
            print_cases(kernels or kernel_names())
            return
        if variant:
            check_variants(kernels or kernel_names(), variant)
        import torch

        from fusionscope.bench import run_bench
        from fusionscope.bench.page import render_bench_page
        from fusionscope.models import DTYPES
        from fusionscope.run_folder import check_out_dir, default_out_dir, staged_dir, write_json

        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype '{dtype}': use bf16, fp16 or fp32")
        if not torch.cuda.is_available():
            raise UsageError("fusionscope bench needs a CUDA GPU; this machine has none (--list works without one)")
        folder = out_dir or default_out_dir("bench")
        check_out_dir(folder)
        with console.status("benchmarking…") as status:
            result = run_bench(
                kernels or None,
                dtype=DTYPES[dtype],
                quick=quick,
                variants=variant,
                on_case=lambda label: status.update(f"benchmarking {label}…"),
            )
        with staged_dir(folder) as tmp:
            result.rows.to_csv(tmp / "bench.csv", index=False, float_format="%.6g")
            write_json(tmp / "bench.json", result.meta)
            (tmp / "bench.html").write_text(render_bench_page(result.rows, result.meta), encoding="utf-8")
    print_bench(result.rows)
    out.print(f"results: {folder}/bench.csv, {folder}/bench.html")


@app.command()
def catalog() -> None:
    """The fusion catalogue: each entry, what it matches, the kernel that serves it and the families it patches."""
    from fusionscope.fusions import fusions

    table = Table(title="fusion catalogue")
    for col in ("fusion", "what it replaces", "kernel", "families"):
        table.add_column(col)
    for fusion in fusions():
        table.add_row(fusion.KEY, fusion.TITLE, f"fusionscope.kernels.{fusion.KERNEL}" if fusion.KERNEL else "—",
                      ", ".join(fusion.FAMILIES))  # fmt: skip
    out.print(table)


def print_cases(names: list[str]) -> None:
    from fusionscope.bench.cases import CASES
    from fusionscope.kernels.tolerances import TOLERANCES

    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise UsageError(f"unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    table = Table(title="bench cases")
    for col in ("kernel", "phase", "shape", "variants"):
        table.add_column(col)
    for name in names:
        for case in CASES[name]():
            table.add_row(name, case.phase, case.label, ", ".join(case.variants))
    out.print(table)
    tol = Table(title="numerical tolerances (kernel vs float64 reference)")
    for col in ("dtype", "atol", "rtol"):
        tol.add_column(col)
    for dt, (atol, rtol) in TOLERANCES.items():
        tol.add_row(str(dt).removeprefix("torch."), f"{atol:g}", f"{rtol:g}")
    out.print(tol)


def print_bench(rows: pd.DataFrame) -> None:
    table = Table(title="fusionscope bench (GPU µs by CUDA-graph replay; % of measured copy bandwidth)")
    cols = ("kernel", "case", "variant", "GPU µs", "cold µs", "host µs", "call µs", "GB/s", "% copy", "max err", "regs")
    for col in cols:
        table.add_column(col, justify="left" if col in ("kernel", "case", "variant") else "right")

    def fmt(value: object, spec: str) -> str:
        return "—" if value is None or value != value else format(value, spec)

    for row in rows.to_dict("records"):
        table.add_row(
            row["kernel"],
            row["case"],
            row["variant"],
            fmt(row.get("gpu_us"), ".2f"),
            fmt(row.get("cold_us"), ".2f"),
            fmt(row.get("host_us"), ".1f"),
            fmt(row.get("call_us"), ".1f"),
            fmt(row.get("gbps"), ".0f"),
            fmt(row.get("pct_copy_bw"), ".0f"),
            fmt(row.get("max_err"), ".2g"),
            fmt(row.get("registers"), ".0f"),
        )
    out.print(table)


def print_summary(summary: dict) -> None:
    """The per-phase table printed at the end of a run, the fusion opportunities and each phase's cumulative plan."""
    from fusionscope.report.regime import paced_by

    model, device = summary.get("model", {}), summary.get("device", {})
    plans = summary.get("cumulative") or {}
    table = Table(title=f"{model.get('name')} on {device.get('name') or 'an unnamed device'} "
                        f"({model.get('dtype') or 'dtype not recorded'})")  # fmt: skip
    text_columns = ("phase", "regime (measured)", "paced by (model)", "top kernel (share)")
    for col in ("phase", "ms/step", "unprof.", "GPU busy", "kernels", "µs/kern", *text_columns[1:]):
        table.add_column(
            col,
            justify="left" if col in text_columns else "right",
            overflow="fold" if col == "top kernel (share)" else "ellipsis",
        )

    def fmt(value: float | None, spec: str = ".2f") -> str:
        return "—" if value is None else format(value, spec)

    def kernel_name(name: object) -> str:
        text = short_kernel_name(name or "")  # the full name is in kernels.csv and summary.json
        return text[:39] + "…" if out.is_terminal and len(text) > 40 else text  # whole in a saved table

    def cumulative_line(phase: str, plan: dict, pacer: str | None) -> str:
        """One phase's plan in a line: all accepted fusions together, then what a CUDA graph would remove of the fused
        step, and what paces the step in the step model."""
        last = plan["waterfall"][-1]
        line = f"{phase}: all accepted fusions {last['speedup_wall']:.3f}× wall"
        if last.get("speedup_gpu") is not None:
            line += f", {last['speedup_gpu']:.3f}× GPU"
        if plan.get("cuda_graph_share") is not None and "cuda_graph_share_unfused" in plan:
            line += f"; then a CUDA graph would remove {plan['cuda_graph_share']:.0%} of the fused step"
        if pacer is not None:
            return line + f" (paced by the {'host' if pacer == 'host' else 'GPU'} in the step model)"
        return line + " (CPU run: the ops are the timeline)" if last.get("speedup_gpu") is None else line

    for name, ph in summary.get("phases", {}).items():
        top = ph.get("top_kernels") or [{}]
        busy = ph.get("gpu_busy_ms_per_step")
        frac = ph.get("gpu_busy_frac")
        table.add_row(
            name,
            fmt(ph.get("wall_ms_per_step")),
            fmt(ph.get("wall_ms_per_step_unprofiled")),
            "—" if busy is None else f"{busy:.2f} ({frac:.0%})",
            fmt(ph.get("kernels_per_step"), ".0f"),
            fmt(ph.get("host_us_per_kernel"), ".1f"),
            ph.get("regime") or "cpu",
            paced_by(plans.get(name)) or "—",
            f"{kernel_name(top[0].get('name'))} ({top[0].get('share', 0):.0%})" if top[0] else "",
        )
    out.print(table)
    out.print(
        "ms/step: profiled wall time per step (median); unprof.: the same without the profiler; GPU busy: "
        "kernel time with overlaps counted once; regime (measured): host-bound when the GPU is busy under half of "
        "the unprofiled step; paced by (model): host when the step model's host work ≥ its GPU work — what the "
        "estimates use",
        style="dim",
    )
    for name, ph in summary.get("phases", {}).items():
        if line := floor_line(name, ph):
            out.print(line)
    if summary.get("opportunities"):
        opp_table = Table(title="fusion opportunities (per step; speedups end to end for the phase)")
        columns = ("fusion", "phase", "count", "µs now", "µs fused", "micro now→fused", "launches", "GPU ×", "wall ×",
                   "confidence")  # fmt: skip
        for col in columns:
            opp_table.add_column(col, justify="left" if col in ("fusion", "phase", "confidence") else "right")
        for opp in summary["opportunities"]:
            opp_table.add_row(
                opp["fusion"], opp["phase"], fmt(opp["count"], ".0f"), fmt(opp["t_now_us"], ".1f"),
                fmt(opp["t_fused_us"], ".1f"),
                f"{fmt(opp.get('micro_now_us'), '.1f')}→{fmt(opp.get('micro_fused_us'), '.1f')}"
                if opp.get("micro_now_us") is not None else "",
                f"{opp['launches_now']:.0f}→{opp['launches_fused']:.0f}",
                fmt(opp["speedup_gpu"], ".3f"), fmt(opp["speedup_wall"], ".3f"), opp["confidence"],
            )  # fmt: skip
        out.print(opp_table)
    for phase, plan in plans.items():
        if plan.get("waterfall"):
            out.print(cumulative_line(phase, plan, paced_by(plan)))
    coverage = summary.get("cost_coverage")
    if coverage is not None:
        out.print(f"cost coverage: {coverage:.1%} of kernel time has a bytes/FLOPs model")


@app.command()
def apply(
    model: ModelArg = "tiny-llama",
    fusions: Annotated[str, typer.Option(help="fusions to apply: a,b or all (every fusion found)")] = "all",
    from_run: Annotated[
        Path | None, typer.Option("--from", help="take the predictions of this earlier run folder instead")
    ] = None,
    repeats: Annotated[int, typer.Option(help="interleaved timing rounds per variant (medians)")] = 3,
    out_dir: OutOpt = None,
    batch: BatchOpt = 1,
    prompt_len: PromptOpt = 128,
    decode_steps: DecodeOpt = 16,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    warmup: WarmupOpt = 1,
    remeasure: RemeasureOpt = False,
    sample: SampleOpt = False,
    temperature: TemperatureOpt = 0.7,
    top_k: TopKOpt = 50,
    top_p: TopPOpt = 0.9,
    graphs: Annotated[
        bool, typer.Option("--graphs", help="also the decode step in a CUDA graph, beside torch.compile and Liger")
    ] = False,
    graphs_only: Annotated[
        bool,
        typer.Option(
            "--graphs-only", help="with --graphs: time the eager model unpatched and all together only, not each fusion"
        ),
    ] = False,
    graphs_together: Annotated[
        bool,
        typer.Option(
            "--graphs-together",
            help="with --graphs: capture the graph alone and fused + graph only, not each fusion + graph; numerics"
            " check every fusion together first, each alone only if that fails",
        ),
    ] = False,
    quantize: Annotated[
        str | None,
        typer.Option(
            help="first quantise the Linears (not the embedding or LM head) to int4: w4 (group 128), "
            "w4:<group> or w4:channel; dequant_gemm is then measured like any fusion"
        ),
    ] = None,
    nproc: NprocOpt = None,
    cache: Annotated[
        str,
        typer.Option(help="the KV cache decode runs on: dynamic, static, or auto (static with --graphs, else dynamic)"),
    ] = "auto",
) -> None:
    """Patch the fusions found into MODEL, check the numerics, measure before and after, predicted vs measured."""
    from fusionscope.apply.run import apply as run_apply

    t0 = time.perf_counter()
    run = run_with_progress("applying", run_apply, model=model, fusions=fusions, from_run=from_run, repeats=repeats,
                            out=out_dir, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps, dtype=dtype,
                            device=device, warmup=warmup, remeasure=remeasure, sample=sample,
                            temperature=temperature, top_k=top_k, top_p=top_p, graphs=graphs,
                            graphs_only=graphs_only, graphs_together=graphs_together, quantize=quantize,
                            nproc=nproc, cache=cache)  # fmt: skip
    print_summary(run.summary)
    if quantization := run.summary["apply"].get("quantization"):
        from fusionscope.report.formatting import NUMERICS_CELLS, fmt_figure

        figures = ", ".join(f"{k} {fmt_figure(quantization['numerics'].get(k), spec)}" for k, spec in NUMERICS_CELLS)
        out.print(f"quantisation {quantization['spec']} of {len(run.summary['quantize']['swapped'])} Linears, against "
                  f"{quantization['against']}: {figures}")  # fmt: skip
    print_apply(run.summary["apply"])
    if run.summary["apply"].get("graphs"):
        print_graphs(run.summary["apply"]["graphs"])
    if run.summary["apply"].get("compiled"):
        print_compiled(run.summary["apply"]["compiled"])
    out.print(f"report: {run.report_path}   ({time.perf_counter() - t0:.1f} s in all)")


@app.command()
def diff(
    run_a: Annotated[Path, typer.Argument(help="run folder or trace file A (before)")],
    run_b: Annotated[Path, typer.Argument(help="run folder or trace file B (after)")],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="folder to create (default reports/diff-<time>)")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="for trace files: the GPU whose roofs to use, as `analyze --device` takes it")
    ] = None,
) -> None:
    """Compare two runs — run folders, or traces analysed on the spot: per phase step time, GPU time, kernels; per
    category, per fusion; kernels gone/new; with two traces also HTA's trace diff."""
    from fusionscope.diff import diff_paths
    from fusionscope.report.diff_page import render_diff_page
    from fusionscope.run_folder import check_out_dir, default_out_dir, staged_dir, write_json

    with usage_errors():
        folder = out_dir or default_out_dir("diff")
        check_out_dir(folder)
        result = diff_paths(run_a, run_b, device)
        with staged_dir(folder) as tmp:
            write_json(tmp / "diff.json", result)
            (tmp / "diff.html").write_text(render_diff_page(result), encoding="utf-8")
    print_diff(result)
    out.print(f"diff: {folder}/diff.json, {folder}/diff.html")


def print_diff(result: dict, top: int = 10) -> None:
    """The diff tables: per phase A, B, Δ, ratio; per category and per fusion; the kernels that appeared or vanished."""

    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "—" if value is None else format(value, spec)

    def signed(value: float | None, spec: str = ".3f") -> str:
        return "—" if value is None else format(value, "+" + spec)

    for note in result.get("notes", []):
        out.print(f"note: {note}")
    labels = {"wall_ms_per_step_unprofiled": "wall ms/step (unprof.)", "gpu_busy_ms_per_step": "GPU busy ms/step",
              "kernels_per_step": "kernels/step", "ops_per_step": "aten ops/step"}  # fmt: skip
    table = Table(title=f"diff: A {result['a']['path']} → B {result['b']['path']} (Δ = B − A, ratio = B ÷ A)")
    for col in ("phase", "metric", "A", "B", "Δ", "ratio"):
        table.add_column(col, justify="left" if col in ("phase", "metric") else "right")
    phases = result.get("phases", {})
    for name, ph in phases.items():
        where = {"a_only": " (only in A)", "b_only": " (only in B)"}.get(ph["present"], "")
        for key, label in labels.items():
            d = ph["metrics"][key]
            if d["a"] is None and d["b"] is None:
                continue
            spec = ".3f" if "ms" in label else ".1f"
            table.add_row(name + where, label, fmt(d["a"], spec), fmt(d["b"], spec), signed(d["delta"], spec),
                          "—" if d["ratio"] is None else f"{d['ratio']:.3f}×")  # fmt: skip
    out.print(table)
    cats = Table(title="kernel time by category (µs/step)")
    for col in ("phase", "category", "A", "B", "Δ", "ratio"):
        cats.add_column(col, justify="left" if col in ("phase", "category") else "right")
    for name, ph in phases.items():
        for cat, d in ph["categories"].items():
            cats.add_row(name, cat, fmt(d["a"], ".1f"), fmt(d["b"], ".1f"), signed(d["delta"], ".1f"),
                         "—" if d["ratio"] is None else f"{d['ratio']:.3f}×")  # fmt: skip
    out.print(cats)
    if any(ph["fusions"] for ph in phases.values()):
        fus = Table(title="fusions found (groups per step, µs per step now; vanished in B: what applying it did)")
        for col in ("phase", "fusion", "status", "count A", "count B", "µs A", "µs B", "Δ µs"):
            fus.add_column(col, justify="left" if col in ("phase", "fusion", "status") else "right")
        for name, ph in phases.items():
            for row in ph["fusions"]:
                status = {"a_only": "phase only in A", "b_only": "phase only in B"}.get(row["status"], row["status"])
                fus.add_row(name, row["fusion"], status, fmt(row["count_a"], ".0f"),
                            fmt(row["count_b"], ".0f"), fmt(row["us_a"], ".1f"), fmt(row["us_b"], ".1f"),
                            signed(row["delta_us"], ".1f"))  # fmt: skip
        out.print(fus)
    changed = Table(title=f"kernels in one run only (top {top} per phase by µs/step)")
    for col in ("phase", "", "kernel", "µs/step", "calls/step"):
        changed.add_column(col, justify="right" if col in ("µs/step", "calls/step") else "left")
    for name, ph in phases.items():
        for word, key in (("appeared", "kernels_appeared"), ("vanished", "kernels_vanished")):
            for row in ph[key][:top]:
                changed.add_row(name, word, short_kernel_name(row["name"]), fmt(row["us_per_step"], ".1f"),
                                fmt(row["calls_per_step"], ".2g"))  # fmt: skip
    if changed.row_count:
        out.print(changed)
    else:
        out.print("kernels: the same kernel names in both runs in every phase they share", style="dim")


def print_apply(result: dict) -> None:
    """The apply tables: per fusion where it was patched and its numerics; per variant measured vs predicted."""

    def fmt(value: object, spec: str) -> str:
        return "—" if value is None or value != value else format(value, spec)

    def pct(value: float | None) -> str:
        return "—" if value is None else f"{value * 100:+.0f}%"

    from fusionscope.report.formatting import figure_cells

    shown = ("max_abs", "kl_mean", "top1", "top5", "first_divergence")  # the report adds max_rel and vs-fp32 figures
    table = Table(title="fusions applied (numerics against the unpatched model on the same inputs)")
    for col in ("fusion", "sites", "status", "max |Δ|", "KL", "top-1", "top-5", "1st diff", "reason"):
        table.add_column(col, justify="left" if col in ("fusion", "status", "reason") else "right",
                         overflow="fold" if col == "reason" else "ellipsis")  # fmt: skip
    table.add_row(
        "(eager vs fp32)",
        "",
        "",
        *figure_cells(result.get("eager_vs_fp32"), shown),
        "the unpatched model's own distance from fp32",
    )
    for row in result.get("fusions", []):
        table.add_row(
            row["fusion"],
            f"{row['sites_patched']}/{row['sites_found']}",
            row["status"],
            *figure_cells(row.get("numerics"), shown),
            row.get("reason") or row.get("skipped") or "",
        )
    together = result.get("together_numerics") or {}
    if together:
        table.add_row("all passing", str(len(together.get("fusions", []))),
                      "passed" if together.get("passed") else "failed", *figure_cells(together.get("numerics"), shown),
                      together.get("reason") or "")  # fmt: skip
    out.print(table)
    tolerances = result.get("tolerances") or []
    if tolerances:
        tol = Table(title="numerics tolerances (what the judge applied, per dtype)")
        keys = list(tolerances[0])
        for key in keys:
            tol.add_column(key, justify="left" if key == "dtype" else "right")
        for row in tolerances:
            tol.add_row(*(str(row.get(k)) for k in keys))
        out.print(tol)
    timing = result.get("timing")
    if not timing:
        out.print(f"timing {result.get('timing_note') or 'not measured'}", style="dim")
        return
    table = Table(title=f"measured vs predicted (medians of {result.get('repeats')} interleaved rounds)")
    for col in ("variant", "phase", "wall ms", "spread", "wall × meas", "wall × pred", "err", "GPU ms", "GPU × meas",
                "GPU × pred", "err ", "kernels", "peak MiB", "term off", "µs/fused launch"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("variant", "phase", "term off") else "right")
    for name, variant in timing["variants"].items():
        for phase, f in variant["phases"].items():
            spread = f.get("wall_ms_spread")
            table.add_row(name, phase, fmt(f.get("wall_ms"), ".2f"),
                          f"{spread[0]:.2f}–{spread[1]:.2f}" if spread else "—",
                          fmt(f.get("measured_speedup_wall"), ".3f"), fmt(f.get("predicted_speedup_wall"), ".3f"),
                          pct(f.get("error_wall")), fmt(f.get("gpu_ms"), ".2f"),
                          fmt(f.get("measured_speedup_gpu"), ".3f"), fmt(f.get("predicted_speedup_gpu"), ".3f"),
                          pct(f.get("error_gpu")), fmt(f.get("kernels"), ".0f"), fmt(variant.get("peak_mib"), ".0f"),
                          f.get("term_off", ""), launch_cost(f))  # fmt: skip
    out.print(table)
    out.print(
        "err: measured ÷ predicted − 1; term off: the step-model term (host or GPU saving) that missed most; "
        "µs/fused launch: host time per fused launch, the step model's → what the measurement implies",
        style="dim",
    )


def floor_line(name: str, phase: dict) -> str:
    """A decode phase's weight-streaming floor beside its unprofiled step: how far eager decode is from the least a
    step can take on this device ('' for other phases, or without a measured copy bandwidth)."""
    floor = phase.get("weight_floor") or {}
    if not floor.get("ms"):
        return ""
    step = phase.get("wall_ms_per_step_unprofiled") or phase.get("wall_ms_per_step")
    times = f"; eager runs at {step:.2f} ms/step, {step / floor['ms']:.2f}× the floor" if step else ""
    return (f"{name}: weight-streaming floor {floor['ms']:.2f} ms/step ({floor['bytes'] / 1e9:.2f} GB of weights and "
            f"KV cache at {floor['copy_gbps']:.0f} GB/s){times}")  # fmt: skip


def print_compiled(result: dict) -> None:
    """A one-forward workload's forward beside torch.compile and fused + compile (`apply.forward_compile`): wall ms
    (median of the interleaved rounds), × eager, first call, peak memory and each compiled forward's check."""

    def fmt(value: object, spec: str) -> str:
        return "—" if value is None or value != value else format(value, spec)

    table = Table(title=f"the forward beside torch.compile ({result.get('mode')}; medians of interleaved rounds)")
    for col in ("variant", "wall ms", "× eager", "first call s", "peak MiB", "check"):
        table.add_column(col, justify="left" if col in ("variant", "check") else "right",
                         overflow="fold" if col == "check" else "ellipsis")  # fmt: skip
    for name, row in result.get("variants", {}).items():
        table.add_row(name, fmt(row.get("wall_ms"), ".2f"), fmt(row.get("speedup_vs_eager"), ".3f"),
                      fmt(row.get("first_call_s"), ".1f"), fmt(row.get("peak_mib"), ".0f"),
                      ("passed: " if row.get("passed") else "not timed: ") + (row.get("reason") or ""))  # fmt: skip
    out.print(table)
    out.print(f"fused + compile vs torch.compile {fmt(result.get('fused_compile_vs_compile'), '.3f')}×")


def print_graphs(result: dict) -> None:
    """The `--graphs` table: each variant's decode ms/token, tokens/s, GPU time and kernels of one profiled replay,
    × the weight-streaming floor, × eager, the step model's prediction, first call, peak memory and its
    teacher-forced check; the predicted vs measured gains; then where the fused step's time goes, kernel by kernel."""

    def fmt(value: object, spec: str) -> str:
        return "—" if value is None or value != value else format(value, spec)

    def pct(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:+.0f}%"

    floor = result.get("floor") or {}
    table = Table(title=f"decode step in a CUDA graph (weight-streaming floor {fmt(floor.get('ms'), '.2f')} ms/token: "
                        f"{fmt((floor.get('bytes') or 0) / 1e9, '.2f')} GB at {fmt(floor.get('copy_gbps'), '.0f')} "
                        "GB/s)")  # fmt: skip
    cols = ("variant", "ms/token", "tokens/s", "GPU ms", "kernels", "gap µs", "× floor", "× eager", "predicted ms",
            "err", "first call s", "peak MiB", "check")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("variant", "check") else "right",
                         overflow="fold" if col == "check" else "ellipsis")  # fmt: skip
    table.add_row("eager (unpatched)", fmt(result.get("eager_ms_per_token"), ".2f"), *[""] * 5, "1.000",
                  *[""] * 5)  # fmt: skip
    for name, row in result.get("variants", {}).items():
        replayed = row.get("replay") or {}
        table.add_row(name, fmt(row.get("ms_per_token"), ".2f"), fmt(row.get("tokens_per_s"), ".0f"),
                      fmt(row.get("gpu_ms_per_step"), ".2f"), fmt(row.get("kernels_per_step"), ".0f"),
                      fmt(replayed.get("gap_us_per_kernel"), ".2f"),
                      fmt(row.get("x_floor"), ".2f"), fmt(row.get("speedup_vs_eager"), ".3f"),
                      fmt(row.get("predicted_ms"), ".2f"), pct(row.get("error_vs_predicted")),
                      fmt(row.get("first_call_s"), ".1f"), fmt(row.get("peak_mib"), ".0f"),
                      ("passed: " if row.get("passed") else "not timed: ") + (row.get("reason") or ""))  # fmt: skip
    out.print(table)
    pred = result.get("predicted") or {}
    share = fmt(pred.get("cuda_graph_share_unfused"), ".0%")
    out.print(f"graph alone vs eager: measured {fmt(result.get('graph_vs_eager'), '.3f')}×, predicted "
              f"{fmt(pred.get('graph_vs_eager'), '.3f')}× (cuda_graph_share {share} of the eager step), error "
              f"{pct(result.get('error_graph_vs_eager'))}")  # fmt: skip
    out.print(f"fused + graph vs graph alone: measured {fmt(result.get('fused_vs_graph'), '.3f')}×, predicted "
              f"{fmt(pred.get('fused_graph_vs_graph'), '.3f')}×, error {pct(result.get('error_fused_vs_graph'))}; "
              f"fused + graph vs torch.compile {fmt(result.get('fused_vs_compile'), '.3f')}× "
              f"(compile {fmt(result.get('compile_seconds'), '.0f')} s); fused + compile vs torch.compile "
              f"{fmt(result.get('fused_compile_vs_compile'), '.3f')}×")  # fmt: skip
    out.print("predicted ms: the profiled GPU time per step (less the fusions' saving) + kernels × "
              f"{fmt(pred.get('graph_gap_us'), '.2f')} µs, the device's idle time between two kernels of a "
              "replayed graph; err: measured ÷ predicted − 1; GPU ms, kernels, gap µs: one profiled replay",
              style="dim")  # fmt: skip
    from fusionscope.apply.cudagraph_skips import skip_lines
    from fusionscope.apply.step_drift import drift_line

    for line in skip_lines(result):
        out.print(line, style="yellow")
    if drift := drift_line(result.get("step_drift")):
        out.print(drift, style="yellow")
    for name in ("fused + graph", "graph"):
        down = ((result.get("variants", {}).get(name) or {}).get("replay") or {}).get("breakdown")
        if down and down.get("rows"):
            print_breakdown(name, down)
            break
    if result.get("timing_note"):
        out.print(result["timing_note"], style="dim")


def print_breakdown(name: str, down: dict, top: int = 15) -> None:
    """Where one replayed step's kernel time goes: per launching op and kernel, µs per step, share, achieved rate and
    its share of the roof."""

    def fmt(value: object, spec: str) -> str:
        return "—" if value is None or value != value else format(value, spec)

    costed = fmt(down.get("matched_share"), ".0%")
    table = Table(title=f"{name}: one replayed step, kernel by kernel ({fmt(down.get('total_us'), '.0f')} µs of "
                        f"kernels; {costed} costed from the same step run eagerly)")  # fmt: skip
    for col in ("launching op", "kernel", "module", "×", "µs", "share", "GB/s", "% copy", "TFLOP/s", "% peak", "class"):
        table.add_column(col, justify="left" if col in ("launching op", "kernel", "module", "class") else "right",
                         overflow="ellipsis", max_width=48 if col == "kernel" else None)  # fmt: skip
    for row in down["rows"][:top]:
        table.add_row(row["op"], short_kernel_name(row["kernel"]), row.get("module") or "", str(row["count"]),
                      fmt(row["us"], ".0f"),
                      fmt(row["share"], ".1%"), fmt(row["achieved_gbps"], ".0f"), fmt(row["frac_bandwidth"], ".0%"),
                      fmt(row["achieved_tflops"], ".1f"), fmt(row["frac_compute"], ".0%"),
                      row.get("bound") or "")  # fmt: skip
    out.print(table)


def launch_cost(figures: dict) -> str:
    """`model→implied` host µs per fused launch (see `apply.run.phase_figures`), or empty."""
    model, implied = figures.get("model_us_per_fused_launch"), figures.get("implied_us_per_fused_launch")
    return f"{model:.0f}→{implied:.0f}" if model is not None and implied is not None else ""


@app.command()
def analyze(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="a torch.profiler trace file (.json or .json.gz); a folder of rank traces; several "
            "trace files, one per rank",
            show_default=False,
        ),
    ],
    out_dir: OutOpt = None,
    device: Annotated[
        str | None, typer.Option(help="GPU name whose roofs to use (default: the trace's); cpu: this machine's CPU")
    ] = None,
    execution_trace: Annotated[
        Path | None,
        typer.Option(help="PyTorch's execution trace of the same run (default: <trace name>.et.json[.gz] beside it)"),
    ] = None,
) -> None:
    """Analyse a trace another program captured, or per-rank traces (a folder of them, or several files): kernels,
    phases, classes, the fusion catalogue, the cross-rank figures and a report, without re-running anything."""
    from fusionscope.analyze import analyze as run_analyze

    t0 = time.perf_counter()
    path: Path | list[Path] = paths[0] if len(paths) == 1 else list(paths)
    run = run_with_progress("analysing", run_analyze, path=path, out=out_dir, device=device,
                            execution_trace=execution_trace)  # fmt: skip
    print_summary(run.summary)
    for line in run.summary["missing"]:
        out.print(f"not in the trace: {line}", style="dim")
    out.print(f"report: {run.report_path}   ({time.perf_counter() - t0:.1f} s in all)")


def main() -> None:
    """Console-script entry point."""
    app()
