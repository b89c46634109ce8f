"""Programmatic dependent launch (`fusionscope.kernels.pdl`) on a replayed decode chain: on against off, same run.

The chain is Llama-3.1-8B's decode step without its attention, 32 layers of published dimensions, bf16, one row,
each layer with its own weights (14 GB in all: every weight comes from HBM, as in a decode step):
    add_rms_norm → gemv qkv (4096 → 6144) → gemv o_proj (the first 4096 of qkv's output → 4096) → add_rms_norm
    → F.linear gate_up (cuBLAS, 4096 → 28672) → silu_and_mul → gemv down (14336 → 4096)
224 kernels per step. One CUDA graph is captured with PDL on and one with it off; their outputs must be bit-equal
(PDL changes when a kernel starts, not what it computes) and equal to the same chain run eagerly without PDL. Then
ROUNDS interleaved rounds, each timing REPLAYS single replays of each graph (synced before and after, as
`apply --graphs` times a decode step) and one batch of BATCH replays back to back; medians per variant. The weight
floor is the chain's weight bytes at the copy roof measured in the run. Rows go to OUT/pdl.jsonl as they come, the
summary to OUT/pdl.json.

    python3 reports/pdl/gpu_pdl.py OUT
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = 32
HIDDEN, KV, INTER = 4096, 1024, 14336
EPS = 1e-5
ROUNDS = 5
REPLAYS = 30
BATCH = 20


def emit(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with (out / "pdl.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def copy_roof_gbs() -> float:
    """Read + write bytes per second of a 1 GiB device copy, replayed in a graph, median of 10."""
    a = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    g = torch.cuda.CUDAGraph()
    b.copy_(a)
    with torch.cuda.graph(g):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 2 / statistics.median(times) / 1e9


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import triton
    from fusionscope.kernels import add_rms_norm, gemv, silu_and_mul
    from fusionscope.kernels.pdl import PDL

    torch.manual_seed(0)
    dev, dt_ = "cuda", torch.bfloat16
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "pdl_available": bool(PDL["enabled"])}  # fmt: skip
    emit(out, {"meta": meta})
    if not PDL["enabled"]:
        emit(out, {"error": "this Triton has no grid dependency control or launch_pdl: nothing to compare"})
        return

    def param(*shape: int, scale: float) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, device=dev, dtype=dt_) * scale, requires_grad=False)

    layers = []
    for _ in range(LAYERS):
        layers.append({
            "ln1": param(HIDDEN, scale=1.0) , "qkv": param(HIDDEN + 2 * KV, HIDDEN, scale=HIDDEN**-0.5),
            "o": param(HIDDEN, HIDDEN, scale=HIDDEN**-0.5), "ln2": param(HIDDEN, scale=1.0),
            "gate_up": param(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), "down": param(HIDDEN, INTER, scale=INTER**-0.5),
        })  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for layer in layers for p in layer.values())
    x0 = torch.randn(1, 1, HIDDEN, device=dev, dtype=dt_)
    r0 = torch.randn(1, 1, HIDDEN, device=dev, dtype=dt_)
    x_in, r_in = x0.clone(), r0.clone()
    result = torch.empty_like(x0)

    def step() -> None:
        x, residual = x_in, r_in
        for layer in layers:
            h, residual = add_rms_norm(x, residual, layer["ln1"], EPS)
            qkv = gemv(h, layer["qkv"])
            attn = gemv(qkv[..., :HIDDEN], layer["o"])
            h, residual = add_rms_norm(attn, residual, layer["ln2"], EPS)
            act = silu_and_mul(F.linear(h, layer["gate_up"]))
            x = gemv(act, layer["down"])
        result.copy_(x + residual)

    def captured() -> torch.cuda.CUDAGraph:
        with torch.inference_mode():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        return graph

    PDL["enabled"] = False
    with torch.inference_mode():
        step()
    torch.cuda.synchronize()
    eager = result.clone()
    graphs = {}
    for name, on in (("pdl off", False), ("pdl on", True)):
        PDL["enabled"] = on
        graphs[name] = captured()
    PDL["enabled"] = True
    outputs = {}
    for name, graph in graphs.items():
        result.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        outputs[name] = result.clone()
    check = {name: {"bit_equal_to_eager": bool(torch.equal(o, eager)), "nan": bool(o.isnan().any()),
                    "max_abs_vs_eager": float((o.float() - eager.float()).abs().max())}
             for name, o in outputs.items()}  # fmt: skip
    emit(out, {"check": check})
    roof = copy_roof_gbs()
    floor_ms = weight_bytes / (roof * 1e9) * 1e3
    emit(out, {"copy_roof_gbs": round(roof), "weight_gb": round(weight_bytes / 1e9, 2), "floor_ms": round(floor_ms, 3)})

    single: dict[str, list[float]] = {n: [] for n in graphs}
    batched: dict[str, list[float]] = {n: [] for n in graphs}
    for rnd in range(ROUNDS):
        order = list(graphs) if rnd % 2 == 0 else list(reversed(graphs))
        for name in order:
            graph = graphs[name]
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(REPLAYS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            single[name].append(statistics.median(times))
            t0 = time.perf_counter()
            for _ in range(BATCH):
                graph.replay()
            torch.cuda.synchronize()
            batched[name].append((time.perf_counter() - t0) * 1e3 / BATCH)
            emit(out, {"round": rnd, "variant": name, "single_ms": round(single[name][-1], 4),
                       "batched_ms": round(batched[name][-1], 4)})  # fmt: skip
    summary = {"meta": meta, "check": check, "copy_roof_gbs": round(roof), "floor_ms": round(floor_ms, 3),
               "kernels_per_step": LAYERS * 7 + 1, "rounds": ROUNDS, "replays": REPLAYS, "batch": BATCH}  # fmt: skip
    for name in graphs:
        s, b = statistics.median(single[name]), statistics.median(batched[name])
        summary[name] = {"single_ms": round(s, 4), "batched_ms": round(b, 4), "single_x_floor": round(s / floor_ms, 3)}
    off, on = summary["pdl off"], summary["pdl on"]
    summary["on_vs_off_single"] = round(off["single_ms"] / on["single_ms"], 4)
    summary["on_vs_off_batched"] = round(off["batched_ms"] / on["batched_ms"], 4)
    summary["saved_us_per_kernel_single"] = round((off["single_ms"] - on["single_ms"]) * 1e3 / (LAYERS * 7), 3)
    (out / "pdl.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit(out, {"summary": summary})


if __name__ == "__main__":
    main()
