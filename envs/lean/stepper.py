"""`LeanStepper`: robosuite's LIBERO `env.step` physics, without robosuite's per-sub-step Python.

What robosuite 1.4.0 + LIBERO do in one `env.step(action)` (robosuite/environments/base.py,
robot_env.py, robots/single_arm.py, libero/libero/envs/bddl_base_domain.py), 25 times:
`sim.forward()`; `robot.control(action, policy_step)` (the OSC controller's `update()` runs
`sim.forward()` again; `set_goal` on the first sub-step only; torques clipped to the actuator
ctrlrange; the gripper); `sim.step()` (`mj_step`, which runs the forward pass a third time);
`_update_observables()`. Then, once: `cur_time += control_timestep`; `reward()` (LIBERO's
`_check_success()`); `done = timestep >= horizon and not ignore_done`; LIBERO's `_post_process()`
(object-state and visual-site updates); LIBERO's `done = _check_success()`.

Here each sub-step is `mj_step1` (positions, velocities: everything the controller reads),
the controller and gripper on that data, then `mj_step2` (actuation, constraint solve,
integration). mj_step1 + mj_step2 run exactly the stages of `mj_step`, and the two extra
`mj_forward` calls robosuite makes recompute the same values from the same state (they do not
touch `qacc_warmstart`, which only the integrator writes), so the simulation is the same to
the last bit (the tests check qpos/qvel equality). Success is checked once per env.step, as
robosuite's reward does; observables are not computed in `step` (see `observe`).
"""

from __future__ import annotations

from typing import Any

import mujoco
import numpy as np

from envs.lean.gripper import LeanGripper
from envs.lean.kernels import osc_gripper_substep
from envs.lean.osc import LeanOsc

ACTION_DIM = 7
# "numba": one fused compiled call per sub-step (envs.lean.kernels); "numpy": the same math as
# separate NumPy calls (envs.lean.osc), kept as the readable reference the tests compare with.
KERNELS = ("numba", "numpy")


def _uses_libero_sparse_reward(robosuite_env: Any) -> bool:
    """True if `reward()` is LIBERO's 1.0-on-success (so it can reuse the one success check)."""
    return getattr(type(robosuite_env).reward, "__qualname__", "") == "BDDLBaseDomain.reward"


class LeanStepper:
    """The Stepper protocol of envs/steppers.py on robosuite's objects, minus their overhead.

    State that must outlive one step (the OSC goal orientation, the gripper's `current_action`,
    `timestep`, `cur_time`) is kept on robosuite's own objects, so the lean path and robosuite's
    `env.step` can be interleaved on one env and give the same simulation.
    """

    def __init__(self, libero_env: Any, kernel: str = "numba"):
        if kernel not in KERNELS:
            raise ValueError(f"LeanStepper kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.libero_env = libero_env
        self.env = libero_env.env
        env = self.env
        if len(env.robots) != 1:
            raise NotImplementedError(f"lean stepping supports one robot, got {len(env.robots)}")
        self.model = env.sim.model._model
        self.data = env.sim.data._data
        self.num_substeps = int(env.control_timestep / env.model_timestep)  # robosuite's count
        self.sparse_reward = _uses_libero_sparse_reward(env)
        # Same as the reference RobosuiteStepper: the harness owns episode length, and
        # observations are computed on demand by `observe`, never inside the step loop.
        env.ignore_done = True
        for observable in env._observables.values():
            observable.set_enabled(False)
        self.after_reset()

    def after_reset(self) -> None:
        """Re-bind to robosuite's objects: `env.reset()` builds a new controller each time."""
        robot = self.env.robots[0]
        self.robot = robot
        self.controller = robot.controller
        self.osc = LeanOsc(self.model, self.data, robot.controller)
        self.gripper = LeanGripper(self.model, robot.gripper)
        self.arm_dim = robot.controller.control_dim
        self.arm_actuator_ids = list(robot._ref_joint_actuator_indexes)
        self.torque_low, self.torque_high = robot.torque_limits
        if self.arm_dim + robot.gripper.dof != ACTION_DIM:
            raise NotImplementedError(
                f"lean stepping expects a {ACTION_DIM}-dim action (OSC_POSE + gripper), "
                f"this robot takes {self.arm_dim + robot.gripper.dof}"
            )
        self._bind_kernel_arrays()

    def _bind_kernel_arrays(self) -> None:
        """Views of mjData and contiguous copies of the constants the fused kernel reads.

        mjData's arrays never move, so the views stay valid for the env's lifetime."""
        d, osc = self.data, self.osc
        sid = osc.state.site_id
        as_index = lambda ids: np.ascontiguousarray(ids, dtype=np.int64)  # noqa: E731
        self._site_xpos = d.site_xpos[sid]
        self._site_xmat = d.site_xmat[sid]
        self._jacp, self._jacr = osc.state.jacp, osc.state.jacr
        self._full_mass = osc.state.full_mass
        self._qpos, self._qvel, self._qfrc_bias, self._ctrl = d.qpos, d.qvel, d.qfrc_bias, d.ctrl
        self._qM = d.qM
        self._qpos_index = as_index(osc.state.qpos_index)
        self._qvel_index = as_index(osc.state.qvel_index)
        self._kp = np.ascontiguousarray(osc.kp, dtype=np.float64)
        self._kd = np.ascontiguousarray(osc.kd, dtype=np.float64)
        self._initial_joint = np.ascontiguousarray(osc.initial_joint, dtype=np.float64)
        self._torque_low = np.ascontiguousarray(self.torque_low, dtype=np.float64)
        self._torque_high = np.ascontiguousarray(self.torque_high, dtype=np.float64)
        self._arm_actuators = as_index(self.arm_actuator_ids)
        self._gripper_actuators = as_index(self.gripper.actuator_ids)
        self._torques = np.zeros(len(self._qvel_index))

    def step(self, action: np.ndarray) -> tuple[float, bool]:
        env = self.env
        if np.shape(action) != (ACTION_DIM,):
            raise ValueError(f"action must have shape ({ACTION_DIM},), got {np.shape(action)}")
        env.timestep += 1
        if self.kernel == "numba":
            self._run_substeps_fused(action)
        else:
            self._run_substeps_numpy(action)
        env.cur_time += env.control_timestep
        return self._finish_step(action)

    def _set_goal(self, action: np.ndarray) -> None:
        """First sub-step only (after mj_step1): robosuite's `set_goal`, stored on its controller."""
        osc, controller = self.osc, self.controller
        osc.goal_pos, osc.goal_ori = controller.goal_pos, controller.goal_ori
        osc.state.read()
        osc.set_goal(action[: self.arm_dim])
        controller.goal_pos, controller.goal_ori = osc.goal_pos, osc.goal_ori
        self.gripper.set_action(action[self.arm_dim :])

    def _run_substeps_numpy(self, action: np.ndarray) -> None:
        model, data = self.model, self.data
        osc, gripper = self.osc, self.gripper
        ctrl, arm_ids = data.ctrl, self.arm_actuator_ids
        low, high = self.torque_low, self.torque_high
        torques = None
        for substep in range(self.num_substeps):
            mujoco.mj_step1(model, data)
            if substep == 0:
                self._set_goal(action)
            else:
                osc.state.read()
            torques = np.clip(osc.torques(), low, high)
            gripper.apply(ctrl)
            ctrl[arm_ids] = torques
            mujoco.mj_step2(model, data)
        self.robot.torques = torques

    def _run_substeps_fused(self, action: np.ndarray) -> None:
        model, data, controller, gripper = self.model, self.data, self.controller, self.gripper
        site_id = self.osc.state.site_id
        jacp, jacr, full_mass, qM = self._jacp, self._jacr, self._full_mass, self._qM
        step1, step2, jac_site, full_m = (
            mujoco.mj_step1, mujoco.mj_step2, mujoco.mj_jacSite, mujoco.mj_fullM
        )
        # The kernel updates current_action in place: give the gripper its own float64 array,
        # broadcast to one entry per finger actuator (robosuite starts it as a 1-vector,
        # np.zeros(dof), which its first format_action broadcasts to two).
        current = np.empty(len(gripper.actuator_ids))
        current[:] = gripper.gripper.current_action
        gripper.gripper.current_action = current
        for substep in range(self.num_substeps):
            step1(model, data)
            if substep == 0:
                self._set_goal(action)
                goal_pos = np.ascontiguousarray(controller.goal_pos, dtype=np.float64)
                goal_ori = np.ascontiguousarray(controller.goal_ori, dtype=np.float64)
            jac_site(model, data, jacp, jacr, site_id)
            full_m(model, full_mass, qM)
            osc_gripper_substep(
                self._site_xpos, self._site_xmat, jacp, jacr, self._qpos, self._qvel,
                full_mass, self._qfrc_bias, self._qpos_index, self._qvel_index,
                goal_pos, goal_ori, self._kp, self._kd, self._initial_joint,
                self._torque_low, self._torque_high, self.osc.uncoupling,
                self._arm_actuators, current, gripper.increment, gripper.bias,
                gripper.weight, self._gripper_actuators, self._ctrl, self._torques,
            )  # fmt: skip
            step2(model, data)
        self.robot.torques = self._torques.copy()

    def _finish_step(self, action: np.ndarray) -> tuple[float, bool]:
        env = self.env
        success = bool(env._check_success())
        if self.sparse_reward:
            reward = 1.0 if success else 0.0
            if env.reward_scale is not None:
                reward *= env.reward_scale / 1.0
        else:
            reward = env.reward(action)
        env.done = (env.timestep >= env.horizon) and not env.ignore_done
        # Object-state / visual-site updates only (no sim state): success is unaffected.
        env._post_process()
        return float(reward), success

    def observe(self, render: bool) -> dict[str, np.ndarray]:
        """The protocol's observation of the current state (forward pass first)."""
        from envs.steppers import render_robosuite_cameras, robosuite_proprio

        mujoco.mj_forward(self.model, self.data)
        obs = robosuite_proprio(self.env)
        if render:
            obs.update(render_robosuite_cameras(self.env))
        return obs
