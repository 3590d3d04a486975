"""A tiny deterministic env with LiberoEnv's low-level episode API (for vector-env tests).

`CountdownEnv` needs no MuJoCo: it is created in microseconds, so tests of the vector env's
mechanics (chunk semantics, masks, groups, crashes, shared memory) run in seconds, and the
same tests run against real LIBERO envs where it matters.

Dynamics: progress starts at 0; each action adds action[0] to it; the episode succeeds (reward
1) on the step where progress >= target, with target = 1 + task_id + (init_state_id % 3).
So with action[0] = 1 an episode of task t from init state k lasts 1 + t + k % 3 steps.
State (8,): [progress, target, steps, init_state_id, task_id, episode_seed % 1000, 0, 0].
Fault injection (to test error forwarding): an action with action[1] == FAULT_VALUE makes
`control_step` raise, one with CRASH_VALUE kills the process with SIGSEGV (a hard crash, which
faulthandler reports); with the environment variable FAIL_BUILD_ENV set, `ensure_created` raises
(a worker started after it is set fails to build its envs).
Images are a deterministic function of (camera, progress, steps, init_state_id): the same
inputs always give the same pixels, different steps give different pixels.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import numpy as np

NUM_TASKS = 4
NUM_INIT_STATES = 6
FAULT_VALUE = 99.0
CRASH_VALUE = -99.0
FAIL_BUILD_ENV = "VLA_COUNTDOWN_FAIL_BUILD"


class CountdownEnv:
    def __init__(
        self,
        task_id: int,
        image_size: int = 16,
        cameras: Sequence[str] = ("agentview", "wrist"),
    ):
        if not 0 <= task_id < NUM_TASKS:
            raise ValueError(f"countdown task_id {task_id} out of range (0..{NUM_TASKS - 1})")
        self.task_id = task_id
        self.image_size = image_size
        self.cameras = tuple(cameras)
        self.created = False
        self._state = np.zeros(8, dtype=np.float64)

    @property
    def prompt(self) -> str:
        return f"count to {self.task_id + 1} (countdown task {self.task_id})"

    @property
    def num_init_states(self) -> int:
        return NUM_INIT_STATES

    def ensure_created(self) -> None:
        if os.environ.get(FAIL_BUILD_ENV):
            raise RuntimeError(f"countdown task {self.task_id}: injected build failure ({FAIL_BUILD_ENV} is set)")
        self.created = True

    def begin_episode(self, init_state_id: int, seed: int) -> None:
        if not 0 <= init_state_id < NUM_INIT_STATES:
            raise ValueError(f"countdown init_state_id {init_state_id} out of range")
        self.ensure_created()
        target = 1 + self.task_id + init_state_id % 3
        self._state = np.array(
            [0.0, target, 0, init_state_id, self.task_id, seed % 1000, 0, 0], dtype=np.float64
        )

    def control_step(self, action: np.ndarray) -> tuple[float, bool]:
        if float(action[1]) == FAULT_VALUE:
            raise RuntimeError(f"countdown task {self.task_id}: injected fault (action[1] == {FAULT_VALUE})")
        if float(action[1]) == CRASH_VALUE:
            os.kill(os.getpid(), signal.SIGSEGV)
        self._state[0] += float(action[0])
        self._state[2] += 1
        success = bool(self._state[0] >= self._state[1])
        return float(success), success

    def observation(self, render: bool = True) -> dict[str, np.ndarray]:
        obs = {"state": self._state.astype(np.float32)}
        if render:
            for index, camera in enumerate(self.cameras):
                obs[f"{camera}_image"] = self._image(index)
        return obs

    def _image(self, camera_index: int) -> np.ndarray:
        progress, _, steps, init_state_id = self._state[:4]
        size = self.image_size
        ramp = np.arange(size * size * 3, dtype=np.int64).reshape(size, size, 3)
        offset = int(round(progress * 10)) * 7 + int(steps) * 13 + int(init_state_id) * 29
        return ((ramp + offset + 101 * camera_index) % 251).astype(np.uint8)

    def close(self) -> None:
        self.created = False
