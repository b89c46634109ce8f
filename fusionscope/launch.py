"""`--nproc N` on the launching side: what the CLI process does for `profile --nproc N` and `apply --nproc N`
before and while the ranks run.

It checks what it can before any rank starts (N against the GPUs present, the model's tensor-parallel plan, heads and
widths divisible by N), stages the run folder, writes the job every rank reads, and launches N ranks through
torch.distributed's own launcher (`python -m torch.distributed.run`, torchrun's module) running
`python -m fusionscope.distributed JOB`, with NVLink multicast off (`NCCL_NVLS_ENABLE=0`) in every rank's
environment; it relays rank 0's stage lines and turns a failed rank into one error. What each rank does is
`fusionscope.distributed`'s. This side sits below the `profile` and `apply` commands, which call it; the ranks' side
sits above them, since a rank runs their stages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusionscope.errors import UsageError
from fusionscope.pipeline import Settings, prepare
from fusionscope.run_folder import Run, command_line, load_run, staged_dir

SCRATCH = ".ranks"  # inside the staged run folder: the job, progress, per-rank notes and the launcher's log
TRACES = "traces"
RANK_TRACE = TRACES + "/rank{rank}.json.gz"
RANK_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off on every rank
RANK_ERROR = re.compile(r"^\[rank\d+\]:\s*(\w+(?:\.\w+)*(?:Error|Exception)\b.*)$", re.M)  # torchrun's prefix


# --- before any rank starts -------------------------------------------------------------------------------------


def tp_config(spec: Any) -> Any:
    """The transformers config of MODEL (None for a factory model, which has none)."""
    from fusionscope import models

    if spec.source == "factory":
        return None
    if spec.config is not None:
        return models._hf_config(spec)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(spec.path), gguf_file=spec.weights)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the config of {spec.path}: {str(exc).splitlines()[0]}") from None


def check_nproc(spec: Any, device: Any, nproc: int) -> dict[str, str]:
    """Refuse, one line each, what would fail in every rank: N < 1, more ranks than GPUs, a model without a
    tensor-parallel plan, and attention heads, KV heads, MLP width or vocabulary that N does not divide. Returns the
    config's plan ({} for N = 1, which shards nothing)."""
    if nproc < 1:
        raise UsageError(f"--nproc must be ≥ 1 (got {nproc})")
    if device.type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UsageError(f"--nproc {nproc} needs {nproc} GPUs, but this machine has {gpus}")
    if nproc == 1:
        return {}
    config = tp_config(spec)
    if config is None:
        raise UsageError(f"{spec.name} is a file.py:factory model, which has no tensor-parallel plan; "
                         "--nproc > 1 needs a Hugging Face model whose config has one")  # fmt: skip
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    if not plan:
        raise UsageError(f"{spec.name} ({getattr(text, 'model_type', '?')}) has no tensor-parallel plan in its "
                         "config (base_model_tp_plan): it cannot be sharded with --nproc > 1")  # fmt: skip
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    for what, value in (("attention heads", heads), ("KV heads", kv_heads),
                        ("MLP width (intermediate_size)", getattr(text, "intermediate_size", None)),
                        ("vocabulary", getattr(text, "vocab_size", None))):  # fmt: skip
        if value and int(value) % nproc:
            raise UsageError(f"--nproc {nproc} does not divide {spec.name}'s {value} {what}: choose N dividing "
                             f"its {heads} attention heads and {kv_heads} KV heads")  # fmt: skip
    return plan


# --- stage, launch, relay ---------------------------------------------------------------------------------------


def profile_tp(settings: Settings, out: str | Path | None, on_stage: Callable[[str], None] | None = None) -> Run:
    """`profile` over `settings.nproc` ranks: check, launch, wait; the run folder appears whole or not at all."""
    return launch_tp(settings, out, on_stage)


def launch_tp(settings: Settings, out: str | Path | None, on_stage: Callable[[str], None] | None = None,
              options: Any = None, check: Callable[[Any], None] | None = None) -> Run:  # fmt: skip
    """`profile`, or with `options` (apply's options, a dataclass every rank receives: `apply.run.ApplyOptions`)
    `apply`, over `settings.nproc` ranks: check (`check(device)` too: apply's kernel and --quantize checks), launch,
    wait; the run folder appears whole or not at all. Returns it as `load_run` reads it (`apply` makes its `ApplyRun`
    of it)."""
    nproc = 1 if settings.nproc is None else int(settings.nproc)
    note = on_stage or (lambda _msg: None)
    out_dir, spec, dev, _dtype = prepare(settings, out)
    check_nproc(spec, dev, nproc)
    if check is not None:
        check(dev)  # a bad --quantize is one line here, not in every rank
    with staged_dir(out_dir) as tmp:
        scratch = tmp / SCRATCH
        scratch.mkdir()
        (tmp / TRACES).mkdir()
        job = {"settings": dataclasses.asdict(settings), "device": dev.type, "folder": str(tmp.resolve()),
               "out_dir": str(out_dir.resolve()), "command": command_line(), "started_at": time.time(),
               "apply": None if options is None else dataclasses.asdict(options)}  # fmt: skip
        (scratch / "job.json").write_text(json.dumps(job))
        note(f"launching {nproc} rank{'s' if nproc > 1 else ''} ({'nccl' if dev.type == 'cuda' else 'gloo'})")
        launch(scratch, nproc, note)
        shutil.rmtree(scratch)
        done = load_run(tmp)
    return Run(out_dir=out_dir, summary=done.summary, kernels=done.kernels)


def launch_command(job_file: Path, nproc: int) -> list[str]:
    """torchrun as a module of this interpreter, one node, N workers running `fusionscope.distributed`'s `main`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
            "-m", "fusionscope.distributed", str(job_file)]  # fmt: skip


def rank_env() -> dict[str, str]:
    """The ranks' environment: this one, NVLink multicast off, and this package importable as it is here."""
    env = {**os.environ, **RANK_ENV}
    root = str(Path(__file__).resolve().parent.parent)  # the folder holding the fusionscope package
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def launch(scratch: Path, nproc: int, note: Callable[[str], None]) -> None:
    """Run the ranks, passing rank 0's stage lines on to `note` as they come; a failed rank becomes one error."""
    log = scratch / "launch.log"
    progress = scratch / "progress.log"
    seen = 0
    with log.open("wb") as sink:
        proc = subprocess.Popen(launch_command(scratch / "job.json", nproc), stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=rank_env())  # fmt: skip
        try:
            while True:
                rc = proc.poll()
                if progress.exists():
                    lines = progress.read_text(encoding="utf-8").splitlines()
                    for line in lines[seen:]:
                        note(line)
                    seen = len(lines)
                if rc is not None:
                    break
                time.sleep(0.2)
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
    if rc != 0:
        raise rank_failure(scratch, nproc, rc)


def rank_failure(scratch: Path, nproc: int, rc: int) -> Exception:
    """A rank's own usage error as it said it; anything else with the last error line of the log, which is kept."""
    said = sorted(scratch.glob("error-rank*.txt"))
    if said:
        return UsageError(said[0].read_text(encoding="utf-8").strip())
    text = (scratch / "launch.log").read_text(encoding="utf-8", errors="replace")
    errors = RANK_ERROR.findall(text)
    last = errors[-1] if errors else f"exit status {rc}"
    return RuntimeError(f"--nproc {nproc}: a rank failed ({last}); the ranks' log is kept at {keep_log(scratch)}")


def keep_log(scratch: Path) -> Path:
    """Copy the launcher's log out of the staged folder (which is removed on failure) into the system's temporary
    folder."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix="fusionscope-ranks-", suffix=".log")
    with os.fdopen(fd, "wb") as dst, (scratch / "launch.log").open("rb") as src:
        shutil.copyfileobj(src, dst)
    return Path(name)
