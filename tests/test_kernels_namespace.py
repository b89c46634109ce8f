"""The top-level `kernels/` folder installs as `fusionscope.kernels`; under its bare name it yields to the distribution.

Run from the repository root, `kernels` is importable as a top-level package, and that name belongs to Hugging Face's
`kernels` distribution, which transformers imports at load time. Imported under the bare name, the folder loads that
distribution where one is installed elsewhere on `sys.path`, and does nothing where none is. Either way it must
register no op and load no Triton of its own, or the kernels would register twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Whatever `kernels` turns out to be, the folder's own kernel modules must not have run.
NO_OPS = """
ops = [n for n in dir(torch.ops) if n == 'fusionscope']
assert not ops or not list(torch.ops.fusionscope), 'ops registered'
"""

PROBE_NO_DISTRIBUTION = (
    """
import sys, torch
from pathlib import Path
root = Path({root!r})
saved = list(sys.path)
# Hide any installed `kernels` distribution, so that the import finds this folder and nothing else.
sys.path[:] = [p for p in sys.path if Path(p or '.').resolve() == root or not (Path(p or '.') / 'kernels').exists()]
import kernels
sys.path[:] = saved
assert Path(kernels.__file__) == root / 'kernels' / '__init__.py', kernels.__file__
public = [n for n in dir(kernels) if not n.startswith('_')]
assert public == [], public
assert 'triton' not in sys.modules, 'importing kernels loaded triton'
try:
    kernels.add_rms_norm
except AttributeError:
    pass
else:
    raise AssertionError('bare kernels exposes kernel functions')
"""
    + NO_OPS
    + "print('ok')\n"
)

PROBE_DISTRIBUTION = (
    """
import sys, torch
import kernels
assert kernels.__file__ == {init!r}, kernels.__file__
assert sys.modules['kernels'] is kernels
assert kernels.CUDAProperties == 'real', kernels.CUDAProperties
from kernels.layer.mode import Mode
assert Mode == 'real mode', Mode
assert sys.modules['kernels.layer.mode'].__file__.startswith({package!r})
assert 'triton' not in sys.modules, 'importing kernels loaded triton'
"""
    + NO_OPS
    + "print('ok')\n"
)

PROBE_TRANSFORMERS = (
    """
import importlib.metadata, sys, torch
from pathlib import Path
import kernels
import transformers
import transformers.modeling_utils  # imports `kernels` submodules where transformers depends on the distribution
try:
    importlib.metadata.distribution('kernels')
except importlib.metadata.PackageNotFoundError:
    assert Path(kernels.__file__).parent == Path({folder!r}), kernels.__file__
else:
    assert Path(kernels.__file__).parent != Path({folder!r}), kernels.__file__
"""
    + NO_OPS
    + "print('ok')\n"
)


def _run_from_root(code: str, env: dict[str, str] | None = None) -> None:
    """Run `code` in a fresh interpreter started in the repository root, where the bare name `kernels` finds the
    folder, and fail with its stderr."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_bare_kernels_import_without_distribution_has_no_effect() -> None:
    _run_from_root(PROBE_NO_DISTRIBUTION.format(root=str(REPO)))


def test_bare_kernels_import_hands_the_name_to_an_installed_distribution(tmp_path: Path) -> None:
    """A stand-in for Hugging Face's package, after the repository root on `sys.path`: the bare import must give it,
    and its submodules (imported by its own `__init__` and afterwards) must come from it."""
    package = tmp_path / "site" / "kernels"
    (package / "layer").mkdir(parents=True)
    (package / "__init__.py").write_text("from kernels._internals import CUDAProperties\n")
    (package / "_internals.py").write_text("CUDAProperties = 'real'\n")
    (package / "layer" / "__init__.py").write_text("")
    (package / "layer" / "mode.py").write_text("Mode = 'real mode'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(package.parent)])}
    _run_from_root(PROBE_DISTRIBUTION.format(init=str(package / "__init__.py"), package=str(package)), env)


def test_transformers_imports_after_bare_kernels() -> None:
    """transformers reads the `kernels` name at load time: the folder, or the distribution it hands over to, must let
    it load."""
    _run_from_root(PROBE_TRANSFORMERS.format(folder=str(REPO / "kernels")))


def test_installed_name_is_fusionscope_kernels() -> None:
    import fusionscope.kernels as fk

    assert fk.__name__ == "fusionscope.kernels"
    assert Path(fk.__file__).resolve().parent == REPO / "kernels"
