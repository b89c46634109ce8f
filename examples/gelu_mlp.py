"""A GELU MLP language-model stack of your own, for `fusionscope profile examples/gelu_mlp.py:factory`.

Token ids → embedding → `layers` × GeluBlock (`x + c_proj(gelu(c_fc(ln(x))))`, LayerNorm and Linear with bias, as
in GPT-2 / StarCoder2 MLPs, minus attention) → final LayerNorm → head. `factory` is tiny, for CPU tests;
`factory_large` has published-like dimensions (hidden 4096, 4× MLP) for a GPU:

    fusionscope profile examples/gelu_mlp.py:factory --out runs/gelu-tiny
    fusionscope profile examples/gelu_mlp.py:factory_large --device cuda --out runs/gelu-large

fusionscope passes `device=` and `dtype=` (the factory accepts both) and profiles one forward of `(module, inputs)`.
"""

from __future__ import annotations

import torch
from torch import nn

TINY = dict(hidden=128, layers=2, vocab=1000, batch=2, seq=16)
LARGE = dict(hidden=4096, layers=4, vocab=50304, batch=4, seq=512)


class GeluBlock(nn.Module):
    """Pre-norm GELU MLP sub-layer with a residual: `x + c_proj(gelu(c_fc(ln(x))))`."""

    def __init__(self, hidden: int, intermediate: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=1e-5)
        self.c_fc = nn.Linear(hidden, intermediate, bias=True)
        self.c_proj = nn.Linear(intermediate, hidden, bias=True)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(nn.functional.gelu(self.c_fc(self.ln(x)), approximate=self.approximate))


class GeluLM(nn.Module):
    """Embedding → GeluBlocks → LayerNorm → head: causal-LM-shaped, without attention."""

    def __init__(self, vocab: int, hidden: int, layers: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(GeluBlock(hidden, mlp_ratio * hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def factory(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, large: bool = False
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """`(module, (ids,))`: tiny dimensions by default, published-like ones with `large=True`."""
    dims = LARGE if large else TINY
    with torch.device(device):
        model = GeluLM(dims["vocab"], dims["hidden"], dims["layers"]).to(dtype=dtype)
        ids = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq"]))
    return model, (ids,)


def factory_large(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Hidden 4096, MLP 16384, 4 blocks, vocab 50304 (about 0.95B parameters), 4 × 512 tokens: for a GPU."""
    return factory(device=device, dtype=dtype, large=True)
