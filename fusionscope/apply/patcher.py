"""The undo log every patch goes through, and the answer a patcher gives per site: what the fusion modules' patchers
and the rewritten forwards they bind (`apply.layers`, `apply.attention`, `apply.gpt2`) are written against.

A `Patcher` changes module instances only (forwards bound on the instance, attributes set on it), logging how to put
each change back; `restore()` undoes them in reverse order, so after a patch the model computes bit-for-bit what it
did before. `Support` says, per site, that a change was made or why not. Both sit below the fusion catalogue so that
each fusion module can hold its own patcher; `apply.patching.patch`, above the catalogue, drives them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


_MISSING = object()


@dataclass(frozen=True)
class Support:
    """Whether a patch could be made at one site, and why not (a silent no-op is a bug in a measuring tool)."""

    ok: bool
    reason: str = ""

    @staticmethod
    def yes() -> Support:
        return Support(True)

    @staticmethod
    def no(reason: str) -> Support:
        return Support(False, reason)


class Patcher:
    """The undo log of one patch over one model: every change made to an instance and how to put it back.

    `state` is scratch space a fusion's patches share while the patch is active (the carried residual of
    add_rms_norm, the memo of a fused projection), keyed by the fusion's name."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state: dict[str, Any] = {}
        self._undo: list[Callable[[], None]] = []
        self._forwards: dict[int, str] = {}  # id(module) -> fusion that rebound its forward

    def module(self, path: str) -> nn.Module | None:
        """The submodule at a qualified path ("" is the model itself); None when there is none."""
        try:
            return self.model.get_submodule(path) if path else self.model
        except AttributeError:
            return None

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set `obj.name` on the instance; on restore, put back the old instance attribute or remove the new one."""
        from torch import nn

        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        object.__setattr__(obj, name, value) if isinstance(obj, nn.Module) else setattr(obj, name, value)

        def undo() -> None:
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                object.__setattr__(obj, name, old) if isinstance(obj, nn.Module) else setattr(obj, name, old)

        self._undo.append(undo)

    def set_forward(self, module: nn.Module, forward: Callable[..., Any], owner: str) -> None:
        """Bind `forward(module, *args, **kwargs)` as this instance's forward. Two fusions may not both rewrite
        the same module's forward (they would silently undo each other): the second is a programming error."""
        if id(module) in self._forwards:
            raise RuntimeError(f"{owner} and {self._forwards[id(module)]} both rewrite {type(module).__name__}.forward")
        self._forwards[id(module)] = owner
        self.set_attr(module, "forward", types.MethodType(forward, module))
        self._undo.append(lambda: self._forwards.pop(id(module), None))

    def forward_owner(self, module: nn.Module) -> str | None:
        return self._forwards.get(id(module))

    def on_restore(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def checkpoint(self) -> int:
        """A mark of the undo log: `rollback(mark)` undoes every change made after it."""
        return len(self._undo)

    def rollback(self, mark: int) -> None:
        while len(self._undo) > mark:
            self._undo.pop()()

    def restore(self) -> None:
        self.rollback(0)
        self._forwards.clear()
        self.state.clear()
