"""How a public kernel function reaches its Triton launch: through the registered op only when it must.

Each kernel registers its launcher with `torch.library.triton_op` as `fusionscope::<name>`, so torch.compile sees
the op in its graph (and can capture it in CUDA graphs). Launchers call `launchable(kernel)[grid](...)`, which is
`wrap_triton(kernel)` — what lets the op be traced — outside plain eager calls. In eager mode the obvious paths are
slow:
- through `torch.ops.fusionscope.<name>`: the dispatcher round trip costs 80–110 µs of host time per call on the
  H200 (torch 2.11);
- calling the launcher directly with `wrap_triton` enabled: every launch goes through the
  `triton_kernel_wrapper_mutation` higher-order op's Python dispatch — 222–593 µs per call measured there
  (`reports/bench/`), against ~17 µs for a plain `kernel[grid](...)`;
- even the plain launch costs more than the kernel at decode sizes: Triton's `JITFunction.run` specialises every
  argument, builds a cache key and looks the compiled kernel up on each call, ~1 µs per argument there (an empty
  kernel: 11.8 µs with 1 argument, 32.9 µs with 24), and rope passes 40.

So a plain eager call — no torch.compile, no dispatch mode (make_fx, FakeTensorMode, ...) active, every tensor
argument a plain `torch.Tensor` or `nn.Parameter` on the GPU — takes one of two lean paths:

1. **Replay.** A launcher must be a function of its arguments' metadata only: shapes, strides, dtypes, devices, 16-byte
   alignment of the data, and the values of the non-tensor arguments. `run` keys each call on exactly that (plus
   which arguments are the same tensor, and the current device). The first call of a key runs the launcher while
   recording what it launches: per launch the compiled kernel, the grid, and every kernel argument, each either a
   constant or "the i-th argument of this call". Later calls with the key skip the launcher — its layout
   arithmetic, launch configuration and Triton's per-argument specialisation — and launch the recorded kernels with
   this call's tensors, passed as their data pointers, straight through the compiled kernel's launcher (the same call
   `JITFunction.run` ends in). Given a pointer, that launcher neither calls `data_ptr()` nor asks the driver whether
   it is device memory: every tensor argument must be on the current GPU (as for Triton's own launch; the public
   functions check that they share one device).
   A launcher that does anything else — a torch op (an allocation, a cuBLAS call), a launch on a tensor that is not
   one of the call's arguments, a launch that took Triton's usual path, a kernel that is no plain `JITFunction` (an
   autotuner) — is never replayed for that key.
2. **Lean launch.** Otherwise launchers run with `wrap_triton` switched off (as `triton_op`'s own eager
   implementation does) and get a `LeanKernel`: it keys the compiled kernel on a summary of the arguments at least
   as fine as Triton's specialisation (dtype and alignment of each tensor; for each integer whether it is 1,
   divisible by 16 and its width; the constexpr and option values; the device); the first call of each summary
   launches through Triton and keeps the compiled kernel it returns, later calls launch that kernel directly.

Triton's launch hooks (set by profilers such as proton) or an unexpected argument type send a launch Triton's usual
way. `LEAN["enabled"] = False` (or `FUSIONSCOPE_LEAN_LAUNCH=0`) switches both lean paths off, `LEAN["replay"] = False`
the first. A launcher that reads module-level settings must keep them in a `Tunables` dict (changing one forgets the
recorded plans), or whoever patches it calls `forget_plans()`; global torch state (a matmul precision, say) is read by
the public function and passed in as an argument.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.library import wrap_triton
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import JITFunction

try:  # triton >= 3.4; without it launches take Triton's usual path
    from triton import knobs
except ImportError:  # pragma: no cover - depends on the installed triton
    knobs = None

try:  # private, but stable since torch 2.6; without it eager calls take the op path (correct, slower)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the installed torch
    set_wrap_triton_enabled = None


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_PLAIN = (_TENSOR, _PARAMETER)  # a model's weights are Parameters; other subclasses may trace
# enabled: both lean paths; replay: the first of them (off, launchers run on every call with a LeanKernel)
LEAN = {"enabled": knobs is not None and os.environ.get("FUSIONSCOPE_LEAN_LAUNCH", "1") != "0", "replay": True}
MAX_PLANS = 4096  # recorded keys kept before the table starts over (prefill at many sequence lengths adds keys)
_I32, _I64 = 2**31, 2**63
_UNKNOWN = object()
_MISSING = object()
_eager = threading.local()  # .active: inside a plain eager GPU call; .recorder: the _Recorder of a first call


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def plain_eager(args: tuple) -> bool:
    """No torch.compile tracing, no dispatch mode (make_fx, FakeTensorMode, ...) active, and every tensor among `args`
    a plain `torch.Tensor` or `nn.Parameter`: a call that needs no registered op to be seen."""
    if set_wrap_triton_enabled is None or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


def _hooked(hook: Any) -> bool:
    """A launch hook is set: a callable, or a `HookChain` (what triton 3.6+ holds there) with calls in it."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    return _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)


def _launch_compiled(compiled: Any, grid: tuple[int, int, int], args: list | tuple, device: int) -> None:
    """Launch a compiled kernel on the current stream of `device` (the current device): the call `JITFunction.run`
    ends in, without launch metadata and hooks (None: the launcher skips them; callers come here only when no hook
    is set, and an empty hook chain would still cost two Python calls)."""
    compiled.run(*grid, _raw_stream(device), compiled.function, compiled.packed_metadata, None, None, None, *args)


# ---------------------------------------------------------------------------------------------------------- replay


class _Launch(NamedTuple):
    """One recorded launch: kernel arguments are `template` with position p replaced by the data pointer of the call's
    argument i for every (p, i) in `slots` (the tensors; `template` holds None there, so a plan keeps no tensor
    alive)."""

    compiled: Any
    grid: tuple[int, int, int]
    template: list
    slots: tuple[tuple[int, int], ...]


class _Recorder(TorchDispatchMode):
    """Active while a launcher runs for the first time with a key: collects its launches; any torch op spoils the
    recording (the launcher computes or allocates something a replay would not)."""

    def __init__(self, args: tuple) -> None:
        super().__init__()
        self.ids = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self.ids.setdefault(id(a), i)
        self.launches: list[_Launch] = []
        self.spoiled = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.spoiled = True
        return func(*args, **(kwargs or {}))

    def add(self, compiled: Any, grid: tuple[int, int, int], args: list) -> None:
        template, slots = list(args), []
        for pos, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                index = self.ids.get(id(a))
                if index is None:  # a tensor made inside the launcher
                    self.spoiled = True
                    return
                slots.append((pos, index))
                template[pos] = None
        self.launches.append(_Launch(compiled, grid, template, tuple(slots)))


_PLANS: dict[tuple, tuple[_Launch, ...] | None] = {}  # key -> recorded launches; None: always run the launcher


def forget_plans() -> None:
    """Drop every recorded plan: call after patching anything a launcher reads that is not in a `Tunables`."""
    _PLANS.clear()


def _forgetting(method: Callable[..., Any]) -> Callable[..., Any]:
    """A `dict` method that also forgets the recorded plans."""

    def changed(self: dict, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        forget_plans()
        return result

    return changed


class Tunables(dict):
    """A kernel module's settings that its launcher reads (tile sizes, paths): changing one — by any of dict's
    mutators — forgets the plans, so the next call runs the launcher with the new value."""

    __setitem__ = _forgetting(dict.__setitem__)
    __delitem__ = _forgetting(dict.__delitem__)
    __ior__ = _forgetting(dict.__ior__)
    update = _forgetting(dict.update)
    setdefault = _forgetting(dict.setdefault)
    pop = _forgetting(dict.pop)
    popitem = _forgetting(dict.popitem)
    clear = _forgetting(dict.clear)


def _replay_key(launcher: Callable[..., None], args: tuple) -> tuple[tuple, list] | None:
    """What a launcher's behaviour depends on, for a plain eager call on GPU tensors, and each argument's data pointer
    (None for a non-tensor); None for any other call. (Every tensor argument of a launcher is on one device — the
    public functions check it — so the first one says whether the call is on the GPU.) Runs on every call: written
    for speed."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return None
    key: list = [launcher]
    pointers: list = []
    ids = []
    first = None
    for a in args:
        kind = type(a)
        if kind is _TENSOR or kind is _PARAMETER:
            pointer = a.data_ptr()
            key.append((a.shape, a.stride(), a.dtype, pointer % 16))
            pointers.append(pointer)
            ids.append(id(a))
            if first is None:
                first = a
        elif isinstance(a, _TENSOR):  # a subclass: it may trace
            return None
        else:  # by type and value: 1, 1.0 and True are equal dictionary keys
            key.append(kind)
            key.append(a)
            pointers.append(None)
    if first is None or not _on_gpu(first):
        return None
    if len(set(ids)) != len(ids):  # the same tensor passed twice (in place): which ones is part of the key
        key.append(tuple(ids.index(i) for i in ids))
    key.append(_current_device())
    return tuple(key), pointers


def _replay(plan: tuple[_Launch, ...], pointers: list, device: int) -> None:
    """Launch the recorded kernels with this call's tensors, passed as their data pointers: the compiled launcher
    takes an int as the pointer itself, where for a tensor it would call `data_ptr()` and ask the driver whether the
    pointer is a device pointer (`run`'s contract: every tensor on the current GPU)."""
    for launch in plan:
        kernel_args = launch.template.copy()
        for pos, index in launch.slots:
            kernel_args[pos] = pointers[index]
        _launch_compiled(launch.compiled, launch.grid, kernel_args, device)


# ------------------------------------------------------------------------------------------------------ lean launch


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


class LeanKernel:
    """`kernel[grid](*args, **kwargs)` with Triton's per-call specialisation replaced by a lookup (module docstring);
    inside a first call of a replay key it also reports each launch to the recorder."""

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
        device = _current_device()
        key: tuple | None = (device, specs, tuple(kwargs.items()))
        try:
            compiled = self.compiled.get(key)
        except TypeError:  # an unhashable constexpr value
            compiled, key = None, None
        usual = key is None or _hooks_set() or _UNKNOWN in specs or not isinstance(grid, tuple)
        recorder = getattr(_eager, "recorder", None)
        if usual or compiled is None:  # Triton specialises, compiles (or finds) and launches; keep what it launched
            compiled = self.kernel[grid](*args, **kwargs)
            if usual or compiled is None:
                if recorder is not None:
                    recorder.spoiled = True
                return
            self.compiled[key] = compiled
            launched = True
        else:
            launched = False
        rest = [kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args) :]]
        grid3 = (*grid, 1, 1)[:3]
        if not launched:
            _launch_compiled(compiled, grid3, (*args, *rest), device)
        if recorder is not None:
            recorder.add(compiled, grid3, [*args, *rest])


_LEAN_KERNELS: dict[Any, LeanKernel] = {}


def eager_launch() -> bool:
    """Inside a plain eager GPU call, where a launcher's kernels launch through a `LeanKernel` (or are recorded):
    launch options that Inductor's launcher would not take (`pdl.launch_options`) are safe only here."""
    return getattr(_eager, "active", False)


def launchable(kernel: Any) -> Any:
    """What a launcher indexes with `[grid]`: a `LeanKernel` inside a plain eager GPU call, else `wrap_triton(kernel)`
    (the kernel itself while wrap_triton is switched off, the traceable wrapper under torch.compile)."""
    if getattr(_eager, "active", False):
        lean = _LEAN_KERNELS.get(kernel)
        if lean is None and type(kernel) is JITFunction:
            lean = _LEAN_KERNELS[kernel] = LeanKernel(kernel)
        if lean is not None:
            return lean
    recorder = getattr(_eager, "recorder", None)
    if recorder is not None:  # a launch the recorder would not see (an autotuned kernel): never replay this call
        recorder.spoiled = True
    return wrap_triton(kernel)


# ------------------------------------------------------------------------------------------------------------ entry


def new_output(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous tensor of `like`'s shape and device: `torch.empty_like` skips the shape and device parsing
    of `torch.empty(shape, dtype=, device=)` (1.0 against 2.4 µs a call on a CPU tensor)."""
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the host side: triton's is a `constexpr_function`, ~3 µs a call outside a kernel."""
    return -(-a // b)


@functools.cache
def _sm_count_of(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.compiler.assume_constant_result
def sm_count(device: int) -> int:
    """The GPU's SM count, which the split schedules size their grids by; a constant to torch.compile, which traces
    a kernel's schedule inside its public function."""
    return _sm_count_of(device)


def pow2(n: int) -> int:
    """`triton.next_power_of_2` for the host side (same reason): the smallest power of two ≥ n, 1 for n ≤ 1."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _plan(key: tuple | None) -> tuple[_Launch, ...] | object | None:
    """The recorded launches for `key`; `_MISSING` when the call should be recorded; None to run the launcher."""
    if key is None or not LEAN["replay"] or _hooks_set():
        return None
    try:
        return _PLANS.get(key, _MISSING)
    except TypeError:  # an unhashable argument
        return None


def run(name: str, launcher: Callable[..., None], *args: Any) -> None:
    """Launch `fusionscope::<name>`'s kernels for these arguments: a replay or the plain launcher in plain eager mode,
    the registered op otherwise (same arguments, same effect). Every tensor argument must be on one device, the
    current one (the public functions check the first, Triton's launch assumes the second): a replay passes raw data
    pointers."""
    keyed = _replay_key(launcher, args) if LEAN["enabled"] and set_wrap_triton_enabled is not None else None
    key = None if keyed is None else keyed[0]
    if key is None and not plain_eager(args):
        getattr(torch.ops.fusionscope, name)(*args)
        return
    plan = _plan(key)
    if plan is not None and plan is not _MISSING:
        _replay(plan, keyed[1], key[-1])  # the key ends with the current device
        return
    recorder = _Recorder(args) if plan is _MISSING else None
    outer = getattr(_eager, "active", False), getattr(_eager, "recorder", None)  # a launcher may call `run` again
    with set_wrap_triton_enabled(False):
        _eager.active = key is not None
        _eager.recorder = recorder
        try:
            if recorder is None:
                launcher(*args)
            else:
                with recorder:
                    launcher(*args)
        finally:
            _eager.active, _eager.recorder = outer
    if recorder is not None:
        if len(_PLANS) >= MAX_PLANS:
            forget_plans()
        _PLANS[key] = None if recorder.spoiled or not recorder.launches else tuple(recorder.launches)
