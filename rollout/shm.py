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
from multiprocessing import shared_memory

from common.shm import ArraySpec, Layout, SharedMemoryFullError, create_segment, forget_mapping

__all__ = ["ALIGN", "ArraySpec", "Layout", "SharedBlock", "SharedMemoryFullError"]

ALIGN = 256  # bytes: every array of an engine block starts aligned for any dtype


class SharedBlock:
    def __init__(self, name: str, size: int, buf, owner_shm: shared_memory.SharedMemory | None, mapping=None):
        self.name, self.size, self.buf = name, size, buf
        self._shm, self._mmap = owner_shm, mapping

    @classmethod
    def create(cls, size: int, what: str = "a shared-memory block") -> SharedBlock:
        """A new segment of `size` bytes, its pages reserved (common.shm.create_segment)."""
        shm = create_segment(size, what)
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
                forget_mapping(shm)
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
