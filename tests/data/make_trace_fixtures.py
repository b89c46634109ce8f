"""Write the CPU traces `tests/test_analyze.py` analyses: torch.profiler on a tiny MLP, as someone else's program
would capture it (no fusionscope phases, no module ranges).

- `traces/cpu-steps.trace.json.gz`: 3 recorded steps (`ProfilerStep#N` markers: torch writes them only under a
  `schedule`, here one warm-up step then 3 active ones), shapes recorded.
- `traces/cpu-plain.trace.json`: 2 forwards in one profile, no step markers, no shapes, uncompressed.

Run from the repository root: `.venv/bin/python tests/data/make_trace_fixtures.py` (a few seconds, tens of KB each).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import torch
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
    for path in sorted(TRACES.iterdir()):
        print(f"{path}: {path.stat().st_size / 1024:.1f} KB")


if __name__ == "__main__":
    main()
