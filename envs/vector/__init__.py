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


def make_vector_env(cfg: EnvConfig, in_process: bool = False) -> VectorEnvBase:
    """The worker-process vector env, or its in-process twin (`in_process=True`)."""
    return SyncVectorEnv(cfg) if in_process else AsyncVectorEnv(cfg)
