"""fusionscope: what to fuse in a PyTorch model, what it is worth, and whether it really pays.

The Python API mirrors the CLI: `fusionscope.profile("tiny-llama")` returns a `Run` whose folder holds the trace,
the tables, summary.json and report.html; `fusionscope.apply("tiny-llama")` patches the fusions found, checks the
numerics and measures before and after; `with fusionscope.patch(model, matches_or_fusion_names) as p:` patches a
model of your own. Importing the package stays cheap: torch and transformers load on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Run", "apply", "load_run", "patch", "profile", "rerender"]

if TYPE_CHECKING:
    from fusionscope.run import Run, load_run, profile, rerender


def __getattr__(name: str) -> Any:
    if name == "apply":
        import fusionscope.apply as apply_package  # a callable module: fusionscope.apply(...) runs `apply`

        return apply_package
    if name == "patch":
        from fusionscope.apply.patching import patch

        return patch
    if name in __all__:
        from fusionscope import run

        return getattr(run, name)
    raise AttributeError(f"module 'fusionscope' has no attribute {name!r}")
