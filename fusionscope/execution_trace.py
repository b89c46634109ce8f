"""Exact dataflow from PyTorch's execution trace (`torch.profiler.ExecutionTraceObserver`), captured beside a Kineto
trace: the edges of `fusionscope.order_graph`'s nodes taken from tensor identities instead of op order.

The execution trace records every op with its arguments, tensors as `[tensor id, storage id, offset, numel, item
size, device]`, and its outputs likewise; each op's `rf_id` attribute is the Kineto event's `Record function id`.
A node's input is then produced by the last node that output that tensor, or that wrote in place into its storage
later (a `copy_` into a slice of a cache is read through the cache's other views) — the rule the dataflow recorder
follows with live tensors (`fusionscope.dataflow`).
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pandas as pd

from fusionscope.dataflow_nodes import LEAF
from fusionscope.errors import UsageError
from fusionscope.op_outputs import short_name
from fusionscope.order_graph import BASIS_EXECUTION_TRACE, dataflow_table, tensor_inputs
from fusionscope.roofline.elementwise import _ELEMENTWISE

ET_SUFFIXES = (".et.json", ".et.json.gz")  # `<trace name>.et.json[.gz]` beside the trace is found on its own


def find_beside(trace: Path, name: str) -> Path | None:
    """The execution trace named after the Kineto trace (`<name>.et.json` or `.et.json.gz`), if there is one."""
    for suffix in ET_SUFFIXES:
        candidate = trace.with_name(name + suffix)
        if candidate.is_file():
            return candidate
    return None


def load(path: Path) -> dict[int, dict]:
    """The execution trace's ops by `rf_id`: {rf_id: {"inputs": [values], "outputs": [values], "schema": str}}. A file
    that is not an execution trace is a UsageError."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        doc = json.loads(raw)
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise UsageError(f"cannot read the execution trace {path}: {type(exc).__name__}") from None
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list):
        raise UsageError(f"{path} is not a PyTorch execution trace (no nodes)")
    ops: dict[int, dict] = {}
    for node in nodes:
        attrs = {a.get("name"): a.get("value") for a in node.get("attrs", []) if isinstance(a, dict)}
        rf = attrs.get("rf_id")
        if isinstance(rf, int) and rf > 0:
            ops[rf] = {
                "inputs": node.get("inputs", {}).get("values", []),
                "outputs": node.get("outputs", {}).get("values", []),
                "schema": attrs.get("op_schema") or "",
            }
    return ops


def _refs(value: object) -> list[tuple[int, int]]:
    """(tensor id, storage id) of a tensor value (`[id, storage, offset, numel, item size, device]`), or of each
    member of a list of them; nothing for any other value."""
    if not isinstance(value, list) or not value:
        return []
    if isinstance(value[0], int) and len(value) >= 6 and isinstance(value[1], int):
        return [(value[0], value[1])]
    return [ref for member in value for ref in _refs(member) if isinstance(member, list)]


def exact_dataflow(nodes: pd.DataFrame, ops: pd.DataFrame, record_ids: dict[int, int],
                   et: dict[int, dict]) -> pd.DataFrame:  # fmt: skip
    """`nodes` (an `order_graph.infer_dataflow` table) with each input's producer taken from the execution trace
    where its op is in it (`record_ids`: op_id → Kineto `Record function id`); other nodes keep their inferred
    inputs. `.attrs`: basis "execution trace", `join_rate` (share of nodes found in the execution trace)."""
    by_op = ops.set_index("op_id")
    producer: dict[int, int] = {}  # tensor id → node that last output it
    writer: dict[int, int] = {}  # storage id → node that last wrote into it in place
    rows, found = [], 0
    for row in nodes.itertuples(index=False):
        entry = et.get(record_ids.get(row.op_id, -1))
        inputs = row.inputs
        if entry is not None:
            found += 1
            op = by_op.loc[row.op_id]
            short = short_name(row.name)
            elementwise = short in _ELEMENTWISE or short.removesuffix("_") in _ELEMENTWISE
            _shapes, where, _others = tensor_inputs(op["input_dims"], op["input_type"], elementwise)
            values = entry["inputs"]
            read = []
            for pos, member in where:
                refs = _refs(values[pos]) if pos < len(values) else []
                ref = refs[max(member, 0)] if max(member, 0) < len(refs) else None
                if ref is None:
                    read.append(LEAF)
                    continue
                own, wrote = producer.get(ref[0], LEAF), writer.get(ref[1], LEAF)
                read.append(max(own, wrote))
            inputs = tuple(read)
            for tensor, _storage in _refs(entry["outputs"]):
                producer[tensor] = row.node
            if "(a!)" in entry["schema"] and where:  # in place: every alias of the written storage now reads it
                for _tensor, storage in _refs(values[where[0][0]]):
                    writer[storage] = row.node
        rows.append((*row[:5], inputs, *row[6:11], *row[12:]))  # the row less its consumers, recounted
    table = dataflow_table(rows, BASIS_EXECUTION_TRACE)
    table.attrs["join_rate"] = found / len(nodes) if len(nodes) else 1.0
    return table
