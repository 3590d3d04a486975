"""Typed configuration of the rollout collector (Hydra key `collector`), validated on creation.

Errors name the full key and the bad value ("rollout.collector.stages must be a positive
integer, got 0"). Checks that need the env config (stages dividing the envs, groups not
straddling stages) run in `check_against_env`, called by the collector.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.config import (
    check_bool,
    check_choice,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    reject_unknown_keys,
)
from envs.config import EnvConfig, mixed_group

PREFIX = "rollout.collector"
RENDER_AT = ("env_step", "before_predict")


@dataclass
class CollectorConfig:
    """How rollout epochs are run.

    stages: S pipeline stages. The envs are split into S vector envs; stage i's envs step (in
        their worker processes) while the engine predicts stage i+1. 1 = no pipelining.
    workers_per_stage: worker processes of each stage's vector env. None: env.num_workers for
        every stage (capped at the stage's env count), so S stages run S * num_workers
        processes on the machine's cores: while one stage waits for its prediction, the
        other stages' workers use the cores it leaves idle. Set env.num_workers // stages for
        disjoint cores (then each stage's cores idle during its own predict).
    max_chunks: chunks per epoch; None: ceil(env.episode_steps / env.chunk_size), so every
        episode ends (success or truncation) within the epoch.
    group_size: envs sharing an init state (GRPO group); None: env.group_size.
    in_process: each stage's vector env in this process (SyncVectorEnv; tests, debugging).
    action_clip: actions are clipped to [-action_clip, action_clip] before the env (and
        recorded clipped). The LIBERO and reach envs clip to [-1, 1] again (robosuite's
        controller does), so above 1 a recorded action can exceed the executed one.
    predict_done_envs: also predict rows whose episode ended (wasted compute; keeps the batch
        size constant per stage, as RLinf does).
    record_images: store the observation images in the RolloutBatch (the trainer's log-prob
        recompute needs them; off only for evaluation).
    seed: draws the init states when collect() gets none (with the epoch counter).
    render_at: when a stage's cameras render. "env_step": in its env workers at the end of each
        chunk, while the engine predicts the next stage (EGL rendering then shares the GPU with
        that predict). "before_predict": the workers run only the chunk's physics; the driver
        renders the stage (`vec.render()`, span rollout/render) after the previous stage's predict
        has returned, just before predicting this one. Same batch either way, bit for bit; only
        when rendering happens moves. Needs env.render_every="chunk_end".
    render_workers_at_once: with before_predict, how many of a stage's workers render at the same
        time (waves; None: all): each worker's GL contexts time-slice the GPU with the others'.
    driver_torch_threads: torch's intra-op threads in the driver while an epoch runs (restored after
        it): an inproc engine predicts there beside the busy env workers (one thread measured ~7% more
        env steps/s on an H100). None leaves the process's setting.
    """

    stages: int = 2
    workers_per_stage: int | None = None
    max_chunks: int | None = None
    group_size: int | None = None
    in_process: bool = False
    action_clip: float = 1.0
    predict_done_envs: bool = False
    record_images: bool = True
    seed: int = 0
    render_at: str = "env_step"
    render_workers_at_once: int | None = None
    driver_torch_threads: int | None = 1

    def __post_init__(self) -> None:
        check_positive_int(f"{PREFIX}.stages", self.stages)
        for key in ("workers_per_stage", "max_chunks", "group_size", "render_workers_at_once", "driver_torch_threads"):
            value = getattr(self, key)
            if value is not None:
                check_positive_int(f"{PREFIX}.{key}", value)
        check_positive_float(f"{PREFIX}.action_clip", self.action_clip)
        check_nonnegative_int(f"{PREFIX}.seed", self.seed)
        for key in ("in_process", "predict_done_envs", "record_images"):
            check_bool(f"{PREFIX}.{key}", getattr(self, key))
        check_choice(f"{PREFIX}.render_at", self.render_at, RENDER_AT)
        if self.render_workers_at_once is not None and self.render_at != "before_predict":
            raise ValueError(f"{PREFIX}.render_workers_at_once ({self.render_workers_at_once}) applies to "
                             f'render_at="before_predict" only (render_at is {self.render_at!r}: the workers '
                             "render at their chunk's end); set it to null or render_at to before_predict")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, key: str = PREFIX, **overrides: Any
                     ) -> CollectorConfig:
        """Build from a dict or OmegaConf node (e.g. cfg.rollout.collector); unknown keys and bad
        values raise naming `key.<field>`."""
        data = dict(reject_unknown_keys(cls, mapping or {}, key, "collector config"))
        data.update(overrides)
        try:
            return cls(**data)
        except ValueError as exc:
            if key == PREFIX:
                raise
            raise ValueError(str(exc).replace(PREFIX, key)) from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ derived from the env
    def effective_group_size(self, env_cfg: EnvConfig) -> int:
        return env_cfg.group_size if self.group_size is None else self.group_size

    def effective_max_chunks(self, env_cfg: EnvConfig) -> int:
        if self.max_chunks is not None:
            return self.max_chunks
        return math.ceil(env_cfg.episode_steps / env_cfg.chunk_size)

    def envs_per_stage(self, env_cfg: EnvConfig) -> int:
        return env_cfg.num_envs // self.stages

    def stage_workers(self, env_cfg: EnvConfig) -> int:
        wanted = env_cfg.num_workers if self.workers_per_stage is None else self.workers_per_stage
        return min(wanted, self.envs_per_stage(env_cfg))

    def check_against_env(self, env_cfg: EnvConfig) -> None:
        """Stages must split the envs evenly, and no GRPO group may straddle two stages; render_at
        before_predict defers the chunk-end render, which per-sub-step rendering does not have."""
        if self.render_at == "before_predict" and env_cfg.render_every != "chunk_end":
            raise ValueError(f'{PREFIX}.render_at="before_predict" defers the chunk-end render: it needs '
                             f'env.render_every="chunk_end", got {env_cfg.render_every!r}')
        if self.render_at == "before_predict" and env_cfg.env_type == "worldmodel":  # refused here, not at chunk 0
            raise ValueError(f'{PREFIX}.render_at="before_predict" defers the chunk-end render, but env_type '
                             '"worldmodel" has no renderer (its frames are the model\'s output): use "env_step"')
        n, s = env_cfg.num_envs, self.stages
        if n % s:
            raise ValueError(f"{PREFIX}.stages ({s}) must divide env.num_envs ({n})")
        g = self.effective_group_size(env_cfg)
        if n % g:
            raise ValueError(f"{PREFIX}.group_size ({g}) must divide env.num_envs ({n})")
        if (n // s) % g:
            raise ValueError(
                f"each of the {s} stages ({PREFIX}.stages) holds {n // s} envs, not a multiple of the "
                f"group size {g}: a GRPO group would straddle two stages"
            )

    def check_group_tasks(self, env_cfg: EnvConfig, task_ids: Sequence[int]) -> None:
        """Every GRPO group must run one task (`task_ids`: one per env). Checked when the collector is
        built and by the run config: otherwise the first reset, after every worker has built its envs,
        refuses the layout without naming the collector key that made it."""
        group_size = self.effective_group_size(env_cfg)
        mixed = mixed_group(task_ids, group_size)
        if mixed is not None:
            start, tasks = mixed
            key = f"{PREFIX}.group_size" if self.group_size is not None else "env.group_size"
            raise ValueError(
                f"{key} ({group_size}) puts envs {start}..{start + group_size - 1}, which run tasks {tasks}, in "
                "one GRPO group; a group must share one task (env.task_ids assigns tasks per env.group_size "
                "envs: use a collector group size that divides env.group_size, or give env.task_ids per group)"
            )
