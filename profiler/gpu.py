"""GPU timing for spans opened with `gpu=True`. torch is imported only when a GPU span runs.

Two ways, chosen by `ProfilerConfig.gpu_timing`:
- "sync": `torch.cuda.synchronize()` before reading the CPU clock at both ends. Exact wall time
  of the GPU work, but it stalls the CPU at every span (fine for coarse phases).
- "cuda_event": a timing event recorded at each end; nothing waits on the hot path. Events are
  resolved at flush and placed on the CPU timeline through an anchor: an event recorded right
  after a synchronize, whose CPU time is known. The anchor is renewed at every flush so that
  `elapsed_time` (float milliseconds) stays short and precise.
"""

from __future__ import annotations

from typing import Any, Protocol


class GpuBackend(Protocol):
    def synchronize(self) -> None: ...

    def record_event(self) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def elapsed_ns(self, start: Any, end: Any) -> float: ...


class TorchCudaBackend:
    """The real backend: torch.cuda on the current device."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "profiler.gpu_timing is 'sync' or 'cuda_event' but torch sees no CUDA device; "
                "use gpu_timing='none' on CPU machines"
            )
        self._cuda = torch.cuda

    def synchronize(self) -> None:
        self._cuda.synchronize()

    def record_event(self) -> Any:
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ns(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e6


class EventAnchor:
    """Maps CUDA events onto the CPU monotonic clock (see the module docstring)."""

    def __init__(self, backend: GpuBackend, clock) -> None:
        self._backend = backend
        self._clock = clock
        self.event: Any = None
        self.cpu_ns = 0

    def renew(self) -> None:
        self._backend.synchronize()
        self.cpu_ns = self._clock()
        self.event = self._backend.record_event()
        self._backend.wait(self.event)

    def to_cpu_ns(self, event: Any) -> int:
        if self.event is None:
            raise RuntimeError("EventAnchor used before renew()")
        return self.cpu_ns + round(self._backend.elapsed_ns(self.event, event))
