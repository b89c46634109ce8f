"""The package's layers import only downward: the layer map of the README's Development section, checked.

Every module under `fusionscope/` is parsed (nothing is imported) and each of its `import` and `from ... import`
statements becomes an arrow to the module it names, wherever it stands: at module level, inside a function (the lazy
imports that keep `import fusionscope` cheap, where a cycle hides most easily) or under
`TYPE_CHECKING`. An arrow may point into its own layer or any layer below; one that points up fails the test, and so
does any cycle (with no arrow pointing up, a cycle can only lie inside one layer). `kernels/`, installed as
`fusionscope.kernels`, is one node of the bottom layer and imports nothing of the package but itself.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fusionscope"
KERNELS = "fusionscope.kernels"

# Bottom to top; a module belongs to the first layer one of whose patterns matches its dotted name. Keep in step with
# the README's Development section.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("fusionscope.errors", "fusionscope.trace_fields", "fusionscope.markers", "fusionscope.kernel_names",
                "fusionscope.datasheets", KERNELS, "fusionscope.bench.cases", "fusionscope.bench.timing")),
    ("trace reading", ("fusionscope.trace", "fusionscope.trace_events", "fusionscope.trace_pool",
                       "fusionscope.training", "fusionscope.ranks", "fusionscope.merged_ranks")),
    ("device and workload", ("fusionscope.gpu_replay", "fusionscope.device", "fusionscope.models",
                             "fusionscope.static_cache", "fusionscope.capture", "fusionscope.apply.sampler")),
    ("costing", ("fusionscope.roofline", "fusionscope.roofline.*", "fusionscope.analysis", "fusionscope.dataflow",
                 "fusionscope.dataflow_nodes", "fusionscope.op_outputs", "fusionscope.order_graph",
                 "fusionscope.aten_schema", "fusionscope.execution_trace", "fusionscope.floor")),
    ("model rewrites", ("fusionscope.apply.patcher", "fusionscope.apply.source", "fusionscope.apply.layers",
                        "fusionscope.apply.attention", "fusionscope.apply.gpt2", "fusionscope.apply.quantize",
                        "fusionscope.apply.numerics")),
    ("finder and estimates", ("fusionscope.fusions", "fusionscope.fusions.*", "fusionscope.opportunities",
                              "fusionscope.amdahl", "fusionscope.micro", "fusionscope.fused_kernels",
                              "fusionscope.repeated_steps")),
    ("patch and measure", ("fusionscope.apply.patching", "fusionscope.apply.rewrite", "fusionscope.apply.measure",
                           "fusionscope.apply.lockstep", "fusionscope.apply.replay", "fusionscope.apply.graphs",
                           "fusionscope.apply.step_drift", "fusionscope.apply.cudagraph_skips",
                           "fusionscope.apply.forward_compile")),
    ("run folder and stages", ("fusionscope.report", "fusionscope.report.*", "fusionscope.bench.page",
                               "fusionscope.run_folder", "fusionscope.table_writer", "fusionscope.pipeline",
                               "fusionscope.launch")),
    ("commands", ("fusionscope.run", "fusionscope.analyze", "fusionscope.apply.run", "fusionscope.distributed",
                  "fusionscope.diff", "fusionscope.bench", "fusionscope.cli", "fusionscope.__main__", "fusionscope",
                  "fusionscope.apply")),
]  # fmt: skip


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} of every module under `package` (a package by its `__init__.py`)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def layer_of(module: str) -> int | None:
    for index, (_name, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return index
    return None


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for every import statement of the file, at any depth."""

    def known(name: str) -> str | None:
        """The module `name` is, or lies in (`fusionscope.kernels.*` is one node); None outside the package."""
        if name == KERNELS or name.startswith(KERNELS + "."):
            return KERNELS
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    arrows = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .table import x` inside fusionscope.report
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself
            targets = [f"{base}.{a.name}" if known(f"{base}.{a.name}") == f"{base}.{a.name}" else base
                       for a in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "fusionscope":
                continue
            resolved = known(target)
            if resolved is not None and resolved != module and (resolved, node.lineno) not in arrows:
                arrows.append((resolved, node.lineno))
    return arrows


def registry_arrows(modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """The catalogue's own imports, made by name (`importlib.import_module`): fusionscope.fusions → each entry of
    its `_MODULES`."""
    path = modules["fusionscope.fusions"]
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_MODULES" for t in node.targets):
            names = ast.literal_eval(node.value)
            return [("fusionscope.fusions", f"fusionscope.fusions.{name}", node.lineno) for name in names]
    raise AssertionError("fusionscope/fusions/__init__.py has no _MODULES")


def arrows(package: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """(importer, imported, line) over the whole package."""
    modules = module_files(package)
    found = []
    for module, path in modules.items():
        found += [(module, target, line) for target, line in imports(module, path, modules)]
    return found + registry_arrows(modules)


def upward(found: list[tuple[str, str, int]]) -> list[str]:
    """Each arrow into a higher layer, as `importer:line → imported (its layer → that layer)`."""
    out = []
    for src, dst, line in found:
        low, high = layer_of(src), layer_of(dst)
        if low is not None and high is not None and high > low:  # a module in no layer fails its own test
            out.append(f"{src}:{line} → {dst} ({LAYERS[low][0]} → {LAYERS[high][0]})")
    return out


def cycles(found: list[tuple[str, str, int]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for src, dst, _line in found:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in module_files() if layer_of(m) is None]
    assert not unplaced, f"modules in no layer of LAYERS (place each in the README's map and here): {unplaced}"


def test_no_import_points_up() -> None:
    up = upward(arrows())
    assert not up, "imports from a lower layer up to a higher one:\n" + "\n".join(up)


def test_no_import_cycle() -> None:
    found = cycles(arrows())
    assert not found, "modules that import each other (directly or round a loop):\n" + "\n".join(map(str, found))


def test_readme_lists_the_layers() -> None:
    """The README's Development section numbers the same layers, bottom to top."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Development") :]
    listed = [line.split(". ", 1)[1].split(" — ", 1)[0].lower() for line in section.splitlines()
              if line[:1].isdigit() and ". " in line]  # fmt: skip
    assert listed == [name for name, _patterns in LAYERS]


def test_kernels_import_only_themselves() -> None:
    """kernels/ installs as fusionscope.kernels and stays a leaf: patchers import it lazily, it imports none of them."""
    bad = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            outside = [
                n for n in names if n.split(".")[0] == "fusionscope" and n.split(".")[:2] != ["fusionscope", "kernels"]
            ]
            bad += [f"kernels/{path.name}:{node.lineno} → {name}" for name in outside]
    assert not bad, "kernels/ imports the package above it:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The check itself: a copy of a bottom-layer module given a lazy import of a command is flagged, and a pair of
    modules importing each other is a cycle."""
    package = tmp_path / "fusionscope"
    (package / "apply").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "apply" / "__init__.py").write_text("")
    (package / "errors.py").write_text("def f():\n    from fusionscope.apply import run\n")
    (package / "apply" / "run.py").write_text("from fusionscope.errors import f\n")
    (package / "fusions").mkdir()
    (package / "fusions" / "__init__.py").write_text("_MODULES = ()\n")
    found = arrows(package)
    assert upward(found) == ["fusionscope.errors:2 → fusionscope.apply.run (leaves → commands)"]
    assert cycles(found) == [["fusionscope.apply.run", "fusionscope.errors"]]
