"""The public kernel functions under the replay path of `kernels/dispatch.py`, with stand-in kernels.

A launcher is replayed only if it does nothing but compute launch parameters from its arguments' metadata and launch;
a torch op inside it (a view, an allocation) silently costs every decode call its launcher again. Here the kernels
are replaced by stand-ins that log what would launch, CPU tensors pass for GPU ones, and each public function is called
twice with fresh inputs of the same metadata: the second call must replay the first call's launches — same grids,
same non-tensor arguments — on the second call's tensors, passed as data pointers at the same offsets into them.
(`reports/bench/check_kernels.py` checks the real launches on the GPU.)
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from fusionscope.kernels import dispatch
from fusionscope.kernels.dispatch import LeanKernel


class _Compiled:
    """Stands in for a CompiledKernel: its launcher logs the grid and the arguments."""

    function = packed_metadata = None

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, gx: int, gy: int, gz: int, _stream: int, _fn: object, _meta: object, *rest: object) -> None:
        self.log.append(((gx, gy, gz), rest[3:]))


class _Kernel:
    """Stands in for a Triton kernel (jitted or interpreted): `kernel[grid](...)` logs the launch, every argument in
    parameter order, and returns a `_Compiled`, as `JITFunction.run` returns the compiled kernel."""

    def __init__(self, kernel: object, log: list) -> None:
        signature = inspect.signature(kernel.fn).parameters.values()
        self.params = [
            SimpleNamespace(name=p.name, is_constexpr="constexpr" in str(p.annotation), default=p.default)
            for p in signature
        ]
        self.log = log

    def __getitem__(self, grid: tuple) -> Callable[..., _Compiled]:
        def launch(*args: object, **kwargs: object) -> _Compiled:
            rest = [kwargs.get(p.name, p.default) for p in self.params[len(args) :]]
            self.log.append(((*grid, 1, 1)[:3], (*args, *rest)))
            return _Compiled(self.log)

        return launch


def _tensors(values: object) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    return [t for v in values for t in _tensors(v)] if isinstance(values, list | tuple) else []


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) + 2.0  # never zero


def _rope_inputs() -> dict:
    return {
        "q": _r(2, 1, 4, 8).transpose(1, 2),
        "k": _r(2, 1, 2, 8).transpose(1, 2),
        "v": _r(2, 1, 2, 8).transpose(1, 2),
        "cos": _r(2, 1, 8),
        "sin": _r(2, 1, 8),
        "k_cache": _r(2, 2, 16, 8),
        "v_cache": _r(2, 2, 16, 8),
        "positions": torch.tensor([5]),
    }


# name: (module, inputs, call, replayed)
CASES: dict[str, tuple[str, Callable[[], dict], Callable[..., object], bool]] = {
    "rms_norm": ("rms_norm", lambda: {"x": _r(3, 40), "w": _r(40)}, lambda k, i: k(i["x"], i["w"], 1e-6), True),
    "add_rms_norm": (
        "add_rms_norm",
        lambda: {"x": _r(3, 40), "r": _r(3, 40), "w": _r(40)},
        lambda k, i: k(i["x"], i["r"], i["w"], 1e-6, offset=1.0),
        True,
    ),
    "add_rms_norm in place": (
        "add_rms_norm",
        lambda: {"x": _r(3, 40), "r": _r(3, 40), "w": _r(40)},
        lambda k, i: k(i["x"], i["r"], i["w"], 1e-6, inplace=True),
        True,
    ),
    "silu_and_mul gate_up": ("silu_and_mul", lambda: {"g": _r(3, 2, 80)}, lambda k, i: k(i["g"]), True),
    "gelu_and_mul": (
        "gelu_and_mul",
        lambda: {"g": _r(3, 40), "u": _r(3, 40)},
        lambda k, i: k(i["g"], i["u"], approximate="tanh"),
        True,
    ),
    "rope": ("rope", _rope_inputs, lambda k, i: k(i["q"], i["k"], i["cos"], i["sin"]), True),
    "rope_and_cache": (
        "rope",
        _rope_inputs,
        lambda k, i: k(*(i[n] for n in ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "positions"))),
        True,
    ),
    "add_layer_norm 4-d": (
        "add_layer_norm",
        lambda: {"x": _r(2, 1, 3, 40), "r": _r(2, 1, 3, 40), "w": _r(40), "b": _r(40)},
        lambda k, i: k(i["x"], i["r"], i["w"], i["b"], 1e-5),
        True,
    ),
    "bias_gelu": (
        "bias_gelu",
        lambda: {"x": _r(3, 40), "b": _r(40), "r": _r(3, 40)},
        lambda k, i: k(i["x"], i["b"], "tanh", residual=i["r"]),
        True,
    ),
    "linear_act triton": (
        "linear_act",
        lambda: {"x": _r(3, 32), "w": _r(48, 32), "b": _r(48)},
        lambda k, i: k(i["x"], i["w"], i["b"], "gelu_tanh", backend="triton"),
        True,
    ),
    "sample greedy": ("sample", lambda: {"logits": _r(2, 100)}, lambda k, i: k(i["logits"], 0.7, 1, 1.0), True),
    "sample two launches": (  # its scratch buffers are allocated by the launcher: run again on every call
        "sample",
        lambda: {"logits": _r(2, 3000)},
        lambda k, i: k(i["logits"], 0.7, 50, 0.9),
        False,
    ),
}


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> list:
    """CPU tensors pass for GPU ones; every kernel of every module launches through a logging stand-in."""
    monkeypatch.setattr(dispatch, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(dispatch, "_PLANS", {})
    log: list = []
    for module in {case[0] for case in CASES.values()}:
        for value in vars(importlib.import_module(f"fusionscope.kernels.{module}")).values():
            if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                monkeypatch.setitem(dispatch._LEAN_KERNELS, value, LeanKernel(_Kernel(value, log)))
    return log


@pytest.mark.parametrize("name", CASES)
def test_a_repeated_call_replays_its_launches_on_its_own_tensors(name: str, stand_ins: list) -> None:
    module, make_inputs, call, replayed = CASES[name]
    function = getattr(importlib.import_module(f"fusionscope.kernels.{module}"), name.split()[0])
    first_inputs = make_inputs()
    first_out = call(function, first_inputs)
    first = list(stand_ins)
    stand_ins.clear()
    second_inputs = make_inputs()
    second_out = call(function, second_inputs)
    plans = list(dispatch._PLANS.values())
    assert len(plans) == 1 and (plans[0] is not None) == replayed
    assert [grid for grid, _ in stand_ins] == [grid for grid, _ in first] and first
    # each storage of the first call's inputs and outputs -> the storage in the same place in the second call's
    mine = {
        a.untyped_storage().data_ptr(): b.untyped_storage().data_ptr()
        for a, b in zip(_tensors([first_inputs, first_out]), _tensors([second_inputs, second_out]), strict=True)
    }
    for (_, before), (_, now) in zip(first, stand_ins, strict=True):
        assert len(before) == len(now)
        for a, b in zip(before, now, strict=True):
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in mine:
                start = mine[a.untyped_storage().data_ptr()]
                if replayed:  # this call's tensor, passed to the compiled launcher as its data pointer
                    assert type(b) is int and b - start == a.data_ptr() - a.untyped_storage().data_ptr()
                else:  # the launcher ran again: Triton got this call's tensor
                    assert isinstance(b, torch.Tensor) and b.untyped_storage().data_ptr() == start
                    assert (b.shape, b.stride(), b.dtype) == (a.shape, a.stride(), a.dtype)
            elif not isinstance(a, torch.Tensor):
                assert a == b or (a != a and b != b), (a, b)  # the same constants (NaN allowed)
