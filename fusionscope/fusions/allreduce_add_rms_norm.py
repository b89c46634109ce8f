"""allreduce_add_rms_norm: under tensor parallelism, the all-reduce that ends o_proj and down_proj (each rank holds a
partial sum of the row-sharded projection), the residual add after it and the RMSNorm after that → one kernel that
reduces the partials, adds the residual and normalises in one pass, as serving engines ship it (TensorRT-LLM's
and FlashInfer's all-reduce fusion, vLLM's fused all-reduce + RMSNorm pass). No bundled kernel (KERNEL None): this
entry estimates what the fusion is worth.

Pattern, on one rank's dataflow: a residual add + RMSNorm (`add_rms_norm`'s group) whose non-residual input is the
output of an all-reduce: `c10d::allreduce_` reading the projection's output in place (its schema marks no write, so
the add still reads the tensor from the projection and the collective appears as a second reader of it), or the
functional `_c10d_functional::all_reduce` → `wait_tensor` that DTensor redistribution runs. Every norm after a
residual add follows one: 2·L per step for L layers. The group holds the add and the norm; the all-reduce stays at
its measured time (it is the communication, which the fusion does not remove), so this entry's opportunity rows are
the add and the norm's own saving at these sites, which `add_rms_norm` then does not claim.

What folding the all-reduce in adds (`estimate_phase`, summary.json `tensor_parallel.fusion`): with x the reduced
activation (rows × N × s bytes), unfused the all-reduce writes x and the add reads it back; fused, the reduced values
go from registers into the add and the norm. Per site, unfused = the all-reduce + (7s + 28)·N bytes per row for the
add and the norm (bf16, as `add_rms_norm` counts them), fused = the all-reduce + 4·s·N − s·N (x is not read back),
and one launch instead of the all-reduce's and the add + norm's. The all-reduce is charged at its measured (NCCL)
time in both, its own write of x included (the saving is a floor); a one-shot fused all-reduce that engines use at
decode sizes can also be faster than NCCL's, which is not modelled.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from fusionscope.fusions.base import Graph, Match
from fusionscope.fusions.rms_norm import is_residual_add, norm_chain

KEY = "allreduce_add_rms_norm"
KERNEL = None  # estimate only: no bundled kernel yet
NO_PATCH = "estimate only: no bundled all-reduce + add + RMSNorm kernel, so there is nothing to patch in"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
TITLE = "all-reduce + residual add + RMSNorm under tensor parallelism → one kernel (estimate only)"

INPLACE_ALL_REDUCE = "c10d::allreduce_"
FUNCTIONAL_ALL_REDUCE = ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce_")
WAIT = "_c10d_functional::wait_tensor"


def reduced_by(graph: Graph, node: int) -> int:
    """The all-reduce whose result is the tensor `node` hands over (-1: none): a functional all-reduce above it
    (through `wait_tensor`), or an in-place `c10d::allreduce_` that also read `node`'s output or its base."""
    up = node
    while graph.name.get(up) == WAIT:
        up = graph.producer(up)
    if graph.name.get(up) in FUNCTIONAL_ALL_REDUCE:
        return up
    for tensor in dict.fromkeys((node, graph.through_views(node))):
        for reader in graph.consumers.get(tensor, ()):
            if graph.name.get(reader) == INPLACE_ALL_REDUCE:
                return reader
    return -1


def find(graph: Graph) -> list[Match]:
    matches = []
    for rsqrt in graph.named("aten::rsqrt"):
        chain = norm_chain(graph, rsqrt)
        if chain is None or not is_residual_add(graph, chain[1]):
            continue
        group, add, out = chain
        if not any(reduced_by(graph, p) >= 0 for p in graph.producers(add)):
            continue
        group = group | {add}
        phase, step = graph.where(rsqrt)
        matches.append(Match(KEY, phase, step, tuple(sorted(group)), graph.module[rsqrt],
                             escaping=graph.escaping(group, {out, add})))  # fmt: skip
    return matches


def all_reduce_per_step(kernels: pd.DataFrame, ops: pd.DataFrame, device_kind: str,
                        element_bytes: int) -> pd.DataFrame:  # fmt: skip
    """Per phase, the medians over its steps of one rank's all-reduces: count, time (µs) and bytes (the reduced
    tensor's). Counted: the `c10d::allreduce_` ops, which do the work in both the in-place and the functional path
    (`_c10d_functional::all_reduce` wraps one). Time: on a GPU the NCCL all-reduce kernels; on the CPU (gloo) the
    ops' self time as the kernel table has it (the reduction itself runs on gloo's threads). Bytes: the tensor's
    recorded shape × `element_bytes` (a TensorList argument carries no dtype in the trace)."""
    columns = ["phase", "count", "us", "bytes"]
    found = ops[(ops["name"] == INPLACE_ALL_REDUCE) & (ops["phase"].fillna("") != "")]
    if found.empty:
        return pd.DataFrame(columns=columns)
    found = found.assign(bytes=[_first_tensor_numel(d) * element_bytes for d in found["input_dims"]])
    if device_kind == "cuda":
        name = kernels["name"].astype(str)
        timed = kernels[name.str.startswith(("ncclKernel", "ncclDevKernel")) & name.str.contains("AllReduce")]
    else:
        timed = kernels[kernels["op"] == INPLACE_ALL_REDUCE]
    us = timed.groupby(["phase", "step"])["dur_us"].sum()
    per_step = found.groupby(["phase", "step"]).agg(count=("name", "size"), bytes=("bytes", "sum"))
    per_step["us"] = us.reindex(per_step.index).fillna(0.0)
    out = per_step.groupby(level="phase", sort=False)[["count", "us", "bytes"]].median().reset_index()
    return out[columns]


def _first_tensor_numel(dims: object) -> float:
    """Elements of an op's first tensor input from the trace's `Input Dims` (a list, or its text as a CSV holds
    it; a TensorList's first tensor); NaN when unknown."""
    dims = _as_list(dims)
    if not dims or not isinstance(dims[0], list):
        return math.nan
    shape = dims[0][0] if dims[0] and isinstance(dims[0][0], list) else dims[0]
    return float(math.prod(shape)) if all(isinstance(n, int) for n in shape) else math.nan


def _as_list(value: object) -> list:
    if isinstance(value, list):
        return value
    if isinstance(value, str) and value.startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            return []
    return []


def estimate_phase(opportunity: dict | None, all_reduce: dict, copy_gbps: float | None, device_kind: str) -> dict:
    """What fusing the all-reduce into the add + norm would save in one phase, per step (µs, bytes, launches).

    `opportunity`: this entry's summary.json row of the phase (the add + norm at the all-reduced sites, as measured
    and as the analytic fused kernel), or None; `all_reduce`: that phase's row of `all_reduce_per_step`. Now: the
    all-reduces' measured time plus the add + norm's; fused: the all-reduces' time again (communication is not
    removed) plus the add + norm's fused time less reading the reduced tensor back, which no longer leaves
    registers. On the CPU gloo reduces on its own threads, so nothing here is a kernel to fuse: confidence low."""
    sites = float(opportunity["count"]) if opportunity else 0.0
    comm_us, comm_bytes = float(all_reduce.get("us") or 0.0), float(all_reduce.get("bytes") or 0.0)
    comm_count = float(all_reduce.get("count") or 0.0)
    base = {"sites": sites, "all_reduces": comm_count, "all_reduce_us": comm_us, "all_reduce_bytes": comm_bytes}
    if not opportunity or not sites:
        return {**base, "t_now_us": None, "t_fused_us": None, "saved_us": None, "launches_now": None,
                "launches_fused": None, "confidence": "low",
                "reason": "no residual add + RMSNorm after an all-reduce was found"}  # fmt: skip
    # The all-reduces at the norm sites: those of o_proj and down_proj; others (an embedding's, the lm_head's
    # gather) stay outside, so time and bytes are scaled to the sites' share of the phase's all-reduces.
    share = min(sites / comm_count, 1.0) if comm_count else 0.0
    site_us, site_bytes = comm_us * share, comm_bytes * share
    read_back_us = site_bytes / (float(copy_gbps) * 1e3) if copy_gbps and site_bytes == site_bytes else 0.0
    norm_fused = max(float(opportunity["t_fused_us"]) - read_back_us, 0.0)
    t_now = site_us + float(opportunity["t_now_us"])
    t_fused = site_us + norm_fused
    if device_kind != "cuda":
        confidence, reason = "low", "a CPU run: gloo reduces on its own threads, so there is no kernel to fuse"
    elif not site_us:
        confidence, reason = "low", "no NCCL kernel time was measured for the all-reduces"
    else:
        confidence = "medium"
        reason = ("the all-reduce is charged at NCCL's measured time in both; a one-shot fused all-reduce can be "
                  "faster at decode sizes (not modelled)")  # fmt: skip
    return {**base, "t_now_us": t_now, "t_fused_us": t_fused, "saved_us": max(t_now - t_fused, 0.0),
            "launches_now": float(opportunity["launches_now"]) + comm_count * share, "launches_fused": sites,
            "confidence": confidence, "reason": reason}  # fmt: skip
