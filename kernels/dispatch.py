"""How a public kernel function reaches its Triton launch: through the registered op only when it must.

Each kernel registers its launcher with `torch.library.triton_op` as `fusionscope::<name>`, so torch.compile sees
the op in its graph (and can capture it in CUDA graphs). Launchers call `wrap_triton(kernel)[grid](...)`, which is
what lets the op be traced. In eager mode both of the obvious paths are slow:
- through `torch.ops.fusionscope.<name>`: the dispatcher round trip costs 80–110 µs of host time per call on the
  H200 (torch 2.11);
- calling the launcher directly: `wrap_triton` is enabled by default, so every launch goes through the
  `triton_kernel_wrapper_mutation` higher-order op's Python dispatch — 222–593 µs per call measured there
  (`reports/bench/`), against ~17 µs for a plain `kernel[grid](...)`.
So plain eager calls — no torch.compile, no dispatch mode (make_fx, FakeTensorMode, ...) active, every tensor
argument a plain `torch.Tensor` or `nn.Parameter` — run the launcher with `wrap_triton` switched off for the call
(what `triton_op` itself does for its eager implementation): `wrap_triton(kernel)` then returns the kernel,
launched the usual way. Everything else goes through the op, which traces.

Even the usual way costs more than the kernel at decode sizes: Triton's `JITFunction.run` specialises every argument
(alignment of each pointer, value class of each integer), builds a cache key and looks the compiled kernel up on
each call — about 1 µs per argument on the H200 (an empty kernel: 11.8 µs with 1 argument, 32.9 µs with 24;
`reports/bench/host_cost_triton_launch.json`), and rope passes 40. So in a plain eager call on the GPU, launchers get a
`LeanKernel` instead: it keys the compiled kernel on a summary of the arguments at least as fine as Triton's
specialisation (dtype and 16-byte alignment of each tensor; for each integer whether it is 1, divisible by 16 and
its width; the constexpr and option values; the device) — the first call of each key launches through Triton and
keeps the compiled kernel it returns, later calls launch that kernel directly (`CompiledKernel[grid](*args)`).
Triton's launch hooks (set by profilers such as proton) or an unexpected argument type send the call the usual way.
`LEAN["enabled"] = False` (or `FUSIONSCOPE_LEAN_LAUNCH=0`) switches it off.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.library import wrap_triton
from triton.runtime.jit import JITFunction

try:  # triton >= 3.4; without it launches take Triton's usual path
    from triton import knobs
except ImportError:  # pragma: no cover - depends on the installed triton
    knobs = None

try:  # private, but stable since torch 2.6; without it eager calls take the op path (correct, slower)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the installed torch
    set_wrap_triton_enabled = None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a model's weights are Parameters; other subclasses may trace


def _plain_eager(args: tuple) -> bool:
    if set_wrap_triton_enabled is None or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


LEAN = {"enabled": knobs is not None and os.environ.get("FUSIONSCOPE_LEAN_LAUNCH", "1") != "0"}
_eager = threading.local()  # .active: inside a plain eager call on this thread
_I32, _I64 = 2**31, 2**63


def _spec(arg: Any) -> Any:
    """A summary of one runtime argument at least as fine as Triton's specialisation of it; `_UNKNOWN` when unsure."""
    kind = type(arg)
    if kind is int:  # the commonest argument (sizes, strides); bool is its own type here
        if -_I32 <= arg < _I32:
            return 1 if arg == 1 else 16 if arg % 16 == 0 else 0
        return "wide", arg % 16 == 0, -_I64 <= arg < _I64
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is bool:  # tagged: True == 1 and False == 0 as dictionary keys
        return "bool", arg
    if arg is None:
        return None
    if kind is float:
        return float
    return _UNKNOWN


_UNKNOWN = object()


def _hooked(hook: Any) -> bool:
    """A launch hook is set: a callable (triton 3.6) or a non-empty `HookChain` (later versions)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class LeanKernel:
    """`kernel[grid](*args, **kwargs)` with Triton's per-call specialisation replaced by a lookup (module docstring)."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.names = [p.name for p in kernel.params]
        self.defaults = {p.name: p.default for p in kernel.params if p.default is not inspect.Parameter.empty}
        self.constexpr = tuple(p.is_constexpr for p in kernel.params)  # a constexpr passed by position keys by value
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        specs = tuple((a,) if const else _spec(a) for a, const in zip(args, self.constexpr))
        key: tuple | None = (torch.cuda.current_device(), specs, tuple(kwargs.items()))
        try:
            compiled = self.compiled.get(key)
        except TypeError:  # an unhashable constexpr value
            compiled, key = None, None
        hooked = _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)
        usual = key is None or hooked or _UNKNOWN in specs or not isinstance(grid, tuple)
        if usual or compiled is None:  # Triton specialises, compiles (or finds) and launches; keep what it launched
            launched = self.kernel[grid](*args, **kwargs)
            if not usual and launched is not None:
                self.compiled[key] = launched
            return
        rest = [kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args) :]]
        compiled[(*grid, 1, 1)[:3]](*args, *rest)


_LEAN_KERNELS: dict[JITFunction, LeanKernel] = {}


def launchable(kernel: Any) -> Any:
    """What a launcher indexes with `[grid]`: a `LeanKernel` inside a plain eager call, else `wrap_triton(kernel)`
    (the kernel itself while wrap_triton is switched off, the traceable wrapper under torch.compile)."""
    if getattr(_eager, "active", False) and type(kernel) is JITFunction:
        lean = _LEAN_KERNELS.get(kernel)
        if lean is None:
            lean = _LEAN_KERNELS[kernel] = LeanKernel(kernel)
        return lean
    return wrap_triton(kernel)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the host side: triton's is a `constexpr_function`, ~3 µs a call outside a kernel."""
    return -(-a // b)


def pow2(n: int) -> int:
    """`triton.next_power_of_2` for the host side (same reason): the smallest power of two ≥ n, 1 for n ≤ 1."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def run(name: str, launcher: Callable[..., None], *args: Any) -> None:
    """Call the plain launcher in plain eager mode, `fusionscope::<name>` otherwise (same arguments, same effect)."""
    if not _plain_eager(args):
        getattr(torch.ops.fusionscope, name)(*args)
        return
    with set_wrap_triton_enabled(False):
        _eager.active = LEAN["enabled"] and bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda
        try:
            launcher(*args)
        finally:
            _eager.active = False
