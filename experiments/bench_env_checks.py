"""Correctness checks of experiments/bench_env.py: did ours and the baseline do the same work?

Both harnesses reset to the same init states and execute the same actions, and the physics is
the same (lean stepping is bit-identical to robosuite's, tests/envs/test_lean.py). Two final
states are compared per env (8-dim: eef position (3), eef axis-angle (3), gripper qpos (2)):

1. ours (observed at the end of the last step) vs the baseline's *end-of-step* state (fetched
   after the timing): must be equal to the last bit (bound 0).
2. ours vs the observation robosuite's `env.step` *returned* to the baseline. These differ:
   robosuite samples each observable once per 50 ms control period at a sub-step whose phase
   drifts (floating-point accumulation of the 2 ms sub-steps), so its step observation lags the
   end-of-step state by up to one control step (envs/steppers.py). Measured on libero_10 task 0
   with actions ~U(-0.5, 0.5): the lag is ~10% of a step's motion, at most 1.0 mm, 5.0 mrad and
   0.2 mm of finger travel over 250 steps (step motion at most 9.7 mm, 62 mrad). The bound is one
   control step of the largest commanded motion: OSC_POSE moves the goal by at most
   output_max x |action| per step (0.05 m, 0.5 rad per unit action), and a finger travels at
   most its 0.04 m range.
Rotations are compared as the angle between them, not component-wise: an axis-angle vector
changes representation (jumps by ~2 pi) where the rotation angle wraps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

OSC_POSITION_LIMIT_M = 0.05  # robosuite OSC_POSE output_max per unit action (position)
OSC_ROTATION_LIMIT_RAD = 0.5  # ... (orientation)
FINGER_RANGE_M = 0.04  # Panda finger joint travel


def axis_angle_to_matrix(vectors: np.ndarray) -> np.ndarray:
    """(N, 3) axis-angle vectors -> (N, 3, 3) rotation matrices (Rodrigues' formula)."""
    vectors = np.asarray(vectors, dtype=np.float64).reshape(-1, 3)
    angle = np.linalg.norm(vectors, axis=1)
    axis = np.divide(vectors, angle[:, None], out=np.zeros_like(vectors), where=angle[:, None] > 0)
    x, y, z = axis.T
    zero = np.zeros_like(x)
    cross = np.stack([zero, -z, y, z, zero, -x, -y, x, zero], axis=1).reshape(-1, 3, 3)
    sin, cos = np.sin(angle)[:, None, None], np.cos(angle)[:, None, None]
    return np.eye(3) + sin * cross + (1 - cos) * (cross @ cross)


def rotation_angle_between(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N,) angle in radians of the rotation taking axis-angle a to axis-angle b."""
    relative = np.transpose(axis_angle_to_matrix(a), (0, 2, 1)) @ axis_angle_to_matrix(b)
    cosine = (np.trace(relative, axis1=1, axis2=2) - 1.0) / 2.0
    return np.arccos(np.clip(cosine, -1.0, 1.0))


def state_gaps(a: Any, b: Any) -> dict[str, float]:
    """Largest difference over envs between two (N, 8) states, per part."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 8)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 8)
    return {
        "position_m": float(np.abs(a[:, :3] - b[:, :3]).max()),
        "rotation_rad": float(rotation_angle_between(a[:, 3:6], b[:, 3:6]).max()),
        "gripper_m": float(np.abs(a[:, 6:] - b[:, 6:]).max()),
    }


def observation_lag_bounds(action_scale: float) -> dict[str, float]:
    """How far robosuite's lagging step observation may be from the end-of-step state: one
    control step of the largest commanded motion (module docstring)."""
    return {
        "position_m": OSC_POSITION_LIMIT_M * action_scale,
        "rotation_rad": OSC_ROTATION_LIMIT_RAD * action_scale,
        "gripper_m": FINGER_RANGE_M,
    }


def final_state_checks(ours: Any, baseline_observed: Any, baseline_end: Any | None,
                       action_scale: float) -> dict[str, Any]:
    """Both comparisons of the module docstring, each with its bound and verdict."""
    checks: dict[str, Any] = {}
    if baseline_end is not None:
        diff = float(np.abs(np.asarray(ours, np.float64) - np.asarray(baseline_end, np.float64)).max())
        checks["end_of_step_state"] = {"max_abs_diff": diff, "bound": 0.0, "ok": diff == 0.0}
    gaps = state_gaps(ours, baseline_observed)
    bounds = observation_lag_bounds(action_scale)
    checks["observation_lag"] = {"gaps": gaps, "bounds": bounds,
                                 "ok": all(gaps[k] <= bounds[k] for k in bounds)}
    return checks


def lean_vs_robosuite_check(lean_state: Any, robosuite_state: Any) -> dict[str, Any]:
    """Ours in both step modes after the same actions: bit-identical physics, so equal."""
    diff = float(np.abs(np.asarray(lean_state, np.float64) - np.asarray(robosuite_state, np.float64)).max())
    return {"max_abs_diff": diff, "bound": 0.0, "ok": diff == 0.0}


def describe_checks(checks: dict[str, Any]) -> list[str]:
    """Human-readable lines, one per check, saying what was compared and why it may differ."""
    lines = []
    if "end_of_step_state" in checks:
        c = checks["end_of_step_state"]
        lines.append(f"[{'ok' if c['ok'] else 'FAIL'}] final state, ours vs the baseline's end-of-step state: "
                     f"max |diff| {c['max_abs_diff']:.3g} (bound 0: same physics, same actions)")
    if "observation_lag" in checks:
        c = checks["observation_lag"]
        parts = ", ".join(f"{k} {c['gaps'][k]:.3g} <= {c['bounds'][k]:.3g}" for k in c["bounds"])
        lines.append(f"[{'ok' if c['ok'] else 'FAIL'}] final state, ours vs the observation robosuite's env.step "
                     f"returned to the baseline: {parts}. robosuite samples observables once per control period "
                     "at a drifting sub-step, so its step observation lags the end-of-step state by up to one "
                     "control step (envs/steppers.py); ours observe the end state. Bound: one control step of the "
                     "largest commanded motion (experiments/bench_env_checks.py)")
    if "lean_vs_robosuite" in checks:
        c = checks["lean_vs_robosuite"]
        lines.append(f"[{'ok' if c['ok'] else 'FAIL'}] final state, ours lean vs ours robosuite: "
                     f"max |diff| {c['max_abs_diff']:.3g} (bound 0: lean stepping is bit-identical)")
    return lines
