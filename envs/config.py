"""Typed configuration of the LIBERO harness (Hydra group `env`, conf/env/*.yaml).

`EnvConfig` is a Hydra structured config: every field has a type and a default, and
`__post_init__` checks values and cross-field rules with errors naming the key
("env.num_envs must be a multiple of env.group_size (8), got 12"). Build it from a Hydra
node with `EnvConfig.from_mapping(cfg.env)`, which rejects unknown keys by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    check_bool,
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    expand_task_ids,
    reject_unknown_keys,
    to_container,
)
from envs.suites import DEFAULT_MAX_EPISODE_STEPS, SUITES

# Camera names in the config (and in observation keys "<name>_image") -> robosuite cameras.
CAMERA_ALIASES = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}
RENDER_EVERY = ("chunk_end", "substep")
RENDER_BACKENDS = ("auto", "egl", "osmesa", "glfw")
START_METHODS = ("spawn", "forkserver")  # never "fork": forking after GL deadlocks
# countdown: envs/testing.py; reach: envs/reach.py; worldmodel: envs/worldmodel_env.py (a learned simulator)
ENV_TYPES = ("libero", "countdown", "reach", "worldmodel")
REACH_MAX_EPISODE_STEPS = 40  # horizon of env_type "reach" when max_episode_steps is None
WORLDMODEL_MAX_EPISODE_STEPS = 40  # horizon of env_type "worldmodel" when max_episode_steps is None
STEP_MODES = ("robosuite", "lean")


def robosuite_camera(alias: str) -> str:
    """The robosuite camera for a config camera name (robosuite names pass through)."""
    return CAMERA_ALIASES.get(alias, alias)


@dataclass
class EnvConfig:
    """One vectorized LIBERO env: which tasks, how many envs, workers, cameras, horizons."""

    suite: str = "libero_10"
    # Task per group (len = num_envs // group_size), per env (len = num_envs) or one for all
    # (len 1). None: group g runs task g % num_tasks, so a suite's tasks share one vector env.
    task_ids: list[int] | None = None
    num_envs: int = 4
    group_size: int = 1  # G consecutive envs share one init state at reset (GRPO groups)
    num_workers: int = 2
    image_size: int = 128
    cameras: list[str] = field(default_factory=lambda: ["agentview", "wrist"])
    render_every: str = "chunk_end"  # or "substep": also return every sub-step's frames
    chunk_size: int = 10  # largest H accepted by step_chunk (sizes the shared result buffers)
    max_episode_steps: int | None = None  # None -> the suite's openpi default
    num_settle_steps: int = 10  # no-op steps (zeros, gripper -1) after set_init_state
    render_backend: str = "auto"  # auto: egl where a GPU is usable, osmesa otherwise
    # Opt-in cheaper renders that change pixels (envs/render_options.py; env_type libero only):
    # MuJoCo's reflection passes off, and the offscreen multisample count (None: the scene's, 4)
    render_reflections: bool = True
    render_multisamples: int | None = None
    # draw each camera mesh with at most this many faces (envs/render_lod.py; physics keeps the full
    # meshes): fewer triangles for the H100's few graphics units. None: LIBERO's full meshes
    render_mesh_faces: int | None = None
    # leave geoms outside a camera's view out of its render (envs/render_culling.py): the same pixels,
    # fewer triangles. None: on under OSMesa (CPU rasterisation: 10-20% faster), off under EGL (no GPU
    # time saved on the H100, ~0.3 ms of Python a camera). env_type libero only (the others ignore it)
    render_culling: bool | None = None
    step_mode: str = "lean"  # envs.lean.LeanStepper (bit-identical to robosuite's step), or "robosuite"
    seed: int = 0
    restart_on_crash: bool = False
    worker_timeout_s: float = 300.0  # a worker silent this long on a command is declared hung
    create_timeout_s: float = 900.0  # per worker, for creating all of its envs
    start_method: str = "spawn"
    # niceness added to env worker processes: the driver (policy predict, CUDA launches) keeps
    # its core when the workers oversubscribe the machine (env steps are throughput work)
    worker_nice: int = 5
    env_type: str = "libero"
    show_progress: bool = True
    # env_type "worldmodel" only: model / serve / init-frame settings (worldmodels/env_config.py)
    worldmodel: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_choice("env.suite", self.suite, SUITES)
        check_choice("env.render_every", self.render_every, RENDER_EVERY)
        check_choice("env.render_backend", self.render_backend, RENDER_BACKENDS)
        check_choice("env.start_method", self.start_method, START_METHODS)
        check_choice("env.env_type", self.env_type, ENV_TYPES)
        check_choice("env.step_mode", self.step_mode, STEP_MODES)
        for key in ("num_envs", "group_size", "num_workers", "image_size", "chunk_size"):
            check_positive_int(f"env.{key}", getattr(self, key))
        check_nonnegative_int("env.num_settle_steps", self.num_settle_steps)
        check_nonnegative_int("env.worker_nice", self.worker_nice)
        if self.worker_nice > 19:
            raise ValueError(f"env.worker_nice must be in 0..19 (added to the workers' niceness), "
                             f"got {self.worker_nice}")
        check_nonnegative_int("env.seed", self.seed)
        if self.max_episode_steps is not None:
            check_positive_int("env.max_episode_steps", self.max_episode_steps)
        for key in ("worker_timeout_s", "create_timeout_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"env.{key} must be a positive number of seconds, got {value!r}")
        if self.num_envs % self.group_size:
            raise ValueError(
                f"env.num_envs must be a multiple of env.group_size ({self.group_size}), "
                f"got {self.num_envs}"
            )
        if self.num_workers > self.num_envs:
            raise ValueError(
                f"env.num_workers ({self.num_workers}) must not exceed env.num_envs ({self.num_envs})"
            )
        self.cameras = list(self.cameras)
        if len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"env.cameras has duplicates: {self.cameras}")
        for camera in self.cameras:
            if not isinstance(camera, str) or not camera:
                raise ValueError(f"env.cameras entries must be camera names, got {camera!r}")
        if self.task_ids is not None:
            self.task_ids = [int(t) for t in self.task_ids]
            allowed = {1, self.num_envs, self.num_groups}
            if len(self.task_ids) not in allowed:
                raise ValueError(
                    f"env.task_ids must have 1, num_groups ({self.num_groups}) or num_envs "
                    f"({self.num_envs}) entries, got {len(self.task_ids)}"
                )
            for task_id in self.task_ids:
                if task_id < 0:
                    raise ValueError(f"env.task_ids entries must be >= 0, got {task_id}")
        self._check_render_options()
        self._check_worldmodel()

    def _check_render_options(self) -> None:
        check_bool("env.render_reflections", self.render_reflections)
        if self.render_culling is not None and not isinstance(self.render_culling, bool):
            raise ValueError(f"env.render_culling must be true, false or null (on under OSMesa only), "
                             f"got {self.render_culling!r}")
        if self.render_multisamples is not None:
            check_nonnegative_int("env.render_multisamples", self.render_multisamples)
        if self.render_mesh_faces is not None:
            check_positive_int("env.render_mesh_faces", self.render_mesh_faces)
        cheaper = (not self.render_reflections or self.render_multisamples is not None
                   or self.render_mesh_faces is not None)
        if cheaper and self.env_type != "libero":
            raise ValueError(
                f"env.render_reflections / env.render_multisamples / env.render_mesh_faces apply to env_type "
                f"'libero' only, got "
                f"env_type {self.env_type!r} (reach renders its own cheap scene; countdown and worldmodel "
                "have no MuJoCo cameras)")

    def _check_worldmodel(self) -> None:
        """`worldmodel` belongs to env_type worldmodel; its keys are validated by the world model's
        own schema now, so a bad key stops at start (the import stays lazy: LIBERO runs never pay it)."""
        if self.env_type != "worldmodel":
            if self.worldmodel is not None:
                raise ValueError(f"env.worldmodel is set but env.env_type is {self.env_type!r}; "
                                 "it applies to env_type 'worldmodel' only")
            return
        from worldmodels.env_config import WorldModelEnvConfig

        WorldModelEnvConfig.from_mapping(self.to_dict())

    @property
    def num_groups(self) -> int:
        return self.num_envs // self.group_size

    @property
    def episode_steps(self) -> int:
        """The horizon in use: max_episode_steps, or the suite's default."""
        if self.max_episode_steps is not None:
            return self.max_episode_steps
        if self.env_type == "reach":  # the suite names LIBERO suites only
            return REACH_MAX_EPISODE_STEPS
        if self.env_type == "worldmodel":
            return WORLDMODEL_MAX_EPISODE_STEPS
        return DEFAULT_MAX_EPISODE_STEPS[self.suite]

    @property
    def robosuite_cameras(self) -> tuple[str, ...]:
        return tuple(robosuite_camera(c) for c in self.cameras)

    def env_task_ids(self, num_tasks: int) -> list[int]:
        """Task id of every env, validated against the suite's task count."""
        source = self.suite if self.env_type == "libero" else self.env_type
        return expand_task_ids(self.task_ids, self.num_envs, self.group_size, num_tasks, source)

    def worker_env_ids(self) -> list[list[int]]:
        """Contiguous, balanced split of env indices over workers."""
        base, extra = divmod(self.num_envs, self.num_workers)
        out, start = [], 0
        for w in range(self.num_workers):
            count = base + (1 if w < extra else 0)
            out.append(list(range(start, start + count)))
            start += count
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, **overrides: Any) -> EnvConfig:
        """Build from a dict or OmegaConf node; unknown keys raise naming the key."""
        data = dict(to_container(mapping) if mapping is not None else {})
        data.update(overrides)
        return cls(**reject_unknown_keys(cls, data, "env", "env config"))






HYDRA_SCHEMA_NAME = "env_schema"


def register_hydra_schema() -> None:
    """Store EnvConfig as the typed schema `env/env_schema` that conf/env/*.yaml extend.

    Call before `@hydra.main` runs (entry points do it at import): Hydra then rejects unknown
    keys and wrongly typed values under `env.` while composing.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="env", name=HYDRA_SCHEMA_NAME, node=EnvConfig)


def mixed_group(task_ids: Sequence[int], group_size: int) -> tuple[int, list[int]] | None:
    """The first group of `group_size` consecutive envs that runs more than one task, as (its first
    env, its sorted tasks), or None: a GRPO group must share one task."""
    for start in range(0, len(task_ids), group_size):
        tasks = sorted(set(task_ids[start:start + group_size]))
        if len(tasks) > 1:
            return start, tasks
    return None
