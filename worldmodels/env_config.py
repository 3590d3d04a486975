"""Typed configuration of the world-model vector env (envs/worldmodel_env.py).

The top-level keys are EnvConfig's (envs/config.py) with the same meaning, so the collector and
GRPO can treat both alike; everything specific to the world model sits under `worldmodel`:

    env_type: worldmodel
    num_envs: 8
    group_size: 4
    image_size: 32            # per camera; the model's frame tiles the cameras side by side
    cameras: [agentview, wrist]
    chunk_size: 10            # <= the model's frames_per_chunk x actions_per_frame (12)
    max_episode_steps: 40
    worldmodel:
      model: {preset: tiny}   # WorldModelConfig (height/width follow image_size and cameras)
      serve: {}               # ServeConfig (rings default to [[device]], max_streams to num_envs,
                              # max_batch to at least the streams one ring serves)
      device: cpu
      num_tasks: 4            # context tables (one learned context per task) and prompts
      num_init_states: 8
      init_frames: null       # .npz with "<camera>_image" (tasks, inits, S, S, 3) uint8 (optionally
                              # "state" (tasks, inits, 8), "prompts" (tasks,)); null: synthetic frames
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    expand_task_ids,
    reject_unknown_keys,
    to_container,
)
from worldmodels.config import WorldModelConfig
from worldmodels.serve_config import ServeConfig

RENDER_EVERY = ("chunk_end", "substep")


@dataclass
class WorldModelSettings:
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    serve: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    num_tasks: int = 4
    num_init_states: int = 8
    init_frames: str | None = None


@dataclass
class WorldModelEnvConfig:
    env_type: str = "worldmodel"
    suite: str = "worldmodel"  # kept for EnvConfig-shaped code; names nothing here
    task_ids: list[int] | None = None
    num_envs: int = 4
    group_size: int = 1
    num_workers: int = 1  # EnvConfig's key; the world model runs in this process
    image_size: int = 32
    cameras: list[str] = field(default_factory=lambda: ["agentview", "wrist"])
    render_every: str = "chunk_end"
    chunk_size: int = 10
    max_episode_steps: int | None = 40
    seed: int = 0
    show_progress: bool = False
    worldmodel: WorldModelSettings = field(default_factory=WorldModelSettings)

    def __post_init__(self) -> None:
        if isinstance(self.worldmodel, Mapping):
            self.worldmodel = WorldModelSettings(
                **reject_unknown_keys(WorldModelSettings, self.worldmodel, "env.worldmodel", "world-model env config"))
        for key, example in (("model", "{preset: tiny}"), ("serve", "{}")):  # dict() of a name or null failed unnamed
            value = getattr(self.worldmodel, key)
            if not isinstance(value, Mapping):
                raise ValueError(f"env.worldmodel.{key} must be a mapping of keys (e.g. {example}), got {value!r}")
        check_choice("env.env_type", self.env_type, ("worldmodel",))
        check_choice("env.render_every", self.render_every, RENDER_EVERY)
        for key in ("num_envs", "group_size", "image_size", "chunk_size", "num_workers"):
            check_positive_int(f"env.{key}", getattr(self, key))
        check_nonnegative_int("env.seed", self.seed)
        if self.max_episode_steps is None:
            self.max_episode_steps = 40
        check_positive_int("env.max_episode_steps", self.max_episode_steps)
        for key in ("num_tasks", "num_init_states"):
            check_positive_int(f"env.worldmodel.{key}", getattr(self.worldmodel, key))
        if self.num_envs % self.group_size:
            raise ValueError(
                f"env.num_envs must be a multiple of env.group_size ({self.group_size}), got {self.num_envs}")
        self.cameras = list(self.cameras)
        if not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"env.cameras must be distinct camera names, got {self.cameras}")
        if self.task_ids is not None:
            self.task_ids = [int(t) for t in self.task_ids]
            if len(self.task_ids) not in {1, self.num_envs, self.num_groups}:
                raise ValueError(f"env.task_ids must have 1, num_groups ({self.num_groups}) or num_envs "
                                 f"({self.num_envs}) entries, got {len(self.task_ids)}")
        model = self.model_config()  # validates the model keys now, with their names
        if self.chunk_size > model.chunk_actions:
            raise ValueError(f"env.chunk_size ({self.chunk_size}) exceeds what one world-model chunk covers "
                             f"({model.chunk_actions} = frames_per_chunk x dit.actions_per_frame)")
        if self.chunk_size > model.video_frames_per_chunk:  # sub-step h's observation is the chunk's video frame h
            raise ValueError(f"env.chunk_size ({self.chunk_size}) exceeds the video frames one world-model chunk "
                             f"decodes ({model.video_frames_per_chunk} = frames_per_chunk x vae.stride[0])")
        self._check_frame_size(model)
        self._check_episode_fits(model)
        self._check_streams_fit(model, self.serve_config())  # validates the serve keys now too

    def _check_frame_size(self, model: WorldModelConfig) -> None:
        """The model's frame is the cameras side by side: an overridden height / width would only fail at reset,
        when the encoded first frames do not have the model's latent shape."""
        want = {"height": self.image_size, "width": self.image_size * len(self.cameras)}
        for key, value in want.items():
            if getattr(model, key) != value:
                raise ValueError(
                    f"env.worldmodel.model.{key} ({getattr(model, key)}) must be {value}: the model's frame is the "
                    f"{len(self.cameras)} camera(s) of env.image_size ({self.image_size}) side by side (leave it unset)"
                )

    def _check_episode_fits(self, model: WorldModelConfig) -> None:
        """An episode's chunks must fit a stream's RoPE table, or the env fails mid-episode (at the server's
        submit). Counted in chunks of chunk_size actions, the collector's; shorter chunks need more."""
        chunks = -(-self.max_episode_steps // self.chunk_size)
        if chunks > model.max_chunks:
            raise ValueError(
                f"env.max_episode_steps ({self.max_episode_steps}) takes {chunks} chunks of env.chunk_size "
                f"({self.chunk_size}) actions, past the {model.max_chunks} a world-model stream holds "
                f"(env.worldmodel.model.dit.max_frames ({model.dit.max_frames}) // frames_per_chunk "
                f"({model.frames_per_chunk}), less the context chunk): lower env.max_episode_steps or raise "
                f"env.worldmodel.model.dit.max_frames")

    def _check_streams_fit(self, model: WorldModelConfig, serve: ServeConfig) -> None:
        """Every env holds a stream: the server must admit num_envs of them, or reset fails on the first env
        past its limits. Admission fills the least-loaded ring, so each ring serves ceil(num_envs / rings)."""
        rings = len(serve.rings)
        per_ring = -(-self.num_envs // rings)
        if per_ring > serve.max_batch:
            raise ValueError(
                f"env.worldmodel.serve.max_batch ({serve.max_batch}) x {rings} ring(s) admits fewer streams than "
                f"env.num_envs ({self.num_envs}; {per_ring} a ring): raise serve.max_batch or add rings")
        pages = model.kv_pages_per_stream()
        capacity = serve.kv_pages_per_stage or serve.max_streams * pages
        if per_ring * pages > capacity:
            raise ValueError(
                f"env.worldmodel.serve KV pools hold {capacity // pages} streams a stage ({capacity} pages: "
                f"kv_pages_per_stage, or max_streams x {pages}), fewer than env.num_envs ({self.num_envs}; "
                f"{per_ring} a ring): raise serve.max_streams or serve.kv_pages_per_stage")

    @property
    def num_groups(self) -> int:
        return self.num_envs // self.group_size

    @property
    def episode_steps(self) -> int:
        return int(self.max_episode_steps)

    def model_config(self) -> WorldModelConfig:
        """The world model: the frame is the cameras side by side; one context per task."""
        overrides = dict(self.worldmodel.model)
        overrides.setdefault("height", self.image_size)
        overrides.setdefault("width", self.image_size * len(self.cameras))
        dit = dict(overrides.pop("dit", {}) or {})
        dit.setdefault("num_contexts", self.worldmodel.num_tasks)
        with _keys_under("worldmodel", "env.worldmodel.model"):
            return WorldModelConfig.from_mapping(overrides, dit=dit)

    def serve_config(self) -> ServeConfig:
        data = dict(self.worldmodel.serve)
        data.setdefault("rings", [[self.worldmodel.device]])
        data.setdefault("max_streams", self.num_envs)
        # a ring admits at most max_batch streams: never fewer than it serves here (ServeConfig's 64 at least)
        per_ring = -(-self.num_envs // max(len(data["rings"]), 1))
        data.setdefault("max_batch", max(ServeConfig.max_batch, per_ring))
        with _keys_under("serve", "env.worldmodel.serve"):
            return ServeConfig.from_mapping(data)

    def env_task_ids(self) -> list[int]:
        return expand_task_ids(self.task_ids, self.num_envs, self.group_size, self.worldmodel.num_tasks,
                               "the world model")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | Any | None = None, **overrides: Any) -> WorldModelEnvConfig:
        """From a dict, an OmegaConf node or an EnvConfig-like object (its fields, `worldmodel` a mapping)."""
        if mapping is not None and dataclasses.is_dataclass(mapping):
            mapping = dataclasses.asdict(mapping)
        data = dict(to_container(mapping) if mapping is not None else {})
        data.update(overrides)
        data = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)} or k not in _ENV_ONLY}
        return cls(**reject_unknown_keys(cls, data, "env", "world-model env config"))


# EnvConfig keys that mean nothing for the world model (dropped when building from an EnvConfig)
_ENV_ONLY = {"num_settle_steps", "render_backend", "step_mode", "restart_on_crash", "worker_timeout_s",
             "create_timeout_s", "start_method", "worker_nice", "render_reflections", "render_multisamples",
             "render_culling", "render_mesh_faces"}


@contextlib.contextmanager
def _keys_under(own: str, full: str) -> Iterator[None]:
    """The model and serve configs name their keys from their own root (`worldmodel.dit.width`,
    `serve.rings`), as `bench_worldmodel` spells them; inside an env config they live under
    `env.worldmodel.model` / `env.worldmodel.serve`: errors name the keys as the env's YAML spells them."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(re.sub(rf"(?<![\w.]){own}\.", f"{full}.", str(exc))) from None
