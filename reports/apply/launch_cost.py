"""The host time per fused launch that each committed apply run implies, beside the step model's figure.

    python3 reports/apply/launch_cost.py          # reads reports/apply/*/summary.json

For every run and phase, the variant with every passing fusion ("all found", or "all together" where that is the
same set): measured and predicted wall speedup, and what one fused launch cost the host according to the step model
(`roofs.launch_us`, an empty Triton launch) and according to the measurement (`apply.run.implied_launch_us`). Runs
written before that figure was recorded get it computed here from their saved numbers, with the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

from fusionscope.apply.run import implied_launch_us, predicted

HERE = Path(__file__).resolve().parent


def main() -> None:
    print(f"{'run':22} {'phase':8} {'variant':13} {'measured':>8} {'predicted':>9} {'error':>6} {'model µs':>8} "
          f"{'implied µs':>10}")  # fmt: skip
    for path in sorted(HERE.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        variants = (summary.get("apply", {}).get("timing") or {}).get("variants", {})
        name = "all found" if "all found" in variants else "all together"
        if name not in variants:
            continue
        variant = variants[name]
        for phase, figures in variant["phases"].items():
            pred = predicted(summary, phase, variant["fusions"])
            implied = implied_launch_us(summary, phase, pred, figures["wall_ms"], figures["baseline_wall_ms"])
            print(f"{path.parent.name:22} {phase:8} {name:13} {figures['measured_speedup_wall']:8.3f} "
                  f"{figures['predicted_speedup_wall']:9.3f} {100 * figures['error_wall']:+5.0f}% "
                  f"{pred.get('launch_us') or float('nan'):8.1f} "
                  f"{implied if implied is not None else float('nan'):10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
