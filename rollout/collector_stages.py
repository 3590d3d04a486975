"""Pipeline stages of the collector and the per-epoch plan (which init state each env starts in).

A stage is one vector env over its own envs [start, stop) of the collector's N envs, with its
own worker processes, its own profiler lane, and the state of its current episode (last
observation, done / lost masks, the env chunk in flight). With `defer_render` (render_at
before_predict) its chunks run physics only and `render` renders them on the caller's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.config import EnvConfig
from envs.vector import ChunkResult, VectorEnvBase, make_vector_env
from envs.vector.catalog import EnvSlot
from rollout.collector_config import CollectorConfig


def stage_env_configs(env_cfg: EnvConfig, cfg: CollectorConfig, slots: Sequence[EnvSlot]) -> list[EnvConfig]:
    """One EnvConfig per stage: its slice of the envs (tasks given per env), its workers."""
    cfg.check_against_env(env_cfg)
    per_stage = cfg.envs_per_stage(env_cfg)
    group = cfg.effective_group_size(env_cfg)
    cfg.check_group_tasks(env_cfg, [slot.task_id for slot in slots])
    configs = []
    for s in range(cfg.stages):
        tasks = [slot.task_id for slot in slots[s * per_stage:(s + 1) * per_stage]]
        configs.append(dataclasses.replace(
            env_cfg, num_envs=per_stage, num_workers=cfg.stage_workers(env_cfg),
            group_size=group, task_ids=tasks,
        ))
    return configs


def plan_init_states(
    slots: Sequence[EnvSlot],
    group_size: int,
    init_state_ids: Sequence[int] | np.ndarray | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Init state id of every env (N,): given per group (N / G entries) or per env (N), or
    drawn per group from `rng`. Envs of a group always share one (GRPO compares them)."""
    n = len(slots)
    if init_state_ids is None:
        per_group = [int(rng.integers(slots[start].num_init_states)) for start in range(0, n, group_size)]
        ids = np.repeat(np.asarray(per_group, dtype=np.int64), group_size)
    else:
        given = np.asarray(init_state_ids, dtype=np.int64).reshape(-1)
        if len(given) == n // group_size:
            ids = np.repeat(given, group_size)
        elif len(given) == n:
            ids = given.copy()
            mixed = [g for g in range(n // group_size) if len(set(ids[g * group_size:(g + 1) * group_size])) > 1]
            if mixed:  # a GRPO group compares attempts from one init state: per-env ids must agree in it
                g = mixed[0]
                raise ValueError(
                    f"init_state_ids: group {g} (envs {g * group_size}..{(g + 1) * group_size - 1}) gets init states "
                    f"{ids[g * group_size:(g + 1) * group_size].tolist()}; the envs of a group must share one")
        else:
            raise ValueError(
                f"init_state_ids must have num_envs / group_size ({n // group_size}) or num_envs ({n}) "
                f"entries, got {len(given)}"
            )
    for i, k in enumerate(ids):
        if not 0 <= k < slots[i].num_init_states:
            raise ValueError(
                f"init_state_ids: env {i} ({slots[i].label}) gets init state {k}, out of range "
                f"(0..{slots[i].num_init_states - 1})"
            )
    return ids


def stage_seed(seed: int, stage: int) -> int:
    """The env seed of one stage: each vector env derives its envs' episode seeds from its own
    numbering (0..n-1), so stages need different seeds or env i of every stage would share one."""
    return int(np.random.SeedSequence([seed, stage]).generate_state(1)[0])


@dataclass
class StageChunk:
    """One env chunk of a stage in flight: which rows were predicted, the future result."""

    chunk: int
    rows: np.ndarray  # local row indices that were active (predicted and stepped)
    future: Future
    finished_at: list[float] = field(default_factory=list)  # perf_counter when the env returned


class Stage:
    """One pipeline stage: a vector env over envs [start, stop) and its episode state."""

    def __init__(self, index: int, start: int, env_cfg: EnvConfig, in_process: bool, lane: Any,
                 defer_render: bool = False, render_workers_at_once: int | None = None):
        self.index = index
        self.start = start
        self.stop = start + env_cfg.num_envs
        self.lane = lane
        self.defer_render = defer_render
        self.render_workers_at_once = render_workers_at_once
        with self.numbering_note():
            self.vec: VectorEnvBase = make_vector_env(env_cfg, in_process=in_process)
        self.vec.numbering_note = self._numbering()
        self.obs: dict[str, Any] | None = None
        self.done = np.zeros(env_cfg.num_envs, dtype=bool)
        self.lost = np.zeros(env_cfg.num_envs, dtype=bool)
        self.pending: StageChunk | None = None

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def rows(self) -> slice:
        """This stage's envs in the collector's numbering."""
        return slice(self.start, self.stop)

    def active_rows(self) -> np.ndarray:
        return np.flatnonzero(~self.done)

    def reset(self, init_state_ids: np.ndarray, group_size: int, seed: int) -> None:
        """init_state_ids: one per env of the collector; seed: the epoch's (stage_seed applied here)."""
        with self.numbering_note():
            self.obs = self.vec.reset(init_state_ids[self.rows], group_size=group_size,
                                      seed=stage_seed(seed, self.index))
        self.done[:] = False
        self.lost[:] = False
        self.pending = None

    def step(self, actions: np.ndarray, chunk: int, step: int | None, finished_at: list[float]) -> ChunkResult:
        """Runs in the collector's thread pool: waits on this stage's worker processes."""
        attrs = {"stage": self.index, "chunk": chunk}
        if step is not None:
            attrs["step"] = step
        with self.lane.span("rollout/env_step", **attrs), self.numbering_note():
            result = self.vec.step_chunk(actions, render=not self.defer_render)
        finished_at.append(time.perf_counter())
        return result

    def render(self, result: ChunkResult, timeline: Any, attrs: dict[str, Any]) -> float:
        """Render what a deferred chunk left unrendered, on the calling (driver) thread and its
        `timeline` (span rollout/render keyed by the env chunk, so the profiler's pipeline model puts
        it on the env side before the next predict); `result` gets the rendered observations and
        any env lost meanwhile. Returns the render's wall seconds."""
        start = time.perf_counter()
        with timeline.span("rollout/render", **attrs), self.numbering_note():
            rendered = self.vec.render(self.render_workers_at_once)
        result.obs = rendered["obs"]
        result.lost = result.lost | rendered["lost"]  # a worker lost while rendering (restart_on_crash)
        result.done = result.done | rendered["done"]
        return time.perf_counter() - start

    @contextlib.contextmanager
    def numbering_note(self) -> Iterator[None]:
        """The stage's vector env names envs and workers in its own numbering (its env 0 is the
        collector's env `start`; every stage has a worker 0): its errors get a note saying so."""
        try:
            yield
        except Exception as exc:
            exc.add_note(self._numbering())
            raise

    def _numbering(self) -> str:
        return (f"in rollout stage {self.index} (its own vector env and workers): env i of the stage is "
                f"the collector's env {self.start} + i (envs {self.start}..{self.stop - 1})")

    def close(self) -> None:
        self.vec.close()
