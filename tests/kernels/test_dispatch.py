"""The eager launch path: launchers run with `wrap_triton` switched off (a plain `kernel[grid](...)` launch instead
of the higher-order op's Python dispatch, ~20× the host cost per call), and the switch is restored afterwards."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from fusionscope.kernels import dispatch
from fusionscope.kernels.dispatch import LeanKernel, Tunables, _spec, knobs, launchable, run
from fusionscope.kernels.rms_norm import rms_norm, rms_norm_reference
from fusionscope.kernels.tolerances import assert_close
from torch._library.triton import is_wrap_triton_enabled

from tests.kernels.conftest import SeenOps, device


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


def test_under_a_dispatch_mode_calls_go_through_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_fx, FakeTensorMode and the dataflow recorder are dispatch modes: there the kernel must be the
    registered op (which they can see and trace), never a raw launch behind their back."""
    monkeypatch.setattr(dispatch, "_PLANS", {})  # on a GPU the plain call below records a plan: keep it local
    x = torch.randn(3, 40, device=device())
    weight = torch.rand(40, device=device()) + 0.5
    with SeenOps() as seen:
        out = rms_norm(x, weight, 1e-6)
    assert "fusionscope.rms_norm.default" in seen.ops
    assert_close(out, rms_norm_reference(x.double(), weight.double(), 1e-6), torch.float32)
    launched = []
    parameter = torch.nn.Parameter(weight, requires_grad=False)
    run("rms_norm", lambda *a: launched.append(a), x, parameter, torch.empty_like(x), 1e-6, 0.0)
    assert len(launched) == 1  # without a mode the plain launcher runs, a model's Parameter weight included


class _Compiled:
    """Stands in for Triton's CompiledKernel: `compiled.run(grid, stream, function, metadata, launch metadata,
    hooks, *all_args)` launches directly."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, gx: int, gy: int, gz: int, stream: int, function: str, metadata: str, *rest: object) -> None:
        assert (stream, function, metadata) == (STREAM, "function", "metadata")
        self.log.append(("direct", (gx, gy, gz), rest[3:]))


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


STREAM = 7


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors stand in for GPU ones: the current device is 0 and its stream STREAM."""
    monkeypatch.setattr(dispatch, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "_raw_stream", lambda device: STREAM)
    monkeypatch.setattr(dispatch, "_PLANS", {})


@pytest.fixture
def lean(gpu: None) -> tuple[LeanKernel, list]:
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


@pytest.fixture
def kernel(gpu: None, monkeypatch: pytest.MonkeyPatch) -> _Kernel:
    """A stand-in kernel that launchers reach through `launchable`, as they reach a JITFunction."""
    stand_in = _Kernel()
    monkeypatch.setitem(dispatch._LEAN_KERNELS, stand_in, LeanKernel(stand_in))
    return stand_in


def _norm_launcher(kernel: _Kernel, calls: list) -> object:
    """A launcher as the kernel modules write them: launch parameters from metadata, one launch."""

    def launcher(x: torch.Tensor, out: torch.Tensor, eps: float) -> None:
        calls.append(1)
        launchable(kernel)[(x.shape[0],)](x, x.shape[1], eps, BLOCK=64)
        launchable(kernel)[(x.shape[0], 2)](out, x.stride(0), eps, 128)

    return launcher


def test_a_second_call_with_the_same_metadata_replays_the_recorded_launches(kernel: _Kernel) -> None:
    calls: list = []
    launcher = _norm_launcher(kernel, calls)
    x, out = torch.randn(3, 40), torch.empty(3, 40)
    run("norm", launcher, x, out, 1e-6)
    x2, out2 = torch.randn(3, 40), torch.empty(3, 40)
    run("norm", launcher, x2, out2, 1e-6)
    assert len(calls) == 1  # the launcher ran for the first call only
    first, replayed = kernel.log[:2], kernel.log[2:]
    assert [e[0] for e in first] == ["triton", "triton"] and [e[0] for e in replayed] == ["direct", "direct"]
    (_, grid_a, args_a), (_, grid_b, args_b) = replayed
    assert (grid_a, grid_b) == ((3, 1, 1), (3, 2, 1))
    # this call's tensors, as their data pointers (what the compiled launcher takes), and the recorded constants
    assert args_a[0] == x2.data_ptr() and args_a[1:] == (40, 1e-6, 64, False)
    assert args_b[0] == out2.data_ptr() and args_b[1:] == (40, 1e-6, 128, False)


@pytest.mark.parametrize(
    "other",
    [
        lambda x, out: (torch.randn(5, 40), torch.empty(5, 40), 1e-6),  # another shape
        lambda x, out: (x.t().contiguous().t(), out, 1e-6),  # other strides
        lambda x, out: (x.half(), out, 1e-6),  # another dtype
        lambda x, out: (torch.randn(3 * 40 + 1)[1:].view(3, 40), out, 1e-6),  # data off 16-byte alignment
        lambda x, out: (x, out, 1e-5),  # another non-tensor value
    ],
)
def test_what_the_launcher_reads_is_part_of_the_key(kernel: _Kernel, other) -> None:
    calls: list = []
    launcher = _norm_launcher(kernel, calls)
    x, out = torch.randn(3, 40), torch.empty(3, 40)
    run("norm", launcher, x, out, 1e-6)
    run("norm", launcher, *other(x, out))
    assert len(calls) == 2


def test_the_same_tensor_in_two_places_is_keyed_apart_from_two_tensors(kernel: _Kernel) -> None:
    calls: list = []
    launcher = _norm_launcher(kernel, calls)
    x = torch.randn(3, 40)
    run("norm", launcher, x, x, 1e-6)  # in place: out is x
    out = torch.empty(3, 40)
    run("norm", launcher, x, out, 1e-6)
    run("norm", launcher, x, out, 1e-6)
    assert len(calls) == 2
    assert kernel.log[-1][2][0] == out.data_ptr()  # a replay writes where this call asked, not into x


def test_a_launcher_that_does_more_than_launch_is_never_replayed(kernel: _Kernel) -> None:
    calls: list = []

    def allocates(x: torch.Tensor) -> None:  # scratch made inside the launcher
        calls.append(1)
        launchable(kernel)[(1,)](torch.empty_like(x), 7, 1e-6, BLOCK=64)

    def computes(x: torch.Tensor) -> None:  # a torch op beside the launch
        calls.append(1)
        x.mul_(2)
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64)

    def launches_nothing(x: torch.Tensor) -> None:
        calls.append(1)

    for launcher in (allocates, computes, launches_nothing):
        calls.clear()
        for _ in range(3):
            run("norm", launcher, torch.randn(4))
        assert len(calls) == 3, launcher.__name__


def test_changed_tunables_or_a_launch_hook_bring_the_launcher_back(
    kernel: _Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list = []
    settings = Tunables(BLOCK=64)

    def launcher(x: torch.Tensor) -> None:
        calls.append(1)
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=settings["BLOCK"])

    x = torch.randn(4)
    run("norm", launcher, x)
    run("norm", launcher, x)
    settings["BLOCK"] = 128
    run("norm", launcher, x)
    assert len(calls) == 2 and kernel.log[-1][3] == {"BLOCK": 128}
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    run("norm", launcher, x)
    assert len(calls) == 3 and kernel.log[-1][0] == "triton"


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.__setitem__("BLOCK", 128),
        lambda s: s.update(BLOCK=128),
        lambda s: s.__ior__({"BLOCK": 128}),
        lambda s: s.setdefault("WARPS", 4),
        lambda s: s.pop("BLOCK"),
        lambda s: s.popitem(),
        lambda s: s.__delitem__("BLOCK"),
        lambda s: s.clear(),
    ],
)
def test_every_change_of_tunables_forgets_the_plans(kernel: _Kernel, change) -> None:
    settings = Tunables(BLOCK=64)
    run("norm", lambda x: launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64), torch.randn(4))
    assert dispatch._PLANS
    change(settings)
    assert not dispatch._PLANS


def test_a_launch_the_recorder_cannot_see_keeps_the_launcher_running(
    kernel: _Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that is no JITFunction (an autotuner, say) launches through `wrap_triton`: a replay would drop it."""
    monkeypatch.setattr(dispatch, "wrap_triton", lambda k: k)
    other = _Kernel()
    calls: list = []

    def launcher(x: torch.Tensor) -> None:
        calls.append(1)
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64)
        launchable(other)[(1,)](x, 7, 1e-6, BLOCK=64)

    x = torch.randn(4)
    for _ in range(3):
        run("norm", launcher, x)
    assert len(calls) == 3 and len(other.log) == 3


def test_a_launcher_that_raises_records_nothing_and_restores_the_state(kernel: _Kernel) -> None:
    def launcher(x: torch.Tensor) -> None:
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64)
        raise ValueError("bad launch")

    with pytest.raises(ValueError, match="bad launch"):
        run("norm", launcher, torch.randn(4))
    assert not dispatch._PLANS
    assert not getattr(dispatch._eager, "active", False) and getattr(dispatch._eager, "recorder", None) is None


def test_a_nested_call_leaves_the_outer_launcher_its_lean_path(
    kernel: _Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(While a call is recorded, a nested call sees the recorder's dispatch mode and takes the op: replays off.)"""
    monkeypatch.setitem(dispatch.LEAN, "replay", False)
    seen: list = []

    def inner(x: torch.Tensor) -> None:
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64)

    def outer(x: torch.Tensor) -> None:
        run("inner", inner, x)
        seen.append(type(launchable(kernel)).__name__)
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64)

    x = torch.randn(4)
    run("outer", outer, x)
    assert seen == ["LeanKernel"]


def test_with_replay_off_the_launcher_runs_and_launches_lean(kernel: _Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(dispatch.LEAN, "replay", False)
    calls: list = []

    def launcher(x: torch.Tensor) -> None:
        calls.append(1)
        launchable(kernel)[(1,)](x, 7, 1e-6, BLOCK=64)

    x = torch.randn(4)
    for _ in range(2):
        run("norm", launcher, x)
    assert len(calls) == 2 and not dispatch._PLANS
    assert [entry[0] for entry in kernel.log] == ["triton", "direct"]


def test_without_the_lean_path_every_call_runs_the_launcher(kernel: _Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    launcher = lambda *args: calls.append(args)  # noqa: E731  (launchable would give wrap_triton)
    monkeypatch.setitem(dispatch.LEAN, "enabled", False)
    x, out = torch.randn(3, 40), torch.empty(3, 40)
    for _ in range(2):
        run("norm", launcher, x, out, 1e-6)
    assert len(calls) == 2 and not dispatch._PLANS
