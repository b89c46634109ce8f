"""A GLU folded into the down_proj GEMV (`fusionscope.kernels.gemv.gemv_gated`) against the pair it replaces
(`silu_and_mul`, then `gemv`), at the decode shapes of four families, bf16, one row.

The fold saves a launch (and the x round trip) but makes every GEMV program compute the activation for all of K:
N / BLOCK_N programs each evaluate K exponentials and divisions, which a memory-bound kernel may or may not hide.
So it is timed here before a model run relies on it: per shape, the pair and the gated kernel with the shipped
schedule and a few wider ones (more columns per program: the activation amortised over more weight rows).

Timing as `gpu_gemv.py`: a CUDA graph of ≥ MIN_CALLS calls, each reading its own copy of the weight (the copies
rotating past the L2), launched as a decode step launches them (eager launches, PDL where the GPU has it); µs per
call is the median of REPLAYS replays ÷ calls; variants interleaved over ROUNDS rounds. Each gated variant's output
must equal the pair's bit for bit (the kernel computes x with silu_and_mul's roundings). Rows go to OUT/gated.jsonl,
the summary to OUT/gated.json; the last line says whether the shipped gated kernel beat the pair on every shape.

    python3 reports/gemv/gpu_gated.py OUT
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gemv import ROTATE_BYTES, capture, replay_us

MIN_CALLS = 24
ROUNDS = 5
SHAPES = [  # (K = intermediate, N = hidden, where)
    (14336, 4096, "llama-3.1-8b down_proj"),
    (12288, 4096, "qwen3-8b down_proj"),
    (11008, 4096, "olmo-2-7b down_proj"),
    (8192, 3072, "phi-3-mini down_proj"),
]
GATED_TILES = [None, (8, 512, 4, 1), (16, 512, 4, 1), (16, 256, 4, 1), (32, 256, 8, 0)]  # None: shipped


def main(argv: list[str]) -> int:
    import importlib

    import triton
    from fusionscope.kernels import dispatch, gemv_gated, silu_and_mul
    from fusionscope.kernels import gemv as gemv_fn  # the function; the module below

    gemv_module = importlib.import_module("fusionscope.kernels.gemv")
    dispatch.LEAN["replay"] = False  # a forced schedule must reach the launcher, not a replayed launch of another
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    rows = (out / "gated.jsonl").open("a", encoding="utf-8")

    def emit(row: dict[str, Any]) -> None:
        rows.write(json.dumps(row) + "\n")
        rows.flush()
        print(json.dumps(row), flush=True)

    device = torch.device("cuda")
    emit({"kind": "meta", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
          "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
          "shipped": dict(gemv_module.TILES)})  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    points = []
    for K, N, where in SHAPES:
        copies = max(2, math.ceil(ROTATE_BYTES / (N * K * 2)))
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=gen) / math.sqrt(K)
              for _ in range(copies)]  # fmt: skip
        h = torch.randn(1, 2 * K, device=device, dtype=torch.bfloat16, generator=gen) * 2
        gate, up = h[:, :K], h[:, K:]

        def pair(w: torch.Tensor, gate: torch.Tensor = gate, up: torch.Tensor = up) -> torch.Tensor:
            return gemv_fn(silu_and_mul(gate, up), w)

        variants: dict[str, Any] = {"pair": (pair, None)}
        for tiles in GATED_TILES:
            name = "gated shipped" if tiles is None else f"gated N{tiles[0]} K{tiles[1]} W{tiles[2]}" + (
                " pf" if tiles[3] else "")  # fmt: skip
            variants[name] = (lambda w, gate=gate, up=up: gemv_gated(gate, up, w), tiles)
        expected = pair(ws[0])
        timers = {}
        for name, (fn, tiles) in variants.items():
            gemv_module.TILES["force"] = tiles
            try:
                got = fn(ws[0])
                torch.cuda.synchronize()
                equal = bool(torch.equal(got, expected))
                emit({"kind": "check", "K": K, "N": N, "variant": name, "bit_equal_to_pair": equal,
                      "max_abs": (got.double() - expected.double()).abs().max().item()})  # fmt: skip
                n = copies * math.ceil(MIN_CALLS / copies)
                graph = capture([lambda w=w, fn=fn: fn(w) for w in ws], n)
                timers[name] = (graph, n)
            except Exception as exc:  # a schedule that does not compile is a row, not the end of the run
                torch.cuda.synchronize()
                emit({"kind": "error", "K": K, "N": N, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
        gemv_module.TILES["force"] = None
        times: dict[str, list[float]] = {name: [] for name in timers}
        names = list(timers)
        for r in range(ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(replay_us(*timers[name]))
        medians = {name: statistics.median(v) for name, v in times.items()}
        point = {"kind": "point", "K": K, "N": N, "where": where, "us": medians,
                 "x_pair": {n: medians["pair"] / us for n, us in medians.items()}}  # fmt: skip
        emit(point)
        points.append(point)
        del ws, timers
        torch.cuda.empty_cache()
    shipped_wins = all(p["x_pair"].get("gated shipped", 0) > 1.0 for p in points)
    (out / "gated.json").write_text(json.dumps({"points": points, "shipped_wins": shipped_wins}, indent=1))
    print(f"GATED shipped beats the pair on every shape: {shipped_wins}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
