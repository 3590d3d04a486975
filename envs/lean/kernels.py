"""One numba call per sub-step: OSC_POSE torques + gripper controls written into `mjData.ctrl`.

This fuses `envs.lean.osc` (robosuite's `update()` + `run_controller()`), the torque clip and
the gripper into a single compiled function, removing ~25 small NumPy calls per sub-step. It
stays bit-identical to robosuite because it performs the same floating-point operations on
arrays of the same layout: the 3x(nv) Jacobian dot products and the small matrix-vector
products are `np.dot` (BLAS gemv, as in NumPy), the mass-matrix and Jacobian blocks are
Fortran-ordered like robosuite's fancy-indexed copies, and robosuite's own numba functions
(`opspace_matrices`, `nullspace_torques`, `orientation_error`) are called, not re-implemented.
Elementwise arithmetic is plain IEEE (no fastmath, no FMA contraction). The tests compare it
against `envs.lean.osc.LeanOsc` and against robosuite's `env.step`.
"""

from __future__ import annotations

from typing import Any

import mujoco
import numba
import numpy as np
from robosuite.utils.control_utils import nullspace_torques, opspace_matrices, orientation_error


@numba.njit(cache=True)
def osc_gripper_substep(
    site_xpos,  # (3,) end-effector site position (mjData.site_xpos[site])
    site_xmat,  # (9,) end-effector site orientation
    jacp,  # (3, nv) from mj_jacSite
    jacr,  # (3, nv)
    qpos,  # (nq,) mjData.qpos
    qvel,  # (nv,) mjData.qvel
    full_mass,  # (nv, nv) from mj_fullM
    qfrc_bias,  # (nv,) mjData.qfrc_bias
    qpos_index,  # (n,) int64 robot joint qpos addresses
    qvel_index,  # (n,) int64 robot joint dof addresses
    goal_pos,  # (3,)
    goal_ori,  # (3, 3)
    kp,  # (6,)
    kd,  # (6,)
    initial_joint,  # (n,) null-space target
    torque_low,  # (n,)
    torque_high,  # (n,)
    uncoupled,  # bool: robosuite's uncouple_pos_ori
    arm_actuators,  # (n,) int64 actuator ids of the arm joints
    gripper_current,  # (2,) the gripper's current_action, updated in place
    gripper_increment,  # (2,) per-sub-step change of current_action
    gripper_bias,  # (2,)
    gripper_weight,  # (2,)
    gripper_actuators,  # (2,) int64
    ctrl,  # (nu,) mjData.ctrl, written in place
    torques_out,  # (n,) the clipped arm torques, written in place
):
    n = qvel_index.shape[0]
    # --- robosuite Controller.update() (the sim was just advanced by mj_step1) ---
    ee_pos = site_xpos.copy()
    ee_ori_mat = site_xmat.copy().reshape((3, 3))
    ee_pos_vel = np.dot(jacp, qvel)
    ee_ori_vel = np.dot(jacr, qvel)
    joint_pos = np.empty(n)
    joint_vel = np.empty(n)
    for i in range(n):
        joint_pos[i] = qpos[qpos_index[i]]
        joint_vel[i] = qvel[qvel_index[i]]
    # Fortran-ordered blocks, like robosuite's fancy-indexed copies and their np.vstack.
    J_pos = np.empty((n, 3)).T
    J_ori = np.empty((n, 3)).T
    J_full = np.empty((n, 6)).T
    mass_matrix = np.empty((n, n)).T
    for j in range(n):
        col = qvel_index[j]
        for r in range(3):
            J_pos[r, j] = jacp[r, col]
            J_ori[r, j] = jacr[r, col]
            J_full[r, j] = jacp[r, col]
            J_full[r + 3, j] = jacr[r, col]
        for i in range(n):
            mass_matrix[i, j] = full_mass[qvel_index[i], col]

    # --- robosuite OperationalSpaceController.run_controller() (no interpolator) ---
    ori_error = orientation_error(goal_ori.copy(), ee_ori_mat)
    position_error = goal_pos - ee_pos
    desired_force = position_error * kp[0:3] + (-ee_pos_vel) * kd[0:3]
    desired_torque = ori_error * kp[3:6] + (-ee_ori_vel) * kd[3:6]
    lambda_full, lambda_pos, lambda_ori, nullspace_matrix = opspace_matrices(
        mass_matrix, J_full, J_pos, J_ori
    )
    wrench = np.empty(6)
    if uncoupled:
        wrench[0:3] = np.dot(lambda_pos, desired_force)
        wrench[3:6] = np.dot(lambda_ori, desired_torque)
    else:
        desired_wrench = np.empty(6)
        desired_wrench[0:3] = desired_force
        desired_wrench[3:6] = desired_torque
        wrench[:] = np.dot(lambda_full, desired_wrench)
    torques = np.dot(J_full.T, wrench)
    for i in range(n):
        torques[i] = torques[i] + qfrc_bias[qvel_index[i]]
    torques += nullspace_torques(mass_matrix, nullspace_matrix, initial_joint, joint_pos, joint_vel)

    # --- robosuite SingleArm.control(): clip to the actuator range, gripper, write ctrl ---
    for i in range(n):
        t = torques[i]
        if t < torque_low[i]:
            t = torque_low[i]
        elif t > torque_high[i]:
            t = torque_high[i]
        torques_out[i] = t
    for k in range(gripper_current.shape[0]):
        g = gripper_current[k] + gripper_increment[k]
        if g < -1.0:
            g = -1.0
        elif g > 1.0:
            g = 1.0
        gripper_current[k] = g
        ctrl[gripper_actuators[k]] = gripper_bias[k] + gripper_weight[k] * g
    for i in range(n):
        ctrl[arm_actuators[i]] = torques_out[i]


def _as_index(ids) -> np.ndarray:
    return np.ascontiguousarray(ids, dtype=np.int64)


def _as_float(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64)


class FusedSubstep:
    """`osc_gripper_substep` bound to one env: mjData views and the controller's constants.

    mjData's arrays never move, so the views stay valid for the env's lifetime; the constants
    change when `env.reset()` builds a new controller, so a new instance is made then."""

    def __init__(self, osc: Any, gripper: Any, arm_actuator_ids, torque_low, torque_high):
        d = osc.data
        self.osc, self.gripper = osc, gripper
        self.model, self.data, self.site_id = osc.model, d, osc.site_id
        self.jacp, self.jacr, self.full_mass, self.qM = osc.jacp, osc.jacr, osc.full_mass, d.qM
        self.site_xpos, self.site_xmat = d.site_xpos[osc.site_id], d.site_xmat[osc.site_id]
        self.qpos, self.qvel, self.qfrc_bias, self.ctrl = d.qpos, d.qvel, d.qfrc_bias, d.ctrl
        self.qpos_index, self.qvel_index = _as_index(osc.qpos_index), _as_index(osc.qvel_index)
        self.kp, self.kd = _as_float(osc.kp), _as_float(osc.kd)
        self.initial_joint = _as_float(osc.initial_joint)
        self.torque_low, self.torque_high = _as_float(torque_low), _as_float(torque_high)
        self.arm_actuators = _as_index(arm_actuator_ids)
        self.gripper_actuators = _as_index(gripper.actuator_ids)
        self.torques = np.zeros(len(self.qvel_index))
        self.goal_pos = self.goal_ori = self.gripper_current = None
        self._args: tuple = ()

    def begin_step(self) -> None:
        """After the goal is set (first sub-step): bind this step's goal and gripper state.

        The kernel updates the gripper's `current_action` in place, so the gripper gets its own
        float64 array with one entry per finger actuator (robosuite starts it as the 1-vector
        np.zeros(dof), which its first `format_action` broadcasts to two entries). The argument
        tuple is built once per env.step, not per sub-step (26 attribute loads add up)."""
        controller, g = self.osc.controller, self.gripper
        self.goal_pos = np.ascontiguousarray(controller.goal_pos, dtype=np.float64)
        self.goal_ori = np.ascontiguousarray(controller.goal_ori, dtype=np.float64)
        current = np.empty(len(g.actuator_ids))
        current[:] = g.gripper.current_action
        g.gripper.current_action = current
        self.gripper_current = current
        self._args = (
            self.site_xpos, self.site_xmat, self.jacp, self.jacr, self.qpos, self.qvel,
            self.full_mass, self.qfrc_bias, self.qpos_index, self.qvel_index,
            self.goal_pos, self.goal_ori, self.kp, self.kd, self.initial_joint,
            self.torque_low, self.torque_high, self.osc.uncoupling, self.arm_actuators,
            current, g.increment, g.bias, g.weight, self.gripper_actuators,
            self.ctrl, self.torques,
        )  # fmt: skip

    def __call__(self) -> None:
        """One sub-step's controls, after mj_step1 and before mj_step2 (and `begin_step`)."""
        mujoco.mj_jacSite(self.model, self.data, self.jacp, self.jacr, self.site_id)
        mujoco.mj_fullM(self.model, self.full_mass, self.qM)
        osc_gripper_substep(*self._args)
