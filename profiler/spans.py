"""Recording spans: `Timeline.span(name)` as a context manager or decorator.

    tl = make_timeline(cfg, rank=0, worker="driver")    # NULL_TIMELINE when cfg.enabled is False
    with tl.span("step", step=i):
        with tl.span("rollout/predict", stage=s, chunk=c, gpu=True):
            ...
    @tl.spanned("actor_train")
    def train(): ...
    tl.close()

Names are hierarchical by convention ("rollout/predict"): the report treats names without "/"
as top-level phases. Attributes (`stage`, `chunk`, `step`, `flops`, `bytes`, ...) travel to the
trace. Each process (and worker label) appends to its own file under RUN_DIR/trace; spans are
buffered and written every `flush_every` spans, on `flush()`, on `close()` and at interpreter
exit. Disabled, every call returns one shared no-op object: nothing is allocated or recorded.

Module-level `span()` / `spanned()` use the process's current timeline (`set_timeline`), so
library code can be instrumented without passing a timeline around.

Create a timeline inside each process (after spawn) and `close()` it in the worker's `finally`:
multiprocessing children leave through os._exit, which skips the atexit flush. A forked copy of
a parent's timeline writes nothing (its spans belong to the parent).
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from profiler.clock import now_ns
from profiler.config import ProfilerConfig
from profiler.gpu import EventAnchor, GpuBackend, TorchCudaBackend
from profiler.trace import header_line, make_header, span_file_path, span_line


class _NullSpan:
    """The disabled span: one shared instance, usable as context manager and decorator."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def __call__(self, fn: Callable) -> Callable:
        return fn


NULL_SPAN = _NullSpan()


class NullTimeline:
    """A timeline that records nothing (profiler disabled)."""

    enabled = False
    spans: tuple = ()

    def span(self, name: str, gpu: bool = False, **attrs: Any) -> _NullSpan:
        return NULL_SPAN

    def spanned(self, name: str, **attrs: Any) -> _NullSpan:
        return NULL_SPAN

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TIMELINE = NullTimeline()


class _Span:
    __slots__ = ("_attrs", "_name", "_start", "_start_event", "_timeline")

    def __init__(self, timeline: Timeline, name: str, attrs: dict | None) -> None:
        self._timeline = timeline
        self._name = name
        self._attrs = attrs

    def __enter__(self) -> _Span:
        self._start = now_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        end = now_ns()
        attrs = self._attrs
        if exc_type is not None:
            attrs = {**(attrs or {}), "error": exc_type.__name__}
        self._timeline._record((self._name, self._start, end, attrs, None))
        return False


class _SyncGpuSpan(_Span):
    """gpu_timing="sync": wait for queued GPU work at both ends."""

    __slots__ = ()

    def __enter__(self) -> _SyncGpuSpan:
        self._timeline._gpu.synchronize()
        self._start = now_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._timeline._gpu.synchronize()
        return super().__exit__(exc_type, exc, tb)


class _EventGpuSpan(_Span):
    """gpu_timing="cuda_event": events at both ends, resolved at flush."""

    __slots__ = ()

    def __enter__(self) -> _EventGpuSpan:
        self._start = now_ns()
        self._start_event = self._timeline._gpu.record_event()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        end_event = self._timeline._gpu.record_event()
        end = now_ns()
        attrs = dict(self._attrs or {})
        if exc_type is not None:
            attrs["error"] = exc_type.__name__
        self._timeline._record((self._name, self._start, end, attrs, (self._start_event, end_event)))
        return False


class Timeline:
    """Records spans of one process (rank, worker) into RUN_DIR/trace/spans_*.jsonl.

    `spans` keeps every finished span in memory as (name, start_ns, end_ns, attrs) when
    `keep_in_memory` is True (tests, small runs); the file is the durable record.
    """

    enabled = True

    def __init__(
        self,
        run_dir: str | os.PathLike | None,
        rank: int = 0,
        worker: str = "main",
        gpu_timing: str = "none",
        flush_every: int = 1024,
        clock_offset_ns: int = 0,
        gpu_backend: GpuBackend | None = None,
        keep_in_memory: bool = False,
    ) -> None:
        if gpu_timing not in ("none", "sync", "cuda_event"):
            raise ValueError(f"gpu_timing must be 'none', 'sync' or 'cuda_event', got {gpu_timing!r}")
        self.rank, self.worker, self.pid = int(rank), str(worker), os.getpid()
        self.gpu_timing = gpu_timing
        self.clock_offset_ns = int(clock_offset_ns)
        self._flush_every = int(flush_every)
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._gpu_backend = gpu_backend
        self._anchor: EventAnchor | None = None
        self._gpu_span_cls = {"none": _Span, "sync": _SyncGpuSpan, "cuda_event": _EventGpuSpan}[gpu_timing]
        self.spans: list[tuple] | None = [] if keep_in_memory else None
        self.path: Path | None = None
        if run_dir is not None:
            self.path = span_file_path(run_dir, self.rank, self.worker, self.pid)
        self._file = None
        self._closed = False
        _register_for_exit(self)

    # -- recording --------------------------------------------------------------------------
    def span(self, name: str, gpu: bool = False, **attrs: Any) -> _Span:
        """A span named `name`; `gpu=True` times it per `gpu_timing`; attrs go to the trace."""
        if gpu and self.gpu_timing != "none":
            self._ensure_gpu()
            return self._gpu_span_cls(self, name, attrs or None)
        return _Span(self, name, attrs or None)

    def spanned(self, name: str, gpu: bool = False, **attrs: Any) -> Callable[[Callable], Callable]:
        """Decorator: every call of the function is one span."""

        def decorate(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self.span(name, gpu=gpu, **attrs):
                    return fn(*args, **kwargs)

            return wrapper

        return decorate

    def _record(self, item: tuple) -> None:
        self._pending.append(item)
        if len(self._pending) >= self._flush_every:
            self.flush()

    # -- GPU --------------------------------------------------------------------------------
    @property
    def _gpu(self) -> GpuBackend:
        return self._gpu_backend  # type: ignore[return-value]

    def _ensure_gpu(self) -> None:
        if self._gpu_backend is None:
            self._gpu_backend = TorchCudaBackend()
        if self.gpu_timing == "cuda_event" and self._anchor is None:
            self._anchor = EventAnchor(self._gpu_backend, now_ns)
            self._anchor.renew()

    def _resolve(self, item: tuple) -> tuple:
        """(name, start, end, attrs, events) -> (name, start, end, attrs) on the CPU clock."""
        name, start, end, attrs, events = item
        if events is None:
            return name, start, end, attrs
        self._gpu.wait(events[1])
        gpu_start = self._anchor.to_cpu_ns(events[0])  # type: ignore[union-attr]
        gpu_end = self._anchor.to_cpu_ns(events[1])  # type: ignore[union-attr]
        attrs = {**(attrs or {}), "gpu": "cuda_event", "cpu_start_ns": start, "cpu_end_ns": end}
        return name, gpu_start, max(gpu_end, gpu_start), attrs

    # -- output -----------------------------------------------------------------------------
    def flush(self) -> None:
        if os.getpid() != self.pid:  # a forked copy: the parent owns these spans and the file
            self._pending = []
            return
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return
            resolved = [self._resolve(item) for item in pending]
            if self._anchor is not None:
                self._anchor.renew()
            if self.spans is not None:
                self.spans.extend(resolved)
            if self.path is None:
                return
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
                header = make_header(self.rank, self.worker, self.pid, self.clock_offset_ns, self.gpu_timing)
                self._file.write(header_line(header))
            # raw local times: the loader adds the header's clock_offset_ns
            self._file.write("".join(span_line(n, s, e, a) + "\n" for n, s, e, a in resolved))
            self._file.flush()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- construction and the process-wide current timeline ------------------------------------

def make_timeline(
    cfg: ProfilerConfig,
    rank: int = 0,
    worker: str = "main",
    run_dir: str | os.PathLike | None = None,
    clock_offset_ns: int = 0,
    gpu_backend: GpuBackend | None = None,
) -> Timeline | NullTimeline:
    """A recording Timeline under `run_dir` (default cfg.out_dir), or NULL_TIMELINE if disabled."""
    if not cfg.enabled:
        return NULL_TIMELINE
    return Timeline(
        run_dir if run_dir is not None else cfg.out_dir, rank=rank, worker=worker,
        gpu_timing=cfg.gpu_timing, flush_every=cfg.flush_every,
        clock_offset_ns=clock_offset_ns, gpu_backend=gpu_backend,
    )


# Worker processes started by code that does not carry the config (env workers, engine ranks)
# find the profiler through the environment, which spawn/forkserver children inherit.
ENV_RUN_DIR = "VLA_PROFILER_RUN_DIR"
ENV_GPU_TIMING = "VLA_PROFILER_GPU_TIMING"


def profiler_environ(cfg: ProfilerConfig, run_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Variables to put in os.environ before starting workers ({} when disabled)."""
    if not cfg.enabled:
        return {}
    return {ENV_RUN_DIR: str(run_dir if run_dir is not None else cfg.out_dir), ENV_GPU_TIMING: cfg.gpu_timing}


def timeline_from_environ(rank: int, worker: str, environ=os.environ) -> Timeline | NullTimeline:
    """In a worker: a Timeline under the parent's run dir, or NULL_TIMELINE if none was set."""
    run_dir = environ.get(ENV_RUN_DIR)
    if not run_dir:
        return NULL_TIMELINE
    return Timeline(run_dir, rank=rank, worker=worker, gpu_timing=environ.get(ENV_GPU_TIMING, "none"))


_current: Timeline | NullTimeline = NULL_TIMELINE


def set_timeline(timeline: Timeline | NullTimeline) -> Timeline | NullTimeline:
    """Make `timeline` this process's current one; returns the previous one."""
    global _current
    previous, _current = _current, timeline
    return previous


def get_timeline() -> Timeline | NullTimeline:
    return _current


def span(name: str, gpu: bool = False, **attrs: Any) -> _Span | _NullSpan:
    """A span on the current timeline (a no-op when none is set or it is disabled)."""
    return _current.span(name, gpu=gpu, **attrs)


def spanned(name: str, gpu: bool = False, **attrs: Any) -> Callable[[Callable], Callable]:
    """Decorator on the current timeline, looked up at call time (set it after decorating)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _current.span(name, gpu=gpu, **attrs):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


# -- flush at exit, without keeping timelines alive ------------------------------------------
_open_timelines: weakref.WeakSet[Timeline] = weakref.WeakSet()


def _register_for_exit(timeline: Timeline) -> None:
    _open_timelines.add(timeline)


@atexit.register
def _close_all() -> None:
    for timeline in list(_open_timelines):
        try:
            timeline.close()
        except Exception:  # noqa: BLE001 - exiting: never raise from atexit
            pass
