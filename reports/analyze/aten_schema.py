"""Write `fusionscope/aten_schema.py`: the installed torch dispatcher's answer to `order_graph.schema_facts` for
every aten op it knows, so that `analyze` answers it without importing torch.

    .venv/bin/python reports/analyze/aten_schema.py     # after a torch upgrade; then `ruff format` the file

Every op name of the JIT registry and the dispatcher (what `torch.ops.aten.<name>` can find) is asked
(`order_graph.dispatcher_facts`) for each device kind a trace's Timeline has; the table lists those that are
composite or views. `tests/test_order_graph_schema.py` checks it against the dispatcher name by name.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from fusionscope.order_graph import dispatcher_facts

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "fusionscope/aten_schema.py"
KINDS = ("cuda", "cpu")  # `trace.Timeline.device_kind`


def aten_names() -> list[str]:
    """Every `aten::` op name torch can look up, without its overload."""
    names = {s.name for s in torch._C._jit_get_all_schemas()}
    names |= {n.split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()}
    return sorted(n for n in names if n.startswith("aten::"))


def table() -> tuple[dict[str, list[str]], list[str]]:
    """({device kind: the composite ops' short names}, the views' short names)."""
    names = aten_names()
    composite = {k: [n.removeprefix("aten::") for n in names if dispatcher_facts(n, k)[0]] for k in KINDS}
    views = [n.removeprefix("aten::") for n in names if dispatcher_facts(n, KINDS[0])[1]]
    return composite, views


def names_literal(names: list[str]) -> str:
    if not names:
        return "frozenset()"
    body = textwrap.fill(", ".join(f'"{n}"' for n in names), width=110, break_long_words=False)
    return "frozenset(\n    {\n" + textwrap.indent(body, "        ") + "\n    }\n)"


def main() -> None:
    composite, views = table()
    common = sorted(set.intersection(*(set(v) for v in composite.values())))
    extra = {k: sorted(set(v) - set(common)) for k, v in composite.items()}
    text = f'''"""What torch's dispatcher says of each aten op that `order_graph` reads (`schema_facts`):
composite (every overload CompositeImplicitAutograd without a kernel for the device kind, so eager execution
decomposes it) or a view (an overload returns an alias of its input). Written from torch {torch.__version__}
by `reports/analyze/aten_schema.py` (do not edit); used only where that torch is installed, so that `analyze` need
not import torch. Short names (`aten::` dropped, no overload); an op in no set is neither.
"""

TORCH = "{torch.__version__}"
_COMPOSITE = {names_literal(common)}
COMPOSITE = {{
'''
    for kind in KINDS:
        text += f'    "{kind}": _COMPOSITE | {names_literal(extra[kind])},\n'
    text += "}\n" + f"VIEWS = {names_literal(sorted(views))}\n"
    TABLE.write_text(text)
    print(f"{TABLE}: {len(common)} composite ops, {sum(map(len, extra.values()))} for one kind only, "
          f"{len(views)} views (torch {torch.__version__})")  # fmt: skip


if __name__ == "__main__":
    main()
