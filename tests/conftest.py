"""Shared fixtures. On a machine without CUDA, Triton kernels run in the interpreter: the variable must be set before
any `@triton.jit` function is defined, hence here, before test modules import kernels."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Roofs are cached per session in a temporary folder, never in the user's cache."""
    monkeypatch.setenv("FUSIONSCOPE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fusionscope-cache"))


@pytest.fixture(scope="session")
def smollm2() -> tuple:
    """(fp32 SmolLM2-135M with its real weights, its tokenizer), loaded once per session: the GGUF file is dequantised
    on every load (~25 s on a 2-core CPU). Shared by every test that takes it: a test that changes the model (casts,
    quantises) works on `fusionscope.apply.numerics.fp32_copy` of it, and undoes its patches before it ends."""
    from transformers import AutoTokenizer

    from fusionscope.models import build_workload, resolve_model

    spec = resolve_model("smollm2-135m")
    model = build_workload(spec, torch.device("cpu"), torch.float32, prompt_len=16, decode_steps=1).module
    return model, AutoTokenizer.from_pretrained(str(spec.path), gguf_file=spec.weights)


@pytest.fixture
def two_gloo_ranks() -> Callable[..., None]:
    """`run(fn, *args)`: `fn(rank, 2, port, *args)` in two spawned processes (their gloo group's rendezvous on a free
    local port), returning when both have finished."""
    import socket

    import torch.multiprocessing as mp

    def run(fn: Callable[..., None], *args: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(fn, args=(2, port, *args), nprocs=2, join=True)

    return run
