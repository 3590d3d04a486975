"""Save and restore everything a LIBERO env's next steps depend on, to replay from one point.

The equivalence tests and the benchmark run robosuite's `env.step` and the lean path from the
same starting point on one env (building a second env costs ~13 s). A flattened sim state
(`get_sim_state`) is not enough for that: MuJoCo's constraint solver warm-starts from
`qacc_warmstart`, the actuators keep `ctrl`, and robosuite keeps Python-side state that shapes
the next steps (the OSC goal orientation, which persists when the rotation command is exactly 0;
the gripper's `current_action`, which robosuite never resets; the controller's cached state,
which it uses instead of the sim for the first action after a reset; step counters; visual-site
colours toggled by LIBERO's post-processing). `capture` / `restore` cover all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

# robosuite's controller caches what its last `update()` read and skips re-reading while
# `new_update` is False (right after `env.reset()` builds it): part of the state too.
CONTROLLER_CACHE = (
    "new_update", "ee_pos", "ee_ori_mat", "ee_pos_vel", "ee_ori_vel", "joint_pos", "joint_vel",
    "J_pos", "J_ori", "J_full", "mass_matrix",
)  # fmt: skip

# Everything mj_step reads that is not recomputed: qpos, qvel, act, time, warm start, ctrl,
# applied forces, mocap poses, equality activations, plugin and user data.
STATE_SPEC = mujoco.mjtState.mjSTATE_INTEGRATION


@dataclass
class EnvSnapshot:
    sim_state: np.ndarray
    site_rgba: np.ndarray
    gripper_current_action: np.ndarray
    goal_pos: np.ndarray
    goal_ori: np.ndarray
    controller_cache: dict[str, Any]
    timestep: int
    cur_time: float
    done: bool


def capture(robosuite_env: Any) -> EnvSnapshot:
    model, data = robosuite_env.sim.model._model, robosuite_env.sim.data._data
    state = np.empty(mujoco.mj_stateSize(model, STATE_SPEC))
    mujoco.mj_getState(model, data, state, STATE_SPEC)
    robot = robosuite_env.robots[0]
    return EnvSnapshot(
        sim_state=state,
        site_rgba=np.array(model.site_rgba),
        gripper_current_action=np.array(robot.gripper.current_action),
        goal_pos=np.array(robot.controller.goal_pos),
        goal_ori=np.array(robot.controller.goal_ori),
        # np.array keeps each array's memory layout (robosuite's blocks are Fortran-ordered).
        controller_cache={k: np.array(getattr(robot.controller, k)) for k in CONTROLLER_CACHE},
        timestep=int(robosuite_env.timestep),
        cur_time=float(robosuite_env.cur_time),
        done=bool(robosuite_env.done),
    )


def restore(robosuite_env: Any, snapshot: EnvSnapshot) -> None:
    """Put the env back to `snapshot`; derived quantities are recomputed with mj_forward."""
    model, data = robosuite_env.sim.model._model, robosuite_env.sim.data._data
    mujoco.mj_setState(model, data, snapshot.sim_state, STATE_SPEC)
    model.site_rgba[:] = snapshot.site_rgba
    mujoco.mj_forward(model, data)
    robot = robosuite_env.robots[0]
    robot.gripper.current_action = np.array(snapshot.gripper_current_action)
    robot.controller.goal_pos = np.array(snapshot.goal_pos)
    robot.controller.goal_ori = np.array(snapshot.goal_ori)
    for key, value in snapshot.controller_cache.items():
        setattr(robot.controller, key, bool(value) if key == "new_update" else np.array(value))
    robosuite_env.timestep = snapshot.timestep
    robosuite_env.cur_time = snapshot.cur_time
    robosuite_env.done = snapshot.done
