"""The device's ceilings, measured on the spot and cached per device and software versions.

Datasheet peaks are not what a kernel can reach: on the H200 a device-to-device copy reaches 4250–4273 GB/s of the
4.8 TB/s on the sheet, a bf16 8192³ matmul 700–716 of ~989 TFLOP/s. Classifying kernels against the sheet would call
every good kernel slow, so fusionscope measures: copy bandwidth (read + write), a read-heavy stream (2 reads : 1
write), GEMM throughput per dtype, the host cost of an empty kernel launch and of a one-kernel aten op. The sheet's
figures are kept beside the measured ones for the report. CPU runs measure the CPU's own roofs the same way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import runpy
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# Vendor datasheet peaks (dense), for display beside the measured roofs. Keys are torch.cuda.get_device_name() values.
DATASHEETS: dict[str, dict] = {
    "NVIDIA H200": {"gbps": 4800.0, "tflops": {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}},
    "NVIDIA H100 80GB HBM3": {
        "gbps": 3350.0,
        "tflops": {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0},
    },
    "NVIDIA A100-SXM4-80GB": {
        "gbps": 2039.0,
        "tflops": {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5},
    },
}
ROOFS_VERSION = 4  # bump when the measurement method changes, so old cache entries are not reused


@dataclass(frozen=True)
class DeviceCeilings:
    """Measured roofs of one device. Bandwidths in GB/s (1e9 B/s), throughput in TFLOP/s, host costs in µs."""

    kind: str  # "cuda" | "cpu"
    name: str
    copy_gbps: float
    read_heavy_gbps: float
    tflops: dict[str, float | None]  # "bfloat16", "float16", "float32", "tf32" (CUDA only)
    launch_us: float | None  # host cost of one empty Triton kernel launch (CUDA only)
    aten_op_host_us: float  # host cost of a one-kernel aten op (torch.add on 1 element)
    fused_call_us: float | None = None  # host cost of one bundled-kernel call with its output allocated (CUDA only)
    graph_gap_us: float | None = None  # GPU idle time between two kernels of a replayed CUDA graph (CUDA only)
    datasheet: dict | None = None
    measured_at: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    source: str = "measured"  # "measured" | "cache"

    def peak_tflops(self) -> dict[str, float]:
        """Peaks by dtype for classification; fp32 kernels use true fp32 unless TF32 matmuls were enabled."""
        import torch

        peaks = {k: v for k, v in self.tflops.items() if v}
        if torch.backends.cuda.matmul.allow_tf32 and self.tflops.get("tf32"):
            peaks["float32"] = self.tflops["tf32"]
        return peaks

    def to_json(self) -> dict:
        return asdict(self)


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"{cpu} ({os.cpu_count()} cores)"


def software_versions() -> dict[str, str]:
    """The versions a measurement depends on; the roofs cache is keyed on them."""
    torch_version, cuda = torch_versions()
    versions = {"python": platform.python_version(), "torch": torch_version}
    distributions = {"triton": "triton", "transformers": "transformers", "pandas": "pandas",
                     "hta": "HolisticTraceAnalysis", "fusionscope": "fusionscope"}  # fmt: skip
    for key, dist in distributions.items():
        try:
            versions[key] = version(dist)
        except PackageNotFoundError:
            versions[key] = "absent"
    if cuda:
        versions["cuda"] = cuda
    return versions


def torch_versions() -> tuple[str, str | None]:
    """`torch.__version__` and `torch.version.cuda`. Where torch is not imported yet (`analyze`, which needs nothing
    else of it: its import is a second), they are read from the file they come from, torch's generated `version.py`,
    without importing torch; where that file cannot be read, torch is imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        try:
            facts = runpy.run_path(str(Path(folders[0]) / "version.py"))
            return str(facts["__version__"]), facts.get("cuda")
        except Exception:  # a version.py that cannot be read as expected: torch says
            pass
        import torch
    return torch.__version__, torch.version.cuda


def cache_dir() -> Path:
    """`$FUSIONSCOPE_CACHE_DIR`, else `$XDG_CACHE_HOME/fusionscope`, else `~/.cache/fusionscope`."""
    if os.environ.get("FUSIONSCOPE_CACHE_DIR"):
        return Path(os.environ["FUSIONSCOPE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fusionscope"


def _cache_file(device: torch.device, versions: dict[str, str]) -> Path:
    key = "-".join(
        [
            device_name(device),
            versions["torch"],
            versions.get("triton", ""),
            versions.get("cuda", "cpu"),
            f"v{ROOFS_VERSION}",
        ]
    )
    return cache_dir() / "roofs" / (re.sub(r"[^A-Za-z0-9.]+", "_", key) + ".json")


def get_ceilings(device: torch.device, remeasure: bool = False) -> DeviceCeilings:
    """Cached ceilings for this device and software, measured (and cached) when absent or when `remeasure`."""
    versions = software_versions()
    path = _cache_file(device, versions)
    if path.is_file() and not remeasure:
        try:
            data = json.loads(path.read_text())
            data["source"] = "cache"
            return DeviceCeilings(**data)
        except (json.JSONDecodeError, TypeError):
            pass  # a damaged or older cache entry is measured again
    ceilings = measure_ceilings(device, versions)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ceilings.to_json(), indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    return ceilings


def measure_ceilings(device: torch.device, versions: dict[str, str] | None = None) -> DeviceCeilings:
    versions = versions or software_versions()
    name = device_name(device)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    if device.type == "cuda":
        return DeviceCeilings(
            kind="cuda",
            name=name,
            copy_gbps=_copy_gbps(device, 1 << 30),
            read_heavy_gbps=_read_heavy_gbps(device, 1 << 29),
            tflops=_gemm_tflops(device, 8192),
            launch_us=_triton_launch_us(),
            aten_op_host_us=_aten_op_us(device),
            fused_call_us=_fused_call_us(device),
            graph_gap_us=_graph_gap_us(device),
            datasheet=DATASHEETS.get(name),
            measured_at=now,
            versions=versions,
        )
    # CPU: sizes keep the whole measurement around a second on a 2-core machine.
    return DeviceCeilings(
        kind="cpu",
        name=name,
        copy_gbps=_copy_gbps(device, 1 << 27),
        read_heavy_gbps=_read_heavy_gbps(device, 1 << 26),
        tflops=_gemm_tflops(device, 512),
        launch_us=None,
        aten_op_host_us=_aten_op_us(device),
        datasheet=None,
        measured_at=now,
        versions=versions,
    )


def _time_ms(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `fn` after a warm-up call: CUDA events on the GPU, perf_counter on the CPU."""
    import torch

    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy_gbps(device: torch.device, nbytes: int) -> float:
    import torch

    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(device, lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / ms / 1e6


def _read_heavy_gbps(device: torch.device, nbytes: int) -> float:
    import torch

    a, b = torch.rand(nbytes // 4, device=device), torch.rand(nbytes // 4, device=device)
    c = torch.empty_like(a)
    ms = _time_ms(device, lambda: torch.add(a, b, out=c), reps=20)
    return 3 * nbytes / ms / 1e6


def _gemm_tflops(device: torch.device, n: int) -> dict[str, float | None]:
    import torch

    result: dict[str, float | None] = {}
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    for label, dtype in dtypes.items():
        size = n if device.type == "cuda" or dtype == torch.float32 else n // 2  # CPU half matmuls are slow
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        ms = _time_ms(device, lambda a=a, b=b: a @ b, reps=10 if device.type == "cuda" else 3)
        result[label] = 2 * size**3 / ms / 1e9
    result["tf32"] = None
    if device.type == "cuda":
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            a = torch.randn(n, n, device=device)
            ms = _time_ms(device, lambda: a @ a, reps=10)
            result["tf32"] = 2 * n**3 / ms / 1e9
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    return result


def _host_us(fn: Callable[[], object], calls: int, sync: Callable[[], object]) -> float:
    """Host microseconds per call over a back-to-back loop (the queue absorbs the GPU work), median of 5 loops."""
    fn()
    sync()
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - t0) * 1e6 / calls)
        sync()
    return statistics.median(loops)


def _aten_op_us(device: torch.device) -> float:
    import torch

    x = torch.ones(1, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return _host_us(lambda: torch.add(x, x), 2000, sync)


def _triton_launch_us() -> float | None:
    """Host cost of launching an empty Triton kernel the usual way (`kernel[grid](...)`)."""
    import torch

    try:
        import triton
    except ImportError:
        return None

    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    return _host_us(lambda: _empty[(1,)](x), 2000, torch.cuda.synchronize)


def _fused_call_us(device: torch.device) -> float | None:
    """Host cost of one call of a bundled kernel as a patched forward makes it: `rms_norm` on a decode-sized row,
    output allocated, dtype and stride checks in Python, then the launch. It is what a fused kernel adds to a step's
    host work, about twice an empty launch (21.5 against 10.8 µs on the H200 host, 2026-12-01)."""
    import torch

    try:
        from fusionscope.kernels import rms_norm
    except ImportError:
        return None
    x = torch.randn(1, 1, 4096, device=device, dtype=torch.bfloat16)
    weight = torch.ones(4096, device=device, dtype=torch.bfloat16)
    return _host_us(lambda: rms_norm(x, weight, 1e-6), 2000, torch.cuda.synchronize)


def _graph_gap_us(device: torch.device, pairs: int = 128, hidden: int = 4096) -> float | None:
    """GPU idle µs between two consecutive kernels of a replayed CUDA graph, in a decode step's pattern: `pairs`
    bf16 GEMVs (one row against a hidden × hidden weight, the weights together twice the L2, so each streams from
    memory) each followed by a one-row add, captured back to back; one replay profiled, (span − busy) ÷ gaps.
    A graph takes the host out of a step but not this: a decode step of ~500 kernels pays it ~500 times, so the step
    model adds it per kernel to a graph's GPU time. Why this pattern and not a chain of one-element adds: on the
    H200 the adds leave 0.08–0.26 µs between them, a GEMV 0.70 and the GEMV + add pair 0.62 µs per kernel, and the
    replayed decode steps of 7–8B models 0.45–0.52 (`reports/apply/graph_gap.py` and its results)."""
    import torch

    try:
        with torch.cuda.device(device):
            return _replayed_gap_us(device, pairs, hidden)
    except Exception as error:  # a profiler that cannot see into graphs leaves the term out, it does not stop a run
        warnings.warn(f"the idle time between replayed kernels was not measured: {type(error).__name__}: {error}",
                      stacklevel=2)  # fmt: skip
        return None


def _replayed_gap_us(device: torch.device, pairs: int, hidden: int) -> float | None:
    import torch

    from fusionscope.gpu_replay import profile_gpu, replay_figures

    weight_bytes = hidden * hidden * 2
    count = max(2, -(-2 * torch.cuda.get_device_properties(device).L2_cache_size // weight_bytes))
    weights = [torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16) for _ in range(count)]
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)

    def step() -> None:
        for i in range(pairs):
            torch.mm(x, weights[i % count], out=out)
            out.add_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # cuBLAS's handle and workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    with tempfile.TemporaryDirectory(prefix="fusionscope-gap-") as tmp:
        figures = replay_figures(profile_gpu(graph.replay, Path(tmp)))
    return figures["gap_us_per_kernel"] if figures["kernels"] >= 2 * pairs else None  # a GEMV and an add each
