"""Steppers: how one control step is executed on a LIBERO env, decoupled from rendering.

The harness (envs/libero_env.py) never calls robosuite's `env.step` directly: it asks a
Stepper to advance the simulation by one control step and, only when it needs pixels, to
observe with `render=True`. That lets cameras render once per action chunk instead of once per
step, and lets a faster implementation of the same physics (`envs.lean.LeanStepper`, mode
"lean") replace robosuite's Python step loop without touching the harness.

The protocol (every stepper implements exactly these; constructor takes the LIBERO env only)
-------------------------------------------------------------------------------------------
`Stepper(libero_env)`
    `libero_env` is LIBERO's `OffScreenRenderEnv` (a `ControlEnv`; the robosuite env is
    `libero_env.env`), already constructed in this process. The stepper may change how
    robosuite computes observations (e.g. disable its observables) but must not change
    physics, controller or task semantics.

`step(action) -> (reward: float, success: bool)`
    One control step: the same physics and controller work as one robosuite `env.step(action)`
    (control_timestep / model_timestep = 25 MuJoCo sub-steps at 20 Hz, OSC_POSE controller
    update on the first one, LIBERO's post-processing of object states), without computing any
    camera image. `action` is a float64 array of shape (7,), already validated and finite.
    `reward` is LIBERO's sparse reward (1.0 on success, else 0.0), `success` is
    `_check_success()` after the step. Episode bookkeeping (max steps, done flags) is the
    caller's job; the stepper never raises because an episode is "over".

`observe(render: bool) -> dict[str, np.ndarray]`
    Robosuite-style observations at the *current* simulator state (derived quantities
    recomputed with `sim.forward()` first, so positions match qpos exactly):
      "robot0_eef_pos" (3,) float64, "robot0_eef_quat" (4,) float64 in (x, y, z, w) order,
      "robot0_gripper_qpos" (2,) float64;
    and when `render` is True, for each camera in `libero_env.env.camera_names`,
      f"{camera}_image" (height, width, 3) uint8 exactly as robosuite's camera observable
      returns it (OpenGL convention: NOT yet rotated; the harness rotates by 180 degrees).
    `render_robosuite_cameras` / `robosuite_proprio` below do this the robosuite way and may be
    reused by other steppers.

`after_reset() -> None`
    Called after the robosuite reset (with the grippers' integrated command
    `robot.gripper.current_action` zeroed, see `envs.libero_env.reset_gripper_memory`) and
    again after `libero_env.set_init_state(state)` (the simulator state was overwritten from
    outside): resynchronise any cached state (controller goals, gripper command, cached body
    poses, ...). Settle steps come after it, through `step`.

Note on robosuite's own step observations: robosuite samples observables on a timer that drifts
within the 25 sub-steps (its `Observable.update` samples at the start of a sampling period), so
the observation returned by `env.step` lags the true end-of-step state by a variable number of
sub-steps (<= 0.5 mm of end-effector motion measured here). Steppers observe the end-of-step
state instead; that is the one deliberate difference from `env.step`.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

from envs.config import STEP_MODES

PROPRIO_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")


@runtime_checkable
class Stepper(Protocol):
    """One control step of a LIBERO env without rendering; see the module docstring."""

    def step(self, action: np.ndarray) -> tuple[float, bool]: ...

    def observe(self, render: bool) -> dict[str, np.ndarray]: ...

    def after_reset(self) -> None: ...


def robosuite_proprio(robosuite_env: Any) -> dict[str, np.ndarray]:
    """The proprio observables, computed by robosuite's own sensor functions (no caching)."""
    observables = robosuite_env._observables
    cache = robosuite_env._obs_cache
    return {key: np.array(observables[key]._sensor(cache), dtype=np.float64) for key in PROPRIO_KEYS}


def render_robosuite_cameras(robosuite_env: Any) -> dict[str, np.ndarray]:
    """Render every configured camera through robosuite's camera sensor (same pixels as its
    `{camera}_image` observable). Requires the env to have been built with camera obs."""
    observables = robosuite_env._observables
    context = robosuite_env.sim._render_context_offscreen
    if context is not None:
        # robosuite makes a GL context current only when it creates it; with several envs in
        # one process, rendering must switch to this env's context first.
        context.gl_ctx.make_current()
    images = {}
    for camera in robosuite_env.camera_names:
        key = f"{camera}_image"
        if key not in observables:
            raise RuntimeError(
                f"camera {camera!r} has no observable {key!r}: build the env with use_camera_obs=True"
            )
        images[key] = np.asarray(observables[key]._sensor(robosuite_env._obs_cache))
    return images


class RobosuiteStepper:
    """Reference stepper: robosuite's own `env.step`, with every observable switched off.

    Switching the observables off removes camera rendering and the ~40 per-object sensors from
    the step loop; physics, controller, reward and success are robosuite's and LIBERO's code.
    """

    def __init__(self, libero_env: Any):
        self.libero_env = libero_env
        self.env = libero_env.env
        # The harness tracks episode length itself; robosuite must never refuse a step.
        self.env.ignore_done = True
        for observable in self.env._observables.values():
            observable.set_enabled(False)

    def step(self, action: np.ndarray) -> tuple[float, bool]:
        # LIBERO's BDDL env returns done = _check_success() after the step.
        _, reward, success, _ = self.env.step(action)
        return float(reward), bool(success)

    def observe(self, render: bool) -> dict[str, np.ndarray]:
        self.env.sim.forward()
        obs = robosuite_proprio(self.env)
        if render:
            obs.update(render_robosuite_cameras(self.env))
        return obs

    def after_reset(self) -> None:
        """Nothing cached outside robosuite's own objects."""


def make_stepper(mode: str, libero_env: Any) -> Stepper:
    """The stepper for `mode` ("robosuite" or "lean"; "lean" is imported lazily from envs.lean)."""
    if mode == "robosuite":
        return RobosuiteStepper(libero_env)
    if mode == "lean":
        try:
            lean = importlib.import_module("envs.lean")
        except ImportError as exc:
            raise ValueError(f"env.step_mode='lean' needs envs.lean.LeanStepper: {exc}") from exc
        return lean.LeanStepper(libero_env)
    raise ValueError(f"env.step_mode must be one of {list(STEP_MODES)}, got {mode!r}")
