"""Programmatic dependent launch: which launches get it, and the rule every kernel that takes it keeps (no read of
another kernel's output and no store before `gdc_wait`). The overlap itself needs a Hopper GPU; what CI can check is
that nothing else launches with it, and the order of the waits in each kernel's source."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fusionscope.kernels import pdl

# the modules (the package's names are the public functions)
MODULES = [importlib.import_module(f"fusionscope.kernels.{name}")
           for name in ("add_layer_norm", "add_rms_norm", "decode_attention", "gemv", "rms_norm", "rope",
                        "silu_and_mul")]  # fmt: skip
# gemv's weight tile may load before the wait: a Parameter no kernel writes (`EARLY_W`)
LOADS_BEFORE_THE_WAIT = {"_gemv_kernel": {"w_rows"}}


def _pdl_kernels() -> list[Any]:
    """The kernels (JIT or, under the interpreter, interpreted functions) with a PDL parameter."""
    kernels = []
    for module in MODULES:
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if inspect.isfunction(fn) and "PDL" in inspect.signature(fn).parameters and value not in kernels:
                kernels.append(value)
    return kernels


def test_every_decode_kernel_takes_pdl() -> None:
    names = {k.fn.__name__ for k in _pdl_kernels()}
    expected = {"_gemv_kernel", "_add_rms_norm_kernel", "_rms_norm_kernel", "_silu_and_mul_flat_kernel",
                "_rope_and_cache_kernel", "_decode_attention_kernel", "_decode_attention_combine_kernel",
                "_add_layer_norm_kernel"}  # fmt: skip
    assert expected <= names


def _calls_in_order(fn: object) -> list[tuple[str, str]]:
    """(callee, first argument's source) of every call in the kernel body, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    out = []
    for call in calls:
        callee = ast.unparse(call.func)
        first = ast.unparse(call.args[0]) if call.args else ""
        out.append((callee, first))
    return out


@pytest.mark.parametrize("kernel", _pdl_kernels(), ids=lambda k: k.fn.__name__)
def test_no_kernel_reads_or_writes_before_its_wait(kernel: Any) -> None:
    """Before the first wait of the source (`pdl.wait_for_previous(PDL)`, or `gdc_wait()`): no `tl.store`, and no
    `tl.load` but of a weight the kernel is allowed to read early; and the wait is followed by the signal to the next
    kernel."""
    calls = _calls_in_order(kernel.fn)
    callees = [c for c, _ in calls]
    if "wait_for_previous" in callees:  # the helper: the wait, then the signal
        assert calls[callees.index("wait_for_previous")][1] == "PDL"
        first_wait = callees.index("wait_for_previous")
    else:
        assert "gdc_wait" in callees and "gdc_launch_dependents" in callees
        first_wait = callees.index("gdc_wait")
        assert callees.index("gdc_launch_dependents") > first_wait
    allowed = LOADS_BEFORE_THE_WAIT.get(kernel.fn.__name__, set())
    for callee, first in calls[:first_wait]:
        assert callee != "tl.store", f"{kernel.fn.__name__} stores before its wait"
        if callee == "tl.load":
            assert any(first.startswith(a) for a in allowed), f"{kernel.fn.__name__} loads {first} before its wait"


def test_launches_get_pdl_only_in_eager_calls_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """On: a plain eager launch on an sm90+ GPU. Off: a CPU tensor (the interpreter), an sm80 GPU, a launch outside
    a plain eager call (torch.compile's, the registered op's), or the switch off."""
    gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    capability = {"major": 9}
    monkeypatch.setattr(pdl, "_hopper_or_later", lambda device: capability["major"] >= 9)
    monkeypatch.setattr(pdl, "eager_launch", lambda: True)
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    assert pdl.launch_options(gpu) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_options(torch.ones(1)) == {"PDL": False}
    capability["major"] = 8
    assert pdl.launch_options(gpu) == {"PDL": False}
    capability["major"] = 9
    monkeypatch.setattr(pdl, "eager_launch", lambda: False)
    assert pdl.launch_options(gpu) == {"PDL": False}
    monkeypatch.setattr(pdl, "eager_launch", lambda: True)
    monkeypatch.setitem(pdl.PDL, "enabled", False)
    assert pdl.launch_options(gpu) == {"PDL": False}


def test_a_launch_without_pdl_never_carries_the_launch_option() -> None:
    """The kernel waits only where its PDL constexpr is set: an option without the constexpr would overlap a kernel
    that does not wait."""
    for options in (pdl._ON, pdl._OFF):
        assert options["PDL"] == ("launch_pdl" in options)


def test_the_wait_helper_waits_then_signals() -> None:
    callees = [c for c, _ in _calls_in_order(pdl.wait_for_previous.fn)]
    assert callees == ["gdc_wait", "gdc_launch_dependents"]
