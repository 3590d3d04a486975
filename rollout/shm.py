"""Shared-memory blocks for the engine's process boundaries (observations, outputs, weights).

`SharedBlock.create(size)` makes a POSIX segment owned by this process (unlinked by `close()`,
and by multiprocessing's resource tracker if the owner dies). `SharedBlock.attach(name)` maps
an existing one WITHOUT registering it with this process's resource tracker (Python < 3.13
registers attachments too, and a consumer's tracker would unlink the owner's segment when the
consumer exits). `Layout` places named arrays in a block at aligned offsets, so both sides
build identical numpy views from the same spec and nothing but names travels through pipes.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

ALIGN = 256


@dataclass(frozen=True)
class ArraySpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype string, e.g. "uint8", "float32"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class Layout:
    """Aligned offsets of named arrays in one block."""

    def __init__(self, specs: list[ArraySpec]):
        self.specs = list(specs)
        self.offsets, cursor = [], 0
        for spec in self.specs:
            cursor = -(-cursor // ALIGN) * ALIGN
            self.offsets.append(cursor)
            cursor += spec.nbytes
        self.nbytes = max(cursor, 1)

    def views(self, buf) -> dict[str, np.ndarray]:
        return {
            s.name: np.ndarray(s.shape, dtype=np.dtype(s.dtype), buffer=buf, offset=o)
            for s, o in zip(self.specs, self.offsets)
        }


class SharedBlock:
    def __init__(self, name: str, size: int, buf, owner_shm: shared_memory.SharedMemory | None, mapping=None):
        self.name, self.size, self.buf = name, size, buf
        self._shm, self._mmap = owner_shm, mapping

    @classmethod
    def create(cls, size: int) -> SharedBlock:
        shm = shared_memory.SharedMemory(create=True, size=max(int(size), 1))
        return cls(shm.name, shm.size, shm.buf, shm)

    @classmethod
    def attach(cls, name: str) -> SharedBlock:
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, memoryview(mapping), None, mapping)

    @property
    def owner(self) -> bool:
        return self._shm is not None

    def close(self) -> None:
        """Unmap (once no view is alive; otherwise when the last one is collected); the owner
        also unlinks the name, so /dev/shm is clean at once. Idempotent."""
        buf, self.buf = self.buf, None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.close()
            except BufferError:
                _forget_mapping(shm)
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        elif self._mmap is not None:
            mapping, self._mmap = self._mmap, None
            try:
                buf.release()
                mapping.close()
            except BufferError:
                pass  # numpy/torch views still export it: unmapped when they are collected


def _forget_mapping(shm: shared_memory.SharedMemory) -> None:
    """Detach a SharedMemory from a mapping that views still export (CPython 3.10-3.13 internals),
    so its close()/__del__ become no-ops; the mapping goes with the last view."""
    shm._buf = None  # type: ignore[attr-defined]
    shm._mmap = None  # type: ignore[attr-defined]
    fd = getattr(shm, "_fd", -1)
    if fd >= 0:
        os.close(fd)
        shm._fd = -1  # type: ignore[attr-defined]


def segment_exists(name: str) -> bool:
    return os.path.exists("/dev/shm/" + name.lstrip("/"))
