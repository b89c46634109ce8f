"""From a fusion's saving to an end-to-end speedup, knowing who sets the pace of a step: the host or the GPU.

A step's wall time is modelled as `max(T_host, T_gpu)`: the host issues ops (Python, dispatch, launches) while the
GPU runs kernels from its queue, and whichever takes longer sets the step time. In Hugging Face eager decode at
batch 1 the H200 is busy 17–28% of each step (reports/samples/): saving GPU time there barely moves the wall clock,
while saving ops — and the host work each one costs — does. So every estimate carries both speedups.

- `T_gpu`: GPU busy time per step (kernel time, overlaps once).
- `T_host`: host time per step = ops per step × host cost per op. In a host-bound step that cost is measured
  directly (unprofiled wall ÷ ops), so `T_host` is the wall time. In a phase measured GPU-bound (busy ≥ 50%) it
  is the measured host cost of a one-kernel aten op (`roofs.aten_op_host_us`) per op, but never more than the
  step: the op count includes nested ops (`aten::linear` and the `aten::mm` inside it), so ops × cost can exceed
  the whole step — llama-3.1-8b prefill on the H200: 5114 ops × 11.3 µs = 58 ms in a 24.1 ms step whose GPU is busy
  16.4 ms. There the host paces the step (18 µs per kernel, the same as in its host-bound decode), and the model
  says so: `T_host` = the wall time, GPU savings alone do not shorten it.
- `T_exposed`: what `max(T_host, T_gpu)` leaves of the measured wall time (GPU idle in a step whose host is fast:
  the queue filling at its start, syncs). It is held constant: a fusion does not remove it, a CUDA graph largely
  does.
- A fused kernel removes its group's ops from the host's work and adds one launch (`roofs.launch_us`, an empty
  Triton launch), and replaces the group's kernel time by the fused kernel's.

The regime named with the estimates is the model's: host-bound when `T_host ≥ T_gpu`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepModel:
    """What a phase's step costs the host and the GPU, in µs per step."""

    wall_us: float
    gpu_us: float
    host_us: float
    host_us_per_op: float
    launch_us: float

    @property
    def regime(self) -> str:
        return "host-bound" if self.host_us >= self.gpu_us else "gpu-bound"

    @property
    def exposed_us(self) -> float:
        """Wall time neither the host term nor the GPU term explains (GPU idle in a GPU-bound step)."""
        return max(self.wall_us - max(self.host_us, self.gpu_us), 0.0)


def step_model(phase: dict, roofs: dict) -> StepModel | None:
    """Build the model of one phase from its summary.json entry and the run's roofs; None without GPU figures."""
    if phase.get("gpu_busy_ms_per_step") is None or not phase.get("ops_per_step"):
        return None
    wall = 1e3 * (phase.get("wall_ms_per_step_unprofiled") or phase["wall_ms_per_step"])
    gpu = 1e3 * phase["gpu_busy_ms_per_step"]
    ops = phase["ops_per_step"]
    host_bound = phase.get("regime") == "host-bound"
    per_op = wall / ops if host_bound else min(float(roofs.get("aten_op_host_us") or wall / ops), wall / ops)
    return StepModel(wall_us=wall, gpu_us=gpu, host_us=ops * per_op, host_us_per_op=per_op,
                     launch_us=float(roofs.get("launch_us") or per_op))  # fmt: skip


@dataclass(frozen=True)
class Speedup:
    gpu: float  # T_gpu / T_gpu'
    wall: float  # max(T_host, T_gpu) / max(T_host', T_gpu')
    saved_gpu_us: float
    saved_host_us: float


def speedup(model: StepModel, saved_gpu_us: float, saved_ops: float, added_launches: float) -> Speedup:
    """End-to-end speedup of one step when kernels worth `saved_gpu_us` are replaced and `saved_ops` host ops are
    removed in exchange for `added_launches` fused-kernel launches."""
    saved_host = saved_ops * model.host_us_per_op - added_launches * model.launch_us
    gpu_new = max(model.gpu_us - saved_gpu_us, 1e-9)
    host_new = max(model.host_us - saved_host, 1e-9)
    before = max(model.host_us, model.gpu_us) + model.exposed_us
    after = max(host_new, gpu_new) + model.exposed_us
    return Speedup(gpu=model.gpu_us / gpu_new, wall=before / after, saved_gpu_us=saved_gpu_us,
                   saved_host_us=saved_host)  # fmt: skip


def cuda_graph_share(model: StepModel) -> float:
    """Share of the step's wall time that capturing it in a CUDA graph would remove: host time not hidden behind
    GPU work and GPU idle time (a replayed graph costs the host one launch, so the step falls to about its GPU
    time)."""
    before = max(model.host_us, model.gpu_us) + model.exposed_us
    return max(0.0, (before - model.gpu_us) / before) if before else 0.0
