"""The arrays a vector env shares with its workers, laid out in one block of memory.

Parent and workers compute the same layout from the config, so a worker attaches to the
parent's `SharedMemory` by name and builds identical numpy views: observations, actions and
per-sub-step results travel through it and nothing but short command tuples is pickled.
The in-process twin uses the same layout over a plain numpy buffer.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from common.shm import ArraySpec, Layout, create_segment, forget_mapping
from envs.config import EnvConfig

ALIGN = 64  # bytes; keeps every array cache-line aligned
STATE_DIM = 8
ACTION_DIM = 7


def buffer_specs(cfg: EnvConfig) -> list[ArraySpec]:
    """Every shared array, in a fixed order (the layout is a pure function of the config)."""
    n, h, s = cfg.num_envs, cfg.chunk_size, cfg.image_size
    specs = [
        ArraySpec("actions", (n, h, ACTION_DIM), np.dtype(np.float64)),
        ArraySpec("state", (n, STATE_DIM), np.dtype(np.float32)),
        ArraySpec("rewards", (n, h), np.dtype(np.float32)),
        ArraySpec("terminated", (n, h), np.dtype(np.bool_)),
        ArraySpec("truncated", (n, h), np.dtype(np.bool_)),
        ArraySpec("valid", (n, h), np.dtype(np.bool_)),
        ArraySpec("success", (n,), np.dtype(np.bool_)),
        ArraySpec("done", (n,), np.dtype(np.bool_)),
        ArraySpec("elapsed_steps", (n,), np.dtype(np.int32)),
        # seconds spent by each env in the last command: [physics, render]
        ArraySpec("timing", (n, 2), np.dtype(np.float64)),
    ]
    for camera in cfg.cameras:
        specs.append(ArraySpec(f"{camera}_image", (n, s, s, 3), np.dtype(np.uint8)))
    if cfg.render_every == "substep":
        for camera in cfg.cameras:
            specs.append(ArraySpec(f"{camera}_frames", (n, h, s, s, 3), np.dtype(np.uint8)))
    return specs


class SharedBuffers:
    """Named numpy views over one buffer (shared memory, or private memory for the twin)."""

    def __init__(self, cfg: EnvConfig, buffer, shm: shared_memory.SharedMemory | None, owner: bool):
        self._shm = shm
        self._owner = owner
        self.arrays: dict[str, np.ndarray] = Layout(buffer_specs(cfg), ALIGN).views(buffer)

    @staticmethod
    def nbytes(cfg: EnvConfig) -> int:
        return Layout(buffer_specs(cfg), ALIGN).nbytes

    @classmethod
    def private(cls, cfg: EnvConfig) -> SharedBuffers:
        """Plain process-private memory, for the in-process twin."""
        return cls(cfg, bytearray(cls.nbytes(cfg)), None, owner=False)

    @classmethod
    def create(cls, cfg: EnvConfig) -> SharedBuffers:
        shm = create_segment(cls.nbytes(cfg), f"the vector env's block ({cfg.num_envs} envs x {len(cfg.cameras)} "
                                              f"cameras at {cfg.image_size} px, {cfg.chunk_size}-step chunks)")
        try:
            np.frombuffer(shm.buf, dtype=np.uint8)[:] = 0
            return cls(cfg, shm.buf, shm, owner=True)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, cfg: EnvConfig, name: str) -> SharedBuffers:
        shm = shared_memory.SharedMemory(name=name)
        if shm.size < cls.nbytes(cfg):
            shm.close()
            raise RuntimeError(f"shared memory {name} has {shm.size} bytes, layout needs {cls.nbytes(cfg)}")
        return cls(cfg, shm.buf, shm, owner=False)

    @property
    def name(self) -> str | None:
        return self._shm.name if self._shm is not None else None

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def close(self) -> None:
        """Drop the views and the mapping; the owner also unlinks the segment. Idempotent."""
        self.arrays = {}
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:
            # A caller still holds a view (e.g. an observation array). Forget the mapping
            # instead: it is unmapped when the last view is garbage collected, and the name is
            # unlinked below regardless, so /dev/shm is clean now.
            forget_mapping(shm)
        if self._owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
