"""fusionscope: what to fuse in a PyTorch model, what it is worth, and whether it really pays.

The Python API mirrors the CLI: `fusionscope.profile("tiny-llama")` returns a `Run` whose folder holds the trace,
the tables, summary.json and report.html. Importing the package stays cheap: torch and transformers load on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Run", "load_run", "profile", "rerender"]

if TYPE_CHECKING:
    from fusionscope.run import Run, load_run, profile, rerender


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fusionscope import run

        return getattr(run, name)
    raise AttributeError(f"module 'fusionscope' has no attribute {name!r}")
