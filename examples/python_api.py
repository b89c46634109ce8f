"""The Python API: profile a model, read the per-phase figures and the fusion opportunities, re-render the report.

python examples/python_api.py            # tiny-llama on whatever device is here
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import fusionscope


def main() -> None:
    out = Path(tempfile.mkdtemp()) / "tiny-llama"
    run = fusionscope.profile("tiny-llama", out=out, prompt_len=32, decode_steps=4)
    for phase, figures in run.summary["phases"].items():
        print(f"{phase}: {figures['wall_ms_per_step']:.2f} ms/step, regime {figures['regime'] or 'cpu run'}")
    for opp in run.summary["opportunities"]:
        print(f"  {opp['fusion']:<14} {opp['phase']:<8} ×{opp['count']:.0f} per step: "
              f"{opp['t_now_us']:.1f} µs now → {opp['t_fused_us']:.1f} µs fused ({opp['confidence']})")  # fmt: skip
    slowest = run.kernels.sort_values("dur_us", ascending=False).head(3)
    print(slowest[["phase", "name", "module", "dur_us", "bound"]].to_string(index=False))
    print("report:", fusionscope.rerender(run.out_dir))


if __name__ == "__main__":
    main()
