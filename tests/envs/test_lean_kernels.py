"""The lean path's controller math, without a LIBERO scene.

- `osc_torques` (robosuite's OSC_POSE, NumPy reference) against a hand-derived case;
- the fused numba kernel against `arm_state` + `osc_torques` + clip + gripper on fresh random
  inputs, bit for bit (the env tests then check the whole step against robosuite's env.step);
- the gripper against hand-computed values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("robosuite")
pytest.importorskip("mujoco")

from envs.lean.osc import arm_state, osc_goal, osc_torques
from envs.lean.selfcheck import (
    fused_kernel_is_exact,
    fused_torques,
    random_substep_inputs,
    reference_torques,
)

pytestmark = pytest.mark.libero  # robosuite + mujoco (no assets needed)

KP, KD = 150.0, 2 * math.sqrt(150.0)  # LIBERO's OSC_POSE: kp 150, damping ratio 1
NULL_KP, NULL_KD = 10.0, 2 * math.sqrt(10.0)  # robosuite's nullspace_torques defaults


def _random_inputs(rng: np.random.Generator, nv: int, qvel_index: list[int]) -> dict:
    return random_substep_inputs(rng, nv, nv + 3, len(qvel_index))


@pytest.mark.parametrize("uncoupled", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_kernel_matches_numpy_reference_bit_for_bit(seed, uncoupled):
    rng = np.random.default_rng(seed)
    nv = 12
    qvel_index = sorted(rng.choice(nv, size=7, replace=False).tolist())  # not 0..6: real indexing
    qpos_index = [i + 1 for i in qvel_index]
    x = _random_inputs(rng, nv, qvel_index)
    kp, kd = np.full(6, KP), np.full(6, KD)
    unclipped = reference_torques(
        x, qpos_index, qvel_index, kp, kd, np.full(7, -np.inf), np.full(7, np.inf), uncoupled
    )
    # Limits at the median magnitude: some torques are clipped (either sign), some are not.
    limit = float(np.median(np.abs(unclipped)))
    low, high = np.full(7, -limit), np.full(7, limit)
    expected = reference_torques(x, qpos_index, qvel_index, kp, kd, low, high, uncoupled)
    torques, ctrl = fused_torques(x, qpos_index, qvel_index, kp, kd, low, high, uncoupled)
    np.testing.assert_array_equal(ctrl[:7], torques)
    # Same operations, so equal to the bit where both BLAS builds round alike (the self-check
    # LeanStepper runs decides); within float rounding everywhere.
    np.testing.assert_allclose(torques, expected, rtol=1e-12, atol=1e-12)
    if fused_kernel_is_exact(nv, nv + 3, qpos_index, qvel_index):
        np.testing.assert_array_equal(torques, expected)
    clipped = np.abs(unclipped) > limit
    assert clipped.any() and not clipped.all(), "inputs should exercise both clip branches"


def test_osc_torques_hand_derived_case():
    """M = I, J = [I6 | 0]: lambda = I, nullspace = diag(0,...,0,1), so every term is explicit."""
    nv, n, theta = 7, 7, 0.1
    jacp, jacr = np.zeros((3, nv)), np.zeros((3, nv))
    jacp[:, 0:3] = np.eye(3)
    jacr[:, 3:6] = np.eye(3)
    qvel = np.array([0.1, -0.2, 0.3, 0.05, -0.04, 0.02, 0.5])
    qpos = np.array([0.0, 0.1, 0.2, -0.3, 0.4, 0.5, 0.6])
    initial_joint = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    goal_ori = np.array(
        [[math.cos(theta), -math.sin(theta), 0], [math.sin(theta), math.cos(theta), 0], [0, 0, 1]]
    )
    goal_pos, ee_pos = np.array([0.3, 0.2, 0.1]), np.array([0.25, 0.2, 0.15])
    bias = np.arange(7, dtype=np.float64)
    state = arm_state(
        ee_pos, np.eye(3).ravel(), jacp, jacr, qpos, qvel, np.eye(nv), list(range(n)),
        list(range(n)),
    )  # fmt: skip
    torques = osc_torques(
        state, goal_pos, goal_ori, np.full(6, KP), np.full(6, KD), initial_joint, bias
    )
    expected = bias.copy()
    expected[0:3] += KP * (goal_pos - ee_pos) - KD * qvel[0:3]
    # orientation_error(Rz(theta), I) = (0, 0, sin theta)
    expected[3:6] += KP * np.array([0, 0, math.sin(theta)]) - KD * qvel[3:6]
    expected[6] += NULL_KP * (initial_joint[6] - qpos[6]) - NULL_KD * qvel[6]
    np.testing.assert_allclose(torques, expected, rtol=0, atol=1e-12)


def test_osc_goal_keeps_orientation_on_exact_zero_rotation():
    state = arm_state(
        np.array([0.1, 0.2, 0.3]), np.eye(3).ravel(), np.zeros((3, 7)), np.zeros((3, 7)),
        np.zeros(7), np.zeros(7), np.eye(7), list(range(7)), list(range(7)),
    )  # fmt: skip
    previous = np.diag([1.0, -1.0, -1.0])
    pos, ori = osc_goal(np.array([0.01, 0.0, -0.02, 0.0, 0.0, 0.0]), state, previous)
    np.testing.assert_allclose(pos, [0.11, 0.2, 0.28], rtol=0, atol=1e-15)
    assert ori is previous  # robosuite keeps the old goal orientation
    _, ori = osc_goal(np.array([0.0, 0.0, 0.0, 0.0, 0.0, 1e-12]), state, previous)
    assert not np.array_equal(ori, previous)  # any nonzero rotation resets it from the eef


def test_gripper_hand_computed():
    """robosuite's PandaGripper: +-0.01 per sub-step by the action's sign, clipped to [-1, 1]."""
    x = _random_inputs(np.random.default_rng(3), 9, list(range(7)))
    kp, kd, low, high = np.full(6, KP), np.full(6, KD), np.full(7, -80.0), np.full(7, 80.0)
    close = {"current": np.zeros(2), "increment": np.array([-0.01, 0.01])}  # sign(+0.3) = +1
    for _ in range(3):
        _, ctrl = fused_torques(x, range(7), range(7), kp, kd, low, high, True, close)
    np.testing.assert_allclose(close["current"], [-0.03, 0.03], atol=1e-15)
    # ctrl = bias + weight * current, bias (0.02, -0.02), weight (0.02, 0.02)
    np.testing.assert_allclose(ctrl[7:], [0.02 - 0.0006, -0.02 + 0.0006], atol=1e-15)
    saturated = {"current": np.array([-0.995, 0.995]), "increment": np.array([-0.01, 0.01])}
    _, ctrl = fused_torques(x, range(7), range(7), kp, kd, low, high, True, saturated)
    np.testing.assert_array_equal(saturated["current"], [-1.0, 1.0])
    np.testing.assert_allclose(ctrl[7:], [0.0, 0.0], atol=1e-15)


def test_self_check_detects_a_one_ulp_difference(monkeypatch):
    """The check LeanStepper(kernel="auto") relies on notices the smallest rounding change."""
    from envs.lean import selfcheck

    exact_kernel = selfcheck.osc_gripper_substep

    def off_by_one_ulp(*args):
        exact_kernel(*args)
        torques = args[-1]
        torques[0] = np.nextafter(torques[0], np.inf)

    monkeypatch.setattr(selfcheck, "osc_gripper_substep", off_by_one_ulp)
    selfcheck._check.cache_clear()
    try:
        assert not selfcheck.fused_kernel_is_exact(20, 20, range(7), range(7))
    finally:
        selfcheck._check.cache_clear()
