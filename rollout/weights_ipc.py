"""Weights shared by another process on the same machine: CUDA IPC on a GPU, shared memory on CPU.

The producer (a collocated trainer) exports its tensors once; the engine opens the handles once
and keeps them, so every later update is "producer writes in place, says go" + one batched
device copy on the engine side (`EngineCore.apply` caches the copy program per handle set).

    # trainer process
    exporter = IpcExporter(named_tensors)       # CUDA: the tensors themselves (no copy);
    send(exporter.handles)                      # CPU: copied once into one shared-memory segment
    ...                                         #      (write new weights into exporter.tensors)
    torch.cuda.synchronize(); send(("go", version))
    # engine process
    engine.update_weights(handles, version)     # opens (first time) and copies

`IpcHandles` is a small picklable object (names, shapes, dtypes, and either the CUDA IPC
handles serialised by torch.multiprocessing's reductions, or the segment name and offsets).
Any number of processes may open it, each once (cached by `uid`). The producer must keep its
`IpcExporter` (and for CUDA its tensors) alive while consumers use the handles, and `close()`
it at the end (the CPU segment is unlinked then). Handles that cannot be opened (their exporter
closed, or opened in the exporting process) are refused (`WeightRefusedError`): the engine
keeps its weights and version.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.shm import aligned_offsets
from rollout.shm import SharedBlock
from rollout.weights import ALIGN, TensorMeta, WeightRefusedError, as_tensor_source

_MAX_OPEN = 2  # handle sets kept open per process (the current one, and the one before)


@dataclass(frozen=True)
class IpcHandles:
    uid: str
    kind: str  # "cuda" | "cpu"
    metas: list[TensorMeta]
    payload: bytes  # cuda: torch reductions of the tensors; cpu: pickled (segment name, offsets)
    producer_pid: int


class IpcExporter:
    """Producer side. CUDA tensors are shared as they are; CPU tensors are copied once into one
    shared-memory segment (`tensors` are views of it: write new weights there)."""

    def __init__(self, named: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]):
        source = as_tensor_source(named)
        devices = {t.device.type for t in source.tensors}
        if len(devices) != 1 or devices.pop() not in ("cuda", "cpu"):
            raise ValueError(f"IpcExporter needs tensors all on CUDA or all on the CPU, got {sorted(devices)}")
        self.metas = source.metas
        self._block: SharedBlock | None = None
        uid = f"{os.getpid()}-{uuid.uuid4().hex}"
        if source.tensors[0].is_cuda:
            self.tensors = dict(zip(source.names, source.tensors))
            payload = _dump_cuda(source.tensors)
            self.handles = IpcHandles(uid, "cuda", self.metas, payload, os.getpid())
        else:
            offsets, size = aligned_offsets((m.nbytes for m in self.metas), ALIGN)
            self._block = SharedBlock.create(size, "the CPU weight export (one copy of the weights)")
            views = _views(self._block.buf, self.metas, offsets)
            for view, tensor in zip(views, source.tensors):
                view.copy_(tensor)
            self.tensors = dict(zip(source.names, views))
            payload = pickle.dumps((self._block.name, offsets))
            self.handles = IpcHandles(uid, "cpu", self.metas, payload, os.getpid())

    def close(self) -> None:
        block, self._block = self._block, None
        self.tensors = {}
        if block is not None:
            block.close()

    def __enter__(self) -> IpcExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- consumer side
_opened: dict[str, tuple[list[Tensor], SharedBlock | None]] = {}


def open_handles(handles: IpcHandles) -> list[Tensor]:
    """The producer's tensors (in metas order), opened once per process and cached by uid.
    Raises WeightRefusedError when they cannot be opened (nothing was written yet)."""
    entry = _opened.get(handles.uid)
    if entry is None:
        entry = _open(handles)
        while len(_opened) >= _MAX_OPEN:
            close_handles(next(iter(_opened)))
        _opened[handles.uid] = entry
    return entry[0]


def _open(handles: IpcHandles) -> tuple[list[Tensor], SharedBlock | None]:
    # a refusal, not a failed write: the engine keeps its weights and version and goes on predicting
    if handles.producer_pid == os.getpid():
        raise WeightRefusedError(f"IpcHandles {handles.uid} opened in the process that exported them: pass its "
                                 f"tensors directly")
    try:
        if handles.kind == "cuda":
            return _load_cuda(handles.payload), None
        name, offsets = pickle.loads(handles.payload)
        block = SharedBlock.attach(name)
        return _views(block.buf, handles.metas, offsets), block
    except Exception as exc:
        raise WeightRefusedError(f"cannot open the {handles.kind} IpcHandles {handles.uid} of pid "
                                 f"{handles.producer_pid} (is its IpcExporter still open?): {exc!r}") from exc


class RankIpc:
    """A rank process's side of a two-phase IPC update (the local and Ray rank shells share it): `open`
    the handle set before any rank copies, so that a set one rank cannot open is refused everywhere
    (WeightRefusedError) with nothing written; then `apply` copies from the set it opened."""

    def __init__(self):
        self.opened: tuple[IpcHandles, Any] | None = None  # (handles, plan) of the last set opened

    def open(self, handles: IpcHandles, plan: Any) -> None:
        open_handles(handles)
        self.opened = (handles, plan)

    def apply(self, core: Any, uid: str) -> None:
        if self.opened is None or self.opened[0].uid != uid:
            raise RuntimeError(f"IPC handles {uid} were not opened on this rank (ipc_open comes first)")
        handles, plan = self.opened
        core.apply(plan, open_handles(handles), cache_key=uid)


def close_handles(uid: str | None = None) -> None:
    """Forget opened handle sets (all of them by default)."""
    for key in [uid] if uid is not None else list(_opened):
        entry = _opened.pop(key, None)
        if entry is not None and entry[1] is not None:
            tensors, block = entry
            tensors.clear()
            block.close()


# ---------------------------------------------------------------------- helpers
def _views(buf, metas: list[TensorMeta], offsets: list[int]) -> list[Tensor]:
    flat = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
    return [flat[o : o + m.nbytes].view(m.dtype).view(m.shape) for m, o in zip(metas, offsets)]


def _dump_cuda(tensors: list[Tensor]) -> bytes:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's CUDA IPC reductions

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(list(tensors))
    return buf.getvalue()


def _load_cuda(payload: bytes) -> list[Tensor]:
    import torch.multiprocessing  # noqa: F401 - the rebuild functions live there

    return pickle.loads(payload)
