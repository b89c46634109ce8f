"""Helpers shared by the kernel tests: strided views of fresh random data, and NaN-poisoned output buffers."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def device() -> torch.device:
    """CUDA when present; otherwise the CPU, where kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(
    *shape: int, dtype: torch.dtype, strided: bool = False, scale: float = 1.0, seed: int | None = None
) -> torch.Tensor:
    """Fresh random values (never zeros). `strided=True` returns a non-contiguous view with the same shape: every
    other column of a twice-as-wide buffer, so the last dimension's stride is 2."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    if not strided:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device(), dtype=dtype)
    wide = (torch.randn(*shape[:-1], shape[-1] * 2, generator=gen) * scale).to(device=device(), dtype=dtype)
    view = wide[..., ::2]
    assert not view.is_contiguous()
    return view


def poisoned(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel forgets to write fails the comparison."""
    return torch.full(tuple(shape), float("nan"), device=device(), dtype=dtype)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


class SeenOps(TorchDispatchMode):
    """Records the name of every op dispatched while it is active (`ops`): whether a kernel call goes through its
    registered `fusionscope::` op under a dispatch mode (make_fx, the dataflow recorder)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
