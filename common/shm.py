"""Named arrays at aligned offsets in one buffer, and shared-memory clean-up.

Used by every process boundary that shares memory: the vector env's block
(envs/vector/buffers.py), the engine's observation / output / weight blocks (rollout/shm.py)
and the CPU weight export (rollout/weights_ipc.py). Both sides of a boundary compute the same
layout from the same specs, so only names and specs travel through pipes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np


def align_up(offset: int, align: int) -> int:
    return -(-offset // align) * align


def aligned_offsets(sizes: Iterable[int], align: int) -> tuple[list[int], int]:
    """Byte offset of each block of `sizes` placed in order, each starting on an `align`
    boundary, and the end of the last one."""
    offsets, cursor = [], 0
    for size in sizes:
        cursor = align_up(cursor, align)
        offsets.append(cursor)
        cursor += int(size)
    return offsets, cursor


@dataclass(frozen=True)
class ArraySpec:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # anything np.dtype() takes: a numpy dtype or its string ("uint8", "<f4")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class Layout:
    """Aligned offsets of named arrays in one buffer (at least 1 byte, so a segment can hold it)."""

    def __init__(self, specs: list[ArraySpec], align: int):
        self.specs = list(specs)
        self.offsets, end = aligned_offsets((s.nbytes for s in self.specs), align)
        self.nbytes = max(end, 1)

    def views(self, buf) -> dict[str, np.ndarray]:
        return {
            s.name: np.ndarray(s.shape, dtype=np.dtype(s.dtype), buffer=buf, offset=o)
            for s, o in zip(self.specs, self.offsets, strict=True)
        }


def forget_mapping(shm: shared_memory.SharedMemory) -> None:
    """Detach a SharedMemory from a mapping that numpy/torch views still export (CPython
    3.10-3.13 internals: `_buf`, `_mmap`, `_fd`), so its own close()/__del__ become no-ops; the
    mapping goes with the last view."""
    shm._buf = None  # type: ignore[attr-defined]
    shm._mmap = None  # type: ignore[attr-defined]
    fd = getattr(shm, "_fd", -1)
    if fd >= 0:
        os.close(fd)
        shm._fd = -1  # type: ignore[attr-defined]
