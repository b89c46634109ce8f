"""`fusionscope analyze` on traces unlike fusionscope's own: without shapes or stacks, with numbers written as hex or
as strings (ROCm), with GPU events whose launch is not in the trace or whose ids repeat; and short kernel names.

Every fixture here is derived in the test from a committed one (tests/data/tiny-llama-cuda.trace.json.gz, an H200
trace fusionscope captured) by rewriting its events the way another program's trace differs."""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from fusionscope import analysis, cli, merged_ranks, trace, trace_events
from fusionscope.analyze import (
    MISSING_SHAPES,
    MISSING_STACKS,
    UNFILLED_PREFIX,
    analyze,
)
from fusionscope.cli import app
from fusionscope.kernel_names import short_kernel_name
from fusionscope.trace_fields import float_array, int_array, to_float, to_int

DATA = Path(__file__).resolve().parent / "data"
TINY = DATA / "tiny-llama-cuda.trace.json.gz"
GPU_FIXTURES = [TINY, DATA / "llama-3.2-1b-cuda.trace.json.gz"]
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SHAPE_ARGS = ("Input Dims", "Input type", "Input Strides", "Concrete Inputs")
STACK_ARGS = ("Call stack", "Stack")  # older torch wrote the Python stack into an op's args
runner = CliRunner()


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def save(doc: dict, path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def gpu_events(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e.get("cat") in GPU_CATS and e.get("ph") == "X"]


# --- a trace without shapes or stacks -----------------------------------------------------------------------------


def without_shapes_or_stacks(doc: dict) -> dict:
    """The trace as `torch.profiler.profile(record_shapes=False, with_stack=False)` writes it."""
    doc = copy.deepcopy(doc)
    events = []
    for e in doc["traceEvents"]:
        if e.get("cat") == "python_function":
            continue
        args = e.get("args")
        if isinstance(args, dict):
            for key in (*SHAPE_ARGS, *STACK_ARGS):
                args.pop(key, None)
        events.append(e)
    doc["traceEvents"] = events
    doc["record_shapes"] = 0
    return doc


@pytest.fixture(scope="module")
def no_shapes_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, object, str]:
    folder = tmp_path_factory.mktemp("no-shapes")
    doc = without_shapes_or_stacks(load(TINY))
    path = save(doc, folder / "plain.trace.json.gz")
    result = runner.invoke(app, ["analyze", str(path), "--out", str(folder / "run")])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    summary = json.loads((folder / "run" / "summary.json").read_text())
    return doc, summary, result.stdout


def test_no_shapes_is_analysed_with_every_kernel(no_shapes_run: tuple, tmp_path: Path) -> None:
    doc, summary, _printed = no_shapes_run
    kernels = pd.read_csv(Path(summary["trace"]["path"]).parent / "run" / "kernels.csv")
    events = gpu_events(doc)
    assert len(kernels) == len(events)
    assert sorted(kernels["name"]) == sorted(e["name"] for e in events)  # full names in the CSV
    assert set(summary["phases"]) == {"prefill", "decode"}  # the timeline: steps and phases as with shapes
    assert summary["phases"]["decode"]["steps"] == 4
    assert summary["dataflow"]["basis"] == "op order" and summary["dataflow"]["nodes"] > 0
    # fused kernels are still recognised by name: HF's sdpa runs as cuDNN's fused attention kernel
    status = {(r["fusion"], r["phase"]): r["status"] for r in summary["fused_kernels"]["catalogue"]}
    assert status[("flash_attention", "decode")] == "active"


def test_no_shapes_names_what_it_could_not_fill(no_shapes_run: tuple) -> None:
    _doc, summary, printed = no_shapes_run
    assert MISSING_SHAPES in summary["missing"] and MISSING_STACKS in summary["missing"]
    assert summary["trace"]["recorded"] == {"shapes": False, "stacks": False, "modules": True}
    unfilled = summary["trace"]["unfilled"]
    assert {"input_dims", "input_type", "concrete_inputs"} <= set(unfilled["ops.csv"])
    assert "dtype" in unfilled["kernels.csv"] and "name" not in unfilled["kernels.csv"]
    line = next(m for m in summary["missing"] if m.startswith(UNFILLED_PREFIX))
    assert "ops.csv input_dims, input_type, concrete_inputs" in line
    # the terminal and the report say it too
    flat = " ".join(printed.split())
    assert "not in the trace: recorded shapes (record_shapes=True)" in flat
    assert "not in the trace: Python call stacks (with_stack=True)" in flat
    html = (Path(summary["trace"]["path"]).parent / "run" / "report.html").read_text(encoding="utf-8")
    assert "recorded shapes (record_shapes=True)" in html and "Python call stacks" in html
    assert "columns no row could fill" in html


def test_full_trace_names_no_unfilled_shape_columns(tmp_path: Path) -> None:
    doc = load(TINY)
    doc["traceEvents"].append({"ph": "X", "cat": "python_function", "name": "model.py(12): forward", "pid": 1,
                               "tid": 1, "ts": doc["traceEvents"][-1]["ts"], "dur": 1.0})  # fmt: skip
    run = analyze(save(doc, tmp_path / "stacks.trace.json.gz"), out=tmp_path / "run")
    s = run.summary
    assert s["trace"]["recorded"] == {"shapes": True, "stacks": True, "modules": True}
    assert MISSING_SHAPES not in s["missing"] and MISSING_STACKS not in s["missing"]
    assert not {"input_dims", "input_type", "concrete_inputs"} & set(s["trace"]["unfilled"]["ops.csv"])


# --- numbers as hex strings and as strings ------------------------------------------------------------------------

HEX_ARGS = ("stream", "correlation", "External id", "device", "Record function id", "context", "queued")


def as_rocm_writes_it(doc: dict) -> dict:
    """pid, tid and every id argument as hex strings (ROCm writes `"stream": "0x0"`), every tenth event's ts and
    dur as decimal strings, and a few shared-memory and register counts as decimal strings."""
    doc = copy.deepcopy(doc)
    for i, e in enumerate(doc["traceEvents"]):
        for key in ("pid", "tid"):
            if isinstance(e.get(key), int):
                e[key] = hex(e[key])
        args = e.get("args")
        if isinstance(args, dict):
            for key in HEX_ARGS:
                if isinstance(args.get(key), int) and not isinstance(args.get(key), bool):
                    args[key] = hex(args[key])
            for key in ("shared memory", "registers per thread"):
                if isinstance(args.get(key), int) and i % 3 == 0:
                    args[key] = str(args[key])
        if i % 10 == 0 and e.get("ph") == "X":
            e["ts"], e["dur"] = repr(e["ts"]), repr(e["dur"])
    for prop in doc.get("deviceProperties", []):
        prop["id"] = hex(prop["id"])
    return doc


def test_hex_and_string_numbers_give_the_same_kernel_table(tmp_path: Path) -> None:
    want = analyze(TINY, out=tmp_path / "original")
    doc = as_rocm_writes_it(load(TINY))
    assert any(isinstance(e.get("args", {}).get("correlation"), str) for e in gpu_events(doc))
    got = analyze(save(doc, tmp_path / "rocm.trace.json.gz"), out=tmp_path / "rocm")
    pd.testing.assert_frame_equal(got.kernels, want.kernels)
    written = pd.read_csv(tmp_path / "rocm" / "kernels.csv")
    pd.testing.assert_frame_equal(written, pd.read_csv(tmp_path / "original" / "kernels.csv"))
    assert got.summary["device"] == want.summary["device"] == {"kind": "cuda", "name": "NVIDIA H200"}
    assert got.summary["phases"] == want.summary["phases"]


def test_hex_strings_through_the_json_fallback_too(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = as_rocm_writes_it(load(TINY))
    raw = json.dumps(doc).encode()
    typed = trace_events.decode(raw)
    monkeypatch.setattr(trace_events, "msgspec", None)
    plain = trace_events.decode(raw)
    a = trace_events.parse_events(typed.events).timeline.kernels
    b = trace_events.parse_events(plain.events).timeline.kernels
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == len(gpu_events(doc))


def test_a_rocm_runtime_call_naming_its_stream_is_no_gpu_event() -> None:
    """hipLaunchKernel carries `stream`; it stays the launch its kernel is joined through, not a GPU event."""
    doc = load(TINY)
    for e in doc["traceEvents"]:
        if e.get("cat") == "cuda_runtime" and isinstance(e.get("args"), dict):
            e["args"]["stream"] = "0x0"
    parsed = trace_events.parse_events(doc["traceEvents"])
    want = trace_events.parse_events(load(TINY)["traceEvents"])
    pd.testing.assert_frame_equal(parsed.timeline.kernels, want.timeline.kernels)
    assert parsed.unlaunched == 0


@pytest.mark.parametrize(
    ("value", "as_int", "as_float"),
    [
        (7, 7, 7.0), ("7", 7, 7.0), (" 7 ", 7, 7.0), ("0x0", 0, 0.0), ("0x1F", 31, 31.0), ("-0x2", -2, -2.0),
        ("012", 12, 12.0), ("7.0", 7, 7.0), (7.0, 7, 7.0), ("12.5", -1, 12.5), (12.5, -1, 12.5),
        ("1e3", 1000, 1000.0), (None, -1, None), ("", -1, None), ("abc", -1, None), ([1], -1, None),
        (True, 1, 1.0), (2**70, -1, float(2**70)), (float("nan"), -1, None),
    ],
)  # fmt: skip
def test_trace_fields(value: object, as_int: int, as_float: float | None) -> None:
    assert to_int(value) == as_int
    got = to_float(value)
    assert math.isnan(got) if as_float is None else got == as_float, (value, got)


def test_trace_field_arrays() -> None:
    assert int_array([1, 2, 3]).tolist() == [1, 2, 3]
    assert int_array(["0x0", 5, None, "x", 7.0, "0x0"], -1).tolist() == [0, 5, -1, -1, 7, 0]
    assert int_array([[1], "1"], -1).tolist() == [-1, 1]  # unhashable values parsed one by one
    assert int_array([2**64, 1]).tolist() == [-1, 1]  # beyond int64
    floats = float_array([1, "2.5", None, "0x10"])
    assert floats[:2].tolist() == [1.0, 2.5] and math.isnan(floats[2]) and floats[3] == 16.0
    assert int_array(np.array([1, 2], dtype=object)).dtype == np.int64


def test_unreadable_times_drop_the_event_not_the_trace() -> None:
    doc = load(TINY)
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    ops[-1]["dur"] = "n/a"
    kernels = gpu_events(doc)
    kernels[0]["ts"] = {"oops": 1}
    frame = trace_events.events_frame(doc["traceEvents"])
    assert len(frame) == sum(e.get("dur") is not None and e.get("cat") not in (None, "Trace")
                             for e in doc["traceEvents"]) - 2  # fmt: skip


def test_merged_ranks_read_string_ranks() -> None:
    events = [{"args": {"rank": "0x1"}}, {"args": {"rank": "0"}}, {"args": {"rank": True}}, {"args": {"rank": "a"}}]
    assert merged_ranks.ranks_of(events) == {0, 1}


# --- every GPU event in the kernels table once ---------------------------------------------------------------------


def irregular(doc: dict) -> dict:
    """The trace with what HTA's negative-queue-length test trace holds: GPU events whose launch is not in the trace
    (launched before the profiler started), several kernels of one launch (repeated correlation ids), negative
    `queued` values and a GPU event with a negative correlation id."""
    doc = copy.deepcopy(doc)
    events = doc["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})]
    launched = {e["args"]["correlation"] for e in runtime}
    # 1. the first five launches vanish: their kernels stay, unlaunched
    dropped = {e["args"]["correlation"] for e in runtime[:5]}
    gone = {id(e) for e in runtime[:5]}
    events[:] = [e for e in events if id(e) not in gone]
    # 2. two kernels claim the correlation (and External id) of a third: one launch, three kernels
    shared = kernels[20]["args"]
    for k in kernels[21:23]:
        k["args"]["correlation"], k["args"]["External id"] = shared["correlation"], shared["External id"]
    # 3. negative queue lengths and a negative correlation
    for k in kernels[30:40]:
        k["args"]["queued"] = -3
    kernels[50]["args"]["correlation"] = -7
    assert dropped <= launched
    return doc


@pytest.mark.parametrize("source", GPU_FIXTURES, ids=[p.name.split(".")[0] for p in GPU_FIXTURES])
def test_every_gpu_event_once(source: Path) -> None:
    doc = load(source)
    for variant in (doc, irregular(doc)):
        parsed = trace_events.parse_events(variant["traceEvents"])
        kernels = analysis.kernel_table(parsed.timeline)
        events = gpu_events(variant)
        assert len(kernels) == len(events)
        assert kernels["kernel_id"].is_unique
        assert sorted(kernels["name"]) == sorted(e["name"] for e in events)
    assert parsed.unlaunched >= 5  # the last variant: the kernels of the five dropped launches (and the -7 one)


def test_irregular_trace_through_analyze(tmp_path: Path) -> None:
    doc = irregular(load(TINY))
    run = analyze(save(doc, tmp_path / "irregular.trace.json.gz"), out=tmp_path / "run")
    written = pd.read_csv(tmp_path / "run" / "kernels.csv")
    assert len(written) == len(run.kernels) == len(gpu_events(doc))
    assert any(line.startswith("the launches of ") for line in run.summary["missing"])


def test_an_index_0_event_is_no_launch() -> None:
    """HTA's `index_correlation` is 0 for a kernel whose launch is not in the trace; event 0 is no launch of it."""
    doc = load(TINY)
    events = doc["traceEvents"]
    first_op = next(i for i, e in enumerate(events) if e.get("cat") == "cpu_op")
    events.insert(0, events.pop(first_op))  # event 0: an op
    orphan = gpu_events(doc)[3]
    gone = next(e for e in events if e.get("cat") == "cuda_runtime"
                and e.get("args", {}).get("correlation") == orphan["args"]["correlation"])  # fmt: skip
    events.remove(gone)
    orphan["args"]["External id"] = -1  # nor joined by External id
    kernels = trace_events.parse_events(events).timeline.kernels
    lone = kernels[kernels["kernel_id"] == next(i for i, e in enumerate(events) if e is orphan)]
    assert len(lone) == 1 and lone["op_id"].iat[0] == -1 and lone["step"].iat[0] == -1
    assert lone["phase"].iat[0] == "" and lone["module"].iat[0] == ""


def test_several_ranks_costed_without_fanning_out() -> None:
    """Op ids repeat across ranks (each is an event's position in its rank's file): costs are joined per rank."""
    timeline = trace.load_timeline(DATA / "traces" / "gloo-2ranks")
    assert not timeline.ops["op_id"].is_unique
    table = analysis.kernel_table(timeline)
    assert len(table) == len(timeline.ops)  # CPU run: one row per op


def _hta_negative_queue_trace() -> Path | None:
    """HTA's own test trace with negative queue lengths, where an HTA source checkout's tests are installed."""
    try:
        import hta
    except ImportError:
        return None
    root = Path(hta.__file__).resolve().parents[1]
    found = sorted(root.glob("**/negative_queue_length_values_check/*.json.gz"))
    return found[0] if found else None


@pytest.mark.skipif(_hta_negative_queue_trace() is None, reason="HTA's test traces are not installed")
def test_hta_negative_queue_length_trace() -> None:
    path = _hta_negative_queue_trace()
    doc = load(path)
    kernels = analysis.kernel_table(trace_events.parse_events(doc["traceEvents"]).timeline)
    assert len(kernels) == len(gpu_events(doc))


# --- short kernel names -------------------------------------------------------------------------------------------

# (full name as the fixtures hold it, short name)
REAL_NAMES = [
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     "vectorized_elementwise_kernel<add>"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>, "
     "std::array<char*, 2ul> >(int, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*, 2ul>)",
     "vectorized_elementwise_kernel<add>"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
     "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >("
     "at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
     "at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, "
     "at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
     "at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<"
     "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > const&)"
     "::{lambda(int)#1})",
     "elementwise_kernel<mul>"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
     "std::array<char*, 2ul> >(int, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}"
     "::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)",
     "vectorized_elementwise_kernel<rsqrt>"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::silu_kernel("
     "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#6}::operator()() const::"
     "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::silu_kernel("
     "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#6}::operator()() const::"
     "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>)",
     "vectorized_elementwise_kernel<silu>"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)",
     "reduce_kernel<mean>"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<float>, "
     "unsigned int, long, 4, 4> >(at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<float>, unsigned int, "
     "long, 4, 4>)",
     "reduce_kernel<argmax>"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
     "pow_tensor_scalar_kernel_impl<float, float>(at::TensorIteratorBase&, float)::{lambda(float)#1}, "
     "std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::pow_tensor_scalar_kernel_impl<float, "
     "float>(at::TensorIteratorBase&, float)::{lambda(float)#1}, std::array<char*, 2ul>)",
     "vectorized_elementwise_kernel<pow_tensor_scalar>"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)",
     "vectorized_gather_kernel"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
     "OpaqueType<4u>, unsigned int, 3, 64, 64>(at::native::(anonymous namespace)::OpaqueType<4u>*, "
     "at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::"
     "OpaqueType<4u>, unsigned int, 64, 64>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, "
     "4u>, int, unsigned int)",
     "CatArrayBatchedCopy"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_"
     "align1::Params)",
     "cutlass_80_simt_sgemm_128x32_8x5_nn_align1"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, float, "
     "__nv_bfloat16, __nv_bfloat16, true, false, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
     "__nv_bfloat16 const*, float*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, float const*, "
     "__nv_bfloat16*, void*, long, float*, int*, float*, float*, float const*, float const*, float const*, "
     "float const*, float const*)",
     "splitKreduce_kernel"),
    ("nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT", "nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
     "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0"),
    ("Memset (Device)", "Memset (Device)"),
    ("Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pinned -> Device)"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
     "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"),
    ("aten::addmm", "aten::addmm"),  # a CPU run's "kernels" are its ops: kept whole
    ("triton_poi_fused_add_mul_0", "triton_poi_fused_add_mul_0"),
]  # fmt: skip


@pytest.mark.parametrize(("full", "short"), REAL_NAMES, ids=[s for _f, s in REAL_NAMES])
def test_short_kernel_name(full: str, short: str) -> None:
    assert short_kernel_name(full) == short


def test_short_names_of_every_fixture_kernel() -> None:
    """Every kernel name in the GPU fixtures is one the fixtures hold (REAL_NAMES come from them), and each gets a
    short name: no return type, no argument list, no namespace before it."""
    names = {e["name"] for path in GPU_FIXTURES for e in gpu_events(load(path))}
    assert {f for f, _s in REAL_NAMES if not f.startswith(("ncclKernel", "aten::", "triton_", "Memcpy"))} <= names
    for name in names:
        short = short_kernel_name(name)
        assert short and len(short) <= max(len(name), 1)
        if name.startswith("void "):
            assert not short.startswith("void") and "(" not in short and "::" not in short, (name, short)
            assert len(short) < 60, short


@pytest.mark.parametrize("bad", ["void f<int(", "void <<<>>>", "", None, "void at::x<a, b>(", ">>(("])
def test_short_kernel_name_never_raises(bad: object) -> None:
    assert isinstance(short_kernel_name(bad), str)


def test_terminal_table_shows_short_names(monkeypatch: pytest.MonkeyPatch) -> None:
    full = REAL_NAMES[0][0]
    buffer = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    monkeypatch.setattr(cli, "out", buffer)
    phase = {"wall_ms_per_step": 1.0, "gpu_busy_ms_per_step": 0.5, "gpu_busy_frac": 0.5, "kernels_per_step": 3,
             "host_us_per_kernel": 2.0, "regime": "host-bound",
             "top_kernels": [{"name": full, "share": 0.4}]}  # fmt: skip
    cli.print_summary({"model": {"name": "m"}, "device": {"name": "d"}, "phases": {"decode": phase}})
    text = buffer.export_text()
    assert "vectorized_elementwise_kernel<add> (40%)" in text and "at::native" not in text


def test_report_shows_short_names_with_the_full_name_as_tooltip(tmp_path: Path) -> None:
    run = analyze(TINY, out=tmp_path / "run")
    html = (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
    written = pd.read_csv(tmp_path / "run" / "kernels.csv")
    assert set(written["name"]) == {e["name"] for e in gpu_events(load(TINY))}  # full names in the CSV
    top = next(k["name"] for ph in run.summary["phases"].values() for k in ph["top_kernels"] if "<" in k["name"])
    import html as html_lib

    assert f'title="{html_lib.escape(top, quote=True)}">{html_lib.escape(short_kernel_name(top))}</span>' in html
