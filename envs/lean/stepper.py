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
the last bit (the tests check qpos/qvel equality over hundreds of steps). Two robosuite quirks
are reproduced because they change the simulation: the goal orientation is kept when the
rotation command is exactly 0, and the first action after `env.reset()` uses the state the new
controller cached when it was built (see `LeanOsc.read_for_new_action`). Success is checked
once per env.step, as robosuite's reward does; observables are not computed in `step` (see
`observe`).
"""

from __future__ import annotations

import warnings
from typing import Any

import mujoco
import numpy as np

from envs.lean.gripper import LeanGripper
from envs.lean.kernels import FusedSubstep
from envs.lean.osc import LeanOsc
from envs.lean.selfcheck import fused_kernel_is_exact
from envs.steppers import render_robosuite_cameras, robosuite_proprio

ACTION_DIM = 7
# "numba": one fused compiled call per sub-step (envs.lean.kernels); "numpy": the same math as
# separate NumPy calls (envs.lean.osc), the readable reference; "auto": numba where a self-check
# finds it bit-identical to the NumPy path on this machine (envs.lean.selfcheck), else numpy.
KERNELS = ("auto", "numba", "numpy")


def _uses_libero_sparse_reward(robosuite_env: Any) -> bool:
    """True if `reward()` is LIBERO's 1.0-on-success (so it can reuse the one success check)."""
    return getattr(type(robosuite_env).reward, "__qualname__", "") == "BDDLBaseDomain.reward"


class LeanStepper:
    """The Stepper protocol of envs/steppers.py on robosuite's objects, minus their overhead.

    State that must outlive one step (the OSC goal orientation, the gripper's `current_action`,
    `timestep`, `cur_time`) is kept on robosuite's own objects, so the lean path and robosuite's
    `env.step` can be interleaved on one env and give the same simulation.
    """

    def __init__(self, libero_env: Any, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"LeanStepper kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.libero_env = libero_env
        self.env = libero_env.env
        env = self.env
        if len(env.robots) != 1:
            raise NotImplementedError(f"lean stepping supports one robot, got {len(env.robots)}")
        self.num_substeps = int(env.control_timestep / env.model_timestep)  # robosuite's count
        self.sparse_reward = _uses_libero_sparse_reward(env)
        # Same as the reference RobosuiteStepper: the harness owns episode length, and
        # observations are computed on demand by `observe`, never inside the step loop.
        env.ignore_done = True
        for observable in env._observables.values():
            observable.set_enabled(False)
        self.after_reset()

    def after_reset(self) -> None:
        """Re-bind to robosuite's objects: `env.reset()` builds a new controller each time (and
        a hard reset a new MjSim). Nothing here caches simulator *state*, so `set_init_state`
        alone needs no re-binding; `step` also re-binds by itself if this was forgotten."""
        self.sim = self.env.sim
        self.model = self.sim.model._model
        self.data = self.sim.data._data
        robot = self.env.robots[0]
        self.robot = robot
        self.osc = LeanOsc(self.model, self.data, robot.controller)
        self.gripper = LeanGripper(self.model, robot.gripper)
        self.arm_dim = robot.controller.control_dim
        if self.arm_dim + robot.gripper.dof != ACTION_DIM:
            raise NotImplementedError(
                f"lean stepping expects a {ACTION_DIM}-dim action (OSC_POSE + gripper), "
                f"this robot takes {self.arm_dim + robot.gripper.dof}"
            )
        self.arm_actuator_ids = list(robot._ref_joint_actuator_indexes)
        self.torque_low, self.torque_high = robot.torque_limits
        self.fused = FusedSubstep(
            self.osc, self.gripper, self.arm_actuator_ids, self.torque_low, self.torque_high
        )
        if self.kernel == "auto":
            self.kernel = self._choose_kernel()

    def _choose_kernel(self) -> str:
        osc = self.osc
        if fused_kernel_is_exact(self.model.nv, self.model.nq, osc.qpos_index, osc.qvel_index):
            return "numba"
        warnings.warn(
            "envs.lean: the fused numba kernel does not reproduce NumPy's BLAS rounding on this "
            "machine; using the NumPy path (same results as robosuite, ~1.5x slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        return "numpy"

    def step(self, action: np.ndarray) -> tuple[float, bool]:
        env = self.env
        if np.shape(action) != (ACTION_DIM,):
            raise ValueError(f"action must have shape ({ACTION_DIM},), got {np.shape(action)}")
        if env.sim is not self.sim or env.robots[0].controller is not self.osc.controller:
            self.after_reset()  # the env was reset without telling us
        env.timestep += 1
        if self.kernel == "numba":
            self._run_substeps_fused(action)
        else:
            self._run_substeps_numpy(action)
        env.cur_time += env.control_timestep
        return self._finish_step(action)

    def _set_goal(self, action: np.ndarray) -> bool:
        """First sub-step only, after mj_step1: robosuite's `set_goal` and the gripper's sign.

        Returns False when robosuite would use its controller's cached (pre-reset) state for
        this sub-step (see `LeanOsc.read_for_new_action`)."""
        fresh = self.osc.read_for_new_action()
        self.osc.set_goal(action[: self.arm_dim])
        self.gripper.set_action(action[self.arm_dim :])
        return fresh

    def _numpy_controls(self) -> np.ndarray:
        """One sub-step's controls through the NumPy reference path, from `osc.state`."""
        torques = np.clip(self.osc.torques(), self.torque_low, self.torque_high)
        self.gripper.apply(self.data.ctrl)
        self.data.ctrl[self.arm_actuator_ids] = torques
        return torques

    def _run_substeps_numpy(self, action: np.ndarray) -> None:
        model, data = self.model, self.data
        torques = None
        for substep in range(self.num_substeps):
            mujoco.mj_step1(model, data)
            if substep == 0:
                self._set_goal(action)
            else:
                self.osc.read()
            torques = self._numpy_controls()
            mujoco.mj_step2(model, data)
        self.robot.torques = torques
        self.osc.controller.new_update = True  # as robosuite's run_controller leaves it

    def _run_substeps_fused(self, action: np.ndarray) -> None:
        model, data, fused = self.model, self.data, self.fused
        step1, step2 = mujoco.mj_step1, mujoco.mj_step2
        step1(model, data)
        if self._set_goal(action):
            fused.begin_step()
            fused()
        else:  # cached-state sub-step after a reset: rare, take the reference path
            self._numpy_controls()
            fused.begin_step()
        step2(model, data)
        for _ in range(self.num_substeps - 1):
            step1(model, data)
            fused()
            step2(model, data)
        self.robot.torques = fused.torques.copy()
        self.osc.controller.new_update = True  # as robosuite's run_controller leaves it

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
        mujoco.mj_forward(self.model, self.data)
        obs = robosuite_proprio(self.env)
        if render:
            obs.update(render_robosuite_cameras(self.env))
        return obs
