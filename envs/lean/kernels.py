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
