"""Episode bookkeeping for a set of envs, writing into the shared buffers.

One `EnvRunner` runs inside each worker process (over that worker's envs) and one runs in the
in-process twin (over all envs): the chunk semantics live here once, so both vector envs
behave identically by construction and the twin tests check the transport.

Chunk semantics: each env executes its H actions open-loop. Sub-step h of env i is "valid"
when it was really executed; an env that succeeds (terminated) or reaches max_episode_steps
(truncated) stops there: its later sub-steps are invalid with zero reward, and it stays done
(no auto-reset) until the next reset. Cameras render once, after the env's last executed
sub-step of the chunk (or after every sub-step with render_every="substep").

Deferred render (`step_chunk(horizon, render=False)`, chunk_end only): the chunk's physics runs as
usual and each stepped env's state is written, but its cameras are not rendered; those envs are
pending until `render_pending()` renders them (a reset clears them, the next chunk replaces them).
The images then equal an immediate render's: nothing changes the simulator in between. This lets
a caller keep the renderer (EGL, on the policy's GPU) off the GPU while a predict runs.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from envs.config import EnvConfig


class EnvRunner:
    def __init__(self, cfg: EnvConfig, env_ids: Sequence[int], envs: Sequence[Any], buffers: dict):
        if len(env_ids) != len(envs):
            raise ValueError(f"{len(env_ids)} env ids for {len(envs)} envs")
        self.env_ids = list(env_ids)
        self.envs = list(envs)
        self.buf = buffers
        self.cameras = list(cfg.cameras)
        self.max_steps = cfg.episode_steps
        self.render_substeps = cfg.render_every == "substep"
        self.pending: list[tuple[int, Any]] = []  # (env_id, env) stepped without their chunk-end render

    def create(self, on_created: Callable[[int], None] = lambda env_id: None) -> None:
        """Build every env's simulator (the slow part: ~13 s per LIBERO env on CPU)."""
        for env_id, env in zip(self.env_ids, self.envs, strict=True):
            env.ensure_created()
            on_created(env_id)

    def reset(self, plan: Sequence[tuple[int, int, int]]) -> None:
        """plan: (env_id, init_state_id, seed) for envs of this runner; writes their obs."""
        local = {env_id: k for k, env_id in enumerate(self.env_ids)}
        buf = self.buf
        self.pending = []  # the reset renders every env it starts
        for env_id, init_state_id, seed in plan:
            env = self.envs[local[env_id]]
            start = time.perf_counter()
            env.begin_episode(int(init_state_id), int(seed))
            physics = time.perf_counter() - start
            buf["done"][env_id] = False
            buf["success"][env_id] = False
            buf["elapsed_steps"][env_id] = 0
            buf["valid"][env_id] = False
            buf["rewards"][env_id] = 0
            buf["terminated"][env_id] = False
            buf["truncated"][env_id] = False
            render = self._write_obs(env_id, env)
            buf["timing"][env_id] = (physics, render)

    def step_chunk(self, horizon: int, render: bool = True) -> None:
        """Execute actions[:, :horizon] for this runner's envs (see the module docstring).
        render=False: skip the chunk-end camera render (state still written); see `render_pending`."""
        if not render and self.render_substeps:
            raise ValueError(deferral_refusal())
        buf = self.buf
        self.pending = []
        for env_id, env in zip(self.env_ids, self.envs, strict=True):
            buf["rewards"][env_id] = 0
            buf["terminated"][env_id] = False
            buf["truncated"][env_id] = False
            buf["valid"][env_id] = False
            buf["timing"][env_id] = 0
            if buf["done"][env_id]:
                continue  # finished envs stay finished until the next reset
            physics, rendered = self._run_env_chunk(env_id, env, horizon)
            if not self.render_substeps:  # (substep: written after every sub-step already)
                if render:
                    rendered += self._write_obs(env_id, env)
                else:
                    self._write_state(env_id, env)  # untimed: neither a render nor the chunk's physics
                    self.pending.append((env_id, env))
            buf["timing"][env_id] = (physics, rendered)

    def render_pending(self) -> None:
        """Render the cameras of the envs the last `step_chunk(render=False)` stepped; their seconds
        are added to timing[env_id, 1] (the chunk wrote 0 there). Nothing pending: a no-op."""
        pending, self.pending = self.pending, []
        for env_id, env in pending:
            self.buf["timing"][env_id, 1] += self._write_obs(env_id, env)

    def _run_env_chunk(self, env_id: int, env: Any, horizon: int) -> tuple[float, float]:
        buf = self.buf
        actions = buf["actions"][env_id]
        physics = render = 0.0
        for h in range(horizon):
            start = time.perf_counter()
            reward, success = env.control_step(actions[h].copy())
            physics += time.perf_counter() - start
            steps = int(buf["elapsed_steps"][env_id]) + 1
            buf["elapsed_steps"][env_id] = steps
            buf["valid"][env_id, h] = True
            buf["rewards"][env_id, h] = reward
            truncated = (not success) and steps >= self.max_steps
            if success:
                buf["terminated"][env_id, h] = True
                buf["success"][env_id] = True
            elif truncated:
                buf["truncated"][env_id, h] = True
            finished = success or truncated
            if self.render_substeps:
                render += self._write_obs(env_id, env, frame_index=h)
            if finished:
                buf["done"][env_id] = True
                break
        return physics, render

    def _write_obs(self, env_id: int, env: Any, frame_index: int | None = None) -> float:
        """Observe env (with images) into the obs rows (and frame h); returns seconds spent."""
        start = time.perf_counter()
        obs = env.observation(render=True)
        buf = self.buf
        buf["state"][env_id] = obs["state"]
        for camera in self.cameras:
            image = obs[f"{camera}_image"]
            buf[f"{camera}_image"][env_id] = image
            if frame_index is not None:
                buf[f"{camera}_frames"][env_id, frame_index] = image
        return time.perf_counter() - start

    def _write_state(self, env_id: int, env: Any) -> None:
        """The state row alone: every env type answers observation(render=False) with "state"."""
        self.buf["state"][env_id] = env.observation(render=False)["state"]

    def close(self) -> None:
        self.pending = []
        errors = []
        with one_collection_at_the_end():
            for env in self.envs:
                try:
                    env.close()
                except Exception as exc:  # close every env even if one fails
                    errors.append(exc)
        self.envs = []
        if errors:
            raise errors[0]


class _NoCollect:
    """Stands in for the `gc` module where robosuite frees a simulation (one_collection_at_the_end)."""

    @staticmethod
    def collect(*_args: Any) -> int:
        return 0


@contextlib.contextmanager
def one_collection_at_the_end():
    """robosuite's MjSim.free runs a full gc.collect() per simulation freed (~80 ms in a worker with torch loaded,
    round 61): a worker closing 8 envs spent ~0.6 s of its exit in them. Inside this block those calls are skipped,
    and one collection runs at its end (the same objects freed)."""
    binding_utils = sys.modules.get("robosuite.utils.binding_utils")
    if binding_utils is None:  # no robosuite simulation in this process (not imported here to find out)
        yield
        return
    own = binding_utils.gc
    binding_utils.gc = _NoCollect
    try:
        yield
    finally:
        binding_utils.gc = own
        gc.collect()


def deferral_refusal() -> str:
    """Why step_chunk(render=False) is refused with per-sub-step rendering (one message for the vector
    env's check and the runner's)."""
    return ('step_chunk(render=False) defers the chunk-end render, but env.render_every="substep" renders '
            'every sub-step as it runs: use env.render_every="chunk_end" to defer rendering')
