"""Inductor's own reasons for running a `reduce-overhead` compile without CUDA graphs.

torch.compile's `reduce-overhead` mode records the compiled step as a CUDA graph unless Inductor finds a reason not
to (an input mutated outside a static address, a CPU tensor in the graph, an op a graph cannot hold). It then runs
every kernel from the host, a few µs of launch each, and says so only through an artifact logger that is off by
default (`TORCH_LOGS=cudagraphs`). A decode step of a 7–8B model is 600–900 kernels, so a silent skip costs the
compiled peers milliseconds per token and would read as "our fusions beat compile" when the cause is the compile
running without graphs. The graph stage records the reasons beside each compiled variant, so the comparison says
which kind of compile it beat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

MAX_CHARS = 600  # a mutation reason carries the mutating op's stack trace: its head names the site


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage()[:MAX_CHARS])


@contextmanager
def cudagraph_skips() -> Iterator[list[str]]:
    """Collects, while it is entered, every reason Inductor gives for not recording a CUDA graph; a skip it counted
    without logging one (its path for graphs on no CUDA device) is added as a count."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_utils

    seen: list[str] = []
    handler = _Collect(seen)
    logger = cudagraph_utils.cudagraphs_log
    before = counters["inductor"]["cudagraph_skips"]
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        silent = counters["inductor"]["cudagraph_skips"] - before - len(seen)
        if silent > 0:
            seen.append(f"{silent} graph(s) run without CUDA graphs (Inductor counted the skip without a reason)")


def first_line(reason: str) -> str:
    """The reason without the stack trace a mutation skip appends."""
    return reason.strip().splitlines()[0] if reason.strip() else ""


def skip_lines(graphs: dict) -> list[str]:
    """One line per compiled variant Inductor ran without CUDA graphs (`apply --graphs`' summary), for the terminal
    and the report; none when every compiled step was graphed."""
    lines = []
    for name, row in (graphs.get("variants") or {}).items():
        reasons = [first_line(r) for r in row.get("cudagraph_skips") or []]
        if reasons:
            shown = "; ".join(dict.fromkeys(reasons))
            lines.append(f"{name}: Inductor ran {len(reasons)} graph(s) without CUDA graphs, its kernels launched "
                         f"one by one from the host: {shown}")  # fmt: skip
    return lines
