"""A fast reach task with LIBERO's arm, controller and observation format (`env.env_type: reach`).

Learning evidence for GRPO needs a task where success is neither rare nor certain under a
randomly initialised policy, and whose episodes cost milliseconds, not seconds. Here the Panda
(robosuite 1.4.0, OSC_POSE, 20 Hz, same steppers as LIBERO, see envs/reach_scene.py) must bring
its grip site within `SUCCESS_RADIUS` of a coloured sphere.

Tasks (`REACH_TASKS`): one target per task at a fixed offset from the arm's home grip-site
position, a distinct colour per task, named in the prompt ("reach the red sphere"). A policy can
succeed by learning one direction per task.
Init states: `NUM_INIT_STATES` arm poses, the home joint configuration plus a small perturbation
seeded by the init-state id (id 0 is the home pose itself). Episodes are deterministic given the
init state and the actions; the episode seed is not used (there is nothing random to draw).

Observation (as envs/libero_env.py): "agentview_image" / "wrist_image" (S, S, 3) uint8 rotated by
180 degrees, "state" (8,) float32 = eef position, axis-angle, gripper qpos; `prompt`.
Action: Box(-1, 1, (7,)), OSC_POSE delta position / rotation + gripper, clipped to [-1, 1] (as
robosuite's controller clips LIBERO's actions) and multiplied by `ACTION_SCALE` before it reaches
robosuite's controller. Reward 1 and success on the control step that ends within the radius; the
harness ends the episode there (or after max_episode_steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.config import EnvConfig, robosuite_camera
from envs.libero_env import NOOP_ACTION, naming_unknown_cameras, reset_gripper_memory, rotate_180, state_vector
from envs.reach_mjcf import VISUALS

# Tuned so that random actions sometimes succeed and a consistent push toward the target almost
# always does (numbers measured with these values: experiments/bench_reach.py).
SUCCESS_RADIUS = 0.08  # m, grip site to target centre
TARGET_DISTANCE = 0.10  # m, target from the home grip-site position
TARGET_SIZE = 0.025  # m, radius of the drawn sphere
# Env action -> controller action. Position deltas are scaled down so that noise alone wanders
# less far in an episode (at 1.0 a constant full action moves the grip site ~1.2 cm per step);
# rotation deltas are scaled down a lot because random wrist rotations at robosuite's 0.5 rad
# per step make the arm swing the grip site around. The gripper command is unchanged.
POSITION_ACTION_SCALE = 0.6
ROTATION_ACTION_SCALE = 0.1
ACTION_SCALE = np.array([POSITION_ACTION_SCALE] * 3 + [ROTATION_ACTION_SCALE] * 3 + [1.0])
NUM_INIT_STATES = 8
INIT_JOINT_NOISE = 0.015  # rad, half-width of the uniform joint perturbation of init states > 0
# robosuite's Panda home configuration (robosuite/models/robots/manipulators/panda_robot.py).
HOME_JOINTS = np.array([0.0, np.pi / 16.0, 0.0, -np.pi / 2.0 - np.pi / 3.0, 0.0, np.pi - 0.2, np.pi / 4])


@dataclass(frozen=True)
class ReachTask:
    """One target: its colour (named in the prompt) and its offset from the home grip site."""

    task_id: int
    colour: str
    rgba: tuple[float, float, float, float]
    direction: tuple[float, float, float]  # unit vector in the world frame (x forward, y left, z up)

    @property
    def prompt(self) -> str:
        return f"reach the {self.colour} sphere"

    @property
    def label(self) -> str:
        return f"reach/{self.task_id} ({self.colour})"

    @property
    def offset(self) -> np.ndarray:
        return TARGET_DISTANCE * np.asarray(self.direction, dtype=np.float64)


REACH_TASKS = (
    ReachTask(0, "red", (0.9, 0.1, 0.1, 1.0), (0.0, 1.0, 0.0)),
    ReachTask(1, "green", (0.1, 0.8, 0.1, 1.0), (0.0, -1.0, 0.0)),
    ReachTask(2, "blue", (0.1, 0.2, 0.9, 1.0), (1.0, 0.0, 0.0)),
    ReachTask(3, "yellow", (0.9, 0.8, 0.1, 1.0), (0.0, 0.0, -1.0)),
)
# Not up (+z: inside the hand) or back (-x: behind it): the agent view could not see them.
NUM_TASKS = len(REACH_TASKS)


def get_reach_task(task_id: int) -> ReachTask:
    if not 0 <= task_id < NUM_TASKS:
        raise ValueError(f"reach task_id {task_id} out of range (0..{NUM_TASKS - 1})")
    return REACH_TASKS[task_id]


def init_joints(init_state_id: int) -> np.ndarray:
    """Arm joints of init state k: the home pose for k = 0, else home + U(-noise, noise) seeded
    by k (a pure function of k, so every process builds the same init states)."""
    if not 0 <= init_state_id < NUM_INIT_STATES:
        raise ValueError(f"reach init_state_id {init_state_id} out of range (0..{NUM_INIT_STATES - 1})")
    if init_state_id == 0:
        return HOME_JOINTS.copy()
    rng = np.random.default_rng(init_state_id)
    return HOME_JOINTS + rng.uniform(-INIT_JOINT_NOISE, INIT_JOINT_NOISE, size=HOME_JOINTS.shape)


def biased_noise_actions(
    task_ids: Sequence[int], horizon: int, bias: float, rng: np.random.Generator, noise_std: float = 1.0
) -> np.ndarray:
    """(N, horizon, 7) actions: N(0, noise_std) noise on every dim plus `bias` times the env's
    target direction on the position dims, clipped to [-1, 1]. bias = 0 is pure noise (a stand-in
    for an untrained policy); bias > 0 is the consistent push GRPO has to discover."""
    directions = np.array([get_reach_task(t).direction for t in task_ids], dtype=np.float64)
    actions = rng.normal(0.0, noise_std, size=(len(task_ids), horizon, 7))
    actions[..., :3] += bias * directions[:, None, :]
    return np.clip(actions, -1.0, 1.0)


class ReachEnv:
    """One reach task with the vector env's low-level episode API (as LiberoEnv / CountdownEnv)."""

    def __init__(
        self,
        task_id: int,
        image_size: int = 64,
        cameras: Sequence[str] = ("agentview", "wrist"),
        num_settle_steps: int = 0,
        step_mode: str = "lean",
        render_backend: str = "auto",
        visuals: str = "low_poly",  # or "full_meshes" / "robosuite" (envs/reach_scene.py)
    ):
        self.task = get_reach_task(task_id)
        if visuals not in VISUALS:
            raise ValueError(f"reach visuals must be one of {VISUALS}, got {visuals!r}")
        self.image_size = int(image_size)
        self.cameras = tuple(cameras)
        self.num_settle_steps = int(num_settle_steps)
        self.step_mode = step_mode
        self.render_backend = render_backend
        self.visuals = visuals
        self._scene: Any = None  # envs.reach_scene.ReachScene, created lazily
        self._stepper: Any = None
        self.home_eef_pos: np.ndarray | None = None  # grip site at HOME_JOINTS (after creation)

    @classmethod
    def from_config(cls, cfg: EnvConfig, task_id: int) -> ReachEnv:
        return cls(
            task_id,
            image_size=cfg.image_size,
            cameras=cfg.cameras,
            num_settle_steps=cfg.num_settle_steps,
            step_mode=cfg.step_mode,
            render_backend=cfg.render_backend,
        )

    # ----------------------------------------------------------------- low-level episode API
    @property
    def prompt(self) -> str:
        return self.task.prompt

    @property
    def num_init_states(self) -> int:
        return NUM_INIT_STATES

    @property
    def created(self) -> bool:
        return self._scene is not None

    @property
    def scene(self) -> Any:
        """The robosuite env (after `ensure_created`)."""
        return self._scene

    @property
    def target_pos(self) -> np.ndarray:
        return self._scene.target_pos.copy()

    def ensure_created(self) -> None:
        """Build the MuJoCo scene in this process and place the target."""
        if self._scene is not None:
            return
        from envs.rendering import configure_gl

        configure_gl(self.render_backend)  # before robosuite imports mujoco
        from envs.reach_scene import ReachScene
        from envs.steppers import make_stepper

        with naming_unknown_cameras(self.cameras, self.task.label):
            scene = ReachScene(
                target_rgba=self.task.rgba,
                target_size=TARGET_SIZE,
                success_radius=SUCCESS_RADIUS,
                camera_names=[robosuite_camera(c) for c in self.cameras],
                image_size=self.image_size,
                visuals=self.visuals,
            )
        try:
            scene.set_initial_joints(HOME_JOINTS)
            scene.reset()
            self.home_eef_pos = np.array(scene._eef_xpos)
            scene.set_target(self.home_eef_pos + self.task.offset)
            self._stepper = make_stepper(self.step_mode, _SceneHandle(scene))
        except BaseException:
            scene.close()
            raise
        self._scene = scene

    def begin_episode(self, init_state_id: int, seed: int) -> None:
        """Soft reset to init state `init_state_id` (+ settle steps); no rendering. `seed` is
        accepted for the API and unused: the episode is a function of the init state and actions."""
        joints = init_joints(int(init_state_id))  # validates the id before any work
        self.ensure_created()
        scene = self._scene
        scene.set_initial_joints(joints)
        scene.reset()  # robosuite: sim.reset(), arm to init_qpos, fresh controller
        reset_gripper_memory(_SceneHandle(scene))
        self._stepper.after_reset()
        for _ in range(self.num_settle_steps):
            self._stepper.step(NOOP_ACTION)

    def control_step(self, action: np.ndarray) -> tuple[float, bool]:
        """One control step (the action clipped to the action space, then scaled by ACTION_SCALE),
        no images. Returns (reward, success).

        The clip keeps LIBERO's semantics for actions outside [-1, 1] (rollout.collector.action_clip
        > 1): robosuite's controller clips its input to [-1, 1], so in LIBERO a command of 2 acts as
        1; scaled first, a reach command of 2 would reach the controller as 1.2 (position) or 0.2
        (rotation, so up to 10x the documented range) and still act."""
        action = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        return self._stepper.step(action * ACTION_SCALE)

    def observation(self, render: bool = True) -> dict[str, np.ndarray]:
        raw = self._stepper.observe(render=render and bool(self.cameras))
        obs = {"state": state_vector(raw)}
        if render:
            for camera in self.cameras:
                obs[f"{camera}_image"] = rotate_180(raw[f"{robosuite_camera(camera)}_image"])
        return obs

    def target_distance(self) -> float:
        """Grip site to target centre (m) at the current state."""
        return self._scene.target_distance()

    def close(self) -> None:
        scene, self._scene, self._stepper = self._scene, None, None
        if scene is not None:
            scene.close()


class _SceneHandle:
    """What the steppers and `reset_gripper_memory` expect of LIBERO's wrapper: `.env` is the
    robosuite env."""

    def __init__(self, scene: Any):
        self.env = scene
