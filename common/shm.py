"""Named arrays at aligned offsets in one buffer, and shared-memory clean-up.

Used by every process boundary that shares memory: the vector env's block
(envs/vector/buffers.py), the engine's observation / output / weight blocks (rollout/shm.py)
and the CPU weight export (rollout/weights_ipc.py). Both sides of a boundary compute the same
layout from the same specs, so only names and specs travel through pipes.
"""

from __future__ import annotations

import errno
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


class SharedMemoryFullError(OSError):
    """/dev/shm cannot hold a new segment (the message says how much was asked and how much is free)."""


def create_segment(size: int, what: str) -> shared_memory.SharedMemory:
    """A new shared-memory segment of `size` bytes with its pages reserved now. Creating one only sizes a
    sparse file: on a /dev/shm (a tmpfs; 64 MB in a default Docker container) without room, the first write
    past the free space killed the writing process with SIGBUS ("Bus error", no traceback) and left the
    segment behind. Now `SharedMemoryFullError` names `what` (the block and the settings that size it)."""
    shm = shared_memory.SharedMemory(create=True, size=max(int(size), 1))
    try:
        _reserve(shm, what)
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return shm


def _reserve(shm: shared_memory.SharedMemory, what: str) -> None:
    fd = getattr(shm, "_fd", -1)  # CPython's POSIX SharedMemory keeps its descriptor open
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, shm.size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            return  # a file system that cannot reserve (EOPNOTSUPP...): pages come with the writes, as before
        stat = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        free = f"{stat.f_bavail * stat.f_frsize / 2**20:.1f} MB free" if stat else "free space unknown"
        raise SharedMemoryFullError(
            exc.errno, f"shared memory is full: {what} needs {shm.size / 2**20:.1f} MB, /dev/shm has {free}; "
                       f"give the machine/container more (docker run --shm-size=...)") from exc
