"""`analyze()`: the analysis `profile` makes, on a torch.profiler / Kineto trace someone else's program captured.

It enters the pipeline at the trace (`trace_events`: the Timeline `trace.load_timeline` builds, from the document
`read_trace` decoded once → `analysis.kernel_table` → `classify` →
`analysis.summarize_phases`), on a CPU, without running anything of the program. A trace holds less than a
fusionscope capture: no unprofiled step times, no dataflow (tensor identities), perhaps no shapes, no
`ProfilerStep#N` markers or `fusionscope.phase:<name>` ranges, no measured roofs. What is absent is filled by the
plainest stand-in (the whole trace as one step; one phase, `trace`; the GPU's datasheet when no measured roofs of
it are cached) and listed in summary.json's `missing`, so no figure pretends to more than the trace holds.

A folder of per-rank traces (or a list of files) is analysed rank by rank, each exactly as a single file is;
`phases` holds the lowest rank's figures and `ranks` every rank's plus the cross-rank ones (`fusionscope.ranks`:
steps, straggler, communication) and HTA's GPU idle time and launch statistics where HTA has data.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from fusionscope import analysis, datasheets, merged_ranks, ranks, roofline, trace_events, trace_pool
from fusionscope.errors import UsageError
from fusionscope.markers import MODULE_PREFIX
from fusionscope.run_folder import (
    SCHEMA_VERSION,
    Run,
    check_out_dir,
    command_line,
    default_out_dir,
    finish_run_folder,
    staged_dir,
)
from fusionscope.table_writer import tables_beside, writer_for
from fusionscope.trace import GPU_CATS, Timeline
from fusionscope.trace_events import distinct_objects
from fusionscope.trace_fields import to_int
from fusionscope.trace_pool import collector_paused

TRACE_PHASE = "trace"  # the one phase of a trace without fusionscope.phase ranges
TRACE_COPY = "trace.json.gz"  # the run folder's copy, named as `profile` names its trace
CPU_DEVICE = "cpu"  # --device cpu: this machine's CPU roofs (measured on first use, as `profile` does)
EVENT_CATS = ("cpu_op", "kernel")

MISSING_UNPROFILED_GPU = "unprofiled step times (the regime is judged against the profiled step)"
MISSING_UNPROFILED_CPU = "unprofiled step times (the figures are the profiled step's)"
MISSING_DATAFLOW = (
    "tensor identities: the fusion catalogue matched on op order, shapes and module nesting instead "
    '(basis "op order", confidence lowered; an execution trace beside the trace gives exact dataflow)'
)
MISSING_ROOFS_FUSED = "device roofs: fusions are counted and timed now, their fused time is not estimated"
ORDER_REASON = "edges inferred from op order and shapes (the trace holds no tensor identities)"
MISSING_SHAPES = (
    "recorded shapes (record_shapes=True): ops.csv's input_dims, input_type and concrete_inputs hold none, so no op "
    "has a bytes/FLOPs model (kernels.csv's flops, bytes, dtype, intensity and achieved rates are empty but for "
    "copies and memsets) and the fusion catalogue has no dataflow edges to match on (kernels already fused are "
    "still recognised by name)"
)
MISSING_STACKS = (
    "Python call stacks (with_stack=True): no python_function events; no figure here reads them (module paths "
    "come from nn.Module ranges), so no column is left empty for their lack"
)
MISSING_UNLAUNCHED = (
    "the launches of {n} GPU events (launched before the profiler started, or by calls it did not record): they are "
    "in kernels.csv, joined to an op by their External id where the trace holds it, else to no op, step or phase"
)
UNFILLED_PREFIX = "columns no row could fill: "
STACK_CATS = ("python_function",)  # torch.profiler(with_stack=True) writes the Python frames as these events
MISSING_STEPS = "ProfilerStep markers: the whole trace is one step"
MISSING_PHASES = f'fusionscope.phase ranges: the whole trace is one phase, "{TRACE_PHASE}"'
MISSING_MODULES = "nn.Module ranges: kernels and ops carry no module path"
MISSING_MODULE_NAMES = (
    "nn.Module ranges: module paths are the Python tracer's module calls (with_stack=True), named by class and "
    "instance (`LlamaModel_0.LlamaDecoderLayer_1.LlamaMLP_1`), not by attribute (`model.layers.1.mlp`)"
)


@dataclass(frozen=True)
class TraceFacts:
    """What the trace file says beyond its events: the GPU its kernels ran on (Kineto's `deviceProperties`)."""

    path: Path
    gpu_name: str | None
    device_kind: str  # "cuda" when it holds GPU kernels, copies or memsets, else "cpu" (as `trace.Timeline` says)
    has_stacks: bool = False  # Python frames recorded (`with_stack=True`: python_function events)


def analyze(
    path: str | Path | list[str | Path],
    out: str | Path | None = None,
    device: str | None = None,
    on_stage: Callable[[str], None] | None = None,
    execution_trace: str | Path | None = None,
) -> Run:
    """Analyse one trace file (`.json` or `.json.gz`) and write its run folder: kernels.csv, ops.csv,
    opportunities.csv, summary.json (with `missing`), report.html and a copy of the trace.

    `device` names the GPU whose roofs classify the kernels (default: the one the trace names); `"cpu"` takes this
    machine's CPU roofs for a CPU-only trace. `execution_trace` is PyTorch's execution trace of the same run (found
    on its own when named `<trace name>.et.json[.gz]` beside the trace): its tensor identities give the catalogue
    exact dataflow. A folder or a list of files is a multi-rank trace (`analyze_ranks`), and so is one file that a
    merge tool filled with several ranks' events (`merged_ranks`). Bad input is a UsageError
    before anything is written."""
    t_start = time.perf_counter()
    with collector_paused():  # the whole run: its millions of small objects hold no cycles (`collector_paused`)
        if isinstance(path, list | tuple) or Path(path).is_dir():
            return analyze_ranks(path, out, device, on_stage)
        with tempfile.TemporaryDirectory(prefix="fusionscope-ranks-") as split_dir:
            files = merged_ranks.split(Path(path), Path(split_dir))
            if files is not None:  # one file holding several ranks (a merged trace): analysed as they were
                return analyze_ranks(files, out, device, on_stage, merged_from=Path(path))
        return _analyze_file(Path(path), out, device, on_stage, execution_trace, t_start)


def _analyze_file(path: Path, out: str | Path | None, device: str | None, on_stage: Callable[[str], None] | None,
                  execution_trace: str | Path | None, t_start: float) -> Run:  # fmt: skip
    """`analyze` of one trace file; `t_start` is when the call began (summary.json's wall time)."""
    note = on_stage or (lambda _msg: None)
    facts, doc = parse_trace(path, while_reading=import_catalogue)
    name = trace_name(facts.path)
    et_path = find_execution_trace(facts.path, name, execution_trace)
    out_dir = Path(out) if out is not None else default_out_dir(name)
    check_out_dir(out_dir)
    roofs, roof_missing = resolve_roofs(facts.gpu_name, facts.device_kind, device)
    note("joining kernels to ops and modules")
    with writer_for(len(doc.events)) as writer:
        parsed = parse_rank(facts, doc)
        del doc  # the decoded document is the largest thing in memory; the tables hold what is needed
        timeline, missing = fill_steps_and_phases(parsed.timeline, parsed.annotations)
        missing += unlaunched_missing(parsed)
        record_ids = parsed.record_ids if et_path is not None else {}
        with staged_dir(out_dir) as tmp, tables_beside(tmp, timeline.ops, kernel_rows(timeline), writer) as hand_over:
            note("costing and classifying kernels")
            kernels = classify(kernel_table(timeline), roofs)
            note("writing the tables (large ones by a second process, beside the next stages)")
            hand_over(kernels)
            note("matching the fusion catalogue (dataflow inferred from op order and shapes, or the execution trace)")
            found = match_catalogue(timeline, kernels, roofs, et_path, record_ids)
            summary = summarize(facts, name, timeline, kernels, roofs, [*missing, *roof_missing], found)
            finish_folder(tmp, summary, kernels, {TRACE_COPY: facts.path}, t_start, on_stage)
    return Run(out_dir=out_dir, summary=summary, kernels=kernels)


def import_catalogue() -> None:
    """Import what the catalogue and the summary need (a tenth of a second), while another thread inflates the
    trace. None of it imports torch, whose import took a second: the catalogue entries import it where they patch a
    model, `order_graph`'s dispatcher look-ups are answered from `aten_schema`, and `device` reads torch's version
    from its file (`tests/test_analyze_torch.py`)."""
    with collector_paused(False):
        from fusionscope import device, execution_trace, opportunities, order_graph, repeated_steps  # noqa: F401
        from fusionscope.fusions import fusions

        fusions()


def finish_folder(tmp: Path, summary: dict, kernels: pd.DataFrame, traces: dict[str, Path], t_start: float,
                  on_stage: Callable[[str], None] | None) -> None:  # fmt: skip
    """The rest of the staged run folder beside its tables: opportunities.csv, a copy of each trace (file name →
    source), summary.json and report.html."""
    from fusionscope import opportunities

    opportunities.opportunities_table(summary["opportunities"]).to_csv(
        tmp / "opportunities.csv", index=False, float_format="%.6g"
    )
    for file, source in traces.items():
        copy_trace(source, tmp / file)
    finish_run_folder(tmp, summary, kernels, t_start, on_stage)


@dataclass(frozen=True)
class CatalogueMatches:
    """The catalogue's matches on a trace's dataflow and their estimates (`opportunities.estimate_matches`)."""

    per_match: pd.DataFrame
    basis: str  # "op order" or "execution trace"
    nodes: int
    join_rate: float | None  # execution trace: share of nodes found in it
    execution_trace: Path | None


def find_execution_trace(trace: Path, name: str, given: str | Path | None) -> Path | None:
    """The execution trace to use: the one given (it must exist), else `<name>.et.json[.gz]` beside the trace."""
    from fusionscope import execution_trace

    if given is not None:
        if not Path(given).is_file():
            raise UsageError(f"execution trace not found: {given}")
        return Path(given)
    return execution_trace.find_beside(trace, name)


def parse_rank(facts: TraceFacts, doc: trace_events.TraceDocument) -> trace_events.Parsed:
    """The Timeline of a checked trace document (`trace_events`: the join `trace.load_timeline` makes, without
    decoding the file again), its rank from `distributedInfo` (0 without one); an empty one is refused."""
    info = doc.distributed_info
    rank = max(to_int(info.get("rank"), 0), 0) if isinstance(info, dict) else 0
    with collector_paused():
        parsed = trace_events.parse_events(doc.events, rank)
    if parsed.timeline.ops.empty and parsed.timeline.kernels.empty:
        raise UsageError(f"{facts.path} holds no profiled ops or kernels (an empty trace)")
    return parsed


def match_catalogue(timeline: Timeline, kernels: pd.DataFrame, roofs: dict | None, et_path: Path | None,
                    record_ids: dict[int, int]) -> CatalogueMatches:  # fmt: skip
    """Infer the dataflow (`fusionscope.order_graph`; exact edges from the execution trace where there is one),
    run the catalogue's matchers on it and estimate each match. Without roofs the fused time cannot be estimated:
    the matches are counted and timed now, and rejected with that reason (so no speedup is claimed). On inferred
    edges, each distinct step's ops are inferred and matched once (`repeated_steps`: the same table, faster).
    `record_ids`: op_id → the op's `Record function id` (what links it to the execution trace)."""
    from fusionscope import execution_trace, opportunities, order_graph, repeated_steps
    from fusionscope.fusions import Graph, find_matches

    bandwidth = {"copy_gbps": float("inf"), "tflops": {}} if roofs is None else roofs
    per_match, join_rate = pd.DataFrame(), None
    with collector_paused():
        repeated = None if et_path is not None else repeated_steps.match(timeline.ops, kernels, bandwidth,
                                                                          timeline.device_kind)  # fmt: skip
        if repeated is not None:  # the same table, each distinct step's ops inferred and matched once
            per_match, count = repeated
            return _with_roofs(CatalogueMatches(per_match, order_graph.BASIS_ORDER, count, None, None), roofs)
        nodes = order_graph.infer_dataflow(timeline.ops, timeline.device_kind)
        if et_path is not None:
            nodes = execution_trace.exact_dataflow(nodes, timeline.ops, record_ids, execution_trace.load(et_path))
            join_rate = nodes.attrs["join_rate"]
        matches = find_matches(Graph(nodes)) if len(nodes) else []
        if matches:
            per_match = opportunities.estimate_matches(matches, nodes, timeline.ops, kernels, bandwidth)
    found = CatalogueMatches(per_match, nodes.attrs.get("basis", order_graph.BASIS_ORDER), len(nodes), join_rate,
                             et_path)  # fmt: skip
    return _with_roofs(found, roofs)


def _with_roofs(found: CatalogueMatches, roofs: dict | None) -> CatalogueMatches:
    """Without roofs the fused time is not estimated: each match not already rejected is, with that reason."""
    per_match = found.per_match
    if roofs is None and len(per_match):
        per_match["rejected"] = per_match["rejected"].where(per_match["rejected"] != "", MISSING_ROOFS_FUSED)
    return found


def with_basis(rows: list[dict], found: CatalogueMatches, roofs: dict | None) -> list[dict]:
    """Opportunity rows with their `basis`; on inferred edges a confidence one level lower (high → medium) and why;
    without roofs no fused figures."""
    from fusionscope.order_graph import BASIS_ORDER

    out = []
    for row in rows:
        row = {**row, "basis": found.basis}
        if found.basis == BASIS_ORDER and row["confidence"] != "low":
            row["confidence"] = "medium"
            row["reason"] = f"{ORDER_REASON}; {row['reason']}"
        if roofs is None:
            row.update(t_fused_us=None, saved_us=None, bytes_fused=None, speedup_gpu=None, speedup_wall=None)
        out.append(row)
    return out


def read_trace(path: Path) -> TraceFacts:
    """Refuse, as one UsageError each, a missing path, a folder, a name that is not .json/.json.gz, a damaged gzip,
    text that is not JSON, JSON that is not a profiler trace and a trace without ops or kernels; else return what
    the file says about its GPU. The file is read whole once here: HTA's own errors on such files are a traceback
    or a log line, not a reason."""
    return parse_trace(path)[0]


def read_bytes(path: Path) -> bytes:
    """The trace file's bytes, inflated when it is gzipped; a damaged gzip is a UsageError."""
    try:
        return gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise UsageError(f"cannot read {path}: truncated or damaged gzip ({exc})") from None


def parse_trace(path: Path, while_reading: Callable[[], object] | None = None, pooled: bool = True,
                ) -> tuple[TraceFacts, trace_events.TraceDocument]:  # fmt: skip
    """`read_trace`, also returning the decoded trace document (`trace_events.decode`: its events as columns).
    `while_reading` runs while another thread reads and inflates the file (zlib releases the GIL), on the other
    core; a gzipped file's events are then decoded as its text inflates (`trace_pool.read_document`; by worker
    processes for a large one where `pooled`, and then the document holds the columns the join takes, not the
    events)."""
    if not path.exists():
        raise UsageError(f"trace not found: {path}")
    if path.is_dir():
        raise UsageError(f"{path} is a folder: pass it to analyze() as a folder of per-rank traces")
    if not path.name.endswith((".json", ".json.gz")):
        raise UsageError(f"{path} is not a .json or .json.gz trace file")
    doc = None
    if path.name.endswith(".gz"):  # text that is not JSON: a UsageError here too
        doc = _decoded(path, lambda: trace_pool.read_document(path, while_reading, pooled))
    if doc is None:  # read whole, then decoded
        with ThreadPoolExecutor(max_workers=1) as pool:
            reading = pool.submit(read_bytes, path)
            if while_reading is not None:
                while_reading()
            raw = reading.result()
        doc = _decoded(path, lambda: trace_events.decode(raw))
        del raw
    events = doc.events
    if events is None:
        raise UsageError(f"{path} is not a torch.profiler trace (no traceEvents)")
    if not (events.complete() & events.cats.isin(EVENT_CATS)).any():
        raise UsageError(f"{path} holds no profiled ops or kernels (an empty trace)")
    used = events.kernel_devices()
    cats = set(events.cats.uniques.tolist())
    facts = TraceFacts(path=path, gpu_name=_gpu_name(doc.device_properties, used),
                       device_kind="cuda" if cats & set(GPU_CATS) else "cpu",
                       has_stacks=bool(cats & set(STACK_CATS)))  # fmt: skip
    return facts, doc


def _decoded(path: Path, decode: Callable[[], trace_events.TraceDocument]) -> trace_events.TraceDocument:
    """`decode()`, with the collector paused; text that is not JSON is a UsageError."""
    try:
        with collector_paused():
            return decode()
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        raise UsageError(f"{path} is not JSON") from None


def _gpu_name(properties: object, devices: list) -> str | None:
    """The name of the device most kernels ran on (`devices`: each kernel's `args.device`, None without one ↔
    `deviceProperties[].id`); the first listed device when kernels carry no id; None for a CPU-only trace."""
    listed = properties if isinstance(properties, list) else []
    named = [p for p in listed if isinstance(p, dict) and p.get("name")]
    used = Counter()  # ROCm writes ids as hex strings: "0x0"; each distinct value read once
    try:
        counts = Counter(devices)
    except TypeError:  # a list or dict among them
        counts = Counter(map(_hashable, devices))
    for value, count in counts.items():
        used[None if value is None else to_int(value)] += count
    if not named or not used:
        return None
    by_id = {to_int(p.get("id")): str(p["name"]) for p in named}
    return next((by_id[d] for d, _ in used.most_common() if d in by_id), str(named[0]["name"]))


def _hashable(value: object) -> object:
    """A device argument as a Counter key: a list or dict (no id a number reads) as its repr."""
    return repr(value) if isinstance(value, list | dict) else value


def trace_name(path: Path) -> str:
    """`worker0.1733.pt.trace.json.gz` → `worker0.1733`: the file name less Kineto's and fusionscope's suffixes."""
    name = path.name.removesuffix(".gz").removesuffix(".json")
    return name.removesuffix(".trace").removesuffix(".pt") or name


def fill_steps_and_phases(timeline: Timeline, annotations: pd.DataFrame | None = None) -> tuple[Timeline, list[str]]:
    """Give a trace without `ProfilerStep#N` markers one step spanning all its events, and a trace without
    `fusionscope.phase` ranges phases of its own: a training trace (a backward pass or an optimizer step in it,
    `fusionscope.training`) `forward`, `backward` and `optimizer`, any other one phase, `trace`, holding every event
    inside a step (events outside every step stay in the tables, in no phase, as in `profile`). `annotations`: the
    trace's user_annotation ranges (`trace_events.Parsed`). Returns the new Timeline and what was filled in: its
    tables are copies where something is filled in, else the given ones (at a million events the copies took a
    tenth of a second, for nothing where the trace has its own steps and phases)."""
    from fusionscope import training

    ops, kernels, steps = timeline.ops, timeline.kernels, timeline.steps
    if steps.empty or not ((steps["phase"] != "").any() or (ops["phase"] != "").any()):
        ops, kernels, steps = ops.copy(), kernels.copy(), steps.copy()
    missing: list[str] = []
    if steps.empty:
        timed = [frame for frame in (ops, kernels) if len(frame)]
        starts = pd.concat([frame["ts_us"].astype(float) for frame in timed])
        ends = pd.concat([(frame["ts_us"] + frame["dur_us"]).astype(float) for frame in timed])
        rank = int(ops["rank"].iat[0]) if len(ops) else 0
        steps = pd.DataFrame({"rank": [rank], "step": [0], "phase": [""], "ts_us": [starts.min()],
                              "dur_us": [ends.max() - starts.min()]})  # fmt: skip
        ops["step"], kernels["step"] = 0, 0
        missing.append(MISSING_STEPS)
    own_phases = (steps["phase"] != "").any() or (ops["phase"] != "").any()
    if not own_phases and training.is_training(ops, annotations):
        filled = Timeline(device_kind=timeline.device_kind, ops=ops, kernels=kernels, steps=steps)
        timeline = training.split_training(filled, annotations)
        ops, kernels, steps = timeline.ops, timeline.kernels, timeline.steps
    elif not own_phases:
        steps["phase"] = TRACE_PHASE
        ops.loc[ops["step"] >= 0, "phase"] = TRACE_PHASE
        kernels.loc[kernels["step"] >= 0, "phase"] = TRACE_PHASE
        missing.append(MISSING_PHASES)
        timed = kernels if timeline.device_kind == "cuda" else ops
        outside = int((timed["step"] < 0).sum())
        if outside:
            what = "kernels" if timeline.device_kind == "cuda" else "ops"
            missing.append(f"{outside} {what} outside every ProfilerStep range: in kernels.csv, in no phase")
    if not (ops["module"].fillna("") != "").any():
        missing.append(MISSING_MODULES)
    elif annotations is not None and not annotations["name"].astype(str).str.startswith(MODULE_PREFIX).any():
        missing.append(MISSING_MODULE_NAMES)  # the paths came from the Python tracer (`trace._cpu_events`)
    filled = Timeline(device_kind=timeline.device_kind, ops=ops, kernels=kernels, steps=steps)
    return filled, missing


def unlaunched_missing(parsed: trace_events.Parsed) -> list[str]:
    """The `missing` line for GPU events whose launch is not in the trace (`trace_events._unlaunched`), if any."""
    return [MISSING_UNLAUNCHED.format(n=parsed.unlaunched)] if parsed.unlaunched else []


NO_VALUE = ("", "-1", "[]")  # what a column holds where the trace had nothing: HTA's defaults (and -1, NaN, None)


def unfilled_columns(kernels: pd.DataFrame, ops: pd.DataFrame) -> dict[str, list[str]]:
    """Per table written (kernels.csv, ops.csv), the columns no row has a value in: each value empty, NaN, None,
    -1 or one of HTA's defaults for an argument the trace did not record (`"-1"`, `"[]"`, an empty list)."""

    def empty(column: pd.Series) -> bool:
        values = column.to_numpy()
        if values.dtype.kind in "iu":
            return bool((values == -1).all())
        if values.dtype.kind == "f":
            return bool((np.isnan(values) | (values == -1)).all())
        return values.dtype.kind == "O" and all(map(_no_value, values.tolist()))

    return {name: [str(c) for c in frame.columns if len(frame) and empty(frame[c])]
            for name, frame in (("kernels.csv", kernels), ("ops.csv", ops))}  # fmt: skip


def _no_value(value: object) -> bool:
    if value is None or (isinstance(value, list | tuple) and not value):
        return True
    if isinstance(value, str):
        return value in NO_VALUE
    return isinstance(value, int | float) and not isinstance(value, bool) and (value != value or value == -1)


def kernel_rows(timeline: Timeline) -> int:
    """The rows `kernel_table` will have: one per kernel, on CPU timelines one per op."""
    return len(timeline.kernels) if timeline.device_kind == "cuda" else len(timeline.ops)


def kernel_table(timeline: Timeline) -> pd.DataFrame:
    """`analysis.kernel_table`, with the ops no cost model knows in category `other` on CPU timelines too (the GPU
    path already does this): without shapes every op is such an op, and a NaN category is no JSON."""
    kernels = analysis.kernel_table(timeline)
    kernels["category"] = kernels["category"].fillna("other")
    return kernels


def resolve_roofs(gpu_name: str | None, device_kind: str, device: str | None) -> tuple[dict | None, list[str]]:
    """The roofs to classify against, as summary.json's `roofs` (`source`: `cache` or `datasheet`), or None; and
    what is missing. Order: measured roofs of the named device from the roofs cache, else (GPU traces) the
    datasheet of that GPU, else none. `device` overrides the name; `cpu` takes this machine's CPU roofs."""
    if device is not None and device.strip().lower() == CPU_DEVICE:
        if device_kind == "cuda":
            raise UsageError("--device cpu names this machine's CPU, but the trace ran kernels on a GPU")
        import torch

        from fusionscope.device import get_ceilings

        return get_ceilings(torch.device("cpu")).to_json(), []
    name = device or (gpu_name if device_kind == "cuda" else None)
    no_roofs = "so kernels are `latency` (under 10 µs) or `unmodeled`"
    if not name:
        if device_kind == "cuda":
            return None, [f"device roofs: the trace names no GPU (--device NAME picks one), {no_roofs}"]
        hint = "--device cpu takes this machine's, --device NAME cached ones"
        return None, [f"device roofs: a CPU trace does not name its CPU ({hint}), {no_roofs}"]
    cached = cached_roofs(name, device_kind)
    if cached is not None:
        return cached, []
    sheet = datasheets.lookup(name) if device_kind == "cuda" else None
    if sheet is not None:
        roofs = {"kind": "cuda", "name": name, "copy_gbps": sheet["gbps"], "read_heavy_gbps": sheet["gbps"],
                 "tflops": dict(sheet["tflops"]), "launch_us": None, "aten_op_host_us": None, "datasheet": sheet,
                 "measured_at": None, "versions": {}, "source": "datasheet"}  # fmt: skip
        return roofs, [f"measured roofs of {name}: kernels are classed against its datasheet peaks, which kernels "
                       "reach less of than measured roofs; host costs per launch and per op are unknown"]  # fmt: skip
    known = "none cached and no datasheet" if device_kind == "cuda" else "none cached"
    return None, [f"device roofs: {known} for '{name}', {no_roofs}"]


def cached_roofs(name: str, kind: str) -> dict | None:
    """The newest measured roofs in the roofs cache for a device of this name and kind, whatever the software
    versions they were measured under (a trace does not say which torch captured it), or None."""
    from fusionscope.device import ROOFS_VERSION, DeviceCeilings, cache_dir

    best: DeviceCeilings | None = None
    wanted = datasheets.normalize(name)
    for file in sorted((cache_dir() / "roofs").glob(f"*_v{ROOFS_VERSION}.json")):
        try:
            ceilings = DeviceCeilings(**json.loads(file.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # a damaged or older entry is no roof
        same = datasheets.normalize(ceilings.name) == wanted and ceilings.kind == kind
        if same and (best is None or ceilings.measured_at > best.measured_at):
            best = ceilings
    if best is None:
        return None
    roofs = {**best.to_json(), "source": "cache"}
    if roofs.get("datasheet") is None and kind == "cuda":
        roofs["datasheet"] = datasheets.lookup(name)
    return roofs


def classify(kernels: pd.DataFrame, roofs: dict | None) -> pd.DataFrame:
    """The kernel table classified against the roofs, or without roofs by the 10 µs rule alone
    (`roofline.classify_against`)."""
    return roofline.classify_against(kernels, roofs)


def summarize(facts: TraceFacts, name: str, timeline: Timeline, kernels: pd.DataFrame, roofs: dict | None,
              missing: list[str], found: CatalogueMatches) -> dict:  # fmt: skip
    """summary.json: `profile`'s keys where the trace holds the facts, plus `trace` (where it came from),
    `dataflow` (how the catalogue's dataflow was had: `basis`, `nodes`, `join_rate`) and `missing` (what the trace
    did not hold, so is not in the analysis)."""
    from fusionscope import opportunities
    from fusionscope.device import software_versions

    gpu = timeline.device_kind == "cuda"
    has_shapes = any(isinstance(d, list) and len(d) > 0 for d in timeline.ops["input_dims"].tolist())
    has_modules = bool((timeline.ops["module"].fillna("") != "").any())
    exact = found.execution_trace is not None
    missing = [MISSING_UNPROFILED_GPU if gpu else MISSING_UNPROFILED_CPU, *([] if exact else [MISSING_DATAFLOW]),
               *missing]  # fmt: skip
    if not has_shapes:
        missing.append(MISSING_SHAPES)
    if not facts.has_stacks:
        missing.append(MISSING_STACKS)
    if roofs is None:
        missing.append(MISSING_ROOFS_FUSED)
    unfilled = unfilled_columns(kernels, timeline.ops)
    if any(unfilled.values()):
        missing.append(UNFILLED_PREFIX + "; ".join(f"{name} {', '.join(cols)}" for name, cols in unfilled.items()
                                                   if cols))  # fmt: skip
    ops_per_step = timeline.ops.groupby("phase").size() / timeline.steps.groupby("phase").size()
    phases = analysis.summarize_phases(kernels, timeline.steps, {}, timeline.device_kind,
                                       {str(k): float(v) for k, v in ops_per_step.dropna().items()})  # fmt: skip
    summary = {
        "schema": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "model": {"source": "trace", "name": name, "dtype": dominant_dtype(timeline.ops)},
        "device": {"kind": timeline.device_kind, "name": facts.gpu_name or (roofs or {}).get("name")},
        "versions": software_versions(),
        "trace": {
            "path": str(facts.path.resolve()),
            "file": TRACE_COPY,
            "execution_trace": str(found.execution_trace.resolve()) if exact else None,
            "recorded": {"shapes": has_shapes, "stacks": facts.has_stacks, "modules": has_modules},
            "unfilled": unfilled,
        },
        "roofs": roofs,
        "cost_coverage": analysis.cost_coverage(kernels),
        "phases": phases,
        "dataflow": {"basis": found.basis, "nodes": found.nodes, "join_rate": found.join_rate},
    }
    rows, summary["cumulative"] = opportunities.summarize_opportunities(found.per_match, phases, roofs or {})
    summary["opportunities"] = with_basis(rows, found, roofs)
    summary["missing"] = missing
    summary["fused_kernels"] = fused_kernel_status(kernels, summary["opportunities"])
    return summary


def fused_kernel_status(kernels: pd.DataFrame, opportunities: list[dict]) -> dict:
    """What the trace already runs fused: each recognised kernel (Inductor's generated kernels by the ops their
    names list, serving engines' and libraries' fused kernels by name; `fusionscope.fused_kernels`) and, per
    catalogue entry and phase, whether it is active, missing (an opportunity was found) or not found."""
    from fusionscope.fused_kernels import catalogue_status, recognise

    if kernels.empty or "name" not in kernels:
        return {"recognised": [], "catalogue": []}
    recognised = recognise(kernels)
    status = catalogue_status(recognised, opportunities)
    return {"recognised": recognised.to_dict("records"),
            "catalogue": [{k: v for k, v in row.items() if k != "opportunity"} for row in status]}  # fmt: skip


def dominant_dtype(ops: pd.DataFrame) -> str | None:
    """The float dtype most ops compute in (`roofline.op_dtype` of their recorded input types); None without
    shapes."""
    listed = ops["input_type"].to_numpy()
    codes, first = distinct_objects(listed)  # by identity: `trace_events` shares equal lists
    per_object = np.empty(len(first), dtype=object)
    per_object[:] = [roofline.op_dtype(listed[i]) for i in first.tolist()]
    dtypes = pd.Series(per_object[codes], dtype=object).dropna()
    return str(dtypes.mode().iat[0]) if len(dtypes) else None


def copy_trace(source: Path, target: Path) -> None:
    """Copy the trace into the run folder, gzipped as `profile`'s own trace is (Perfetto and HTA read both)."""
    if source.name.endswith(".gz"):
        shutil.copyfile(source, target)
        return
    with source.open("rb") as src, gzip.open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)


# --- a folder of per-rank traces -------------------------------------------------------------------------------

RANK_COPY = "trace-rank{rank}.json.gz"  # the run folder's copies of the other ranks' traces


@dataclass(frozen=True)
class RankTrace:
    """One rank's file, what it says about its device, and its intervals for the cross-rank figures."""

    rank: int
    facts: TraceFacts
    intervals: ranks.RankIntervals
    parsed: trace_events.Parsed


def analyze_ranks(
    paths: str | Path | list[str | Path],
    out: str | Path | None = None,
    device: str | None = None,
    on_stage: Callable[[str], None] | None = None,
    merged_from: Path | None = None,
) -> Run:
    """Analyse a folder of per-rank traces (its `.json`/`.json.gz` files) or a list of trace files: each rank as
    `analyze` analyses one file, then the cross-rank figures. kernels.csv and ops.csv hold every rank (`rank`
    column); `phases` and `opportunities` are the lowest rank's, `ranks` every rank's. Refused before anything is
    written: a folder without traces, ranks that ran on different devices, two files claiming the same rank.
    `merged_from`: the files are the ranks split out of this one merged trace (its name names the run)."""
    t_start = time.perf_counter()
    note = on_stage or (lambda _msg: None)
    files = rank_files(paths)
    traces = check_ranks([read_rank(f) for f in files])
    name = trace_name(merged_from) if merged_from is not None else ranks_name(paths, files)
    out_dir = Path(out) if out is not None else default_out_dir(name)
    check_out_dir(out_dir)
    first = traces[0]
    roofs, roof_missing = resolve_roofs(first.facts.gpu_name, first.facts.device_kind, device)
    summaries: dict[int, dict] = {}
    kernel_parts, op_parts = [], []
    for rt in traces:
        note(f"rank {rt.rank}: costing, classifying and matching the fusion catalogue")
        timeline, missing = fill_steps_and_phases(rt.parsed.timeline, rt.parsed.annotations)
        missing += unlaunched_missing(rt.parsed)
        kernels = classify(kernel_table(timeline), roofs)
        found = match_catalogue(timeline, kernels, roofs, None, {})
        summaries[rt.rank] = summarize(rt.facts, name, timeline, kernels, roofs, [*missing, *roof_missing], found)
        kernel_parts.append(kernels)
        op_parts.append(timeline.ops)
    kernels, ops = pd.concat(kernel_parts, ignore_index=True), pd.concat(op_parts, ignore_index=True)
    note("cross-rank figures (and HTA's idle time and launch statistics)")
    summary = summaries[first.rank]
    summary["ranks"] = ranks_summary(traces, summaries)
    if merged_from is not None:  # the split files are temporary: each rank's events came from the merged file
        summary["ranks"]["merged_from"] = str(merged_from.resolve())
        for entry in [*summary["ranks"]["files"].values(), summary["trace"]]:
            entry["path"] = summary["ranks"]["merged_from"]
    note("writing the tables")
    copies = {TRACE_COPY: first.facts.path, **{RANK_COPY.format(rank=rt.rank): rt.facts.path for rt in traces[1:]}}
    with staged_dir(out_dir) as tmp, tables_beside(tmp, ops, len(kernels)) as hand_over:
        hand_over(kernels)
        finish_folder(tmp, summary, kernels, copies, t_start, on_stage)
    return Run(out_dir=out_dir, summary=summary, kernels=kernels)


def rank_files(paths: str | Path | list[str | Path]) -> list[Path]:
    """The trace files of a folder (sorted, not recursive; execution traces, `*.et.json[.gz]`, are not ranks) or the
    given list; a folder without any is refused."""
    from fusionscope.execution_trace import ET_SUFFIXES

    if isinstance(paths, list | tuple):
        if not paths:
            raise UsageError("no trace files given")
        return [Path(p) for p in paths]
    folder = Path(paths)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz"))
                   and not p.name.endswith(ET_SUFFIXES))  # fmt: skip
    if not files:
        raise UsageError(f"{folder} holds no .json or .json.gz trace files")
    return files


def read_rank(path: Path) -> RankTrace:
    """A rank's file checked as a single trace is, its rank (`distributedInfo.rank`, 0 without one) and intervals."""
    facts, doc = parse_trace(path, pooled=False)  # the rank's intervals read every event (`EventColumns.dicts`)
    info = doc.distributed_info
    given = info.get("rank", 0) if isinstance(info, dict) else 0
    rank = to_int(given, -1) if not isinstance(given, bool) else -1
    if rank < 0:
        raise UsageError(f"{path}: distributedInfo.rank is {given!r}, not a rank number")
    parsed = parse_rank(facts, dataclasses.replace(doc, distributed_info={"rank": rank}))
    return RankTrace(rank=rank, facts=facts, intervals=ranks.rank_intervals(rank, doc.events.dicts()), parsed=parsed)


def check_ranks(traces: list[RankTrace]) -> list[RankTrace]:
    """Refuse two files claiming one rank and ranks that ran on different devices; return them in rank order."""
    seen: dict[int, Path] = {}
    for rt in traces:
        if rt.rank in seen:
            raise UsageError(f"{seen[rt.rank]} and {rt.facts.path} both claim rank {rt.rank}")
        seen[rt.rank] = rt.facts.path
    devices = {rt.rank: _device_label(rt.facts) for rt in traces}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"rank {r} on {d}" for r, d in sorted(devices.items()))
        raise UsageError(f"the ranks ran on different devices ({listed}): analyse them separately")
    return sorted(traces, key=lambda rt: rt.rank)


def _device_label(facts: TraceFacts) -> str:
    if facts.device_kind == "cpu":
        return "the CPU"
    return facts.gpu_name or "an unnamed GPU"


def ranks_name(paths: str | Path | list[str | Path], files: list[Path]) -> str:
    """The run's name: the folder's, or the first file's trace name with the number of ranks."""
    if isinstance(paths, list | tuple):
        return f"{trace_name(files[0])}-{len(files)}ranks"
    return Path(paths).resolve().name


def ranks_summary(traces: list[RankTrace], summaries: dict[int, dict]) -> dict:
    """summary.json's `ranks`: files, every rank's phases, the cross-rank figures and HTA's per-rank results."""
    per_rank = {rt.rank: ranks.step_figures(rt.intervals) for rt in traces}
    cross = ranks.cross_rank(per_rank, traces[0].intervals.source)
    files = {str(rt.rank): {"path": str(rt.facts.path.resolve()), "file": RANK_COPY.format(rank=rt.rank)}
             for rt in traces}  # fmt: skip
    files[str(traces[0].rank)]["file"] = TRACE_COPY
    has_kernels = {rt.rank: rt.facts.device_kind == "cuda" for rt in traces}
    return {
        "count": len(traces),
        "files": files,
        "phases": {str(rank): summary["phases"] for rank, summary in summaries.items()},
        **cross,
        "hta": hta_figures({rt.rank: rt.facts.path for rt in traces}, has_kernels),
    }


HTA_NO_KERNELS = "unavailable: no GPU kernels in this rank's trace"
HTA_NO_DATA = "unavailable: HTA returned no data"


def hta_figures(files: dict[int, Path], has_kernels: dict[int, bool]) -> dict[str, dict]:
    """Per rank, HTA's GPU idle time (by category, summed over streams) and kernel launch statistics, each with
    `source`: "hta", or only `source`: "unavailable: <reason>" (no kernels, no data, or HTA failed: on CPU-only
    traces HTA's GPU analyses raise or return empty frames, and it logs rather than raises its own errors)."""
    import logging
    import os

    os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")
    logging.getLogger("hta").setLevel(logging.CRITICAL)
    try:
        from hta.trace_analysis import TraceAnalysis

        resolved = {rank: str(path.resolve()) for rank, path in files.items()}
        analysis_ = TraceAnalysis(trace_files=resolved, trace_dir=str(next(iter(files.values())).resolve().parent))
    except Exception as exc:  # any HTA failure is a reason in the summary, never a crash
        failed = {"source": f"unavailable: HTA could not load the traces ({_reason(exc)})"}
        return {str(rank): {"idle_time": failed, "kernel_launches": failed} for rank in files}
    out = {}
    for rank in files:
        idle = _hta_call(lambda r=rank: analysis_.get_idle_time_breakdown(ranks=[r], visualize=False)[0], _idle)
        launch = _hta_call(
            lambda r=rank: analysis_.get_cuda_kernel_launch_stats(ranks=[r], visualize=False).get(r), _launches
        )
        if not has_kernels.get(rank):
            idle, launch = (f if f["source"] == "hta" else {"source": HTA_NO_KERNELS} for f in (idle, launch))
        out[str(rank)] = {"idle_time": idle, "kernel_launches": launch}
    return out


def _hta_call(call: Callable[[], pd.DataFrame | None], figures: Callable[[pd.DataFrame], dict]) -> dict:
    """One HTA analysis, its frame reduced by `figures`; an empty or absent frame is no data, an exception failed."""
    try:
        frame = call()
    except Exception as exc:  # see hta_figures
        return {"source": f"unavailable: HTA failed ({_reason(exc)})"}
    if frame is None or len(frame) == 0:
        return {"source": HTA_NO_DATA}
    return {"source": "hta", **figures(frame)}


def _idle(frame: pd.DataFrame) -> dict:
    by_category = frame.groupby("idle_category")["idle_time"].sum() / 1e3
    return {"streams": int(frame["stream"].nunique()), "idle_ms": {str(k): float(v) for k, v in by_category.items()}}


def _launches(frame: pd.DataFrame) -> dict:
    return {
        "launches": len(frame),
        "median_cpu_us": float(frame["cpu_duration"].median()),
        "median_gpu_us": float(frame["gpu_duration"].median()),
        "median_launch_delay_us": float(frame["launch_delay"].median()),
        "max_launch_delay_us": float(frame["launch_delay"].max()),
    }


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
