"""`analyze` without torch: its import took about a second of every run, and nothing of the analysis needs torch's
code. GIVEN a trace, WHEN analyze runs in a fresh interpreter, THEN torch is never imported; and what torch used to
answer (the dispatcher's composite and view ops, the TF32 switch, torch's version in summary.json) is answered the
same without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusionscope import aten_schema, order_graph
from fusionscope.roofline.classify import TF32_OVERRIDE

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
KINDS = ("cuda", "cpu")  # `trace.Timeline.device_kind`


def fresh(code: str, env: dict[str, str] | None = None) -> str:
    """Run `code` in a fresh interpreter importing this tree's fusionscope; its stdout."""
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run_env.pop(TF32_OVERRIDE, None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**run_env, **(env or {})},
                          capture_output=True, text=True, check=True, timeout=300)  # fmt: skip
    return done.stdout


@pytest.mark.parametrize("trace", ["tiny-llama-cuda.trace.json.gz", "traces/cpu-steps.trace.json.gz",
                                   "traces/gloo-2ranks"])  # fmt: skip
def test_analyze_never_imports_torch(tmp_path: Path, trace: str) -> None:
    run = f"analyze({str(DATA / trace)!r}, out={str(tmp_path / 'run')!r})"
    code = (f"import sys\nfrom fusionscope.analyze import analyze\n{run}\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")  # fmt: skip
    assert fresh(code).strip() == "[]"
    assert (tmp_path / "run" / "summary.json").exists()


def aten_names() -> list[str]:
    """Every `aten::` op name torch can look up (as `reports/analyze/aten_schema.py` lists them)."""
    names = {s.name for s in torch._C._jit_get_all_schemas()}
    names |= {n.split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()}
    return sorted(n for n in names if n.startswith("aten::"))


def test_aten_schema_is_the_dispatchers() -> None:
    """The table answers `schema_facts` as torch's dispatcher does, name by name, for every aten op torch knows."""
    if str(torch.__version__) != aten_schema.TORCH:
        pytest.skip(f"aten_schema was written from torch {aten_schema.TORCH}, this is {torch.__version__}: "
                    "schema_facts asks the dispatcher (reports/analyze/aten_schema.py writes a new table)")  # fmt: skip
    differ = [(name, kind) for name in aten_names() for kind in KINDS
              if order_graph.schema_facts(name, kind) != order_graph.dispatcher_facts(name, kind)]  # fmt: skip
    assert not differ
    assert order_graph.schema_facts("aten::linear", "cuda") == (True, False)
    assert order_graph.schema_facts("aten::view", "cpu") == (False, True)
    assert order_graph.schema_facts("aten::no_such_op", "cuda") == (False, False)


def test_schema_facts_of_another_torch_ask_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aten_schema, "TORCH", "0.0.0")
    monkeypatch.setattr(aten_schema, "COMPOSITE", {kind: frozenset() for kind in KINDS})
    order_graph.schema_facts.cache_clear()
    try:
        assert order_graph.schema_facts("aten::linear", "cuda") == order_graph.dispatcher_facts("aten::linear", "cuda")
        assert order_graph.schema_facts("aten::linear", "cuda") == (True, False)
    finally:
        order_graph.schema_facts.cache_clear()


def test_versions_without_torch_are_torchs() -> None:
    """summary.json's versions read without importing torch equal those torch gives once imported."""
    code = ("import json, sys\nfrom fusionscope.device import software_versions\nbefore = software_versions()\n"
            "assert 'torch' not in sys.modules\nimport torch\n"
            "print(json.dumps([before, software_versions()]))")  # fmt: skip
    before, after = json.loads(fresh(code))
    assert before == after
    assert before["torch"] == str(torch.__version__)


def test_tf32_switch_without_torch() -> None:
    """Without torch imported nothing turned TF32 matmuls on, but torch's environment override, where torch is asked."""
    code = ("import sys\nfrom fusionscope.roofline.classify import tf32_matmuls\nfirst = tf32_matmuls()\n"
            "imported = 'torch' in sys.modules\nimport torch\n"
            "print(first, imported, bool(torch.backends.cuda.matmul.allow_tf32))")  # fmt: skip
    assert fresh(code).split() == ["False", "False", "False"]
    first, imported, asked = fresh(code, {TF32_OVERRIDE: "1"}).split()
    assert imported == "True" and first == asked
