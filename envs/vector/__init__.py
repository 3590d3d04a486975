"""The vectorized LIBERO env: worker processes + shared memory, and its in-process twin."""

from __future__ import annotations

from envs.config import EnvConfig
from envs.vector.base import ChunkResult, VectorEnvBase
from envs.vector.subproc import AsyncVectorEnv, EnvWorkerError, WorkerCrashedError
from envs.vector.sync import SyncVectorEnv

__all__ = [
    "AsyncVectorEnv",
    "ChunkResult",
    "EnvConfig",
    "EnvWorkerError",
    "SyncVectorEnv",
    "VectorEnvBase",
    "WorkerCrashedError",
    "make_vector_env",
]


def make_vector_env(
    cfg: EnvConfig | None = None, in_process: bool = False, **overrides
) -> VectorEnvBase:
    """The worker-process vector env, or its in-process twin (`in_process=True`).

    `make_vector_env(suite="libero_10", num_envs=64, group_size=8, num_workers=16)` builds the
    EnvConfig from keyword arguments (applied on top of `cfg` when both are given).
    """
    if cfg is None:
        cfg = EnvConfig(**overrides)
    elif overrides:
        cfg = EnvConfig.from_mapping(cfg.to_dict(), **overrides)
    if cfg.env_type == "worldmodel":  # served by a model in this process: no workers, one class
        from envs.worldmodel_env import WorldModelVectorEnv

        return WorldModelVectorEnv(cfg.to_dict())
    return SyncVectorEnv(cfg) if in_process else AsyncVectorEnv(cfg)
