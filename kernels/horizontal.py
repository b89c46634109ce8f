"""Horizontal fusion of Linears that read the same input: QKV (q_proj, k_proj, v_proj) and gate_up (gate_proj,
up_proj). No kernel: the weights are concatenated once along the output dimension, one GEMM computes every
projection, and the outputs are views of its result.

Per call with x: (M, K) and n Linears of output sizes N_1..N_n (ΣN = N_1 + … + N_n), dtype size s:
    unfused = Σ_i (M·K + N_i·K + N_i + M·N_i)·s = (n·M·K + ΣN·K + ΣN + M·ΣN)·s     n launches
    fused   = (M·K + ΣN·K + ΣN + M·ΣN)·s                                           1 launch
The saving is (n − 1)·M·K·s bytes (x read once instead of n times) and n − 1 launches. At decode (M small) the
weights dominate the bytes and both versions read them exactly once, so the gain is the launches and one larger,
better-shaped GEMM (the small k/v GEMMs of grouped-query attention use few SMs on their own); at prefill it is the
repeated reads of x. Memory is unchanged: the originals' parameters become views into the fused ones.
"""

from __future__ import annotations

import torch
from torch import nn


def horizontal_reference(x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """The unfused projections: one GEMM per Linear, each reading x again. x: (..., K)."""
    return tuple(linear(x) for linear in linears)  # per Linear: read (M·K + N_i·K + N_i)·s, write M·N_i·s


def split_sizes(linears: list[nn.Linear]) -> list[int]:
    """The output sizes [N_1, …, N_n] that split a fused output back into the Linears' outputs."""
    return [linear.out_features for linear in linears]


class FusedLinear(nn.Linear):
    """One nn.Linear whose weight is the concatenation of several Linears' weights along the output dimension.
    `forward(x)` returns a tuple of views, one per original Linear: x: (..., K) -> ((..., N_1), …, (..., N_n))."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, split_sizes: list[int], requires_grad: bool = True
    ) -> None:
        """weight: (ΣN, K), bias: (ΣN,) or None; both taken as they are (no copy)."""
        if sum(split_sizes) != weight.shape[0]:
            raise ValueError(f"split_sizes {split_sizes} do not add up to the weight's {weight.shape[0]} rows")
        # Built on the meta device so that nn.Linear allocates and initialises nothing, then given the real tensors.
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=requires_grad)
        self.split_sizes = list(split_sizes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return super().forward(x).split(self.split_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, split_sizes={self.split_sizes}"


def _check(linears: list[nn.Linear]) -> None:
    if len(linears) < 2:
        raise ValueError(f"fuse_linears needs at least two Linears, got {len(linears)}")
    if not all(isinstance(linear, nn.Linear) for linear in linears):
        raise ValueError(f"fuse_linears takes nn.Linear modules, got {[type(m).__name__ for m in linears]}")
    if len({id(linear) for linear in linears}) != len(linears):
        raise ValueError("fuse_linears got the same Linear twice")
    first = linears[0]
    for name, values in [
        ("in_features", [linear.in_features for linear in linears]),
        ("dtypes", [linear.weight.dtype for linear in linears]),
        ("devices", [linear.weight.device for linear in linears]),
    ]:
        if len(set(values)) != 1:
            raise ValueError(f"Linears to fuse must share their input: mismatched {name} {values}")
    has_bias = [linear.bias is not None for linear in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError(f"Linears to fuse must all have a bias or none (got bias={has_bias})")
    if first.bias is not None and any(
        linear.bias.dtype != first.weight.dtype or linear.bias.device != first.weight.device for linear in linears
    ):
        raise ValueError("each bias must have its weight's dtype and device")


@torch.no_grad()
def fuse_linears(linears: list[nn.Linear]) -> FusedLinear:
    """Build one FusedLinear from two or more Linears that share an input (e.g. [q_proj, k_proj, v_proj] or
    [gate_proj, up_proj]): all of one in_features, dtype and device, and all with a bias or all without (ValueError
    otherwise). The weights (and biases) are concatenated once; each original's `.weight` / `.bias` is then re-pointed
    (`.data`) at its rows of the fused tensor, so the old storage is freed and the originals still compute their own
    outputs, sharing memory with the fused module. Peak memory during the call is one extra copy of these weights.
    """
    linears = list(linears)
    _check(linears)
    weight = torch.cat([linear.weight for linear in linears], dim=0)
    bias = torch.cat([linear.bias for linear in linears], dim=0) if linears[0].bias is not None else None
    sizes = split_sizes(linears)
    fused = FusedLinear(weight, bias, sizes, requires_grad=any(linear.weight.requires_grad for linear in linears))
    for linear, w in zip(linears, fused.weight.split(sizes, dim=0), strict=True):
        linear.weight.data = w
    if bias is not None:
        for linear, b in zip(linears, fused.bias.split(sizes, dim=0), strict=True):
            linear.bias.data = b
    return fused
