"""The eager launch path: launchers run with `wrap_triton` switched off (a plain `kernel[grid](...)` launch instead
of the higher-order op's Python dispatch, ~20× the host cost per call), and the switch is restored afterwards."""

from __future__ import annotations

import pytest
from fusionscope.kernels.dispatch import run
from torch._library.triton import is_wrap_triton_enabled


def test_eager_launchers_run_without_the_wrap_triton_dispatch() -> None:
    seen: list[tuple[bool, tuple]] = []
    before = is_wrap_triton_enabled()
    run("rms_norm", lambda *args: seen.append((is_wrap_triton_enabled(), args)), 1, "two")
    assert seen == [(False, (1, "two"))]
    assert is_wrap_triton_enabled() == before


def test_the_switch_is_restored_when_a_launcher_raises() -> None:
    before = is_wrap_triton_enabled()

    def launcher() -> None:
        raise ValueError("bad launch")

    with pytest.raises(ValueError, match="bad launch"):
        run("rms_norm", launcher)
    assert is_wrap_triton_enabled() == before
