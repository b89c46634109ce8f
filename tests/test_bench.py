"""`fusionscope bench` wiring on the CPU: every case builds, its variants agree with the kernel's reference, and the
command refuses clearly without a GPU. The timings themselves need the H200 (reports/bench/gpu_kernels.sh)."""

from __future__ import annotations

import pytest
import torch
from fusionscope.kernels.tolerances import assert_close
from typer.testing import CliRunner

from fusionscope.bench import cases as bench_cases
from fusionscope.cli import app

runner = CliRunner()


@pytest.fixture
def small_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the sweep to interpreter sizes: odd, non-power-of-two widths."""
    for name, value in {
        "DECODE_ROWS": (1,),
        "PREFILL_ROWS": (5,),
        "HIDDEN": (123,),
        "INTERMEDIATE": 100,
        "VOCAB": 257,
        "ROPE_HEADS": (4, 2, 16),
        "ROPE_SHAPES": ((1, 1), (2, 3)),
        "GLU_PREFILL_ROWS": (5,),
        "CACHE_LEN": 7,
        "QKV": (48, (48, 16, 16), (1, 5)),
        "LINEAR": (40, 72),
    }.items():
        monkeypatch.setattr(bench_cases, name, value)


@pytest.mark.parametrize("kernel", list(bench_cases.CASES))
def test_cases_agree_with_the_reference(kernel: str, small_shapes: None) -> None:
    """The first case of each kind a kernel's list holds (add_layer_norm's: the single norm and GPT-NeoX's pair)."""
    firsts = {c.kernel: c for c in reversed(bench_cases.CASES[kernel]())}
    assert kernel != "add_layer_norm" or set(firsts) == {"add_layer_norm", "add_layer_norm_pair"}
    for case in firsts.values():
        _agrees(kernel, case)


def _agrees(kernel: str, case: bench_cases.Case) -> None:
    inputs = case.build(torch.device("cpu"), torch.float32)
    assert case.traffic(inputs) > 0
    assert {"eager", "fusionscope"} <= set(case.variants)
    ours = case.variants["fusionscope"](inputs)
    eager = case.variants["eager"](inputs)
    if kernel == "sample":
        assert ours.shape == eager.shape == (inputs["logits"].shape[0],)
        assert case.variants["fusionscope-1launch"](inputs).shape == ours.shape
        return
    ours = ours if isinstance(ours, tuple) else (ours,)
    eager = eager if isinstance(eager, tuple) else (eager,)
    expected = case.reference(inputs) if case.reference else eager
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want, base in zip(ours, expected, eager):
        assert_close(got, want, torch.float32, scale=10)
        assert_close(base, want, torch.float32, scale=10)
    if kernel == "rope_and_cache":  # the cache slot holds the rotated k and the plain v
        from fusionscope.kernels.rope import rope_reference

        slot = inputs["pos"]
        k_rot = rope_reference(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"])[1]
        assert_close(inputs["kc"][:, :, slot], k_rot, torch.float32, scale=10)
        assert torch.equal(inputs["vc"][:, :, slot], inputs["v"])


def test_bench_list_needs_no_gpu() -> None:
    result = runner.invoke(app, ["bench", "--list"])
    assert result.exit_code == 0, result.output
    assert "rms_norm" in result.stdout and "bfloat16" in result.stdout and "tolerances" in result.stdout


def test_bench_without_cuda_is_a_clear_error() -> None:
    assert not torch.cuda.is_available(), "this test describes the CPU-only CI machine"
    result = runner.invoke(app, ["bench", "rms_norm"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.stderr


def test_bench_unknown_kernel() -> None:
    result = runner.invoke(app, ["bench", "--list", "fused_everything"])
    assert result.exit_code == 2 and "unknown kernel" in result.stderr


def test_bench_unknown_variant_is_a_clear_error() -> None:
    result = runner.invoke(app, ["bench", "rms_norm", "--variant", "fusionscope", "--variant", "fusionscop"])
    assert result.exit_code == 2 and "unknown variant(s) fusionscop;" in result.stderr
    assert "have compile, eager, fusionscope" in result.stderr  # names the variants the kernel does have


def test_bench_known_variant_reaches_the_gpu_check() -> None:
    result = runner.invoke(app, ["bench", "sample", "--variant", "fusionscope-1launch"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.stderr
