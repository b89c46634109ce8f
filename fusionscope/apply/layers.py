"""The RMSNorms and decoder layers the norm fusions patch, described by two small tables, the layer rewrite, and the
residual carry it shares with GPT-2's (`fusionscope.apply.gpt2`).

`NORMS` says, per RMSNorm class, where its ε lives and how it casts — the kernels' `offset`: 0 for Llama's
`weight * x̂.to(dtype)`, 1 for Gemma's `(x̂ * (1 + weight)).type_as(x)`. A class that is not in the table is vouched
for only when its `forward` (and, where that forward calls it, `_norm`) has the signature and, statement for statement,
the body of the first table class of its kind (`fusionscope.apply.source`; comments and docstrings aside):
transformers copies the Llama and Gemma norms into each new family under a new name. Anything else (a LayerNorm, a
norm with a bias, another cast) is not patched.

`SHAPES` says which decoder layers the add_rms_norm rewrite knows, by the modules an instance holds and the statements
of its class's forward, compared one for one with the shape's — not by the model's name, so that an unseen family
built the same way is patched too, and one whose forward computes anything else is not (Granite's
`residual + hidden_states * self.residual_multiplier` is refused at that statement):
- llama: `input_layernorm → self_attn → + → post_attention_layernorm → mlp → +` (Llama, Mistral, Qwen2, Qwen3, Gemma);
- phi3: the same with `resid_attn_dropout` / `resid_mlp_dropout` on each branch before its add (Phi-3);
- sandwich: `input_layernorm → self_attn → post_attention_layernorm → + → pre_feedforward_layernorm → mlp →
  post_feedforward_layernorm → +` (Gemma-2, Gemma-3).
The self-attention call must pass each named parameter of the forward on under its own name, and `**kwargs`: the
rewrite passes the attention the keywords it was given over the forward's defaults, which is that same dict. The
forward's `deprecate_kwarg` renames (5.24's `past_key_values` → `cache`) are read from its decorators and made first,
as the decorator makes them. All shapes return a tensor in transformers 5.17 and 5.24, as the rewrite does (4.x layers
returned tuples; the project requires transformers ≥ 5.17).

The rewrite carries the residual across the layer boundary as vLLM's decoder layers do: a layer whose output goes
straight into a patched norm (the next layer's input norm, or the final norm after the last layer) skips its last
`residual + out` and returns `out`, handing `(out, residual)` over to the stack's `Carry`; the next consumer sees that
the tensor it got *is* the carried `out` and runs `add_rms_norm(out, residual)`. That reaches all 2·L add + norm
sites; a module-for-module swap reaches none of the input norms. The limits:
- something that reads a layer's output between the layers gets `out`, not the sum. While the hidden states are
  recorded (`hidden_states_recorded`: transformers' output capture is collecting them, or the call or the config asks
  for them) no layer carries (the in-layer add + norm stay fused, the input and final norms run unfused). A forward
  hook of one's own that reads or replaces a decoder layer's output is not detected: it sees `out`, and a tensor it
  returns in place of `out` fails the next consumer's identity check, which then treats it as the whole hidden state.
- a consumer that gets a tensor other than the carried one (a direct call of the final norm, a stale carry from a
  forward that raised) drops the carry and computes exactly what the unpatched module does.
- a module in training mode runs its class's forward (`fusionscope.apply.source.unless_training`), a consumer first
  adding a carried pair back into the hidden state it was handed: the kernels have no backward.
- the carry is Python state, set and read in program order: a CUDA graph captured from the patched forward bakes in
  the branch taken at capture (the same every replay, since the identity holds at capture); under torch.compile the
  identity check and the carry's attribute writes are traced by dynamo (not exercised by the CPU tests). Two threads
  running one patched model at once would share its carry.
- the fused norms are no longer called as modules, so a profile of the patched model attributes their kernels to the
  decoder layer (the in-layer and input norms) or to the final norm.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusionscope.apply.source import (
    Source,
    agreeing,
    deprecated_aliases,
    difference,
    forward_replaced,
    kernel_dtypes,
    read_source,
    rename,
    template,
    unless_training,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher

    Enter = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    AddNorm = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    Leave = Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]


class NotPatchable(Exception):
    """Why a module cannot be patched: becomes that site's `Support.no(reason)`."""


# ------------------------------------------------------------------------------------------------------------ norms


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


@dataclass(frozen=True)
class _Reference:
    """A table class's forward and, where the class has one (Gemma's forward calls it), its `_norm`, parsed."""

    cls: type
    spec: NormSpec
    forward: Source
    norm: Source | None


@functools.cache
def _references() -> tuple[_Reference, ...]:
    """The first table class of each spec, parsed (imports the Llama and Gemma modeling modules)."""
    refs: list[_Reference] = []
    for key, spec in NORMS.items():
        if any(r.spec == spec for r in refs):
            continue
        module_name, _, name = key.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        forward, norm = read_source(cls.forward), read_source(getattr(cls, "_norm", None))
        if forward is not None and (norm is not None or not hasattr(cls, "_norm")):
            refs.append(_Reference(cls, spec, forward, norm))
    return tuple(refs)


def _method_difference(cls: type, method: str, ref: type, want: Source) -> tuple[int, str]:
    """(how many statements agree, '' or the reason) for `cls.method` against the reference class's method."""
    name, what = f"{cls.__name__}.{method}", f"{ref.__name__}.{method}"
    got = read_source(getattr(cls, method, None))
    if got is None:
        return -1, f"{name} has no readable source"
    if got.params != want.params:
        return 0, f"{name} takes ({', '.join(got.params)}), not ({', '.join(want.params)}) as {what} does"
    if got.signature != want.signature:
        return 0, f"{name}'s signature or decorators differ from {what}'s"
    return agreeing(got, want.statements), difference(got, want.statements, name, what)


@functools.cache
def _class_spec(cls: type) -> NormSpec | str:
    """The spec of an RMSNorm class: from the table, or from the reference its methods copy; else the reason, naming
    the statement that differs from the closest reference."""
    spec = NORMS.get(_class_key(cls))
    if spec is not None:
        return spec
    closest: tuple[int, str] = (-2, "no reference norm class could be read")
    for ref in _references():
        agreed, reason = _method_difference(cls, "forward", ref.cls, ref.forward)
        if not reason and ref.norm is not None:  # Gemma's forward calls `self._norm`: that must be a copy too
            agreed, reason = _method_difference(cls, "_norm", ref.cls, ref.norm)
            agreed += len(ref.forward.statements)
        if not reason:
            return ref.spec
        closest = max(closest, (agreed, reason), key=lambda c: c[0])
    return closest[1]


def norm_spec(norm: nn.Module, patcher: Patcher | None = None) -> NormSpec:
    """The casting of an RMSNorm instance the kernels can stand in for; raises NotPatchable saying why not."""
    from torch import nn

    cls = type(norm)
    replaced = forward_replaced(norm, patcher)
    if replaced:
        raise NotPatchable(replaced)
    spec = _class_spec(cls)
    if isinstance(spec, str):
        raise NotPatchable(
            f"{cls.__name__} is not an RMSNorm the kernels know: its forward is neither in the table of Llama- and "
            f"Gemma-style norms nor a copy of one ({spec})"
        )
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        raise NotPatchable(f"{cls.__name__} has no 1-d weight parameter")
    if weight.dtype not in kernel_dtypes():
        raise NotPatchable(f"{cls.__name__}'s weight is {weight.dtype}; the kernels take fp32, fp16 and bf16")
    if not isinstance(getattr(norm, spec.eps_attr, None), float | int):
        raise NotPatchable(f"{cls.__name__} has no numeric `{spec.eps_attr}`")
    return spec


# ---------------------------------------------------------------------------------------------------- decoder layers


@dataclass(frozen=True)
class LayerShape:
    """A decoder-layer structure the rewrite knows: its RMSNorm attributes in forward order, the norm that follows the
    in-layer residual add, the dropouts its branches go through, and its forward's body (`{attn}`: the self-attention
    call's arguments)."""

    name: str
    norms: tuple[str, ...]
    added_norm: str
    body: str
    dropouts: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return (*self.norms, "self_attn", "mlp", *self.dropouts)


SANDWICH = LayerShape(
    "sandwich",
    ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    added_norm="pre_feedforward_layernorm",
    body="""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn({attn})
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
    """,
)
LLAMA = LayerShape(
    "llama",
    ("input_layernorm", "post_attention_layernorm"),
    added_norm="post_attention_layernorm",
    body="""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn({attn})
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
    """,
)
PHI3 = LayerShape(
    "phi3",
    ("input_layernorm", "post_attention_layernorm"),
    added_norm="post_attention_layernorm",
    dropouts=("resid_attn_dropout", "resid_mlp_dropout"),
    body="""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights = self.self_attn({attn})
        hidden_states = residual + self.resid_attn_dropout(hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + self.resid_mlp_dropout(hidden_states)
        return hidden_states
    """,
)
SHAPES = (SANDWICH, LLAMA, PHI3)


@dataclass(frozen=True)
class LayerForm:
    """What the rewrite needs of a decoder-layer class's forward: its shape, the positional parameters after the
    input (the model passes them by keyword; positional ones become keywords), their defaults, and the keyword renames
    of its `deprecate_kwarg` decorators."""

    shape: LayerShape
    names: tuple[str, ...]
    defaults: dict[str, Any]
    aliases: tuple[tuple[str, str], ...]


def _shape_statements(shape: LayerShape, source: Source) -> tuple[Any, ...]:
    """The shape's body, its self-attention given each of this forward's named parameters under its own name."""
    attn = ", ".join(["hidden_states=hidden_states", *(f"{p}={p}" for p in source.params[2:]), f"**{source.varkw}"])
    return template(shape.body.format(attn=attn))


@functools.cache
def read_layer(cls: type) -> LayerForm | str:
    """The form of a decoder-layer class whose forward is, statement for statement, one of `SHAPES`; else the reason,
    naming the first statement that differs from the closest shape."""
    name = f"{cls.__name__}.forward"
    source = read_source(cls.forward)
    if source is None:
        return f"{name} has no readable source, so its structure cannot be checked"
    if source.params[1:2] != ("hidden_states",) or source.varargs or source.kwonly or source.varkw is None:
        return f"{name} takes ({', '.join(source.params)}), not (hidden_states, named parameters..., **kwargs)"
    aliases = deprecated_aliases(source.decorators)
    if isinstance(aliases, str):
        return f"{cls.__name__}: {aliases}"
    closest = (-1, "")
    for shape in SHAPES:
        statements = _shape_statements(shape, source)
        reason = difference(source, statements, name, f"the {shape.name}-shape decoder layer")
        if not reason:
            params = list(inspect.signature(cls.forward).parameters.values())[2:]
            names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
            defaults = {p.name: p.default for p in params if p.name in names and p.default is not p.empty}
            return LayerForm(shape, names, defaults, aliases)
        closest = max(closest, (agreeing(source, statements), reason), key=lambda c: c[0])
    return closest[1]


def layer_form(layer: nn.Module, patcher: Patcher | None = None) -> LayerForm:
    """The known form of a decoder-layer instance, its norms vouched for; raises NotPatchable saying why not."""
    from torch import nn

    name = type(layer).__name__
    if not any(all(isinstance(getattr(layer, m, None), nn.Module) for m in s.modules) for s in SHAPES):
        known = "; ".join(f"{s.name}: {', '.join(s.modules)}" for s in SHAPES)
        raise NotPatchable(f"{name} is not a decoder layer of a known shape ({known})")
    replaced = forward_replaced(layer, patcher)
    if replaced:
        raise NotPatchable(replaced)
    form = read_layer(type(layer))
    if isinstance(form, str):
        raise NotPatchable(form)
    missing = [m for m in form.shape.modules if not isinstance(getattr(layer, m, None), nn.Module)]
    if missing:
        raise NotPatchable(f"{name}'s forward is a {form.shape.name}-shape layer's, but it has no {', '.join(missing)}")
    for norm in form.shape.norms:
        norm_spec(getattr(layer, norm))
    return form


def layer_shape(layer: nn.Module, patcher: Patcher | None = None) -> LayerShape:
    """`layer_form(layer).shape`."""
    return layer_form(layer, patcher).shape


# ------------------------------------------------------------------------------------------------- the residual carry


class Carry:
    """The residual add a layer left undone for the next consumer: `out` (its last branch's output, which it returned
    in place of the sum) and `residual`. One per layer stack, shared by the decoder-layer rewrite here and GPT-2's
    (`fusionscope.apply.gpt2`); `take` empties it, so a handed-over pair is added exactly once."""

    __slots__ = ("out", "residual")

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None

    def hand_over(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Keep `(out, residual)` for the next consumer; returns `out`, what the giver returns."""
        self.out, self.residual = out, residual
        return out

    def take(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(out, residual)` when `x` is the tensor handed over (an identity check, not a shape check); None for any
        other tensor. The carry is empty afterwards either way, so a stale pair is dropped."""
        out, residual = self.out, self.residual
        self.out = self.residual = None
        return (out, residual) if out is not None and x is out else None  # type: ignore[return-value]

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """The whole hidden state for `x`: `residual + out` when `x` is the handed-over `out`, else `x` itself."""
        pair = self.take(x)
        return x if pair is None else pair[1] + pair[0]

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


def hidden_states_recorded(kwargs: dict[str, Any], config: Any) -> bool:
    """Whether this forward's layer outputs are being recorded, so that no layer may hand its last add over: while
    transformers' output capture (5.17 and 5.24: `transformers.utils.output_capturing`) collects hidden states, which
    its hooks read from each layer's output; or when the call (else the config) asks for `output_hidden_states` — an
    index or a list of indices asks for some of them. GPT-2's model forward pops `output_hidden_states` before it calls
    the blocks, so for GPT-2 the capture is the answer (`output_collector`)."""
    collector = output_collector()
    collected = collector.get() if collector is not None else None
    if collected and "hidden_states" in collected:
        return True
    flag = (
        kwargs["output_hidden_states"]
        if "output_hidden_states" in kwargs
        else getattr(config, "output_hidden_states", False)
    )
    return flag is not None and flag is not False


@functools.cache
def output_collector() -> Any:
    """transformers' context variable of the outputs being captured, looked up once (each layer asks at decode); None
    where this transformers has none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


# ------------------------------------------------------------------------------------------------ the layer rewrite


@dataclass(frozen=True)
class LayerPlan:
    """What one layer instance's rewritten forward does.

    take: its input norm continues the carry of the layer before; fuse: its in-layer add + norm is one add_rms_norm;
    give: it leaves its last add to the next consumer."""

    form: LayerForm
    take: bool
    fuse: bool
    give: bool
    carry: Carry
    input_spec: NormSpec
    added_spec: NormSpec
    config: Any


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
        pair = carry.take(x)
        if pair is None:
            return layer.input_layernorm(x), x
        norm = layer.input_layernorm
        return kernels.add_rms_norm(*pair, norm.weight, getattr(norm, eps_attr), offset)

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
    """The layer's output: `out` with the add handed over, or `residual + out` (always while hidden states are
    recorded)."""
    carry, config = plan.carry, plan.config
    if not plan.give:

        def add(out: torch.Tensor, residual: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
            return residual + out

        return add

    def leave(out: torch.Tensor, residual: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        if hidden_states_recorded(kwargs, config):
            carry.clear()
            return residual + out
        return carry.hand_over(out, residual)

    return leave


def _keywords(form: LayerForm, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords the class's forward would pass the attention: positional arguments by name, its decorators'
    renames made, over its defaults."""
    if len(args) > len(form.names):
        raise TypeError(f"the decoder layer takes {len(form.names) + 1} positional arguments, got {len(args) + 1}")
    kwargs = {**dict(zip(form.names, args)), **kwargs}
    rename(kwargs, form.aliases)
    return {**form.defaults, **kwargs}


def layer_forward(plan: LayerPlan, kernels: Any) -> Callable[..., torch.Tensor]:
    """The rewritten forward of one layer instance, `(self, hidden_states, *args, **kwargs)`: the keywords the class's
    forward would pass `self_attn` go to it unchanged (`past_key_values` in 5.17, `cache` in 5.24, sliding-window
    masks, ...); self_attn, mlp and the norms that are not fused are called as modules, so other fusions' swaps of them
    run. In training mode, the class's forward (`unless_training`)."""
    enter, add_norm, leave, form = _enter(plan, kernels), _add_norm(plan, kernels), _leave(plan), plan.form
    restore = plan.carry.restore if plan.take else None

    if form.shape is SANDWICH:

        def sandwich_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            kwargs = _keywords(form, args, kwargs)
            h, residual = enter(self, hidden_states)
            h, _ = self.self_attn(hidden_states=h, **kwargs)
            h = self.post_attention_layernorm(h)
            h, residual = add_norm(self.pre_feedforward_layernorm, h, residual)
            h = self.post_feedforward_layernorm(self.mlp(h))
            return leave(h, residual, kwargs)

        return unless_training(sandwich_forward, restore)

    dropouts = form.shape is PHI3

    def llama_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs = _keywords(form, args, kwargs)
        h, residual = enter(self, hidden_states)
        h, _ = self.self_attn(hidden_states=h, **kwargs)
        if dropouts:  # Phi-3: residual + dropout(attn)
            h = self.resid_attn_dropout(h)
        h, residual = add_norm(self.post_attention_layernorm, h, residual)
        h = self.mlp(h)
        if dropouts:
            h = self.resid_mlp_dropout(h)
        return leave(h, residual, kwargs)

    return unless_training(llama_forward, restore)


def final_norm_forward(carry: Carry, spec: NormSpec, kernels: Any) -> Callable[..., torch.Tensor]:
    """The final norm's forward: add_rms_norm of the last layer's carried pair, or the norm's class forward when the
    input is not the carried tensor (and in training mode, the carry added back first)."""
    eps_attr, offset = spec.eps_attr, spec.offset

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        pair = carry.take(hidden_states)
        if pair is None:
            return type(self).forward(self, hidden_states)
        return kernels.add_rms_norm(*pair, self.weight, getattr(self, eps_attr), offset)[0]

    return unless_training(forward, carry.restore)
