"""Write the CPU traces `tests/test_analyze.py` analyses: torch.profiler on a tiny MLP, as someone else's program
would capture it (no fusionscope phases, no module ranges).

- `traces/cpu-steps.trace.json.gz`: 3 recorded steps (`ProfilerStep#N` markers: torch writes them only under a
  `schedule`, here one warm-up step then 3 active ones), shapes recorded.
- `traces/cpu-plain.trace.json`: 2 forwards in one profile, no step markers, no shapes, uncompressed.
- `traces/gloo-2ranks/rank{0,1}.trace.json.gz`: two processes joined by torch.distributed (gloo, on the CPU),
  each profiling 4 steps (after 2 warm-up ones) of matmul + all_reduce; rank 1 runs 12x the matmuls per step, so
  it is the straggler and rank 0 waits for it inside the all_reduce. torch writes `distributedInfo.rank` once the
  process group is initialised.

Run from the repository root: `.venv/bin/python tests/data/make_trace_fixtures.py` (a few seconds, tens of KB each).
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

TRACES = Path(__file__).resolve().parent / "traces"


def tiny_model() -> tuple[nn.Module, torch.Tensor]:
    """Linear → SiLU → Linear → LayerNorm on a (4, 32) input: a handful of aten ops per forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32), nn.LayerNorm(32)).eval()
    return model, torch.randn(4, 32)


def with_steps(path: Path, steps: int = 3) -> None:
    model, x = tiny_model()
    plan = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with (
        torch.inference_mode(),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=plan,
                on_trace_ready=lambda p: _export(p, path)) as prof,
    ):  # fmt: skip
        for _ in range(1 + steps):
            model(x)
            prof.step()


def plain(path: Path, forwards: int = 2) -> None:
    model, x = tiny_model()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(forwards):
            model(x)
    _export(prof, path)


def gloo_ranks(folder: Path, steps: int = 4, world: int = 2) -> None:
    """Spawn `world` gloo processes that each write `folder/rank{N}.trace.json.gz`."""
    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(world, port, folder, steps), nprocs=world, join=True)


def _gloo_rank(rank: int, world: int, port: int, folder: Path, steps: int) -> None:
    """One rank: (128, 128) matmuls then an all_reduce per step; rank 1 does 24 matmuls where others do 2."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    matmuls = 24 if rank == 1 else 2
    plan = schedule(wait=0, warmup=2, active=steps, repeat=1)
    path = folder / f"rank{rank}.trace.json.gz"
    with profile(activities=[ProfilerActivity.CPU], schedule=plan, on_trace_ready=lambda p: _export(p, path)) as prof:
        for _ in range(2 + steps):
            x = a
            for _ in range(matmuls):
                x = torch.tanh(x @ b)
            dist.all_reduce(x)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


def _export(prof: profile, path: Path) -> None:
    """Chrome trace export writes plain JSON; gzip it when the name asks for it."""
    raw = path.with_name(path.name.removesuffix(".gz"))
    prof.export_chrome_trace(str(raw))
    if path.suffix == ".gz":
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()


def main() -> None:
    TRACES.mkdir(parents=True, exist_ok=True)
    with_steps(TRACES / "cpu-steps.trace.json.gz")
    plain(TRACES / "cpu-plain.trace.json")
    gloo_ranks(TRACES / "gloo-2ranks")
    for path in sorted(p for p in TRACES.rglob("*") if p.is_file()):
        print(f"{path}: {path.stat().st_size / 1024:.1f} KB")


if __name__ == "__main__":
    main()
