"""The RMSNorms and decoder layers the norm fusions patch, described by two small tables, and the layer rewrite.

`NORMS` says, per RMSNorm class, where its ε lives and how it casts — the kernels' `offset`: 0 for Llama's
`weight * x̂.to(dtype)`, 1 for Gemma's `(x̂ * (1 + weight)).type_as(x)`. A class that is not in the table is vouched
for only when its `forward` (and the `_norm` that forward calls) is, statement for statement, the forward of a class
in the table: transformers copies the Llama and Gemma norms into each new family under a new name. Anything else (a
LayerNorm, a norm with a bias, another cast) is not patched.

`SHAPES` says which decoder layers the add_rms_norm rewrite knows, by the modules an instance holds and the `self.`
attributes its class's forward reads — not by the model's name, so that an unseen family built the same way is
patched too, and one whose forward does more is not (Granite's `residual + out * self.residual_multiplier`):
- llama: `input_layernorm → self_attn → + → post_attention_layernorm → mlp → +` (Llama, Mistral, Qwen2, Qwen3,
  Gemma; Phi-3, whose `resid_attn_dropout` / `resid_mlp_dropout` are called where its forward calls them);
- sandwich: `input_layernorm → self_attn → post_attention_layernorm → + → pre_feedforward_layernorm → mlp →
  post_feedforward_layernorm → +` (Gemma-2, Gemma-3).
Both return a tensor in transformers 5.17 and 5.24, as the rewrite does (4.x layers returned tuples; the project
requires transformers ≥ 5.17).

The rewrite carries the residual across the layer boundary as vLLM's decoder layers do: a layer whose output goes
straight into a patched norm (the next layer's input norm, or the final norm after the last layer) skips its last
`residual + out` and returns `out`, leaving `(out, residual)` in the stack's `Carry`; the next consumer sees that the
tensor it got *is* the carried `out` and runs `add_rms_norm(out, residual)`. That reaches all 2·L add + norm sites; a
module-for-module swap reaches none of the input norms. The limits:
- something that reads a layer's output between the layers gets `out`, not the sum. The model's own hidden-state
  capture (`output_hidden_states`, in the call or in the config) switches the carry off for that call (the in-layer
  add + norm stay fused, the input and final norms run unfused). A forward hook of one's own that reads or replaces a
  decoder layer's output is not detected: it sees `out`, and a tensor it returns in place of `out` fails the next
  consumer's identity check, which then treats it as the whole hidden state.
- a consumer that gets a tensor other than the carried one (a direct call of the final norm, a stale carry from a
  forward that raised) drops the carry and computes exactly what the unpatched module does.
- the carry is Python state, set and read in program order: a CUDA graph captured from the patched forward bakes in
  the branch taken at capture (the same every replay, since the identity holds at capture); under torch.compile the
  identity check and the carry's attribute writes are traced by dynamo (not exercised by the CPU tests). Two threads
  running one patched model at once would share its carry.
- the fused norms are no longer called as modules, so a profile of the patched model attributes their kernels to the
  decoder layer (the in-layer and input norms) or to the final norm; the kernels have no backward: inference only.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import nn

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NotPatchable(Exception):
    """Why a module cannot be patched: becomes that site's `Support.no(reason)`."""


@dataclass(frozen=True)
class NormSpec:
    """How one RMSNorm class computes: the attribute holding ε and the kernels' `offset` (0 Llama, 1 Gemma)."""

    eps_attr: str
    offset: float


LLAMA_NORM = NormSpec("variance_epsilon", 0.0)
GEMMA_NORM = NormSpec("eps", 1.0)

# keyed by "<module>.<qualname>" of the norm's own class (a subclass is compared like an unseen class: it may override
# `_norm`); the first entry of each spec is the one unseen classes are compared with
NORMS: dict[str, NormSpec] = {
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": LLAMA_NORM,
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": LLAMA_NORM,
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": LLAMA_NORM,
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": LLAMA_NORM,
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm": LLAMA_NORM,
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm": GEMMA_NORM,
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm": GEMMA_NORM,
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm": GEMMA_NORM,
}


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _method_body(cls: type, method: str) -> str | None:
    """The statements of `cls.method` as an AST dump (comments and names of the family gone); None without source."""
    fn = getattr(cls, method, None)
    if fn is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    return ast.dump(ast.Module(body=node.body, type_ignores=[]))


@cache
def _norm_body(cls: type) -> tuple[str | None, str | None]:
    return _method_body(cls, "forward"), _method_body(cls, "_norm")


@cache
def _reference_bodies() -> dict[tuple[str | None, str | None], NormSpec]:
    """The forward bodies of the first table class of each spec (imports the Llama and Gemma modeling modules)."""
    refs: dict[tuple[str | None, str | None], NormSpec] = {}
    seen: set[NormSpec] = set()
    for key, spec in NORMS.items():
        if spec in seen:
            continue
        module_name, _, name = key.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        seen.add(spec)
        refs[_norm_body(cls)] = spec
    return refs


def _class_spec(cls: type) -> NormSpec | None:
    spec = NORMS.get(_class_key(cls))
    if spec is not None:
        return spec
    body = _norm_body(cls)
    return _reference_bodies().get(body) if body[0] is not None else None


def kernel_device_reason(t: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on `t`'s device (None when they can): a GPU, or the interpreter on a CPU."""
    if t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"the kernels need a CUDA device (or TRITON_INTERPRET=1); the weights are on {t.device}"


def norm_spec(norm: nn.Module) -> NormSpec:
    """The casting of an RMSNorm instance the kernels can stand in for; raises NotPatchable saying why not."""
    cls = type(norm)
    if "forward" in norm.__dict__:
        raise NotPatchable(f"{cls.__name__}'s forward is already replaced on this instance")
    spec = _class_spec(cls)
    if spec is None:
        raise NotPatchable(
            f"{cls.__name__} is not an RMSNorm the kernels know: its forward is neither in the table of Llama- and "
            "Gemma-style norms nor a copy of one"
        )
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        raise NotPatchable(f"{cls.__name__} has no 1-d weight parameter")
    if weight.dtype not in _KERNEL_DTYPES:
        raise NotPatchable(f"{cls.__name__}'s weight is {weight.dtype}; the kernels take fp32, fp16 and bf16")
    if not isinstance(getattr(norm, spec.eps_attr, None), float | int):
        raise NotPatchable(f"{cls.__name__} has no numeric `{spec.eps_attr}`")
    reason = kernel_device_reason(weight)
    if reason:
        raise NotPatchable(reason)
    return spec


@dataclass(frozen=True)
class LayerShape:
    """A decoder-layer structure the rewrite knows: its RMSNorm attributes in forward order, the norm that follows the
    in-layer residual add, and the modules its forward may also call when present."""

    name: str
    norms: tuple[str, ...]
    added_norm: str
    optional: frozenset[str] = frozenset()

    @property
    def modules(self) -> tuple[str, ...]:
        return (*self.norms, "self_attn", "mlp")

    @property
    def reads(self) -> frozenset[str]:
        return frozenset(self.modules) | self.optional


SANDWICH = LayerShape(
    "sandwich",
    ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    added_norm="pre_feedforward_layernorm",
)
LLAMA = LayerShape(
    "llama",
    ("input_layernorm", "post_attention_layernorm"),
    added_norm="post_attention_layernorm",
    optional=frozenset({"resid_attn_dropout", "resid_mlp_dropout"}),
)
SHAPES = (SANDWICH, LLAMA)


@cache
def forward_reads(cls: type) -> frozenset[str] | None:
    """The `self.<name>` attributes the class's forward reads (through functools.wraps decorators); None without
    source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    return frozenset(
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    )


def layer_shape(layer: nn.Module) -> LayerShape:
    """The known shape of a decoder-layer instance, its norms vouched for; raises NotPatchable saying why not."""
    name = type(layer).__name__
    if "forward" in layer.__dict__:
        raise NotPatchable(f"{name}'s forward is already replaced on this instance")
    reads = forward_reads(type(layer))
    if reads is None:
        raise NotPatchable(f"{name}'s forward has no readable source, so its structure cannot be checked")
    for shape in SHAPES:  # the layer holds the shape's modules and its forward uses them all, and nothing else
        holds = all(isinstance(getattr(layer, m, None), nn.Module) for m in shape.modules)
        if not holds or not reads >= set(shape.modules):
            continue
        extra = sorted(reads - shape.reads)
        if extra:
            raise NotPatchable(
                f"{name} holds the modules of a {shape.name}-shape layer but its forward also reads "
                f"{', '.join('self.' + e for e in extra)}, which the rewrite would drop"
            )
        for norm in shape.norms:
            norm_spec(getattr(layer, norm))
        return shape
    known = "; ".join(f"{s.name}: {', '.join(s.modules)}" for s in SHAPES)
    raise NotPatchable(f"{name} is not a decoder layer of a known shape ({known})")


class Carry:
    """The residual add a layer left undone for the next norm: `out` (its last branch's output, which it returned)
    and `residual`. One per layer stack; `take` empties it, so a carried pair is added exactly once."""

    __slots__ = ("out", "residual")

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None

    def put(self, out: torch.Tensor, residual: torch.Tensor) -> None:
        self.out, self.residual = out, residual

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.out, self.residual
        self.out = self.residual = None
        return pair  # type: ignore[return-value]

    def clear(self) -> None:
        self.out = self.residual = None


@dataclass
class NormState:
    """What the norm fusions share in `patcher.state["add_rms_norm"]`: one carry per layer stack, and the norms whose
    work a rewritten layer now does itself (an rms_norm swap of one of them would never run)."""

    carries: dict[int, Carry] = field(default_factory=dict)
    fused: dict[int, str] = field(default_factory=dict)  # id(norm) -> its path

    def carry(self, stack: nn.Module) -> Carry:
        return self.carries.setdefault(id(stack), Carry())


def hidden_states_requested(kwargs: dict[str, Any], config: Any) -> bool:
    """Whether this forward records every layer's output, decided as transformers' `capture_outputs` does (the call's
    `output_hidden_states`, else the config's); an index or a list of indices asks for some of them."""
    if "output_hidden_states" in kwargs:
        flag = kwargs["output_hidden_states"]
    else:
        flag = getattr(config, "output_hidden_states", False)
    return flag is not None and flag is not False


@dataclass(frozen=True)
class LayerPlan:
    """What one layer instance's rewritten forward does.

    take: its input norm continues the carry of the layer before; fuse: its in-layer add + norm is one add_rms_norm;
    give: it leaves its last add to the next consumer. `arg_names` name the original forward's positional parameters
    after hidden_states (the model passes them by keyword; positional ones are turned into keywords for self_attn)."""

    shape: LayerShape
    take: bool
    fuse: bool
    give: bool
    carry: Carry
    input_spec: NormSpec
    added_spec: NormSpec
    arg_names: tuple[str, ...]
    config: Any


def positional_names(layer: nn.Module) -> tuple[str, ...]:
    """The original forward's parameters that can come positionally after hidden_states."""
    params = list(inspect.signature(type(layer).forward).parameters.values())[2:]
    return tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


Enter = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
AddNorm = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Leave = Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]


def _enter(plan: LayerPlan, kernels: Any) -> Enter:
    """(normed input, residual): add_rms_norm of the carried pair when the input is the carried tensor, else the
    layer's own input norm, called as a module (so an rms_norm swap of layer 0's input norm runs)."""
    carry, eps_attr, offset = plan.carry, plan.input_spec.eps_attr, plan.input_spec.offset
    if not plan.take:

        def enter(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            carry.clear()  # a pair left by a forward that raised is dropped here, at the start of the stack
            return layer.input_layernorm(x), x

        return enter

    def enter_carried(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x is carry.out:
            out, residual = carry.take()
            norm = layer.input_layernorm
            return kernels.add_rms_norm(out, residual, norm.weight, getattr(norm, eps_attr), offset)
        carry.clear()
        return layer.input_layernorm(x), x

    return enter_carried


def _add_norm(plan: LayerPlan, kernels: Any) -> AddNorm:
    """(norm(residual + x), residual + x): one add_rms_norm, or the add and the norm module as the original does."""
    eps_attr, offset = plan.added_spec.eps_attr, plan.added_spec.offset
    if plan.fuse:

        def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return kernels.add_rms_norm(x, residual, norm.weight, getattr(norm, eps_attr), offset)

        return add_norm

    def add_then_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + x
        return norm(h), h

    return add_then_norm


def _leave(plan: LayerPlan) -> Leave:
    """The layer's output: `out` with the add carried, or `residual + out` (always when hidden states are recorded)."""
    carry, config = plan.carry, plan.config
    if not plan.give:

        def add(out: torch.Tensor, residual: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
            return residual + out

        return add

    def leave(out: torch.Tensor, residual: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        if hidden_states_requested(kwargs, config):
            carry.clear()
            return residual + out
        carry.put(out, residual)
        return out

    return leave


def _keywords(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) > len(names):
        raise TypeError(f"the decoder layer takes {len(names) + 1} positional arguments, got {len(args) + 1}")
    return {**dict(zip(names, args)), **kwargs}


def layer_forward(plan: LayerPlan, kernels: Any) -> Callable[..., torch.Tensor]:
    """The rewritten forward of one layer instance, `(self, hidden_states, *args, **kwargs)`: the model's keyword
    arguments go to `self_attn` unchanged (`past_key_values` in 5.17, `cache` in 5.24, sliding-window masks, ...);
    self_attn, mlp and the norms that are not fused are called as modules, so other fusions' swaps of them run."""
    enter, add_norm, leave, names = _enter(plan, kernels), _add_norm(plan, kernels), _leave(plan), plan.arg_names

    if plan.shape is SANDWICH:

        def sandwich_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args:
                kwargs = _keywords(names, args, kwargs)
            h, residual = enter(self, hidden_states)
            h, _ = self.self_attn(hidden_states=h, **kwargs)
            h = self.post_attention_layernorm(h)
            h, residual = add_norm(self.pre_feedforward_layernorm, h, residual)
            h = self.post_feedforward_layernorm(self.mlp(h))
            return leave(h, residual, kwargs)

        return sandwich_forward

    def llama_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            kwargs = _keywords(names, args, kwargs)
        h, residual = enter(self, hidden_states)
        h, _ = self.self_attn(hidden_states=h, **kwargs)
        if "resid_attn_dropout" in self._modules:  # Phi-3: residual + dropout(attn)
            h = self.resid_attn_dropout(h)
        h, residual = add_norm(self.post_attention_layernorm, h, residual)
        h = self.mlp(h)
        if "resid_mlp_dropout" in self._modules:
            h = self.resid_mlp_dropout(h)
        return leave(h, residual, kwargs)

    return llama_forward


def final_norm_forward(
    carry: Carry, spec: NormSpec, kernels: Any, original: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The final norm's forward: add_rms_norm of the last layer's carried pair, or the norm's own forward when the
    input is not the carried tensor."""
    eps_attr, offset = spec.eps_attr, spec.offset

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states is carry.out:
            out, residual = carry.take()
            return kernels.add_rms_norm(out, residual, self.weight, getattr(self, eps_attr), offset)[0]
        carry.clear()
        return original(hidden_states)

    return forward
