"""The vector env interface shared by the in-process twin and the worker-process version.

    vec = make_vector_env(EnvConfig(suite="libero_10", num_envs=8, group_size=4))
    obs = vec.reset(init_state_ids=[3, 17])     # one init state per group of 4
    out = vec.step_chunk(actions)               # (8, H, 7) -> ChunkResult
    vec.close()

Observation arrays returned by `reset` / `step_chunk` are views of the shared buffers: they
are overwritten by the next call (copy what you keep).

Deferred render (env.render_every="chunk_end" only): `step_chunk(actions, render=False)` runs the
physics and writes every result and the state, but leaves the envs it stepped unrendered (their
images are the previous ones) until `render()`; the pair gives exactly the observations of
`step_chunk(actions)`. A caller sharing the GPU with the renderer (EGL) picks when it renders. A
reset or the next chunk drops what is still unrendered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.config import check_nonnegative_int, check_positive_int
from envs.config import EnvConfig, mixed_group
from envs.vector.buffers import ACTION_DIM, SharedBuffers
from envs.vector.catalog import EnvSlot, env_slots
from envs.vector.runner import deferral_refusal


def first_non_finite(actions: np.ndarray) -> tuple[int, int, int] | None:
    """(env row, sub-step, dim) of the first NaN/inf entry of (N, H, D) actions, or None."""
    bad = ~np.isfinite(actions)
    if not bad.any():
        return None
    row, h, dim = (int(i) for i in np.argwhere(bad)[0])
    return row, h, dim


@dataclass
class ChunkResult:
    """What one `step_chunk` returns (arrays (N, H) are per sub-step)."""

    obs: dict[str, Any]  # "<camera>_image" (N,S,S,3) uint8, "state" (N,8) float32, "prompt"
    rewards: np.ndarray  # (N, H) float32; 0 on invalid sub-steps
    terminated: np.ndarray  # (N, H) bool; True on the sub-step that succeeded
    truncated: np.ndarray  # (N, H) bool; True on the sub-step that hit max_episode_steps
    valid: np.ndarray  # (N, H) bool; sub-steps really executed (False after done / for lost)
    success: np.ndarray  # (N,) bool; the episode has succeeded (at this chunk or before)
    done: np.ndarray  # (N,) bool; finished: success, truncation or lost, until next reset
    lost: np.ndarray  # (N,) bool; the env's worker crashed this episode (restart_on_crash)
    frames: dict[str, np.ndarray] | None = None  # render_every="substep": (N,H,S,S,3)
    info: dict[str, Any] = field(default_factory=dict)


class VectorEnvBase:
    """Validation, group layout, seeding and result assembly; subclasses move the work."""

    # (N,) envs stepped by the last step_chunk(render=False) and not yet rendered; None: nothing
    # (a class default, so subclasses that set up their own state, like the world model's, have it)
    _unrendered: np.ndarray | None = None

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.num_envs = cfg.num_envs
        self.slots: list[EnvSlot] = env_slots(cfg)
        self.task_ids = [slot.task_id for slot in self.slots]
        self.prompts = [slot.prompt for slot in self.slots]
        self.init_state_ids = np.full(self.num_envs, -1, dtype=np.int64)
        self.episode_seeds = np.zeros(self.num_envs, dtype=np.int64)
        self._lost = np.zeros(self.num_envs, dtype=bool)
        self._reset_count = 0
        self.last_reset_s = 0.0  # wall time of the last reset (episode start incl. settle steps)
        self._has_reset = False
        self._closed = False
        self._buffers: SharedBuffers | None = None
        # set by an owner that numbers these envs otherwise (a collector stage: its env 0 is the
        # collector's env `start`); appended to warnings, which carry no notes
        self.numbering_note = ""

    # ------------------------------------------------------------------ public interface
    def reset(
        self,
        init_state_ids: Sequence[int] | None = None,
        group_size: int | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """Start a new episode in every env; returns the first observations.

        init_state_ids: one per group (G = group_size consecutive envs share it) or one per
        env; None draws one per group from a generator seeded by (seed, reset count).
        """
        self._check_open()
        plan = self.plan_reset(init_state_ids, group_size, seed)
        start = time.perf_counter()
        self._has_reset = False  # until every env has started its episode (a failed reset leaves some old ones)
        self._unrendered = None  # the reset renders every env
        self._reset_envs(plan)
        self._lost[:] = False
        self._has_reset = True
        self.last_reset_s = time.perf_counter() - start
        return self._obs()

    def step_chunk(self, actions: np.ndarray, render: bool = True) -> ChunkResult:
        """Execute actions (N, H, 7) open-loop in every env that is not done. render=False: skip the
        chunk-end camera render (the result's images are stale, its state current) until `render()`."""
        self._check_open()
        if not self._has_reset:
            raise RuntimeError("step_chunk() before reset() (or after a reset or chunk that failed): "
                               "call reset() first")
        if not render:
            self._check_deferrable()
        horizon = self.validate_actions(actions)
        buf = self._buffers
        buf["actions"][:, :horizon] = actions
        running = ~buf["done"]  # the envs this chunk steps
        self._unrendered = None  # a new chunk replaces what the last one left unrendered
        start = time.perf_counter()
        try:
            newly_lost = self._step_envs(horizon, render)
        except BaseException:
            # some envs ran the chunk and others did not (the sync twin stops at the failing env, the
            # workers stop at theirs): the episodes no longer line up, so only a reset may follow
            self._has_reset = False
            raise
        wall = time.perf_counter() - start
        if not render:
            self._unrendered = running & ~self._lost  # a worker lost in this chunk renders nothing
        result = self._result(horizon, wall, newly_lost)
        result.info["rendered"] = render
        return result

    def render(self, workers_at_once: int | None = None) -> dict[str, Any]:
        """Render the cameras the last `step_chunk(render=False)` skipped; afterwards the observations
        equal those of `step_chunk(actions)`. Nothing unrendered (a chunk that rendered, a second
        call): a cheap no-op. `workers_at_once`: worker processes rendering at the same time (waves;
        None: all), since every worker's GL context time-slices the one GPU with the others. Returns
        {"obs": as step_chunk's, "timing": {"wall_s", "render_s" (this render's seconds summed over
        envs), "busiest_worker_s"}, "done", "lost" (N,) bool and "lost_workers" (a worker lost while
        rendering loses its unrendered episodes, restart_on_crash)}."""
        self._check_open()
        if workers_at_once is not None:
            check_positive_int("workers_at_once", workers_at_once)
        if not self._has_reset:
            raise RuntimeError("render() before reset() (or after a reset, chunk or render that failed): "
                               "call reset() first")
        unrendered, self._unrendered = self._unrendered, None
        column = self._buffers["timing"][:, 1]  # each env's render seconds; 0 after a deferred chunk
        before = column.copy()
        start = time.perf_counter()
        newly_lost: list[dict] = []
        if unrendered is not None and unrendered.any():
            try:
                newly_lost = self._render_envs(unrendered, workers_at_once)
            except BaseException:
                self._has_reset = False  # some envs rendered and others did not: only a reset may follow
                raise
        wall = time.perf_counter() - start
        seconds = np.maximum(column - before, 0.0)  # a lost worker's rows were zeroed
        busy = [float(seconds[ids].sum()) for ids in self._worker_env_ids()]
        timing = {"wall_s": wall, "render_s": float(seconds.sum()), "busiest_worker_s": max(busy, default=0.0)}
        buf = self._buffers
        return {"obs": self._obs(), "timing": timing, "done": buf["done"].copy(), "lost": self._lost.copy(),
                "lost_workers": newly_lost}

    def close(self) -> None:
        """Stop workers and free shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_impl()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def reset_count(self) -> int:
        """Resets so far: episode seeds (and drawn init states) derive from (seed, reset count),
        so a trainer checkpoints it as the data position and sets it back to resume exactly."""
        return self._reset_count

    @reset_count.setter
    def reset_count(self, value: int) -> None:
        check_nonnegative_int("reset_count", value)
        self._reset_count = value

    # ------------------------------------------------------------------ shared helpers
    def plan_reset(
        self,
        init_state_ids: Sequence[int] | None,
        group_size: int | None,
        seed: int | None,
    ) -> list[tuple[int, int, int]]:
        """(env_id, init_state_id, episode_seed) for every env; validates groups and ids."""
        n = self.num_envs
        g = self.cfg.group_size if group_size is None else int(group_size)
        if g < 1 or n % g:
            raise ValueError(f"group_size must divide num_envs ({n}), got {group_size}")
        mixed = mixed_group(self.task_ids, g)
        if mixed is not None:
            start, tasks = mixed
            raise ValueError(
                f"group of envs {start}..{start + g - 1} mixes tasks {tasks}: "
                "a group must share one task (set env.task_ids per group)"
            )
        base_seed = self.cfg.seed if seed is None else int(seed)
        count = self._reset_count + 1  # committed only once the plan is valid: a refused reset draws nothing
        if init_state_ids is None:
            rng = np.random.default_rng([base_seed, count])
            per_group = [int(rng.integers(self.slots[s].num_init_states)) for s in range(0, n, g)]
            ids = [k for k in per_group for _ in range(g)]
        else:
            ids = [int(k) for k in np.asarray(init_state_ids).reshape(-1)]
            if len(ids) == n // g:
                ids = [k for k in ids for _ in range(g)]
            elif len(ids) != n:
                raise ValueError(
                    f"init_state_ids must have num_envs/group_size ({n // g}) or num_envs ({n}) "
                    f"entries, got {len(ids)}"
                )
        for i, k in enumerate(ids):
            if not 0 <= k < self.slots[i].num_init_states:
                raise ValueError(
                    f"env {i} ({self.slots[i].label}): init_state_id {k} out of range "
                    f"(0..{self.slots[i].num_init_states - 1})"
                )
        seeds = [
            int(np.random.SeedSequence([base_seed, count, i]).generate_state(1)[0])
            for i in range(n)
        ]
        self._reset_count = count
        self.init_state_ids[:] = ids
        self.episode_seeds[:] = seeds
        return [(i, ids[i], seeds[i]) for i in range(n)]

    def validate_actions(self, actions: Any) -> int:
        """Checks shape (N, H, 7), float dtype and finiteness; returns H."""
        n, max_h = self.num_envs, self.cfg.chunk_size
        if not isinstance(actions, np.ndarray):
            raise ValueError(f"actions must be a numpy array (N={n}, H, 7), got {type(actions).__name__}")
        if actions.dtype not in (np.float32, np.float64):
            raise ValueError(f"actions must be float32 or float64, got dtype {actions.dtype}")
        if actions.ndim != 3 or actions.shape[0] != n or actions.shape[2] != ACTION_DIM:
            raise ValueError(f"actions must have shape (N={n}, H, {ACTION_DIM}), got {actions.shape}")
        horizon = actions.shape[1]
        if not 1 <= horizon <= max_h:
            raise ValueError(
                f"actions chunk length H={horizon} must be in 1..env.chunk_size ({max_h})"
            )
        bad = first_non_finite(actions)
        if bad is not None:
            env, h, dim = bad
            raise ValueError(
                f"actions for env {env} ({self.slots[env].label}) are not finite: "
                f"value {actions[env, h, dim]} at sub-step {h}, dim {dim}"
            )
        return horizon

    def _obs(self) -> dict[str, Any]:
        buf = self._buffers
        obs: dict[str, Any] = {f"{c}_image": buf[f"{c}_image"] for c in self.cfg.cameras}
        obs["state"] = buf["state"]
        obs["prompt"] = list(self.prompts)
        return obs

    def _result(self, horizon: int, wall_s: float, newly_lost: Sequence[dict]) -> ChunkResult:
        buf = self._buffers
        timing = buf["timing"]
        info = {
            "elapsed_steps": buf["elapsed_steps"].copy(),
            "init_state_ids": self.init_state_ids.copy(),
            "task_ids": list(self.task_ids),
            "lost_workers": list(newly_lost),
            "timing": self._timing(timing, wall_s),
        }
        frames = None
        if self.cfg.render_every == "substep":
            frames = {c: buf[f"{c}_frames"][:, :horizon] for c in self.cfg.cameras}
        return ChunkResult(
            obs=self._obs(),
            rewards=buf["rewards"][:, :horizon].copy(),
            terminated=buf["terminated"][:, :horizon].copy(),
            truncated=buf["truncated"][:, :horizon].copy(),
            valid=buf["valid"][:, :horizon].copy(),
            success=buf["success"].copy(),
            done=buf["done"].copy(),
            lost=self._lost.copy(),
            frames=frames,
            info=info,
        )

    def _timing(self, per_env: np.ndarray, wall_s: float) -> dict[str, float]:
        """Physics and render seconds (summed over envs), the busiest worker's time, and the
        rest of the wall time (transfer and synchronisation)."""
        busy = [float(per_env[ids].sum()) for ids in self._worker_env_ids()]
        busiest = max(busy) if busy else 0.0
        return {
            "wall_s": wall_s,
            "physics_s": float(per_env[:, 0].sum()),
            "render_s": float(per_env[:, 1].sum()),
            "busiest_worker_s": busiest,
            "transfer_s": max(wall_s - busiest, 0.0),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vector env is closed")

    def _check_deferrable(self) -> None:
        """Refuses step_chunk(render=False) where there is no chunk-end render to defer."""
        if self.cfg.render_every == "substep":
            raise ValueError(deferral_refusal())

    # ------------------------------------------------------------------ subclass hooks
    def _worker_env_ids(self) -> list[list[int]]:
        raise NotImplementedError

    def _reset_envs(self, plan: list[tuple[int, int, int]]) -> None:
        raise NotImplementedError

    def _step_envs(self, horizon: int, render: bool = True) -> list[dict]:
        """Run the chunk (render=False: without the chunk-end render); returns one dict per worker lost
        during it (restart_on_crash)."""
        raise NotImplementedError

    def _render_envs(self, unrendered: np.ndarray, workers_at_once: int | None = None) -> list[dict]:
        """Render the envs a deferred chunk left unrendered ((N,) mask, some True), `workers_at_once`
        workers at a time (None: all); returns one dict per worker lost during it."""
        raise NotImplementedError

    def _close_impl(self) -> None:
        raise NotImplementedError
