"""The eager launch path: launchers run with `wrap_triton` switched off (a plain `kernel[grid](...)` launch instead
of the higher-order op's Python dispatch, ~20× the host cost per call), and the switch is restored afterwards."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from fusionscope.kernels.dispatch import LeanKernel, _spec, knobs, launchable, run
from fusionscope.kernels.rms_norm import rms_norm, rms_norm_reference
from fusionscope.kernels.tolerances import assert_close
from torch._library.triton import is_wrap_triton_enabled
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.conftest import device


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
    x = torch.randn(3, 40, device=device())
    weight = torch.rand(40, device=device()) + 0.5
    with _Seen() as seen:
        out = rms_norm(x, weight, 1e-6)
    assert "fusionscope.rms_norm.default" in seen.ops
    assert_close(out, rms_norm_reference(x.double(), weight.double(), 1e-6), torch.float32)
    launched = []
    parameter = torch.nn.Parameter(weight, requires_grad=False)
    run("rms_norm", lambda *a: launched.append(a), x, parameter, torch.empty_like(x), 1e-6, 0.0)
    assert len(launched) == 1  # without a mode the plain launcher runs, a model's Parameter weight included


class _Compiled:
    """Stands in for Triton's CompiledKernel: `compiled[grid](*all_args)` launches directly."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid: tuple) -> object:
        return lambda *args: self.log.append(("direct", grid, args))


class _Kernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` is Triton's usual launch; it returns the
    compiled kernel, as `JITFunction.run` does."""

    def __init__(self) -> None:
        param = inspect.Parameter
        self.params = [
            SimpleNamespace(name=name, is_constexpr=const, default=default)
            for name, const, default in (
                ("x", False, param.empty), ("n", False, param.empty), ("eps", False, param.empty),
                ("BLOCK", True, param.empty), ("FLAG", True, False),
            )
        ]  # fmt: skip
        self.log: list = []

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, **kwargs: object) -> _Compiled:
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log)

        return launch


@pytest.fixture
def lean(monkeypatch: pytest.MonkeyPatch) -> tuple[LeanKernel, list]:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = _Kernel()
    return LeanKernel(kernel), kernel.log


def test_lean_launch_reuses_the_compiled_kernel_with_every_argument(lean: tuple[LeanKernel, list]) -> None:
    launcher, log = lean
    x = torch.randn(64)
    launcher[(3,)](x, 7, 1e-6, BLOCK=64, num_warps=4)
    launcher[(5, 2)](x, 9, 2e-6, BLOCK=64, num_warps=4)  # same specialisation: 7 and 9 are both odd, not 1
    assert log[0] == ("triton", (3,), (x, 7, 1e-6), {"BLOCK": 64, "num_warps": 4})
    kind, grid, args = log[1]
    assert (kind, grid) == ("direct", (5, 2, 1))
    assert args[1:] == (9, 2e-6, 64, False) and args[0] is x  # constexprs in order, the default filled in


@pytest.mark.parametrize(
    "change",
    [
        lambda x: (x[1:], 7, {}),  # a pointer 4 bytes off 16-byte alignment
        lambda x: (x.half(), 7, {}),  # another dtype
        lambda x: (x, 1, {}),  # an integer equal to 1 (Triton folds it)
        lambda x: (x, 32, {}),  # an integer divisible by 16
        lambda x: (x, 2**40 + 1, {}),  # an integer wider than 32 bits
        lambda x: (x, 7, {"BLOCK": 128}),  # another constexpr value
        lambda x: (x, 7, {"num_warps": 8}),  # another launch option
    ],
)
def test_a_different_specialisation_goes_through_triton(lean: tuple[LeanKernel, list], change) -> None:
    launcher, log = lean
    x = torch.randn(64)
    launcher[(1,)](x, 7, 1e-6, BLOCK=64, num_warps=4)
    x2, n, override = change(x)
    launcher[(1,)](x2, n, 1e-6, **{"BLOCK": 64, "num_warps": 4, **override})
    assert [entry[0] for entry in log] == ["triton", "triton"]


def test_argument_summaries_keep_apart_what_triton_keeps_apart() -> None:
    summaries = [_spec(a) for a in (1, True, False, 7, 16, 2**31, 2**63, 1.0, None)]
    assert len(set(summaries)) == len(summaries)
    assert _spec(3) == _spec(5) and _spec(0) == _spec(16) == _spec(4096)  # what Triton specialises alike may share


def test_unknown_arguments_and_launch_hooks_always_take_the_usual_path(
    lean: tuple[LeanKernel, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher, log = lean
    x = torch.randn(64)
    for _ in range(2):
        launcher[(1,)](x, "seven", 1e-6, BLOCK=64)
    launcher[(1,)](x, 7, 1e-6, BLOCK=64)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launcher[(1,)](x, 7, 1e-6, BLOCK=64)
    assert [entry[0] for entry in log] == ["triton"] * 4


def test_a_constexpr_passed_by_position_keys_by_value(lean: tuple[LeanKernel, list]) -> None:
    launcher, log = lean
    x = torch.randn(64)
    launcher[(1,)](x, 7, 1e-6, 64)
    launcher[(1,)](x, 7, 1e-6, 128)
    launcher[(1,)](x, 7, 1e-6, 128)
    assert [entry[0] for entry in log] == ["triton", "triton", "direct"]
    assert log[2][2] == (x, 7, 1e-6, 128, False)


def test_only_a_plain_eager_cuda_call_gets_the_lean_launcher() -> None:
    from triton.runtime.jit import JITFunction

    seen = []
    kernel = object.__new__(JITFunction)  # identity is all `launchable` looks at before launching
    run("rms_norm", lambda *a: seen.append(type(launchable(kernel)).__name__), torch.randn(3))
    assert len(seen) == 1 and seen[0] != "LeanKernel"  # CPU tensors: never lean
