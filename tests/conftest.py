"""Shared fixtures. On a machine without CUDA, Triton kernels run in the interpreter: the variable must be set before
any `@triton.jit` function is defined, hence here, before test modules import kernels."""

from __future__ import annotations

import os
from pathlib import Path

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
