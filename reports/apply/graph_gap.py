"""How long the GPU idles between two kernels of a replayed CUDA graph, by the kind of kernel replayed.

`fusionscope.device` measured the step model's `graph_gap_us` with one-element adds (0.08 µs on the H200) until
this script showed why the graph predictions came out short: the profiled replays of real decode steps leave
0.45–0.52 µs idle per kernel (every 7–8B run under `rewrite/runs/`). It replays graphs of kernels of growing size:
one-element adds, one-block adds, adds over many blocks, bf16 GEMVs that stream their weights from HBM, a GEMV and
a small add alternating as in a decode step, the bundled RMSNorm, aten's LayerNorm and the bundled add + LayerNorm
(one norm, and GPT-NeoX's pair) on one row; then `fusionscope.device`'s own roof measurement, three times. For each
it says the profiled gap per kernel and, timed without the profiler, the replay's wall time less its kernels' busy
time, per kernel.

    python reports/apply/graph_gap.py OUT_DIR      # on a GPU; writes OUT_DIR/graph_gap.json
    python reports/apply/graph_gap.py --repredict GAP_US RUN_FOLDER...    # anywhere: the runs' graph predictions
                                                                          # again, with GAP_US as the roof
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from fusionscope.gpu_replay import profile_gpu, replay_figures

REPLAYS = 20


def _graph(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # lazy initialisation (cuBLAS handles, Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def _wall_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Median ms of one replay between CUDA events, after warm-up."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases() -> dict[str, Callable[[], None]]:
    dev, bf16 = "cuda", torch.bfloat16
    one = torch.zeros(1, device=dev)
    block = torch.randn(4096, device=dev, dtype=bf16)
    many = torch.randn(1 << 22, device=dev, dtype=bf16)  # 8 MB: 2048 blocks
    weights = [torch.randn(4096, 4096, device=dev, dtype=bf16) for _ in range(8)]  # 256 MB: past the L2
    x = torch.randn(1, 4096, device=dev, dtype=bf16)
    out = torch.empty(1, 4096, device=dev, dtype=bf16)
    norm_w = torch.randn(4096, device=dev, dtype=bf16)

    def adds(t: torch.Tensor, n: int) -> Callable[[], None]:
        def body() -> None:
            for _ in range(n):
                t.add_(1)

        return body

    def gemvs() -> None:
        for i in range(128):
            torch.mm(x, weights[i % len(weights)], out=out)

    def gemv_and_add() -> None:
        for i in range(128):
            torch.mm(x, weights[i % len(weights)], out=out)
            block.add_(1)

    found = {"add, 1 element × 256": adds(one, 256), "add, 4096 bf16 × 256": adds(block, 256),
             "add, 4M bf16 × 256": adds(many, 256), "GEMV 1×4096×4096 bf16 × 128": gemvs,
             "GEMV + 4096-element add, × 128 pairs": gemv_and_add}  # fmt: skip
    try:
        from fusionscope.kernels import rms_norm

        def norms() -> None:
            for _ in range(256):
                rms_norm(x, norm_w, 1e-6)

        found["bundled rms_norm (1, 4096) × 256"] = norms
    except ImportError as error:
        print(f"rms_norm not loaded: {error}")
    # aten's LayerNorm on one row against the bundled kernels (GPT-NeoX normalises each residual sum twice)
    bias = torch.randn(4096, device=dev, dtype=bf16)
    residual = torch.randn(1, 4096, device=dev, dtype=bf16)

    def layer_norms() -> None:
        for _ in range(256):
            torch.nn.functional.layer_norm(x, (4096,), norm_w, bias, 1e-5)

    found["aten layer_norm (1, 4096) bf16 × 256"] = layer_norms
    try:
        from fusionscope.kernels import add_layer_norm

        def add_layer_norms() -> None:
            for _ in range(256):
                add_layer_norm(x, residual, norm_w, bias, 1e-5)

        found["bundled add_layer_norm (1, 4096) × 256"] = add_layer_norms
        from fusionscope.kernels import add_layer_norm_pair

        def add_layer_norm_pairs() -> None:
            for _ in range(256):
                add_layer_norm_pair(x, residual, norm_w, bias, bias, norm_w, 1e-5)

        found["bundled add_layer_norm_pair (1, 4096) × 256"] = add_layer_norm_pairs
    except ImportError as error:
        print(f"add_layer_norm not loaded: {error}")
    return found


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": props.name, "torch": torch.__version__, "rows": []}  # fmt: skip
    for name, body in cases().items():
        try:
            graph = _graph(body)
            with tempfile.TemporaryDirectory() as tmp:
                graph.replay()
                torch.cuda.synchronize()
                figures = replay_figures(profile_gpu(graph.replay, Path(tmp)))
            wall = _wall_ms(graph)
            kernels = figures["kernels"] + figures["copies"]
            row = {"case": name, **figures, "wall_ms": wall,
                   "wall_less_busy_us_per_kernel": (wall - figures["gpu_busy_ms"]) * 1e3 / max(kernels, 1)}  # fmt: skip
        except Exception as exc:  # one case failing does not cost the others
            row = {"case": name, "error": f"{type(exc).__name__}: {exc}"}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "graph_gap.json").write_text(json.dumps(result, indent=1))
    from fusionscope.device import _graph_gap_us

    result["device_roof_graph_gap_us"] = [_graph_gap_us(torch.device("cuda")) for _ in range(3)]
    print("fusionscope.device's graph_gap_us, three times:", result["device_roof_graph_gap_us"], flush=True)
    (out_dir / "graph_gap.json").write_text(json.dumps(result, indent=1))


def repredict(gap_us: float, folders: list[Path]) -> list[dict]:
    """Each `apply --graphs` run's predicted ms for graph and fused + graph, as `apply.run` computes them, with its
    own `roofs.graph_gap_us` and with `gap_us`, beside what it measured: the same profiled GPU time, savings and
    kernel counts, only the per-kernel idle term changed."""
    from fusionscope.apply.run import predicted

    rows = []
    for folder in folders:
        summary = json.loads((folder / "summary.json").read_text())
        graphs = summary["apply"]["graphs"]
        variants = graphs["variants"]
        gpu_us = summary["cumulative"]["decode"]["step_model"]["gpu_us"]
        kernels = summary["phases"]["decode"]["kernels_per_step"]
        pred = predicted(summary, "decode", variants["fused + graph"]["fusions"])
        fused_kernels = kernels - (pred.get("kernels_removed") or 0.0) + (pred.get("launches_added") or 0.0)
        fused_gpu_us = gpu_us - (pred.get("saved_gpu_us") or 0.0)
        row = {"run": folder.name, "roof_gap_us": summary["roofs"].get("graph_gap_us")}
        for name, busy, count in (("graph", gpu_us, kernels), ("fused + graph", fused_gpu_us, fused_kernels)):
            measured = variants[name].get("ms_per_token")
            for label, gap in (("run's roof", row["roof_gap_us"] or 0.0), ("new roof", gap_us)):
                ms = (busy + count * gap) / 1e3
                row[f"{name}: {label} ms"] = round(ms, 3)
                row[f"{name}: {label} err"] = round(measured / ms - 1, 3) if measured else None
            row[f"{name}: measured ms"] = measured
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "--repredict":
        repredict(float(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
    else:
        main(Path(sys.argv[1]))
