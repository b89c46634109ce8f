"""The class's forward that a patch replaces on one instance, and the rules every replacement keeps.

A rewritten forward is only as exact as the claim that it computes what the class's forward computes. That claim is
checked on the class's source, statement by statement (`read_source`, `difference`): a forward is accepted only when
its statements are, one for one, those of a shape the rewrite reproduces (comments, layout and docstrings aside). The
names of parameters the rewrite passes on by name may differ between families and versions (the KV cache is `cache`
in transformers 5.24, `past_key_values` in 5.17: such templates are written with the candidate's own names);
operators, constants, attributes and call structure may not. Bytecode names (`co_names`) cannot carry that claim: they
do not record operators, so `LayerNorm(h) + x` and `LayerNorm(h + x)` read the same names.

Every patcher that rewrites a forward also refuses an instance whose forward is already its own (`forward_replaced`:
that forward is not the class's whose source was read), and binds the rewrite through `unless_training`: the kernels
have no backward, so a module in training mode at call time runs its class's forward, exactly.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fusionscope.apply.patcher import Patcher


@functools.cache
def kernel_dtypes() -> tuple[torch.dtype, ...]:
    """The activation dtypes every bundled kernel takes (torch is imported here, on first use: `analyze` matches
    the catalogue without it)."""
    import torch

    return (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Source:
    """A function's parameters and body as parsed from its source: the statements as syntax trees (comments, layout
    and the docstring dropped), decorators as written."""

    params: tuple[str, ...]  # positional-or-keyword parameters, `self` first
    varargs: str | None
    kwonly: tuple[str, ...]
    varkw: str | None
    statements: tuple[ast.stmt, ...]
    decorators: tuple[ast.expr, ...]

    @property
    def signature(self) -> tuple[object, ...]:
        """What the parameters and decorators say, comparable between two functions."""
        return self.params, self.varargs, self.kwonly, self.varkw, tuple(ast.dump(d) for d in self.decorators)

    def text(self, i: int) -> str:
        return ast.unparse(self.statements[i])

    def key(self, i: int) -> str:
        """Statement `i` as a comparable string (an `ast.dump`: the unparsed text may change between Python versions;
        the tree does not)."""
        return ast.dump(self.statements[i])

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(ast.dump(s) for s in self.statements)


def statement_key(text: str) -> str:
    """The `Source.key` of a statement written out as source."""
    return ast.dump(ast.parse(text).body[0])


def expression_key(text: str) -> str:
    return ast.dump(ast.parse(text, mode="eval").body)


def read_source(function: Callable[..., Any]) -> Source | None:
    """The parsed source of `function` (unwrapped through `functools.wraps` decorators); None when it has none."""
    try:
        return parse_function(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def parse_function(text: str) -> Source | None:
    """The `Source` of the first function defined in `text` (a function's source, dedented)."""
    tree = ast.parse(text)
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]  # the docstring
    args = node.args
    return Source(
        params=tuple(a.arg for a in (*args.posonlyargs, *args.args)),
        varargs=args.vararg.arg if args.vararg else None,
        kwonly=tuple(a.arg for a in args.kwonlyargs),
        varkw=args.kwarg.arg if args.kwarg else None,
        statements=tuple(body),
        decorators=tuple(node.decorator_list),
    )


def template(text: str) -> tuple[ast.stmt, ...]:
    """The statements of a block of source (a forward's body written out, dedented before parsing).

    An `if` whose body is `...` stands for that test with any body: for the branches a rewrite hands back to the class's
    own forward whenever their test holds (GPT-2's cross-attention), so what they contain never runs in the rewrite."""
    return tuple(ast.parse(textwrap.dedent(text)).body)


def _any_body(statement: ast.stmt) -> bool:
    body = statement.body if isinstance(statement, ast.If) else ()
    return len(body) == 1 and isinstance(body[0], ast.Expr) and getattr(body[0].value, "value", None) is Ellipsis


def _same(got: ast.stmt, want: ast.stmt) -> bool:
    if _any_body(want):
        return (
            isinstance(got, ast.If)
            and ast.dump(got.test) == ast.dump(want.test)
            and [ast.dump(s) for s in got.orelse] == [ast.dump(s) for s in want.orelse]
        )
    return ast.dump(got) == ast.dump(want)


def agreeing(source: Source, statements: Sequence[ast.stmt]) -> int:
    """How many leading statements of `source` are those of `statements`."""
    n = 0
    while n < min(len(source.statements), len(statements)) and _same(source.statements[n], statements[n]):
        n += 1
    return n


def difference(source: Source, statements: Sequence[ast.stmt], name: str, what: str) -> str:
    """'' when the statements of `source` are, one for one, `statements`; else the reason, naming the first statement
    that differs (`name`: the function read, `what`: the shape it was compared with)."""
    n = agreeing(source, statements)
    if n == len(statements) == len(source.statements):
        return ""
    if n < len(source.statements):
        at = source.text(n).splitlines()[0]
        if n == len(statements):
            return f"{name} goes on after the end of {what}, at `{at}`"
        return f"{name} differs from {what} at `{at}`"
    return f"{name} ends after {n} statements, before the end of {what}"


def deprecated_aliases(decorators: Sequence[ast.expr]) -> tuple[tuple[str, str], ...] | str:
    """(old, new) keyword names of the forward's `@deprecate_kwarg(old, ..., new_name=new)` decorators, which rename
    a keyword before the body runs (a rewrite must rename it too: `rename`); a reason for any other decorator."""
    found = []
    for deco in decorators:
        call = deco if isinstance(deco, ast.Call) else None
        name = getattr(call.func, "id", getattr(call.func, "attr", "")) if call else ""
        if name != "deprecate_kwarg" or not call.args or not isinstance(call.args[0], ast.Constant):
            return f"its forward is decorated with `{ast.unparse(deco)}`, which the rewrite does not reproduce"
        new = next((k.value.value for k in call.keywords if k.arg == "new_name"), None)
        if isinstance(new, str):
            found.append((call.args[0].value, new))
    return tuple(found)


def rename(kwargs: dict[str, Any], aliases: tuple[tuple[str, str], ...]) -> None:
    """What `deprecate_kwarg` does to the keywords (warnings aside): the old name's value goes to the new name, unless
    the new name is given too, which then wins."""
    for old, new in aliases:
        if old in kwargs:
            kwargs.setdefault(new, kwargs.pop(old))


def forward_replaced(module: nn.Module, patcher: Patcher | None = None) -> str:
    """Why `module`'s forward may not be rewritten ('' when it may): a forward already bound on the instance — by
    another fusion of this patch, or by anything else — is not the class's forward whose source was checked, and the
    training-mode fallback would run the class's forward in place of it."""
    if "forward" not in vars(module):
        return ""
    owner = patcher.forward_owner(module) if patcher is not None else None
    if owner is not None:
        return f"the forward of {type(module).__name__} is already rewritten by the {owner} fusion"
    if sharded(module):
        return (f"this {type(module).__name__} is sharded over tensor-parallel ranks (DTensor weights, transformers' "
                "sharded forward on the instance): the fusion does not rewrite sharded modules")  # fmt: skip
    return f"this {type(module).__name__}'s forward is already replaced on the instance"


def sharded(module: nn.Module) -> bool:
    """Whether a parameter of `module` itself is a DTensor (tensor parallelism shards it across ranks)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


Forward = Callable[..., Any]


def unless_training(forward: Forward, restore: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Forward:
    """`forward` (a rewrite, `(self, *args, **kwargs)`) for a module in eval mode; in training mode at call time the
    class's forward, given the same arguments: the kernels keep no autograd history.

    `restore`: for a consumer of a carried residual add (`fusionscope.apply.layers.Carry`), turns the hidden state it
    was handed (its first argument, or `hidden_states=`) back into the whole sum the class's forward expects."""

    @functools.wraps(forward)
    def patched(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            return forward(self, *args, **kwargs)
        if restore is not None:
            if args:
                args = (restore(args[0]), *args[1:])
            elif "hidden_states" in kwargs:
                kwargs["hidden_states"] = restore(kwargs["hidden_states"])
        return type(self).forward(self, *args, **kwargs)

    return patched
