"""Write the CPU traces `tests/test_analyze.py` analyses: torch.profiler on a tiny MLP, as someone else's program
would capture it (no fusionscope phases, no module ranges).

- `traces/cpu-steps.trace.json.gz`: 3 recorded steps (`ProfilerStep#N` markers: torch writes them only under a
  `schedule`, here one warm-up step then 3 active ones), shapes recorded.
- `traces/cpu-plain.trace.json`: 2 forwards in one profile, no step markers, no shapes, uncompressed.
- `traces/gloo-2ranks/rank{0,1}.trace.json.gz`: two processes joined by torch.distributed (gloo, on the CPU),
  each profiling 4 steps (after 2 warm-up ones) of matmul + all_reduce; rank 1 runs 12x the matmuls per step, so
  it is the straggler and rank 0 waits for it inside the all_reduce. torch writes `distributedInfo.rank` once the
  process group is initialised.
- `traces/gloo-2ranks-merged.trace.json.gz`: the two rank files above merged into one, as TraceLens' TraceFuse
  merges ranks for one Perfetto view: every event tagged `args.rank`, `pid`, `id`, `correlation` and the kernel
  linking key (`External id`) offset by rank × a power of ten above the largest value, each original kept as
  `args["<field>_raw"]`, no `distributedInfo`.
- `traces/llama-et.trace.json.gz` and `traces/llama-et.et.json.gz`: a 2-layer Llama (hidden 64, 4 heads, 2 KV heads,
  random weights, bf16) run as a program of its own would run it — a prefill of 8 tokens, then 2 decode steps with
  its KV cache, each step a `ProfilerStep#N` range — with `nn.Module: <path>` ranges (fusionscope's module hooks)
  and PyTorch's execution trace (`ExecutionTraceObserver`) recorded beside the Kineto trace: the tensor identities
  `analyze` uses for exact dataflow.
- `traces/train-steps.trace.json.gz`: a training loop of a small MLP (Linear → GELU → Linear, AdamW), 2 recorded
  steps after 1 warm-up step: forward, loss, `backward()` (autograd's engine runs it on a thread of its own on the
  CPU) and `optimizer.step()` (its `Optimizer.step#AdamW.step` range).

Run from the repository root: `.venv/bin/python tests/data/make_trace_fixtures.py` (a few seconds, tens of KB each).
"""

from __future__ import annotations

import gzip
import json
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


def merged_ranks(folder: Path, path: Path) -> None:
    """The rank files of `folder` merged into `path` the way TraceFuse merges them (see the module docstring)."""
    docs = {}
    for file in sorted(folder.glob("rank*.trace.json.gz")):
        with gzip.open(file, "rt") as f:
            doc = json.load(f)
        docs[doc["distributedInfo"]["rank"]] = doc
    fields = ("pid", "id", "correlation")
    largest = max(abs(v) for d in docs.values() for e in d["traceEvents"]
                  for v in [*(e.get(k) for k in fields), (e.get("args") or {}).get("External id")]
                  if isinstance(v, int))  # fmt: skip
    multiplier = 10 ** (len(str(largest)) + 1)
    events = []
    for rank, doc in sorted(docs.items()):
        for event in doc["traceEvents"]:
            event = dict(event, args=dict(event.get("args") or {}, rank=rank))
            for field in fields:
                if isinstance(event.get(field), int):
                    event["args"][f"{field}_raw"] = event[field]
                    event[field] += rank * multiplier
            if isinstance(event["args"].get("External id"), int):
                event["args"]["External id_raw"] = event["args"]["External id"]
                event["args"]["External id"] += rank * multiplier
            events.append(event)
    header = {k: v for k, v in docs[min(docs)].items() if k not in ("traceEvents", "distributedInfo")}
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump({**header, "traceEvents": events}, f)


def tiny_llama() -> tuple[nn.Module, torch.Tensor]:
    """A 2-layer Llama of random weights in bf16 and an 8-token prompt (transformers' own classes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model, torch.randint(0, 128, (1, 8))


def with_execution_trace(folder: Path, decode_steps: int = 2) -> None:
    """Prefill, then greedy decode steps, under the profiler and the execution trace observer."""
    from torch.profiler import ExecutionTraceObserver, record_function

    from fusionscope.capture import _forward_kwargs, module_ranges

    model, ids = tiny_llama()
    cache_kw = _forward_kwargs(model)["cache"]
    kineto, et = folder / "llama-et.trace.json.gz", folder / "llama-et.et.json"
    observer = ExecutionTraceObserver().register_callback(str(et))
    with (
        torch.inference_mode(),
        module_ranges(model),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True, execution_trace_observer=observer) as prof,
    ):
        with record_function("ProfilerStep#0"):
            out = model(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for step in range(1, decode_steps + 1):
            with record_function(f"ProfilerStep#{step}"):
                out = model(input_ids=token, use_cache=True, **{cache_kw: cache})
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _export(prof, kineto)
    with et.open("rb") as src, gzip.open(et.with_name(et.name + ".gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    et.unlink()


def training(path: Path, steps: int = 2) -> None:
    """Forward, loss, backward and AdamW step of a (16, 32) batch through Linear → GELU → Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    plan = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=plan,
                 on_trace_ready=lambda p: _export(p, path)) as prof:  # fmt: skip
        for _ in range(1 + steps):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            prof.step()


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
    merged_ranks(TRACES / "gloo-2ranks", TRACES / "gloo-2ranks-merged.trace.json.gz")
    with_execution_trace(TRACES)
    training(TRACES / "train-steps.trace.json.gz")
    for path in sorted(p for p in TRACES.rglob("*") if p.is_file()):
        print(f"{path}: {path.stat().st_size / 1024:.1f} KB")


if __name__ == "__main__":
    main()
