"""robosuite 1.4.0's OSC_POSE controller as plain functions on MuJoCo arrays (the reference path).

robosuite's `OperationalSpaceController` (controllers/osc.py, base_controller.py) re-runs
`sim.forward()` inside `update()` on every sub-step and allocates a dozen arrays per call. Here
the same quantities are computed from the `mjData` that `mj_step1` has just filled (positions
and velocities are final at that point; the torques only feed `mj_step2`).

Bit-for-bit agreement with robosuite is the goal, so every floating-point operation is the one
robosuite performs, in the same order, on arrays of the same memory layout:
- the 3 x nv site Jacobians come from `mj_jacSite`, and the end-effector velocities are the full
  nv-long BLAS dot products robosuite computes (`get_site_xvelp`), not shorter 7-long ones;
- the 7x7 mass matrix and the Jacobian blocks are fancy-indexed copies (Fortran-ordered, as in
  robosuite), so robosuite's numba kernels (`opspace_matrices`, `nullspace_torques`,
  `orientation_error`) run the same compiled specialisation;
- the goal (once per env.step) goes through robosuite's own `set_goal_position` /
  `set_goal_orientation` (its `quat2mat` rounds through float32).
`envs.lean.kernels` fuses the per-sub-step part into one numba call; the tests compare the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np
from robosuite.utils.control_utils import (
    nullspace_torques,
    opspace_matrices,
    orientation_error,
    set_goal_orientation,
    set_goal_position,
)

SUPPORTED_CONTROLLER = "OperationalSpaceController"


def check_supported_controller(controller: Any) -> None:
    """Raise a clear error for OSC configurations this mirror does not implement."""
    name = type(controller).__name__
    problems = []
    if name != SUPPORTED_CONTROLLER:
        problems.append(f"controller class is {name}, expected {SUPPORTED_CONTROLLER} (OSC_POSE)")
    else:
        if not controller.use_ori:
            problems.append("control_ori=False (OSC_POSITION)")
        if not controller.use_delta:
            problems.append("control_delta=False (absolute goals)")
        if controller.impedance_mode != "fixed":
            problems.append(f"impedance_mode={controller.impedance_mode!r} (only 'fixed')")
        if controller.interpolator_pos is not None or controller.interpolator_ori is not None:
            problems.append("an interpolator is configured (only interpolation=None)")
    if problems:
        raise NotImplementedError(
            "env.step_mode='lean' supports robosuite's OSC_POSE with fixed impedance, delta "
            "goals and no interpolator (LIBERO's default); this env has: " + "; ".join(problems)
        )


@dataclass
class ArmState:
    """What robosuite's `Controller.update()` reads from the sim, for the robot's joints."""

    ee_pos: np.ndarray  # (3,)
    ee_ori_mat: np.ndarray  # (3, 3)
    ee_pos_vel: np.ndarray  # (3,)
    ee_ori_vel: np.ndarray  # (3,)
    joint_pos: np.ndarray  # (n,)
    joint_vel: np.ndarray  # (n,)
    J_pos: np.ndarray  # (3, n) Fortran-ordered
    J_ori: np.ndarray  # (3, n) Fortran-ordered
    J_full: np.ndarray  # (6, n) Fortran-ordered
    mass_matrix: np.ndarray  # (n, n) Fortran-ordered


def arm_state(
    site_xpos: np.ndarray,
    site_xmat: np.ndarray,
    jacp: np.ndarray,
    jacr: np.ndarray,
    qpos: np.ndarray,
    qvel: np.ndarray,
    full_mass: np.ndarray,
    qpos_index: Sequence[int],
    qvel_index: Sequence[int],
) -> ArmState:
    """`Controller.update()` without `sim.forward()`, same expressions as robosuite's."""
    J_pos = jacp[:, qvel_index]
    J_ori = jacr[:, qvel_index]
    return ArmState(
        ee_pos=np.array(site_xpos),
        ee_ori_mat=np.array(site_xmat.reshape([3, 3])),
        ee_pos_vel=np.dot(jacp, qvel),
        ee_ori_vel=np.dot(jacr, qvel),
        joint_pos=qpos[qpos_index],
        joint_vel=qvel[qvel_index],
        J_pos=J_pos,
        J_ori=J_ori,
        J_full=np.vstack([J_pos, J_ori]),
        mass_matrix=full_mass[qvel_index, :][:, qvel_index],
    )


def osc_goal(
    scaled_delta: np.ndarray,
    state: ArmState,
    goal_ori: np.ndarray,
    position_limits: np.ndarray | None = None,
    orientation_limits: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """robosuite's delta `set_goal`: the new (goal_pos, goal_ori).

    robosuite keeps the previous goal orientation when the rotation command is exactly 0
    (`math.isclose(x, 0.0)` with no tolerance), so `goal_ori` is state carried across steps."""
    if any(not math.isclose(x, 0.0) for x in scaled_delta[3:]):
        goal_ori = set_goal_orientation(
            scaled_delta[3:], state.ee_ori_mat, orientation_limit=orientation_limits
        )
    goal_pos = set_goal_position(scaled_delta[:3], state.ee_pos, position_limit=position_limits)
    return goal_pos, goal_ori


def osc_torques(
    state: ArmState,
    goal_pos: np.ndarray,
    goal_ori: np.ndarray,
    kp: np.ndarray,
    kd: np.ndarray,
    initial_joint: np.ndarray,
    bias_torques: np.ndarray,
    uncoupling: bool = True,
) -> np.ndarray:
    """robosuite's `run_controller` (no interpolator): unclipped joint torques.

    `bias_torques` is `qfrc_bias` at the robot's dofs (gravity + Coriolis compensation)."""
    s = state
    ori_error = orientation_error(np.array(goal_ori), s.ee_ori_mat)
    position_error = np.array(goal_pos) - s.ee_pos
    desired_force = np.multiply(position_error, kp[0:3]) + np.multiply(-s.ee_pos_vel, kd[0:3])
    desired_torque = np.multiply(ori_error, kp[3:6]) + np.multiply(-s.ee_ori_vel, kd[3:6])
    lambda_full, lambda_pos, lambda_ori, nullspace_matrix = opspace_matrices(
        s.mass_matrix, s.J_full, s.J_pos, s.J_ori
    )
    if uncoupling:
        wrench = np.concatenate(
            [np.dot(lambda_pos, desired_force), np.dot(lambda_ori, desired_torque)]
        )
    else:
        wrench = np.dot(lambda_full, np.concatenate([desired_force, desired_torque]))
    torques = np.dot(s.J_full.T, wrench) + bias_torques
    torques += nullspace_torques(
        s.mass_matrix, nullspace_matrix, initial_joint, s.joint_pos, s.joint_vel
    )
    return torques


class LeanOsc:
    """robosuite's OSC_POSE bound to one env's controller and `mjData` (NumPy reference path)."""

    def __init__(self, model: mujoco.MjModel, data: mujoco.MjData, controller: Any):
        check_supported_controller(controller)
        self.model = model
        self.data = data
        self.controller = controller
        self.site_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, controller.eef_name)
        if self.site_id < 0:
            raise ValueError(f"end-effector site {controller.eef_name!r} not found in the model")
        # Same index lists as robosuite (lists of numpy ints): identical fancy-index results.
        self.qpos_index = controller.qpos_index
        self.qvel_index = controller.qvel_index
        self.kp, self.kd = controller.kp, controller.kd
        self.uncoupling = bool(controller.uncoupling)
        self.initial_joint = controller.initial_joint
        nv = model.nv
        self.jacp = np.zeros((3, nv))
        self.jacr = np.zeros((3, nv))
        self.full_mass = np.ndarray(shape=(nv, nv), dtype=np.float64, order="C")
        self.state: ArmState | None = None

    def read(self) -> ArmState:
        """The arm state of the current `mjData` (after mj_step1 or mj_forward)."""
        d, sid = self.data, self.site_id
        mujoco.mj_jacSite(self.model, d, self.jacp, self.jacr, sid)
        mujoco.mj_fullM(self.model, self.full_mass, d.qM)
        self.state = arm_state(
            d.site_xpos[sid], d.site_xmat[sid], self.jacp, self.jacr, d.qpos, d.qvel,
            self.full_mass, self.qpos_index, self.qvel_index,
        )  # fmt: skip
        return self.state

    def read_for_new_action(self) -> bool:
        """The state for a new action's `set_goal` and first torques; True if read fresh.

        robosuite re-reads the sim in `update()` only when `controller.new_update` is set, which
        `run_controller` does after every sub-step but a freshly built controller (every
        `env.reset()`) does not: it caches the state it saw when it was built, so the first
        action after a reset (and after `set_init_state`) uses that cached state for its goal
        and its first sub-step's torques. Reproduced here for bit-identical simulation."""
        c = self.controller
        if c.new_update:
            self.read()
            return True
        self.state = ArmState(
            c.ee_pos, c.ee_ori_mat, c.ee_pos_vel, c.ee_ori_vel, c.joint_pos, c.joint_vel,
            c.J_pos, c.J_ori, c.J_full, c.mass_matrix,
        )  # fmt: skip
        return False

    def set_goal(self, arm_action: np.ndarray) -> None:
        """Once per env.step, after `read()`: new goal, stored on robosuite's controller."""
        c = self.controller
        c.goal_pos, c.goal_ori = osc_goal(
            c.scale_action(arm_action), self.state, c.goal_ori,
            c.position_limits, c.orientation_limits,
        )  # fmt: skip

    def torques(self) -> np.ndarray:
        """Unclipped torques for the current goal, after `read()`."""
        c = self.controller
        return osc_torques(
            self.state, c.goal_pos, c.goal_ori, self.kp, self.kd, self.initial_joint,
            self.data.qfrc_bias[self.qvel_index], self.uncoupling,
        )  # fmt: skip
