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
- A fused kernel removes its group's host time and adds one fused call, and replaces the group's kernel time by the
  fused kernel's (`fused`: the step model after them). The group's host time is what its ops and the Python between
  them took in the profiled step (`opportunities.HostSpans`), scaled by `host_scale` (modelled host time ÷ profiled
  wall time: the profiler slows the host 2–3× in an eager decode). A fused call costs `roofs.fused_call_us`: a bundled
  kernel called as a patched forward calls it, output allocation included (about twice an empty Triton launch,
  `roofs.launch_us`, which roofs measured before that figure existed stand in for). Without host spans (a match
  whose ops were not timed) the group's ops × the mean host cost per op stand in.
- A CUDA graph replays the step for one launch: what it can remove is the step's wall time beyond its GPU time
  (`cuda_graph_share`). After the fusions only the fused step's host time is left to remove, so the plan
  (`opportunities.summarize_opportunities`) gives the share on the fused step — on llama-3.1-8b decode (H200,
  reports/samples/catalogue/) 73% of the fused step, 38% of the unfused one, not the 80% a graph alone would
  remove from the unfused step on top of the fusions' 48%.

Two names for two things. The phase's `regime` (summary.json `phases`, `host-bound` / `gpu-bound`) is measured:
host-bound when the GPU is busy under half of the unprofiled step; it only picks the host cost per op above. What
paces a step in this model, and so what every estimate assumes, is `StepModel.paced_by`: `host` when
`T_host ≥ T_gpu`, else `gpu` (summary.json `cumulative[phase].paced_by`). They differ where the host's work fills
the step while the GPU is busy most of it: llama-3.1-8b prefill, measured gpu-bound (68% busy), paced by the host.
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
    launch_us: float  # what one fused call costs the host
    host_scale: float = 1.0  # modelled host µs per profiled µs
    comm_us: float = 0.0  # communication kernels (NCCL) per step, outside `gpu_us`: what a compute fusion keeps

    @property
    def device_us(self) -> float:
        """The GPU's work per step: computation and communication, one after the other on its timeline."""
        return self.gpu_us + self.comm_us

    @property
    def paced_by(self) -> str:
        """`host` or `gpu`: the term that sets the step time (not the phase's measured `regime`)."""
        return "host" if self.host_us >= self.device_us else "gpu"

    @property
    def exposed_us(self) -> float:
        """Wall time neither the host term nor the GPU term explains (GPU idle in a GPU-bound step)."""
        return max(self.wall_us - max(self.host_us, self.device_us), 0.0)

    @property
    def step_us(self) -> float:
        """The modelled step time: `max(T_host, T_gpu + T_comm) + T_exposed`."""
        return max(self.host_us, self.device_us) + self.exposed_us

    def figures(self) -> dict[str, float]:
        """The model's terms for summary.json (µs per step)."""
        return {"wall_us": self.step_us, "host_us": self.host_us, "gpu_us": self.gpu_us, "comm_us": self.comm_us,
                "exposed_us": self.exposed_us}  # fmt: skip


def step_model(phase: dict, roofs: dict) -> StepModel | None:
    """Build the model of one phase from its summary.json entry and the run's roofs; None without GPU figures."""
    if phase.get("gpu_busy_ms_per_step") is None or not phase.get("ops_per_step"):
        return None
    wall = 1e3 * (phase.get("wall_ms_per_step_unprofiled") or phase["wall_ms_per_step"])
    comm = 1e3 * (phase.get("comm_ms_per_step") or 0.0)  # inside the busy time: NCCL kernels are kernels
    gpu = 1e3 * phase["gpu_busy_ms_per_step"] - comm
    ops = phase["ops_per_step"]
    host_bound = phase.get("regime") == "host-bound"
    per_op = wall / ops if host_bound else min(float(roofs.get("aten_op_host_us") or wall / ops), wall / ops)
    profiled = 1e3 * (phase.get("wall_ms_per_step") or 0.0)
    call = roofs.get("fused_call_us") or roofs.get("launch_us") or per_op
    return StepModel(wall_us=wall, gpu_us=gpu, host_us=ops * per_op, host_us_per_op=per_op, launch_us=float(call),
                     host_scale=ops * per_op / profiled if profiled else 1.0, comm_us=comm)  # fmt: skip


@dataclass(frozen=True)
class Speedup:
    gpu: float  # T_gpu / T_gpu'
    wall: float  # max(T_host, T_gpu) / max(T_host', T_gpu')
    saved_gpu_us: float
    saved_host_us: float


def saved_host_us(model: StepModel, saved_ops: float, added_launches: float, host_now_us: float | None = None) -> float:
    """Host µs per step that removing a group saves: its profiled host time × `host_scale` (or, without it, its ops ×
    the mean cost per op), less the fused calls it adds."""
    removed = host_now_us * model.host_scale if host_now_us else saved_ops * model.host_us_per_op
    return removed - added_launches * model.launch_us


def fused(model: StepModel, saved_gpu_us: float, saved_ops: float, added_launches: float,
          host_now_us: float | None = None) -> StepModel:  # fmt: skip
    """The step after kernels worth `saved_gpu_us` are replaced and a group of `saved_ops` host ops (profiled host
    time `host_now_us`) is removed in exchange for `added_launches` fused calls; its exposed time is the unfused
    step's (a fusion does not remove it)."""
    saved_host = saved_host_us(model, saved_ops, added_launches, host_now_us)
    gpu_new = max(model.gpu_us - saved_gpu_us, 1e-9)
    host_new = max(model.host_us - saved_host, 1e-9)
    return StepModel(wall_us=max(host_new, gpu_new + model.comm_us) + model.exposed_us, gpu_us=gpu_new,
                     host_us=host_new, host_us_per_op=model.host_us_per_op, launch_us=model.launch_us,
                     host_scale=model.host_scale, comm_us=model.comm_us)  # fmt: skip


def speedup(model: StepModel, saved_gpu_us: float, saved_ops: float, added_launches: float,
            host_now_us: float | None = None) -> Speedup:  # fmt: skip
    """End-to-end speedup of one step when kernels worth `saved_gpu_us` are replaced and a group of `saved_ops` host
    ops (profiled host time `host_now_us`) is removed in exchange for `added_launches` fused calls."""
    after = fused(model, saved_gpu_us, saved_ops, added_launches, host_now_us)
    return Speedup(gpu=model.device_us / after.device_us, wall=model.step_us / after.step_us, saved_gpu_us=saved_gpu_us,
                   saved_host_us=saved_host_us(model, saved_ops, added_launches, host_now_us))  # fmt: skip


def cuda_graph_share(model: StepModel) -> float:
    """Share of `model`'s step time that capturing it in a CUDA graph would remove: host time not hidden behind
    GPU work and GPU idle time (a replayed graph costs the host one launch, so the step falls to about its GPU
    time). Pass the fused step (`fused`) for what a graph adds to the fusions: the share is of that step."""
    before = model.step_us
    return max(0.0, (before - model.device_us) / before) if before else 0.0
