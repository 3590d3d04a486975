"""Typed profiler and logger configs (Hydra groups `profiler` and `logger`), validated on creation.

Errors name the key and the bad value, e.g.
"profiler.gpu_timing must be one of ['none', 'sync', 'cuda_event'], got 'cuda'".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

GPU_TIMING_MODES = ("none", "sync", "cuda_event")
EXPORTS = ("json", "console", "perfetto", "png", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
DEFAULT_SPEEDUPS = (1.5, 2.0, 2.55, 4.0, math.inf)


@dataclass
class WandbConfig:
    """Where the wandb run goes. Offline by default: no network, files under `dir`.

    `dir=None` means the run directory (wandb then writes `<run_dir>/wandb/offline-run-*`).
    """

    mode: str = "offline"
    project: str = "vla-rollout"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    dir: str | None = None

    def __post_init__(self) -> None:
        _check_choice("logger.mode", self.mode, WANDB_MODES)
        if not isinstance(self.project, str) or not self.project:
            raise ValueError(f"logger.project must be a non-empty string, got {self.project!r}")
        self.tags = [str(t) for t in _as_list("logger.tags", self.tags)]


@dataclass
class ProfilerConfig:
    """Step-timeline profiler settings.

    enabled: False turns every span into a shared no-op object (nothing recorded, no files).
    gpu_timing: how spans opened with `gpu=True` are timed: "none" (CPU clock only),
        "sync" (torch.cuda.synchronize before reading the clock at both ends),
        "cuda_event" (CUDA events, resolved at flush; no synchronize on the hot path).
    out_dir: the run directory; spans go to `<out_dir>/trace/`, exports to `<out_dir>/profile/`.
    exports: any of json, console, perfetto, png, wandb.
    amdahl_targets / speedups: which phases the projection tables cover and at which speed-ups.
    predict_speedup: a measured (or given) predict speed-up shown in the PhyAI-style section.
    control_budget_s: control-loop budget per chunk (chunk length / control rate) for the
        control-margin distribution.
    """

    enabled: bool = True
    gpu_timing: str = "none"
    out_dir: str = "."
    exports: list[str] = field(default_factory=lambda: ["json", "console", "perfetto", "png", "wandb"])
    flush_every: int = 1024
    predict_name: str = "rollout/predict"
    rollout_name: str = "rollout"
    amdahl_targets: list[str] = field(
        default_factory=lambda: ["rollout/predict", "rollout/env_step", "actor_train"]
    )
    speedups: list[float] = field(default_factory=lambda: list(DEFAULT_SPEEDUPS))
    predict_speedup: float | None = None
    control_budget_s: float | None = None
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        if isinstance(self.wandb, Mapping):
            self.wandb = config_from_dict(WandbConfig, self.wandb, "profiler.wandb")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"profiler.enabled must be true or false, got {self.enabled!r}")
        _check_choice("profiler.gpu_timing", self.gpu_timing, GPU_TIMING_MODES)
        self.exports = _as_list("profiler.exports", self.exports)
        for name in self.exports:
            _check_choice("profiler.exports[]", name, EXPORTS)
        if not isinstance(self.flush_every, int) or self.flush_every < 1:
            raise ValueError(f"profiler.flush_every must be an integer >= 1, got {self.flush_every!r}")
        self.speedups = [_as_float("profiler.speedups entries", s)
                         for s in _as_list("profiler.speedups", self.speedups)]
        for s in self.speedups:
            if not s >= 1.0:
                raise ValueError(f"profiler.speedups entries must be >= 1 (or .inf), got {s!r}")
        for key in ("predict_speedup", "control_budget_s"):
            value = getattr(self, key)
            if value is not None and not float(value) > 0:
                raise ValueError(f"profiler.{key} must be > 0 or null, got {value!r}")
        for key in ("predict_name", "rollout_name"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"profiler.{key} must be a non-empty span name, got {getattr(self, key)!r}")
        self.amdahl_targets = [str(t) for t in _as_list("profiler.amdahl_targets", self.amdahl_targets)]

    @classmethod
    def from_dict(cls, data: Any, logger: Any = None) -> ProfilerConfig:
        """Build from a Hydra group (DictConfig or dict). Unknown keys raise, naming the key.

        `logger`, when given (the `logger` group), replaces the `wandb` sub-config.
        """
        cfg = config_from_dict(cls, data, "profiler")
        if logger is not None:
            cfg.wandb = config_from_dict(WandbConfig, logger, "logger")
        return cfg


def config_from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, rejecting keys it does not declare."""
    mapping = _plain(data)
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{prefix} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ValueError(f"{prefix}: unknown key {unknown[0]!r} (known keys: {sorted(known)})")
    return cls(**dict(mapping))


def _plain(data: Any) -> Any:
    """OmegaConf containers -> plain Python (imported only when given one)."""
    if type(data).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(data, resolve=True)
    return data


def _as_list(key: str, value: Any) -> list:
    """A list-valued key as a list. A single string is refused rather than split into characters: a
    command-line override `profiler.amdahl_targets=actor_train` gives a string, and list() of it made
    targets 'a', 'c', 't', ... (no projection, no error) or exports 'j', 's', 'o', 'n'."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{key} must be a list, got {value!r} (on the command line: {key}=[{value}])")
    return list(value)


def _as_float(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be numbers (.inf for infinity), got {value!r}") from None


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")
