"""Rank 0's decisions on every rank of a tensor-parallel apply run.

Every forward of a sharded model holds collectives (an all-reduce after each row-wise projection), so every rank must
run the same forwards in the same order: the same fusions patched, the same variants timed. What decides them is
measured (a fusion's numerics, which fusions were clearly slower alone), and a measurement can differ between ranks
(timings always do); a rank that took the other branch would wait in a collective that never comes. So each such
decision is taken on rank 0 and sent to the others (`agree`), and the other ranks follow it.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def in_ranks() -> bool:
    """Whether this process is one of several ranks of an initialised process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(value: T) -> T:
    """`value` as rank 0 has it, on every rank (a picklable object; rank 0's own is returned unchanged); outside a
    multi-rank run, `value` itself. Every rank must call it at the same point of the run."""
    if not in_ranks():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
