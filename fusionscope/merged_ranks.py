"""One trace file that holds several ranks, split back into one trace per rank.

Tools that merge per-rank torch.profiler traces for a single Perfetto view (TraceLens' TraceFuse and scripts
modelled on it) tag every event with `args.rank` and offset the ids that must stay unique across ranks (`pid`,
`id`, `correlation`, the linking key), keeping each original as `args["<field>_raw"]`. Analysed as it is, such a
file would be one process with every rank's kernels on one timeline. `split` undoes the merge: one trace per rank
with its own ids back and `distributedInfo.rank` set, which `analyze.analyze_ranks` then takes like a folder of
ranks. A file without `args.rank` on two or more distinct ranks is not a merged one and is left alone.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from fusionscope.trace_fields import to_int

# the fields a merge offsets per rank, each kept as args["<field>_raw"]; restored from there
RESTORED_FIELDS = ("pid", "id", "correlation", "External id")
MARKER = b'"rank"'  # a merged file has it on every event; a plain one at most in distributedInfo
PROBE_BYTES = 4 << 20  # the head of the file read to tell a merged trace (every event tagged) from a plain one


def _read_bytes(path: Path, limit: int = -1) -> bytes:
    """The file's (decompressed) bytes, the first `limit` only when given; b"" when it cannot be read (the
    single-file reader then says why in one line)."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read(limit)
        with path.open("rb") as f:
            return f.read(limit)
    except (OSError, EOFError):
        return b""


def ranks_of(events: list[Any]) -> set[int]:
    """The distinct `args.rank` values among the events (numbers, or numeric strings: `_rank`)."""
    found: set[int] = set()
    for event in events:
        if isinstance(event, dict):
            rank = _rank(event)
            if rank is not None:
                found.add(rank)
    return found


def _rank(event: dict) -> int | None:
    """The event's `args.rank` (`trace_fields.to_int`: a number or a numeric string), None without one."""
    args = event.get("args")
    rank = args.get("rank") if isinstance(args, dict) else None
    if rank is None or isinstance(rank, bool):
        return None
    parsed = to_int(rank, -1)
    return parsed if parsed >= 0 else None


def _restored(event: dict) -> dict:
    """The event as its rank wrote it: each offset field back from its `_raw` copy, the merge's args removed (and an
    args object the merge added to hold them)."""
    args = event.get("args")
    if not isinstance(args, dict):
        return event
    event = dict(event)
    args = dict(args)
    for field in RESTORED_FIELDS:
        raw = args.pop(f"{field}_raw", None)
        if raw is None:
            continue
        if field in event:
            event[field] = raw
        elif field in args:
            args[field] = raw
    args.pop("rank", None)
    if args:
        event["args"] = args
    else:  # the merge gave it its only argument
        del event["args"]
    return event


def split(path: Path, folder: Path) -> list[Path] | None:
    """Write one `rank<k>.trace.json.gz` per rank of a merged trace into `folder` and return them in rank order, or
    None when `path` is not a merged multi-rank trace. Events without a rank (metadata a merger added) go to every
    rank."""
    if _read_bytes(path, PROBE_BYTES).count(MARKER) < 2:
        return None
    data = _read_bytes(path)
    try:
        doc = json.loads(data)
    except ValueError:
        return None  # not JSON: the single-file reader says so in one line
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return None
    found = ranks_of(events)
    if len(found) < 2:
        return None
    per_rank: dict[int, list[dict]] = {rank: [] for rank in sorted(found)}
    for event in events:
        if not isinstance(event, dict):
            continue
        rank = _rank(event)
        targets = [rank] if rank in per_rank else list(per_rank)
        restored = _restored(event)
        for target in targets:
            per_rank[target].append(restored)
    header = {k: v for k, v in doc.items() if k not in ("traceEvents", "distributedInfo")}
    info = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    files = []
    folder.mkdir(parents=True, exist_ok=True)
    for rank, rank_events in per_rank.items():
        out = folder / f"rank{rank}.trace.json.gz"
        body = {**header, "distributedInfo": {**info, "rank": rank, "world_size": len(per_rank)},
                "traceEvents": rank_events}  # fmt: skip
        with gzip.open(out, "wt", compresslevel=3) as f:
            json.dump(body, f)
        files.append(out)
    return files
