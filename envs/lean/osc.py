"""robosuite 1.4.0's OSC_POSE controller, one MuJoCo sub-step at a time, without its objects.

robosuite's `OperationalSpaceController` (controllers/osc.py, base_controller.py) re-runs
`sim.forward()` inside `update()` on every sub-step and allocates a dozen arrays per call. Here
the same quantities are read from the `mjData` that `mj_step1` has just computed (positions and
velocities are final at that point; the torques only feed `mj_step2`), into preallocated
buffers.

Bit-for-bit agreement with robosuite is the goal, so every floating-point operation is the one
robosuite performs, in the same order, on arrays of the same memory layout:
- the 3x(nv) site Jacobians come from `mj_jacSite` and the end-effector velocities are the full
  (nv)-long BLAS dot products robosuite computes (`get_site_xvelp`), not shorter 7-long ones;
- the 7x7 mass matrix and Jacobian blocks are fancy-indexed copies (Fortran-ordered, as in
  robosuite), so robosuite's numba kernels (`opspace_matrices`, `nullspace_torques`,
  `orientation_error`) run the same compiled specialisation;
- the goal (once per env.step) goes through robosuite's own `set_goal_position` /
  `set_goal_orientation` (its `quat2mat` rounds through float32).
The fused numba kernel in `envs.lean.kernels` is checked against this path in the tests.
"""

from __future__ import annotations

import math
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

# robosuite's OSC hard-codes this goal orientation for position-only control; LIBERO uses
# OSC_POSE (control_ori=True) so it never applies, but unsupported configurations are refused.
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


class OscState:
    """robosuite's `Controller.update()` quantities for the current `mjData`, without forward()."""

    def __init__(self, model: mujoco.MjModel, data: mujoco.MjData, controller: Any):
        self.model = model
        self.data = data
        self.site_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, controller.eef_name)
        if self.site_id < 0:
            raise ValueError(f"end-effector site {controller.eef_name!r} not found in the model")
        # Same index lists as robosuite (lists of numpy ints): identical fancy-index results.
        self.qpos_index = controller.qpos_index
        self.qvel_index = controller.qvel_index
        nv = model.nv
        self.jacp = np.zeros((3, nv))
        self.jacr = np.zeros((3, nv))
        self.full_mass = np.ndarray(shape=(nv, nv), dtype=np.float64, order="C")
        self.ee_pos = self.ee_ori_mat = self.ee_pos_vel = self.ee_ori_vel = None
        self.joint_pos = self.joint_vel = None
        self.J_pos = self.J_ori = self.J_full = self.mass_matrix = None

    def read(self) -> None:
        d = self.data
        sid = self.site_id
        self.ee_pos = np.array(d.site_xpos[sid])
        self.ee_ori_mat = np.array(d.site_xmat[sid].reshape([3, 3]))
        mujoco.mj_jacSite(self.model, d, self.jacp, self.jacr, sid)
        self.ee_pos_vel = np.dot(self.jacp, d.qvel)
        self.ee_ori_vel = np.dot(self.jacr, d.qvel)
        self.joint_pos = d.qpos[self.qpos_index]
        self.joint_vel = d.qvel[self.qvel_index]
        self.J_pos = self.jacp[:, self.qvel_index]
        self.J_ori = self.jacr[:, self.qvel_index]
        self.J_full = np.vstack([self.J_pos, self.J_ori])
        mujoco.mj_fullM(self.model, self.full_mass, d.qM)
        self.mass_matrix = self.full_mass[self.qvel_index, :][:, self.qvel_index]


class LeanOsc:
    """Goal setting (once per env.step) and torques (every sub-step) of robosuite's OSC_POSE."""

    def __init__(self, model: mujoco.MjModel, data: mujoco.MjData, controller: Any):
        check_supported_controller(controller)
        self.state = OscState(model, data, controller)
        self.data = data
        self.kp = controller.kp
        self.kd = controller.kd
        self.uncoupling = bool(controller.uncoupling)
        self.initial_joint = controller.initial_joint
        self.position_limits = controller.position_limits
        self.orientation_limits = controller.orientation_limits
        self.scale_action = controller.scale_action  # clip to input range, rescale to output
        self.qvel_index = controller.qvel_index
        self.goal_pos = np.array(controller.goal_pos)
        self.goal_ori = np.array(controller.goal_ori)

    def set_goal(self, delta: np.ndarray) -> None:
        """robosuite's `set_goal` for delta OSC_POSE; the state must have been read."""
        s = self.state
        scaled_delta = self.scale_action(delta)
        # robosuite keeps the previous goal orientation when the rotation delta is exactly 0.
        if any(not math.isclose(x, 0.0) for x in scaled_delta[3:]):
            self.goal_ori = set_goal_orientation(
                scaled_delta[3:], s.ee_ori_mat, orientation_limit=self.orientation_limits
            )
        self.goal_pos = set_goal_position(
            scaled_delta[:3], s.ee_pos, position_limit=self.position_limits
        )

    def torques(self) -> np.ndarray:
        """robosuite's `run_controller` (no interpolator); the state must have been read."""
        s = self.state
        kp, kd = self.kp, self.kd
        ori_error = orientation_error(np.array(self.goal_ori), s.ee_ori_mat)
        position_error = np.array(self.goal_pos) - s.ee_pos
        desired_force = np.multiply(position_error, kp[0:3]) + np.multiply(-s.ee_pos_vel, kd[0:3])
        desired_torque = np.multiply(ori_error, kp[3:6]) + np.multiply(-s.ee_ori_vel, kd[3:6])
        lambda_full, lambda_pos, lambda_ori, nullspace_matrix = opspace_matrices(
            s.mass_matrix, s.J_full, s.J_pos, s.J_ori
        )
        if self.uncoupling:
            wrench = np.concatenate(
                [np.dot(lambda_pos, desired_force), np.dot(lambda_ori, desired_torque)]
            )
        else:
            wrench = np.dot(lambda_full, np.concatenate([desired_force, desired_torque]))
        torques = np.dot(s.J_full.T, wrench) + self.data.qfrc_bias[self.qvel_index]
        torques += nullspace_torques(
            s.mass_matrix, nullspace_matrix, self.initial_joint, s.joint_pos, s.joint_vel
        )
        return torques
