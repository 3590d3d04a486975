"""Initial observations of the world-model env: frames (and state, prompts) per task and init state.

From an .npz with `"<camera>_image"` (tasks, inits, S, S, 3) uint8 (e.g. LIBERO's first frames
rendered once) and/or `"latents"` (tasks, inits, F, C, h, w) float (context chunks encoded
offline: used as they are, no VAE encode), optionally `"state"` (tasks, inits, 8) and `"prompts"`
(tasks,); or, without a file, synthetic scenes: a deterministic function of (task, init state,
camera), a colour gradient with a few blocks, so every init state starts from another picture.
"""

from __future__ import annotations

import os

import numpy as np


class InitialFrames:
    def __init__(self, cameras: list[str], image_size: int, num_tasks: int, num_init_states: int,
                 path: str | None = None, state_dim: int = 8):
        self.cameras = list(cameras)
        self.size = image_size
        self.num_tasks = num_tasks
        self.num_init_states = num_init_states
        self.state_dim = state_dim
        self.prompts = [f"world-model task {t}" for t in range(num_tasks)]
        self._images: dict[str, np.ndarray] | None = None
        self._latents: np.ndarray | None = None
        self._state: np.ndarray | None = None
        if path is not None:
            self._load(path)

    def _load(self, path: str) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"env.worldmodel.init_frames {path!r} does not exist")
        data = np.load(path, allow_pickle=False)
        want = (self.num_tasks, self.num_init_states, self.size, self.size, 3)
        if "latents" in data:
            latents = data["latents"]
            if latents.ndim != 6 or latents.shape[:2] != want[:2]:
                raise ValueError(f"{path}: latents must be (tasks={want[0]}, init states={want[1]}, F, C, h, w), "
                                 f"got {latents.shape}")
            self._latents = latents.astype(np.float32)
        cameras = [c for c in self.cameras if f"{c}_image" in data]
        if cameras or self._latents is None:
            self._images = {}
            for camera in self.cameras:
                key = f"{camera}_image"
                if key not in data:
                    raise ValueError(f"{path}: no {key!r} array (cameras {self.cameras}); has {sorted(data.files)}")
                array = data[key]
                if array.dtype != np.uint8 or array.shape != want:
                    raise ValueError(f"{path}: {key} must be uint8 {want} (tasks, init states, S, S, 3), got "
                                     f"{array.dtype} {array.shape}")
                self._images[camera] = array
        # checked here, naming the array: a wrong shape failed at reset (a broadcast error) or on the first env of
        # a task past the array (an IndexError)
        if "state" in data:
            state = data["state"]
            want_state = (self.num_tasks, self.num_init_states, self.state_dim)
            if state.shape != want_state or not np.issubdtype(state.dtype, np.number):
                raise ValueError(f"{path}: state must be numeric {want_state} (tasks, init states, state dim), got "
                                 f"{state.dtype} {state.shape}")
            self._state = state.astype(np.float32)
        if "prompts" in data:
            prompts = data["prompts"]
            if prompts.shape != (self.num_tasks,):
                raise ValueError(f"{path}: prompts must be ({self.num_tasks},) (one per task), got {prompts.shape}")
            self.prompts = [str(p) for p in prompts]

    @property
    def has_images(self) -> bool:
        return self._images is not None or self._latents is None

    def latents(self, task: int, init_state: int) -> np.ndarray | None:
        """The stored context chunk (F, C, h, w), or None (encode the images)."""
        return None if self._latents is None else self._latents[task, init_state]

    def images(self, task: int, init_state: int) -> list[np.ndarray]:
        """One (S, S, 3) uint8 image per camera."""
        if self._images is not None:
            return [self._images[c][task, init_state] for c in self.cameras]
        return [self._synthetic(task, init_state, i) for i in range(len(self.cameras))]

    def state(self, task: int, init_state: int) -> np.ndarray:
        if self._state is not None:
            return self._state[task, init_state]
        return np.zeros(self.state_dim, dtype=np.float32)

    def _synthetic(self, task: int, init_state: int, camera: int) -> np.ndarray:
        rng = np.random.default_rng([task, init_state, camera, 7])
        s = self.size
        ramp = np.linspace(0.0, 1.0, s, dtype=np.float32)
        base = rng.uniform(40, 200, 3).astype(np.float32)
        slope = rng.uniform(-60, 60, (2, 3)).astype(np.float32)
        image = base + ramp[:, None, None] * slope[0] + ramp[None, :, None] * slope[1]
        for _ in range(3):
            y, x = rng.integers(0, max(s - s // 4, 1), 2)
            h, w = rng.integers(max(s // 8, 1), max(s // 3, 2), 2)
            image[y:y + h, x:x + w] = rng.uniform(0, 255, 3)
        return np.clip(image, 0, 255).astype(np.uint8)
