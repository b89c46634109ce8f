"""`apply --nproc N` on the CPU: gloo ranks through torchrun, each patching its shard of a tiny Llama in step with the
others; rank 0's decisions followed by every rank (`apply.lockstep`); and the options that cannot run with N > 1
refused in one line before any rank starts."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from fusionscope.cli import app

runner = CliRunner()
WORKLOAD = ["--prompt-len", "12", "--decode-steps", "3"]


@pytest.fixture(scope="module")
def tp_apply(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("apply-nproc") / "tp2"
    result = runner.invoke(app, ["apply", "tiny-llama", "--nproc", "2", "--out", str(out), *WORKLOAD])
    assert result.exit_code == 0, result.output
    return out


def test_two_ranks_apply_into_one_run_folder(tp_apply: Path) -> None:
    assert {"apply.csv", "summary.json", "report.html", "traces/rank0.json.gz", "traces/rank1.json.gz"} <= {
        str(p.relative_to(tp_apply)) for p in tp_apply.rglob("*")
    }
    assert not list(tp_apply.parent.glob(".*partial"))
    summary = json.loads((tp_apply / "summary.json").read_text())
    assert summary["model"]["nproc"] == 2 and summary["ranks"]["count"] == 2
    assert summary["tensor_parallel"]["plan"]["model.layers.*.self_attn.q_proj"] == "colwise"
    rows = {row["fusion"]: row for row in summary["apply"]["fusions"]}
    # the kernels that work on a rank's local activations patch its shard and keep its numerics
    for fusion in ("rms_norm", "silu_and_mul", "rope", "decode_attention"):
        assert rows[fusion]["status"] == "passed", rows[fusion]
        assert rows[fusion]["sites_patched"] == rows[fusion]["sites_found"] > 0
        assert rows[fusion]["numerics"]["max_abs"] < 1e-4  # fp32 shards: patched vs unpatched, same ranks
    # a horizontal fusion of sharded projections is not built: skipped, and the reason says why
    for fusion in ("qkv", "gate_up"):
        assert rows[fusion]["status"] == "skipped" and "sharded over tensor-parallel ranks" in rows[fusion]["reason"]
    assert rows["allreduce_add_rms_norm"]["status"] == "skipped"  # estimate only, no kernel
    assert summary["apply"]["together_numerics"]["passed"]
    table = pd.read_csv(tp_apply / "apply.csv")
    assert set(table["variant"]) >= {"rms_norm", "qkv"}


def test_nproc_1_applies_what_a_plain_apply_applies(tmp_path: Path, tp_apply: Path) -> None:
    result = runner.invoke(app, ["apply", "tiny-llama", "--nproc", "1", "--out", str(tmp_path / "one"), *WORKLOAD])
    assert result.exit_code == 0, result.output
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert one["model"]["nproc"] == 1 and one["tensor_parallel"]["plan"] == {}
    rows = {row["fusion"]: row["status"] for row in one["apply"]["fusions"]}
    assert rows["qkv"] == rows["gate_up"] == rows["add_rms_norm"] == "passed"  # nothing sharded: all patchable


def _lockstep_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 1's own judge fails every fusion and its own timings find nothing slower; rank 0's pass them and find
    rms_norm slower: both ranks must patch, report and time as rank 0 decided."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRITON_INTERPRET="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from fusionscope import distributed, models
    from fusionscope.apply import lockstep, measure, numerics
    from fusionscope.apply import run as apply_run
    from fusionscope.apply.run import run_apply

    if rank == 1:
        numerics.judge = lambda *args, **kwargs: (False, "rank 1's own judgement")
    mesh = init_device_mesh("cpu", (world,))
    workload = distributed.build_sharded_workload(models.resolve_model("tiny-llama"), torch.device("cpu"),
                                                  torch.float32, mesh=mesh, world=world, applied={}, prompt_len=8,
                                                  decode_steps=2)  # fmt: skip
    layers = len(workload.module.model.layers)
    found = [{"fusion": "silu_and_mul", "phase": "decode", "confidence": "high",
              "module_paths": [f"model.layers.{i}.mlp" for i in range(layers)]},
             {"fusion": "rms_norm", "phase": "decode", "confidence": "high",
              "module_paths": ["model.norm"]}]  # fmt: skip
    summary = {"opportunities": found} if rank == 0 else {}  # the other ranks learn the fusions from rank 0
    result = run_apply(workload, summary, None, 1, Path(folder), lambda _line: None)
    statuses = {row["fusion"]: (row["status"], row["reason"]) for row in result["fusions"]}
    agreed = lockstep.agree(f"rank {rank}")
    # timing: rank 0 finds rms_norm clearly slower alone in decode, rank 1 finds nothing slower; both must time rank
    # 0's second set (the rounds themselves are left out here: on a CPU they would time the interpreter)
    timed: list[list[str]] = []

    def timed_set(workload, variants, *args, **kwargs):
        timed.append(list(variants))
        return {name: SimpleNamespace(name=name, peak_mib=0.0) for name in variants}

    apply_run._timed_set = timed_set
    apply_run.clearly_slower = lambda variant, baseline, phase: rank == 0 and variant.name == "rms_norm"
    apply_run.phase_figures = lambda *args, **kwargs: {}
    measure.gpu_figures = lambda *args, **kwargs: {}
    passing = [f for f, (status, _why) in statuses.items() if status == "passed"]
    timing = apply_run.measure_variants(workload, {"phases": {"decode": {}}}, passing,
                                        lambda _fusions: contextlib.nullcontext(), None, 1, Path(folder),
                                        lambda _line: None, together_ok=True)  # fmt: skip
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"statuses": statuses, "agreed": agreed, "timed": timed,
                                                            "all_together": timing["all_together"]}))  # fmt: skip
    dist.destroy_process_group()


def test_every_rank_follows_rank_0s_decisions(tmp_path: Path, two_gloo_ranks) -> None:
    two_gloo_ranks(_lockstep_rank, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert ranks[0]["statuses"]["silu_and_mul"][0] == ranks[0]["statuses"]["rms_norm"][0] == "passed"
    assert ranks[1]["statuses"] == ranks[0]["statuses"]  # rank 1's own failing judge was overruled
    assert [r["agreed"] for r in ranks] == ["rank 0", "rank 0"]
    second = ["baseline", "all together (decode)"]
    assert ranks[0]["timed"][1] == second and ranks[1]["timed"] == ranks[0]["timed"]  # rank 0's choice, timed by both
    assert ranks[1]["all_together"] == ranks[0]["all_together"] == {"decode": "all together (decode)"}


def test_agree_outside_ranks_is_the_value_itself() -> None:
    from fusionscope.apply.lockstep import agree

    value = {"a": [1, 2]}
    assert agree(value) is value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nproc", "2", "--graphs"], "--graphs with --nproc > 1 is not measured"),
        (["--nproc", "2", "--quantize", "w4"], "--quantize with --nproc > 1 is not supported"),
        (["--nproc", "1", "--from", "."], "--from takes an earlier run's predictions for one process"),
        (["--nproc", "0"], "--nproc must be ≥ 1 (got 0)"),
        (["--nproc", "3"], "--nproc 3 does not divide"),
    ],
)
def test_bad_apply_nproc_is_one_line_before_any_rank(tmp_path: Path, extra: list[str], message: str) -> None:
    out = tmp_path / "never"
    result = runner.invoke(app, ["apply", "tiny-llama", *extra, "--out", str(out), *WORKLOAD])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


@pytest.mark.parametrize("ranks", [False, True])
def test_a_patched_forward_that_raises_fails_the_fusion_or_on_ranks_the_run(monkeypatch, ranks: bool) -> None:
    """In one process a patched forward that raises is a failed fusion; on tensor-parallel ranks it ends the run,
    since the other ranks wait in that forward's all-reduce (torchrun then stops them all)."""
    from fusionscope import models
    from fusionscope.apply import numerics
    from fusionscope.apply import run as apply_run

    workload = models.build_workload(models.resolve_model("tiny-llama"), torch.device("cpu"), torch.float32,
                                     prompt_len=8, decode_steps=2)  # fmt: skip
    real = numerics.reference
    norm = workload.module.model.norm

    def raises_when_patched(*args, **kwargs):
        if "forward" in vars(norm):  # the rms_norm patch binds the norm's forward on the instance
            raise RuntimeError("a rank's kernel failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(numerics, "reference", raises_when_patched)
    monkeypatch.setattr(apply_run, "in_ranks", lambda: ranks)
    # the raise is keyed on the layout patcher's forward bound on the norm instance (the rewrite binds none there)
    from functools import partial

    from fusionscope.apply import patching

    monkeypatch.setattr(patching, "patch", partial(patching.patch, rewrite=False))
    found = [{"fusion": "rms_norm", "phase": "decode", "confidence": "high", "module_paths": ["model.norm"]}]
    if ranks:
        with pytest.raises(RuntimeError, match="a rank's kernel failed"):
            apply_run.run_apply(workload, {"opportunities": found}, None, 1, Path("."), lambda _line: None)
        return
    result = apply_run.run_apply(workload, {"opportunities": found}, None, 1, Path("."), lambda _line: None)
    row = result["fusions"][0]
    assert row["status"] == "failed" and "raised RuntimeError: a rank's kernel failed" in row["reason"]
