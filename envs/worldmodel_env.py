"""The world model as a vector env: LIBERO's vector-env interface, frames from the model.

    vec = WorldModelVectorEnv(WorldModelEnvConfig(num_envs=8, group_size=4))   # or an EnvConfig-shaped mapping
    obs = vec.reset(init_state_ids=[3, 5])   # "<camera>_image" (N, S, S, 3) uint8, "state" (N, 8), "prompt"
    out = vec.step_chunk(actions)            # (N, H, 7) -> ChunkResult, as envs/vector/base.py defines it
    vec.close()

Each env is one stream of a `WorldModelServer` in this process: reset encodes the init state's
frames (the cameras side by side in one frame) into the context chunk; `step_chunk` submits
every unfinished env's action chunk and ticks the server until all those chunks are out, so
the chunks of all envs are denoised together, batched per block. Action h drives video frame h
of the chunk; the observation is the decoded frame of the env's last executed sub-step, split
into cameras, and the state comes from the readout head.

Episode semantics follow the LIBERO runner: success is read once per chunk (the readout's
probability > `readout.success_threshold`, or `reward_fn`), and gives reward 1 and
`terminated` on the chunk's last sub-step; `truncated` on the sub-step reaching
`max_episode_steps` (sub-steps past it are invalid; a chunk cut short is not judged);
finished envs stay finished until the next reset. There are no worker processes, so `lost`
is always False.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from envs.vector.base import VectorEnvBase
from envs.vector.buffers import SharedBuffers
from envs.vector.catalog import EnvSlot
from worldmodels.env_config import WorldModelEnvConfig
from worldmodels.initial import InitialFrames
from worldmodels.readout import RewardFn
from worldmodels.serve import WorldModelServer
from worldmodels.vae import frame_to_images, images_to_frame


class WorldModelVectorEnv(VectorEnvBase):
    def __init__(self, cfg: WorldModelEnvConfig | Mapping | Any, reward_fn: RewardFn | None = None,
                 server: WorldModelServer | None = None):
        if not isinstance(cfg, WorldModelEnvConfig):
            cfg = WorldModelEnvConfig.from_mapping(cfg)
        self.model_cfg = cfg.model_config()
        self.initial = initial_frames(cfg)
        self._init_base(cfg, worldmodel_slots(cfg, self.initial))
        self._buffers = SharedBuffers.private(cfg)
        self.server = server or WorldModelServer(self.model_cfg, cfg.serve_config(), reward_fn=reward_fn)
        self._streams: list[int | None] = [None] * cfg.num_envs
        self.last_success_prob = np.zeros(cfg.num_envs, dtype=np.float32)

    def _init_base(self, cfg: WorldModelEnvConfig, slots: list[EnvSlot]) -> None:
        """VectorEnvBase.__init__'s state, with our own slots (the base derives them from EnvConfig)."""
        self.cfg = cfg
        self.num_envs = cfg.num_envs
        self.slots = slots
        self.task_ids = [slot.task_id for slot in slots]
        self.prompts = [slot.prompt for slot in slots]
        self.init_state_ids = np.full(self.num_envs, -1, dtype=np.int64)
        self.episode_seeds = np.zeros(self.num_envs, dtype=np.int64)
        self._lost = np.zeros(self.num_envs, dtype=bool)
        self._reset_count = 0
        self.last_reset_s = 0.0
        self._has_reset = False
        self._closed = False

    # ------------------------------------------------------------------ VectorEnvBase hooks
    def _worker_env_ids(self) -> list[list[int]]:
        return [list(range(self.num_envs))]

    def _reset_envs(self, plan: list[tuple[int, int, int]]) -> None:
        buf = self._buffers
        start = time.perf_counter()
        latents, per_camera = self._initial_chunks(plan)
        for row, (env_id, init_state, seed) in enumerate(plan):
            if self._streams[env_id] is not None:
                self.server.close_stream(self._streams[env_id])
            self._streams[env_id] = self.server.open_stream(
                latents[row], seed=seed, context_id=self.task_ids[env_id] % self.model_cfg.dit.num_contexts,
                frames="all")
            for c, camera in enumerate(self.cfg.cameras):
                buf[f"{camera}_image"][env_id] = per_camera[c][row]
            buf["state"][env_id] = self.initial.state(self.task_ids[env_id], init_state)
        for key in ("done", "success", "valid", "rewards", "terminated", "truncated"):
            buf[key][:] = False if buf[key].dtype == bool else 0
        buf["elapsed_steps"][:] = 0
        buf["timing"][:] = (time.perf_counter() - start) / self.num_envs, 0.0

    def _initial_chunks(self, plan) -> tuple[torch.Tensor, list[np.ndarray]]:
        """Context latents (n, F, C, h, w) and first images per camera (n, S, S, 3) of every env:
        stored latents are used as they are (their last frame decoded when no images are stored);
        images are encoded as a still clip."""
        keys = [(self.task_ids[i], k) for i, k, _ in plan]
        stored = [self.initial.latents(t, k) for t, k in keys]
        cameras = len(self.cfg.cameras)
        if stored[0] is not None:
            latents = torch.from_numpy(np.stack(stored))
        if self.initial.has_images:
            images = [self.initial.images(t, k) for t, k in keys]
            per_camera = [np.stack([imgs[c] for imgs in images]) for c in range(cameras)]
            if stored[0] is None:
                latents = self.server.encode_frames(images_to_frame(per_camera))
        else:
            with torch.no_grad():
                device = self.server.vae.dec_in.weight.device
                frames = self.server.vae.decode(latents[:, -1:].to(device)).float().cpu()[:, -1]
            per_camera = frame_to_images(frames, cameras)
        return latents, per_camera

    def _check_deferrable(self) -> None:
        raise ValueError("the world-model vector env has no renderer to defer (its frames are the model's "
                         "output): step_chunk(render=False) is not supported, use render=True")

    def _step_envs(self, horizon: int, render: bool = True) -> list[dict]:
        buf = self._buffers
        for key in ("rewards", "terminated", "truncated", "valid", "timing"):
            buf[key][:] = 0
        active = [i for i in range(self.num_envs) if not buf["done"][i]]
        start = time.perf_counter()
        for i in active:
            self.server.submit(self._streams[i], buf["actions"][i, :horizon])
        outputs = self._wait(active)
        elapsed = time.perf_counter() - start
        for i in active:
            self._record(i, outputs[i], horizon)
            buf["timing"][i] = (elapsed / max(len(active), 1), 0.0)
        return []

    def _close_impl(self) -> None:
        for sid in self._streams:
            if sid is not None:
                self.server.close_stream(sid)
        self._streams = [None] * self.num_envs
        self._buffers.close()

    def _result(self, horizon: int, wall_s: float, newly_lost):
        result = super()._result(horizon, wall_s, newly_lost)
        result.info["success_prob"] = self.last_success_prob.copy()
        return result

    # ------------------------------------------------------------------ helpers
    def _wait(self, active: list[int]) -> dict[int, Any]:
        outputs: dict[int, Any] = {}
        while len(outputs) < len(active):
            for i in active:
                if i not in outputs:
                    out = self.server.poll(self._streams[i])
                    if out is not None:
                        outputs[i] = out
            if len(outputs) < len(active):
                if self.server.scheduler.idle():
                    raise RuntimeError("world-model server idle while envs wait for chunks")
                self.server.tick()
        return outputs

    def _record(self, i: int, out, horizon: int) -> None:
        """Sub-step masks, reward and observation of env i after its chunk (LIBERO runner semantics)."""
        buf = self._buffers
        steps = int(buf["elapsed_steps"][i])
        executed = min(horizon, self.cfg.episode_steps - steps)
        buf["elapsed_steps"][i] = steps + executed
        buf["valid"][i, :executed] = True
        self.last_success_prob[i] = out.success_prob
        success = executed == horizon and out.success_prob > self.model_cfg.readout.success_threshold
        if success:
            buf["terminated"][i, executed - 1] = True
            buf["rewards"][i, executed - 1] = 1.0
            buf["success"][i] = True
            buf["done"][i] = True
        elif steps + executed >= self.cfg.episode_steps:
            buf["truncated"][i, executed - 1] = True
            buf["done"][i] = True
        frames = out.frames  # (T, 3, H, W): video frame h follows action h
        images = frame_to_images(frames[executed - 1:executed], len(self.cfg.cameras))
        for c, camera in enumerate(self.cfg.cameras):
            buf[f"{camera}_image"][i] = images[c][0]
        buf["state"][i] = out.state
        if self.cfg.render_every == "substep":
            all_images = frame_to_images(frames[:executed], len(self.cfg.cameras))
            for c, camera in enumerate(self.cfg.cameras):
                buf[f"{camera}_frames"][i, :executed] = all_images[c]


def initial_frames(cfg: WorldModelEnvConfig) -> InitialFrames:
    settings = cfg.worldmodel
    return InitialFrames(cfg.cameras, cfg.image_size, settings.num_tasks, settings.num_init_states,
                         settings.init_frames)


def worldmodel_slots(cfg: WorldModelEnvConfig | Mapping | Any, initial: InitialFrames | None = None) -> list[EnvSlot]:
    """What each env runs (task, prompt, init states), without building the model: what
    `envs.vector.catalog.env_slots` returns for the other env types."""
    if not isinstance(cfg, WorldModelEnvConfig):
        cfg = WorldModelEnvConfig.from_mapping(cfg)
    initial = initial or initial_frames(cfg)
    return [EnvSlot(i, t, initial.prompts[t], cfg.worldmodel.num_init_states, f"worldmodel/{t}")
            for i, t in enumerate(cfg.env_task_ids())]


def make_worldmodel_env(cfg: WorldModelEnvConfig | Mapping | Any, **kwargs) -> WorldModelVectorEnv:
    """Build from a config (WorldModelEnvConfig, an EnvConfig-shaped dict / OmegaConf node)."""
    return WorldModelVectorEnv(cfg, **kwargs)
