"""The top-level `kernels/` folder installs as `fusionscope.kernels`, and imported under its bare name it does nothing.

Run from the repository root, `kernels` is importable as a top-level package, and transformers imports whatever
answers to that name at import time (when no distribution owns it). That import must register no op and load no
Triton, or kernels would register twice.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import sys, torch
import kernels
assert kernels.__file__.startswith({root!r}), kernels.__file__
public = [n for n in dir(kernels) if not n.startswith('_')]
assert public == [], public
assert 'triton' not in sys.modules, 'importing kernels loaded triton'
ops = [n for n in dir(torch.ops) if n == 'fusionscope']
assert not ops or not list(torch.ops.fusionscope), 'ops registered'
try:
    kernels.add_rms_norm
except AttributeError:
    pass
else:
    raise AssertionError('bare kernels exposes kernel functions')
import transformers  # probes the `kernels` name at import time
print('ok')
"""


def test_bare_kernels_import_from_repo_root_has_no_effect() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=str(REPO / "kernels"))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_installed_name_is_fusionscope_kernels() -> None:
    import fusionscope.kernels as fk

    assert fk.__name__ == "fusionscope.kernels"
    assert Path(fk.__file__).resolve().parent == REPO / "kernels"
