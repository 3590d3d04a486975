"""Typed configuration of the rollout side (Hydra group `rollout`, conf/rollout/*.yaml).

    rollout:
      engine:    EngineConfig      the policy engine (backend, ranks, devices, seed, timeouts)
      weights:   WeightSyncConfig  weight sync (bucket size, dtype rule, torch.distributed)
      collector: helper D's CollectorConfig (rollout/collector_config.py), parsed when present

`RolloutConfig.from_mapping(cfg.rollout)` builds and validates all of it; every error names
the full key (`rollout.engine.num_ranks must be a positive integer, got 0`). `EngineConfig`
alone is enough for `PolicyEngine(EngineConfig(...), policy_cfg)`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from common.config import (
    CUDA_DEVICE_PATTERN,
    check_bool,
    check_choice,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)

BACKENDS = ("inproc", "local", "ray")
DIST_BACKENDS = ("auto", "nccl", "gloo")
WEIGHT_FORMATS = ("auto", "ours", "lerobot", "openpi")
TRANSPORTS = ("auto", "tensors", "broadcast")
START_METHODS = ("spawn", "forkserver")
# the longest timeout a key may set: a week (no run waits that long for one answer), far inside what the
# waits underneath take (poll's int32 milliseconds: ~24.8 days); "no timeout" (inf) is not one
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class EngineConfig:
    """The data-parallel policy engine (rollout/engine.py).

    backend: "inproc" (every rank's model in the caller's process, run one after another),
      "local" (one spawned process per rank, shared-memory transport), "ray" (one Ray actor per rank).
    num_ranks: data-parallel ranks; a batch is split over them (balanced, groups kept together).
    devices: "auto" (rank r on cuda:(r mod #GPUs) when CUDA is available, else cpu), one device
      for every rank ("cpu", "cuda:0": ranks may share a device), or a list with one per rank.
    seed: seeds the front-end generator that draws all noise and denoise indices, so outputs do
      not depend on the backend or on how the batch was split.
    rank_timeout_s: a rank that does not answer a command within this time is reported (by
      rank) as hung; a dead rank is reported at once. Every timeout is a finite number of
      seconds, at most MAX_TIMEOUT_S (a week).
    start_timeout_s: building the policy in a rank process (imports, weights) may take this long.
    torch_threads: torch.set_num_threads in each rank process (None: leave torch's default;
      several CPU ranks on few cores want 1).
    start_method: multiprocessing start method of the local backend (fork is never safe with CUDA).
    ray_address: an existing Ray cluster ("auto", "ray://..."); None starts a local Ray.
    ray_num_cpus: CPUs of the local Ray started when ray_address is None (None: Ray decides).
    ray_actor_cpus: CPUs each rank actor reserves (0 lets two actors share a 2-core box).
    """

    backend: str = "inproc"
    num_ranks: int = 1
    devices: Any = "auto"
    seed: int = 0
    rank_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    torch_threads: int | None = None
    start_method: str = "spawn"
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    ray_actor_cpus: float = 0.0

    def __post_init__(self) -> None:
        self.validate("rollout.engine")

    def validate(self, key: str) -> None:
        check_choice(f"{key}.backend", self.backend, BACKENDS)
        check_positive_int(f"{key}.num_ranks", self.num_ranks)
        check_nonnegative_int(f"{key}.seed", self.seed)
        check_timeout(f"{key}.rank_timeout_s", self.rank_timeout_s)
        check_timeout(f"{key}.start_timeout_s", self.start_timeout_s)
        if self.torch_threads is not None:
            check_positive_int(f"{key}.torch_threads", self.torch_threads)
        check_choice(f"{key}.start_method", self.start_method, START_METHODS)
        if self.ray_num_cpus is not None:
            check_positive_int(f"{key}.ray_num_cpus", self.ray_num_cpus)
        if isinstance(self.ray_actor_cpus, bool) or not isinstance(self.ray_actor_cpus, (int, float)) \
                or self.ray_actor_cpus < 0:
            raise ValueError(f"{key}.ray_actor_cpus must be a number >= 0, got {self.ray_actor_cpus!r}")
        self.devices = _check_devices(f"{key}.devices", self.devices, self.num_ranks)

    def check_keeps_prefixes(self, what: str) -> None:
        """`what` (keeping the rollout's prefix K/V for the trainer) reads the rank's tensors in the caller's process:
        only the in-process backend with one rank has them there."""
        if self.backend != "inproc" or self.num_ranks != 1:
            raise ValueError(f"{what} needs the in-process engine with one rank (rollout.engine.backend=inproc, "
                             f"num_ranks=1), got backend={self.backend!r} with {self.num_ranks} ranks")

    def rank_devices(self, cuda_count: int | None = None) -> list[str]:
        """The device of every rank ("auto" resolved against the visible GPUs)."""
        if isinstance(self.devices, list):
            return list(self.devices)
        if self.devices != "auto":
            return [self.devices] * self.num_ranks
        if cuda_count is None:
            import torch

            cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda_count == 0:
            return ["cpu"] * self.num_ranks
        return [f"cuda:{r % cuda_count}" for r in range(self.num_ranks)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_timeout(key: str, value: Any) -> None:
    """A positive, finite number of seconds <= MAX_TIMEOUT_S (inf would overflow the waits later,
    with an error naming no key)."""
    check_positive_float(key, value)
    if not value <= MAX_TIMEOUT_S:
        raise ValueError(f"{key} must be a finite number of seconds <= {MAX_TIMEOUT_S:.0f} (a week), got {value!r}")


def _check_devices(key: str, devices: Any, num_ranks: int) -> str | list[str]:
    if type(devices).__name__ == "ListConfig" or isinstance(devices, (list, tuple)):
        devices = [str(d) for d in devices]
        if len(devices) != num_ranks:
            raise ValueError(f"{key} lists {len(devices)} devices for {num_ranks} ranks (rollout.engine.num_ranks)")
        for d in devices:
            _check_device(key, d)
        return devices
    if not isinstance(devices, str):
        raise ValueError(f"{key} must be 'auto', a device string or a list of them, got {devices!r}")
    if devices != "auto":
        _check_device(key, devices)
    return devices


# cpu, or a CUDA device as torch.device spells it: other spellings ("cuda:01") failed on the rank (the ray backend
# checks no visibility first) naming no key
_DEVICE = re.compile(f"cpu|{CUDA_DEVICE_PATTERN}")


def _check_device(key: str, device: str) -> None:
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"{key} entries must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")


@dataclass
class WeightSyncConfig:
    """Weight sync (rollout/weights*.py).

    bucket_mb: bucket size for staged and broadcast transfers (RLinf's default is 512 MB); a
      tensor larger than a bucket travels alone (tensors are never split).
    format: names of incoming tensors: "ours" (fused layout), "lerobot", "openpi", or "auto".
    strict_dtype: refuse a tensor whose dtype differs from the parameter's (default: any floating
      dtype is accepted and cast, as load_state_dict does).
    dist_backend: torch.distributed backend of the broadcast source ("auto": nccl on CUDA ranks,
      gloo on CPU ranks).
    dist_timeout_s: timeout of each collective of a broadcast update (finite, at most a week); a
      rank process may take it for every collective of the update (manifest, agreements, one per
      bucket) plus rollout.engine.rank_timeout_s before it is reported hung.
    transport: how a trainer in another process than the ranks pushes its weights
      (rollout/placement.py, rollout/weights_push.py): "tensors" (update_weights(state dict):
      staged through host memory for rank processes), "broadcast" (torch.distributed from the
      trainer's device), "auto" (broadcast over NCCL when every local rank has a GPU of its own
      apart from the trainer's, else tensors).
    """

    bucket_mb: float = 512.0
    format: str = "auto"
    strict_dtype: bool = False
    dist_backend: str = "auto"
    dist_timeout_s: float = 300.0
    transport: str = "auto"

    def __post_init__(self) -> None:
        self.validate("rollout.weights")

    def validate(self, key: str) -> None:
        check_positive_float(f"{key}.bucket_mb", self.bucket_mb)
        check_choice(f"{key}.format", self.format, WEIGHT_FORMATS)
        check_choice(f"{key}.dist_backend", self.dist_backend, DIST_BACKENDS)
        check_timeout(f"{key}.dist_timeout_s", self.dist_timeout_s)
        check_choice(f"{key}.transport", self.transport, TRANSPORTS)
        check_bool(f"{key}.strict_dtype", self.strict_dtype)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


@dataclass
class RolloutConfig:
    """Everything under the Hydra key `rollout`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    # ---- the collector's sub-config: helper D's `CollectorConfig` (rollout/collector_config.py,
    # `CollectorConfig.from_mapping(mapping)`), built by `from_mapping` below when the mapping has
    # a `collector` key (imported lazily: the engine does not depend on it).
    collector: Any = None

    @staticmethod
    def from_mapping(mapping: Mapping[str, Any] | None = None, key: str = "rollout") -> RolloutConfig:
        data = reject_unknown_keys(RolloutConfig, mapping or {}, key)
        engine = _build(EngineConfig, data.get("engine") or {}, f"{key}.engine")
        weights = _build(WeightSyncConfig, data.get("weights") or {}, f"{key}.weights")
        collector = None
        if data.get("collector") is not None:
            collector = _collector(data["collector"], f"{key}.collector")
        return RolloutConfig(engine=engine, weights=weights, collector=collector)


def _collector(data: Any, key: str) -> Any:
    try:
        from rollout.collector_config import CollectorConfig
    except ImportError as exc:
        raise ValueError(f"{key} is set but rollout/collector_config.py is not importable: {exc}") from exc
    return CollectorConfig.from_mapping(data)


def _build(cls: type, data: Any, key: str) -> Any:
    """A config dataclass from a mapping (or itself); unknown keys and bad values name `key.<field>`."""
    if isinstance(data, cls):
        return data
    data = reject_unknown_keys(cls, to_container(data), key)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{key}: {exc}") from exc


def engine_config(cfg: Any) -> tuple[EngineConfig, WeightSyncConfig]:
    """(engine, weights) from an EngineConfig, a RolloutConfig, or a mapping of either shape."""
    if isinstance(cfg, EngineConfig):
        return cfg, WeightSyncConfig()
    if isinstance(cfg, RolloutConfig):
        return cfg.engine, cfg.weights
    data = to_container(cfg)
    if "engine" in data or "weights" in data or "collector" in data:
        rollout = RolloutConfig.from_mapping(data)
        return rollout.engine, rollout.weights
    return _build(EngineConfig, data, "rollout.engine"), WeightSyncConfig()
