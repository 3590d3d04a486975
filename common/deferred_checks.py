"""Checks of a device-side condition whose read-back does not stall the host.

Reading a CUDA bool back (`bool(t)`) waits for every kernel queued before it. Where the host runs ahead of the GPU
on purpose (the GRPO actor: the next micro-batch's launches overlap this one's backward), such a read in every call
drains the queue each time. A DeferredChecks instead copies the bool into pinned host memory behind an event and
reads it at `settle`: before the next call, and wherever a caller must not go on past a failed check (the actor
settles before each optimiser step). A check of a tensor off CUDA is read at once, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class DeferredChecks:
    """Pending (bool read-back, event, error) checks, raised in the order they were added."""

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, torch.cuda.Event, Callable[[], Exception]]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, ok: Tensor, error: Callable[[], Exception]) -> None:
        """Check the one-element bool `ok`: raise `error()` if it is false, here off CUDA, else at `settle`."""
        if ok.device.type != "cuda":
            if not bool(ok):
                raise error()
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(ok.reshape(()), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event, error))

    def settle(self) -> None:
        """Wait for every pending check's value (only the kernels queued before it) and raise the first failure;
        none is pending afterwards."""
        pending, self._pending = self._pending, []
        for host, event, error in pending:
            event.synchronize()
            if not bool(host):
                raise error()
