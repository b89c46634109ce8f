"""How each next token is picked in the runs `apply` times and checks: greedy argmax, or `generate(do_sample=True)`'s
pipeline (temperature → top-k → top-p warpers, softmax, multinomial) — the unfused chain the sampling fusion replaces.

The pick is an attribute of a `Sampler` instance, so the sampling fusion's patch swaps it on the instance (and the
patch's undo log puts it back), exactly as the model patches swap forwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Sampler:
    """`sampler(ids, logits)` → (B, 1) int64 next tokens from `logits: (B, S, V)` (its last position is used).

    `sampling=None` picks by argmax; `(temperature, top_k, top_p)` samples as HF's `generate(do_sample=True)` does,
    from a generator seeded at `reset()` so that two runs of the same workload draw the same tokens."""

    def __init__(self, sampling: tuple[float, int, float] | None, device: torch.device, seed: int = 0) -> None:
        self.sampling = sampling
        self.seed = seed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.temperature, self.top_k, self.top_p = sampling or (1.0, 0, 1.0)
        self.pick: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            self._warped_draw if sampling is not None else _argmax
        )
        if sampling is not None:
            from transformers.generation.logits_process import (
                LogitsProcessorList,
                TemperatureLogitsWarper,
                TopKLogitsWarper,
                TopPLogitsWarper,
            )

            self._warpers = LogitsProcessorList(
                [TemperatureLogitsWarper(self.temperature), TopKLogitsWarper(self.top_k), TopPLogitsWarper(self.top_p)]
            )

    def reset(self) -> None:
        self.generator.manual_seed(self.seed)

    def __call__(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """ids: (B, S) the tokens so far (the warpers' signature); logits: (B, S', V). Returns (B, 1) int64."""
        return self.pick(ids, logits[:, -1, :])

    def _warped_draw(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        scores = self._warpers(ids, last.to(copy=True, dtype=torch.float32))
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=self.generator)


def _argmax(_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return last.argmax(-1, keepdim=True)
