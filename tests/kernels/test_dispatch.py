"""The eager launch path: launchers run with `wrap_triton` switched off (a plain `kernel[grid](...)` launch instead
of the higher-order op's Python dispatch, ~20× the host cost per call), and the switch is restored afterwards."""

from __future__ import annotations

import pytest
import torch
from fusionscope.kernels.dispatch import run
from fusionscope.kernels.rms_norm import rms_norm, rms_norm_reference
from fusionscope.kernels.tolerances import assert_close
from torch._library.triton import is_wrap_triton_enabled
from torch.utils._python_dispatch import TorchDispatchMode


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


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_calls_go_through_the_op() -> None:
    """make_fx, FakeTensorMode and the dataflow recorder are dispatch modes: there the kernel must be the
    registered op (which they can see and trace), never a raw launch behind their back."""
    x = torch.randn(3, 40)
    weight = torch.rand(40) + 0.5
    with _Seen() as seen:
        out = rms_norm(x, weight, 1e-6)
    assert "fusionscope.rms_norm.default" in seen.ops
    assert_close(out, rms_norm_reference(x.double(), weight.double(), 1e-6), torch.float32)
    launched = []
    parameter = torch.nn.Parameter(weight, requires_grad=False)
    run("rms_norm", lambda *a: launched.append(a), x, parameter, torch.empty_like(x), 1e-6, 0.0)
    assert len(launched) == 1  # without a mode the plain launcher runs, a model's Parameter weight included
