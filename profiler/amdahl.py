"""Amdahl projections: what an RL step would cost if one phase ran s times faster.

Ideal form: the phase stays fully on the critical path, so the step shrinks by exactly what
the phase saves:  T' = T - t + t / s,  speed-up T / T'  (s = inf: T' = T - t).
For overlapped phases use the critical-path replay (profiler.critical_path), which never
projects more saving than this.

CLI (prints the table, and last the projected step time for --speedup):
    python -m profiler.amdahl --step 955.8 --predict 152.4 --speedup 2.55
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from profiler.config import DEFAULT_SPEEDUPS


@dataclass(frozen=True)
class IdealProjection:
    speedup: float  # how much faster the phase runs
    step_s: float  # projected step time
    end_to_end: float  # T / T'

    @property
    def saving(self) -> float:
        """Fraction of the step saved (0.097 for -9.7%)."""
        return 1.0 - 1.0 / self.end_to_end


def ideal_step_time(step_s: float, phase_s: float, speedup: float) -> float:
    """T - t + t / s, validated (the phase cannot exceed the step, s >= 1)."""
    if step_s <= 0:
        raise ValueError(f"step time must be > 0, got {step_s}")
    if not 0 <= phase_s <= step_s * (1 + 1e-9):
        raise ValueError(f"phase time must be within [0, step time {step_s}], got {phase_s}")
    if not speedup >= 1:
        raise ValueError(f"speed-up must be >= 1 (or inf), got {speedup}")
    remaining = 0.0 if math.isinf(speedup) else phase_s / speedup
    return step_s - phase_s + remaining


def ideal_projection(step_s: float, phase_s: float, speedup: float) -> IdealProjection:
    projected = ideal_step_time(step_s, phase_s, speedup)
    end_to_end = math.inf if projected == 0 else step_s / projected
    return IdealProjection(speedup=speedup, step_s=projected, end_to_end=end_to_end)


def ideal_table(
    step_s: float, phase_s: float, speedups: Sequence[float] = DEFAULT_SPEEDUPS
) -> list[IdealProjection]:
    return [ideal_projection(step_s, phase_s, s) for s in speedups]


def format_speedup(s: float) -> str:
    return "inf" if math.isinf(s) else f"{s:g}x"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m profiler.amdahl",
        description="Ideal Amdahl projection of an RL step when one phase (predict) gets faster.",
    )
    parser.add_argument("--step", type=float, required=True, help="step time, seconds")
    parser.add_argument("--predict", type=float, required=True,
                        help="phase time on the critical path (max per-rank predict), seconds")
    parser.add_argument("--speedup", type=float, default=2.0, help="phase speed-up to project")
    parser.add_argument("--name", default="predict", help="phase name for the printout")
    args = parser.parse_args(argv)
    try:
        rows = ideal_table(args.step, args.predict, sorted(set(DEFAULT_SPEEDUPS) | {args.speedup}))
        chosen = ideal_projection(args.step, args.predict, args.speedup)
    except ValueError as error:
        parser.error(str(error))
    share = args.predict / args.step
    print(f"step {args.step:g} s, {args.name} {args.predict:g} s ({share:.1%} of the step)")
    print(f"{args.name + ' speed-up':>18} {'projected step':>15} {'end-to-end':>11} {'saving':>8}")
    for row in rows:
        print(f"{format_speedup(row.speedup):>18} {row.step_s:>13.1f} s {row.end_to_end:>10.3f}x "
              f"{row.saving:>8.1%}")
    print(f"projected step time: {chosen.step_s:.1f} s with {args.name} {format_speedup(args.speedup)} "
          f"faster (end-to-end speed-up {chosen.end_to_end:.3f}x, {-chosen.saving:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
