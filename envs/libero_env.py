"""One LIBERO task as a `gymnasium.Env`, plus the low-level episode API the vector env uses.

Observation (openpi / RLinf conventions):
  "<camera>_image"  (H, W, 3) uint8 for each configured camera ("agentview", "wrist"),
                    rotated by 180 degrees (img[::-1, ::-1]) as openpi and RLinf feed policies;
  "state"           (8,) float32: eef position (3), axis-angle of the eef quaternion (3),
                    gripper qpos (2);
  "prompt"          the task's language instruction.
Action: Box(-1, 1, (7,)) (OSC_POSE delta pose + gripper). Reward 1 and terminated on
success; truncated after max_episode_steps actions. Each episode starts with LIBERO's
`reset()`, `set_init_state(init_states[k])` and `num_settle_steps` no-op actions (zeros, gripper
-1, as openpi does) so objects settle before the policy acts.

The MuJoCo env is created lazily (first reset, or `ensure_created()`), inside the process that
uses it, after the GL backend is chosen. Physics goes through a Stepper (envs/steppers.py), so
cameras render only when an observation with images is asked for.
"""

from __future__ import annotations

import contextlib
import math
import string
from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from envs.config import CAMERA_ALIASES, EnvConfig, robosuite_camera
from envs.suites import DEFAULT_MAX_EPISODE_STEPS, TaskSpec, get_task, load_init_states

STATE_DIM = 8
ACTION_DIM = 7
NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)  # gripper -1: open
PROMPT_MAX_LENGTH = 512


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """(x, y, z, w) quaternion -> axis-angle vector (robosuite's `quat2axisangle`).

    The angle is 2 acos(w) in [0, 2 pi]; a rotation within float precision of identity maps to
    zeros. Does not modify its input (robosuite's version clips w in place).
    """
    quat = np.asarray(quat, dtype=np.float64)
    w = min(max(float(quat[3]), -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return quat[:3] * (2.0 * math.acos(w) / den)


def state_vector(proprio: dict[str, np.ndarray]) -> np.ndarray:
    """The 8-dim policy state from robosuite-style proprio observations."""
    return np.concatenate(
        [
            proprio["robot0_eef_pos"],
            quat_to_axis_angle(proprio["robot0_eef_quat"]),
            proprio["robot0_gripper_qpos"],
        ]
    ).astype(np.float32)


def rotate_180(image: np.ndarray) -> np.ndarray:
    """openpi's / RLinf's camera preprocessing: flip rows and columns (a view, no copy)."""
    return image[::-1, ::-1]


def _readonly(states: np.ndarray) -> np.ndarray:
    states = np.asarray(states, dtype=np.float64)
    if states.ndim != 2 or len(states) == 0:
        raise ValueError(f"init states must have shape (N, D) with N >= 1, got {states.shape}")
    states = states.copy() if states.flags.writeable else states
    states.setflags(write=False)
    return states


@contextlib.contextmanager
def naming_unknown_cameras(cameras: Sequence[str], where: str) -> Iterator[None]:
    """Around a scene's build: an `env.cameras` entry the scene has no camera for is named as such.

    robosuite reports it as "Current sensor for observable agentveiw_image is invalid." after the
    whole build (~24 s for a LIBERO scene); MuJoCo's own message, with the scene's camera names,
    is only in the exception's context. Other errors pass unchanged."""
    try:
        yield
    except ValueError as exc:
        for alias in cameras:
            name = robosuite_camera(alias)
            if f"observable {name}_image " in str(exc):
                detail = f": {exc.__context__}" if exc.__context__ is not None else ""
                raise ValueError(
                    f"{where}: env.cameras entry {alias!r} (robosuite camera {name!r}) is not a camera "
                    f"of this scene{detail} (env.cameras also takes the aliases {CAMERA_ALIASES})"
                ) from exc
        raise


def reset_robosuite(libero_env: Any, max_attempts: int = 100) -> None:
    """LIBERO's `ControlEnv.reset` without its trap: it retries object placement on
    RandomizationError but, through `finally: continue`, also retries forever on *any*
    exception. Here only placement failures are retried, a bounded number of times."""
    from robosuite.utils.errors import RandomizationError

    for _ in range(max_attempts):
        try:
            libero_env.env.reset()
            return
        except RandomizationError:
            continue
    raise RuntimeError(f"object placement failed {max_attempts} times in a row during reset")


def reset_gripper_memory(libero_env: Any) -> None:
    """Zero the grippers' integrated command, as in a freshly built env.

    robosuite's Panda gripper integrates sign(action) into `current_action` (clipped to +-1)
    at every sub-step and a soft reset never clears it, so without this an episode's first
    steps depend on how the previous episode ended: two envs reset to the same init state
    with the same actions would drift apart (~1e-4 in qpos after the settle steps).
    """
    for robot in libero_env.env.robots:
        gripper = getattr(robot, "gripper", None)
        if gripper is not None:
            gripper.current_action = np.zeros_like(gripper.current_action)


class LiberoEnv(gym.Env):
    """One LIBERO task (one MuJoCo scene); see the module docstring."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        task: TaskSpec,
        image_size: int = 128,
        cameras: Sequence[str] = ("agentview", "wrist"),
        max_episode_steps: int | None = None,
        num_settle_steps: int = 10,
        step_mode: str = "robosuite",
        render_backend: str = "auto",
        seed: int = 0,
        init_states: np.ndarray | None = None,
        render_reflections: bool = True,
        render_multisamples: int | None = None,
        render_culling: bool | None = None,
        render_mesh_faces: int | None = None,
    ):
        self.task = task
        # Given by the parent of a worker process (loaded there once): reading them here would
        # import torch (LIBERO saved them with torch.save), ~1-2 s and ~225 MB per worker.
        self._init_states = None if init_states is None else _readonly(init_states)
        self.image_size = int(image_size)
        self.cameras = tuple(cameras)
        self.max_episode_steps = int(max_episode_steps or DEFAULT_MAX_EPISODE_STEPS[task.suite])
        self.num_settle_steps = int(num_settle_steps)
        self.step_mode = step_mode
        self.render_backend = render_backend
        self.render_reflections = bool(render_reflections)
        self.render_multisamples = render_multisamples
        self.render_culling = render_culling  # None: on under OSMesa only (envs/config.py says why)
        self.render_mesh_faces = render_mesh_faces
        self.render_faces: dict[str, int] = {}  # the drawn meshes' faces before / after (coarse meshes only)
        self._base_seed = int(seed)
        self._env: Any = None  # LIBERO OffScreenRenderEnv, created lazily
        self._stepper: Any = None
        self._elapsed_steps = 0
        self._episode_over = True
        size = (self.image_size, self.image_size, 3)
        spaces: dict[str, gym.Space] = {
            f"{camera}_image": gym.spaces.Box(0, 255, size, dtype=np.uint8) for camera in self.cameras
        }
        spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (STATE_DIM,), dtype=np.float32)
        spaces["prompt"] = gym.spaces.Text(PROMPT_MAX_LENGTH, charset=string.printable)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), dtype=np.float32)

    @classmethod
    def from_config(cls, cfg: EnvConfig, task_id: int, task: TaskSpec | None = None,
                    init_states: np.ndarray | None = None) -> LiberoEnv:
        """The env of `cfg.suite` task `task_id`. `task` and `init_states`, when the caller has
        them (a worker's parent), spare this process LIBERO's task tables and torch."""
        return cls(
            task if task is not None else get_task(cfg.suite, task_id),
            image_size=cfg.image_size,
            cameras=cfg.cameras,
            max_episode_steps=cfg.episode_steps,
            num_settle_steps=cfg.num_settle_steps,
            step_mode=cfg.step_mode,
            render_backend=cfg.render_backend,
            seed=cfg.seed,
            init_states=init_states,
            render_reflections=cfg.render_reflections,
            render_multisamples=cfg.render_multisamples,
            render_culling=cfg.render_culling,
            render_mesh_faces=cfg.render_mesh_faces,
        )

    # ----------------------------------------------------------------- low-level episode API
    @property
    def prompt(self) -> str:
        return self.task.language

    @property
    def init_states(self) -> np.ndarray:
        """The task's recorded init states (num_states, state_dim), read-only."""
        if self._init_states is None:
            self._init_states = load_init_states(self.task)
        return self._init_states

    @property
    def num_init_states(self) -> int:
        return len(self.init_states)

    @property
    def created(self) -> bool:
        return self._env is not None

    @property
    def libero_env(self) -> Any:
        """LIBERO's OffScreenRenderEnv (after `ensure_created`)."""
        return self._env

    def ensure_created(self) -> None:
        """Build the MuJoCo scene in this process (~13 s on CPU for libero_10)."""
        if self._env is not None:
            return
        from envs.render_culling import culling_enabled, set_frustum_culling
        from envs.render_options import apply_render_options
        from envs.rendering import configure_gl
        from envs.steppers import make_stepper
        from envs.suites import make_robosuite_env

        backend = configure_gl(self.render_backend)
        with naming_unknown_cameras(self.cameras, self.task.label):
            env = make_robosuite_env(
                self.task,
                image_size=self.image_size,
                cameras=tuple(robosuite_camera(c) for c in self.cameras),
                use_camera_obs=bool(self.cameras),
                ignore_done=True,  # episode length is tracked here, not by robosuite
            )
        try:
            if self.cameras:
                self.render_faces = apply_render_options(env, self.render_reflections, self.render_multisamples,
                                                         self.render_mesh_faces)
                set_frustum_culling(env, culling_enabled(self.render_culling, backend))
            self._stepper = make_stepper(self.step_mode, env)
        except BaseException:
            env.close()
            raise
        self._env = env

    def begin_episode(self, init_state_id: int, seed: int) -> None:
        """reset + set_init_state(init_states[init_state_id]) + settle steps; no rendering."""
        self.ensure_created()
        states = self.init_states
        if not 0 <= init_state_id < len(states):
            raise ValueError(
                f"{self.task.label}: init_state_id {init_state_id} out of range "
                f"(0..{len(states) - 1})"
            )
        self._env.seed(int(seed) % 2**32)  # LIBERO seeds numpy's global generator
        reset_robosuite(self._env)
        reset_gripper_memory(self._env)
        self._stepper.after_reset()
        self._env.set_init_state(states[init_state_id])
        self._stepper.after_reset()
        for _ in range(self.num_settle_steps):
            self._stepper.step(NOOP_ACTION)
        self._elapsed_steps = 0
        self._episode_over = False

    def control_step(self, action: np.ndarray) -> tuple[float, bool]:
        """One env step's physics + controller, no images. Returns (reward, success)."""
        return self._stepper.step(np.asarray(action, dtype=np.float64))

    def observation(self, render: bool = True) -> dict[str, np.ndarray]:
        """Policy observation at the current state: "state" always, "<camera>_image" (rotated
        views) when `render`."""
        raw = self._stepper.observe(render=render and bool(self.cameras))
        obs = {"state": state_vector(raw)}
        if render:
            for camera in self.cameras:
                obs[f"{camera}_image"] = rotate_180(raw[f"{robosuite_camera(camera)}_image"])
        return obs

    # ----------------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed if seed is not None else None)
        options = dict(options or {})
        init_state_id = options.pop("init_state_id", None)
        if options:
            raise ValueError(f"unknown reset option(s) {sorted(options)}; known: ['init_state_id']")
        if init_state_id is None:
            init_state_id = int(self.np_random.integers(self.num_init_states))
        episode_seed = seed if seed is not None else self._base_seed
        self.begin_episode(int(init_state_id), int(episode_seed))
        return self._gym_obs(), {"init_state_id": int(init_state_id)}

    def step(self, action):
        if self._episode_over:
            raise RuntimeError(f"{self.task.label}: step() after the episode ended; call reset()")
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (ACTION_DIM,) or not np.all(np.isfinite(action)):
            raise ValueError(f"action must be 7 finite numbers, got {action!r}")
        reward, success = self.control_step(action)
        self._elapsed_steps += 1
        truncated = (not success) and self._elapsed_steps >= self.max_episode_steps
        self._episode_over = success or truncated
        info = {"success": success, "elapsed_steps": self._elapsed_steps}
        return self._gym_obs(), float(reward), bool(success), bool(truncated), info

    def _gym_obs(self) -> dict[str, Any]:
        obs: dict[str, Any] = {
            k: np.ascontiguousarray(v) for k, v in self.observation(render=True).items()
        }
        obs["prompt"] = self.prompt
        return obs

    def close(self) -> None:
        env, self._env, self._stepper = self._env, None, None
        if env is not None:
            env.close()
