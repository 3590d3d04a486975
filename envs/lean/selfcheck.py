"""Is the fused numba kernel bit-identical to robosuite's NumPy arithmetic on this machine?

robosuite computes five small matrix-vector products with NumPy (whose BLAS is NumPy's bundled
OpenBLAS); the fused kernel computes them with numba's `np.dot` (SciPy's bundled OpenBLAS).
Both pick the same gemv kernels here (the equivalence tests find zero deviation), but two BLAS
builds on another CPU could round differently. `fused_kernel_is_exact` runs the fused kernel and
the NumPy reference path (`envs.lean.osc`, the very calls robosuite makes) on random inputs of
the env's shapes, once per process and shape; `LeanStepper(kernel="auto")` uses the fused kernel
only where they agree bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from envs.lean.kernels import osc_gripper_substep
from envs.lean.osc import arm_state, osc_torques


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def random_substep_inputs(rng: np.random.Generator, nv: int, nq: int, n: int) -> dict:
    """One sub-step's controller inputs: a random SPD mass matrix, Jacobians, state, goal."""
    a = rng.standard_normal((nv, nv))
    return {
        "site_xpos": rng.standard_normal(3),
        "site_xmat": random_rotation(rng).ravel(),
        "jacp": rng.standard_normal((3, nv)),
        "jacr": rng.standard_normal((3, nv)),
        "qpos": rng.standard_normal(nq),
        "qvel": rng.standard_normal(nv),
        "full_mass": a @ a.T + nv * np.eye(nv),
        "qfrc_bias": rng.standard_normal(nv) * 5,
        "goal_pos": rng.standard_normal(3),
        "goal_ori": random_rotation(rng),
        "initial_joint": rng.standard_normal(n),
    }


def reference_torques(x: dict, qpos_index, qvel_index, kp, kd, low, high, uncoupled):
    """robosuite's update + run_controller + clip, as its NumPy calls (envs.lean.osc)."""
    state = arm_state(
        x["site_xpos"], x["site_xmat"], x["jacp"], x["jacr"], x["qpos"], x["qvel"],
        x["full_mass"], list(qpos_index), list(qvel_index),
    )  # fmt: skip
    torques = osc_torques(
        state, x["goal_pos"], x["goal_ori"], kp, kd, x["initial_joint"],
        x["qfrc_bias"][list(qvel_index)], uncoupled,
    )  # fmt: skip
    return np.clip(torques, low, high)


def fused_torques(x: dict, qpos_index, qvel_index, kp, kd, low, high, uncoupled, gripper=None):
    """The fused kernel on the same inputs; returns (clipped torques, ctrl).

    ctrl holds the n arm torques then the two gripper controls (bias (0.02, -0.02), weight
    (0.02, 0.02): the Panda fingers' ctrlrange)."""
    n = len(qvel_index)
    gripper = gripper or {"current": np.zeros(2), "increment": np.zeros(2)}
    ctrl = np.full(n + 2, np.nan)
    torques = np.zeros(n)
    osc_gripper_substep(
        x["site_xpos"], x["site_xmat"], x["jacp"], x["jacr"], x["qpos"], x["qvel"],
        x["full_mass"], x["qfrc_bias"], np.asarray(qpos_index, dtype=np.int64),
        np.asarray(qvel_index, dtype=np.int64), x["goal_pos"], x["goal_ori"], kp, kd,
        x["initial_joint"], low, high, uncoupled, np.arange(n, dtype=np.int64),
        gripper["current"], gripper["increment"], np.array([0.02, -0.02]),
        np.array([0.02, 0.02]), np.array([n, n + 1], dtype=np.int64), ctrl, torques,
    )  # fmt: skip
    return torques, ctrl


@functools.cache
def _check(nv: int, nq: int, qpos_index: tuple, qvel_index: tuple, trials: int) -> bool:
    rng = np.random.default_rng(12345)
    n = len(qvel_index)
    kp, kd = np.full(6, 150.0), np.full(6, 2 * np.sqrt(150.0))
    unlimited = (np.full(n, -np.inf), np.full(n, np.inf))
    for trial in range(trials):
        x = random_substep_inputs(rng, nv, nq, n)
        uncoupled = trial % 2 == 0
        ref = reference_torques(x, qpos_index, qvel_index, kp, kd, *unlimited, uncoupled)
        got, _ = fused_torques(x, qpos_index, qvel_index, kp, kd, *unlimited, uncoupled)
        if not np.array_equal(ref, got):
            return False
    return True


def fused_kernel_is_exact(
    nv: int, nq: int, qpos_index: Sequence[int], qvel_index: Sequence[int], trials: int = 4
) -> bool:
    """True if the fused kernel reproduces the NumPy path bit for bit (cached per shape)."""
    return _check(
        int(nv),
        int(nq),
        tuple(int(i) for i in qpos_index),
        tuple(int(i) for i in qvel_index),
        trials,
    )
