"""A custom model for `fusionscope profile examples/custom_factory.py:make_mlp`.

fusionscope calls the factory, passing `device=` and `dtype=` only because it accepts them, and expects
`(module, inputs)`: inputs is a tuple of positional arguments (or a dict of keyword arguments) for one forward.
"""

from __future__ import annotations

import torch
from torch import nn


class GatedMLPBlock(nn.Module):
    """RMSNorm → SwiGLU MLP → residual add: the shape of a Llama feed-forward sub-layer."""

    def __init__(self, hidden: int = 256, intermediate: int = 688) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def make_mlp(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    model = nn.Sequential(GatedMLPBlock(), GatedMLPBlock()).to(device=device, dtype=dtype)
    x = torch.randn(4, 33, 256, device=device, dtype=dtype)
    return model, (x,)
