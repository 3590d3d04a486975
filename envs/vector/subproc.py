"""The worker-process vector env: N envs over W spawned workers, shared-memory transport.

Each worker owns a contiguous block of envs and runs `worker.worker_main`. Commands are short
tuples over a pipe; observations, actions and per-sub-step results live in one shared-memory
block (`buffers.py`), so no image is pickled. The parent waits on every worker's pipe *and*
its process sentinel, so a worker that dies is noticed at once and one that hangs after
`worker_timeout_s`. Without `restart_on_crash` that raises `WorkerCrashedError` naming the
worker, its envs and their tasks; with it the worker is restarted (its envs are rebuilt in the
background) and its envs are reported as lost episodes (done, `lost` mask, zeroed
observations) until the next reset, which waits for the rebuild. A worker that fails while
building its envs is never restarted (that is not transient): the error names the worker, the env
and task it was building, and carries the worker's traceback (for a hard crash, the stack
faulthandler wrote).

Workers get each env's LIBERO task and init states from the parent (`catalog.worker_specs`), so
they never import torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Any

import numpy as np

from common.processes import end_process, stop_processes
from envs.config import EnvConfig
from envs.vector.base import VectorEnvBase
from envs.vector.buffers import SharedBuffers
from envs.vector.catalog import worker_specs
from envs.vector.worker import worker_main

CLOSE_GRACE_S = 10.0


class WorkerCrashedError(RuntimeError):
    """An env worker process died or stopped answering."""


class EnvWorkerError(RuntimeError):
    """An env worker raised an exception (its traceback is in the message)."""


@dataclass
class WorkerHandle:
    index: int
    env_ids: list[int]
    process: Any
    conn: Any
    creating: bool = True  # "create" sent, reply not yet collected
    failed: bool = False  # died or hung: stop it without asking


class AsyncVectorEnv(VectorEnvBase):
    def __init__(self, cfg: EnvConfig):
        super().__init__(cfg)
        self._ctx = mp.get_context(cfg.start_method)
        self._broken: str | None = None
        self._specs = worker_specs(cfg, self.task_ids)
        self._buffers = SharedBuffers.create(cfg)
        self._workers: list[WorkerHandle] = []
        self._fault_dir = tempfile.mkdtemp(prefix=f"vla-env-{os.getpid()}-")
        # Runs on close(), on garbage collection and at interpreter exit: never leak processes,
        # /dev/shm segments or fault files, even when the caller forgets close().
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._buffers, self._fault_dir)
        try:
            for index, env_ids in enumerate(cfg.worker_env_ids()):
                self._workers.append(self._start_worker(index, env_ids))
            self._wait_created(self._workers)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------- properties
    @property
    def worker_pids(self) -> list[int]:
        return [h.process.pid for h in self._workers]

    @property
    def worker_env_ids(self) -> list[list[int]]:
        return [list(h.env_ids) for h in self._workers]

    # ---------------------------------------------------------------------- worker life
    def _start_worker(self, index: int, env_ids: Sequence[int]) -> WorkerHandle:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(child_conn, index, list(env_ids), [self.task_ids[i] for i in env_ids],
                  self.cfg.to_dict(), self._buffers.name, [self._specs[i] for i in env_ids],
                  self._fault_path(index)),
            name=f"vla-env-worker-{index}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        handle = WorkerHandle(index, list(env_ids), process, parent_conn)
        self._send(handle, ("create", None))  # envs are built in parallel across workers
        return handle

    def _wait_created(self, handles: Sequence[WorkerHandle]) -> None:
        handles = [h for h in handles if h.creating]
        if not handles:
            return
        bar = None
        if self.cfg.show_progress:
            from tqdm.auto import tqdm

            total = sum(len(h.env_ids) for h in handles)
            bar = tqdm(total=total, desc=f"creating envs ({len(handles)} workers)", unit="env")
        created: dict[int, list[int]] = {h.index: [] for h in handles}

        def progress(index: int, env_id: int) -> None:
            created[index].append(env_id)
            if bar is not None:
                bar.update(1)

        try:
            replies, errors, failures = self._gather(handles, "create", self.cfg.create_timeout_s, progress)
        finally:
            if bar is not None:
                bar.close()
        for h in handles:
            if h.index in replies:
                h.creating = False
        if failures or errors:  # a failure while building envs is not transient: never retried
            self._raise_creation_failure(errors, failures, created)

    def _raise_creation_failure(self, errors: dict[int, str], failures: dict[int, str],
                                created: dict[int, list[int]]) -> None:
        """One paragraph per failed worker: what it was building, and its traceback."""
        paragraphs = []
        for index, reason in sorted(failures.items()):
            self._workers[index].failed = True
            paragraphs.append(self._creation_report(index, reason, created[index], self._read_faults(index, reason)))
        for index, text in sorted(errors.items()):
            paragraphs.append(self._creation_report(index, "raised", created[index], text))
        message = "could not create the envs:\n" + "\n".join(paragraphs)
        # never retried, so the env is unusable either way; a worker that raised is idle but still counted
        # as creating, and a later command would wait for the "create" reply it already sent
        self._broken = f"after a failed env build: {message}"
        if failures:
            raise WorkerCrashedError(message)
        raise EnvWorkerError(message)

    def _creation_report(self, index: int, what: str, created: list[int], trace: str) -> str:
        handle = self._workers[index]
        pending = [i for i in handle.env_ids if i not in created]
        where = (f" while creating env {pending[0]} ({self.slots[pending[0]].label})" if pending
                 else " after creating all of its envs")
        before = f"envs created before: {created}" if created else "no env created yet"
        return f"{self._describe(handle)} {what}{where} ({before}); worker traceback:\n{trace.rstrip()}"

    def _fault_path(self, index: int) -> str:
        return os.path.join(self._fault_dir, f"worker{index}.faults")

    def _fault_stack(self, index: int) -> str:
        """The stack faulthandler wrote for the worker (empty when it wrote none)."""
        try:
            with open(self._fault_path(index)) as f:
                return f.read().strip()
        except OSError:
            return ""

    def _read_faults(self, index: int, reason: str) -> str:
        """The stack faulthandler wrote for a worker that crashed, or why there is none."""
        text = self._fault_stack(index)
        if text:
            return text
        oom = " (SIGKILL is also what the kernel's out-of-memory killer sends)" if "SIGKILL" in reason else ""
        return f"none: the process ended without a Python fault handler report{oom}"

    def _kill(self, handle: WorkerHandle) -> None:
        handle.failed = True
        _stop_processes([handle], graceful=False)

    # ---------------------------------------------------------------------- messaging
    def _send(self, handle: WorkerHandle, message: tuple) -> bool:
        try:
            handle.conn.send(message)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return False

    def _gather(
        self,
        handles: Sequence[WorkerHandle],
        command: str,
        timeout_s: float,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> tuple[dict, dict, dict]:
        """Collect one reply per worker (`gather_replies`), keyed by worker index."""
        peers = {h.index: (h.conn, h.process) for h in handles}
        return gather_replies(peers, command, timeout_s, on_progress)

    def _describe(self, handle: WorkerHandle) -> str:
        tasks = sorted({self.slots[i].label for i in handle.env_ids})
        return f"env worker {handle.index} (pid {handle.process.pid}, envs {handle.env_ids}, tasks {tasks})"

    def _error_report(self, errors: dict[int, str], command: str) -> str:
        """Every worker's traceback, one paragraph each (several workers may fail in one command)."""
        return "\n".join(f"{self._describe(self._workers[index])} raised during {command!r}:\n{text}"
                         for index, text in sorted(errors.items()))

    def _raise_errors(self, errors: dict[int, str], command: str) -> None:
        if errors:
            raise EnvWorkerError(self._error_report(errors, command))

    def _crash_report(self, index: int, reason: str, stack: str) -> str:
        """A crashed worker, why it is gone, and the Python stack faulthandler wrote for it (a hard crash)."""
        stack = f"; worker stack (faulthandler):\n{stack}" if stack else ""
        return f"{self._describe(self._workers[index])} {reason}{stack}"

    def _raise_crash(self, failures: dict[int, str], command: str, errors: dict[int, str] | None = None) -> None:
        lines = [self._crash_report(i, reason, self._fault_stack(i)) for i, reason in sorted(failures.items())]
        for index in failures:
            self._workers[index].failed = True
        self._broken = "after a worker crash: " + "; ".join(lines)
        hint = "" if self.cfg.restart_on_crash else " (set env.restart_on_crash=true to restart it)"
        also = f"\nin the same {command!r}, " + self._error_report(errors, command) if errors else ""
        raise WorkerCrashedError(f"during {command!r}: " + "; ".join(lines) + hint + also)

    def _handle_failures(self, failures: dict[int, str], command: str, errors: dict[int, str],
                         finished: np.ndarray | None = None) -> list[dict]:
        """Restart crashed workers (restart_on_crash) and mark their envs lost; else raise (with the other
        workers' errors). finished: envs whose episode had ended before the command (they keep their result)."""
        if not failures:
            return []
        if not self.cfg.restart_on_crash:
            self._raise_crash(failures, command, errors)
        lost = []
        for index, reason in sorted(failures.items()):
            handle = self._workers[index]
            stack = self._fault_stack(index)  # before the restart reopens (empties) its fault file
            description = self._describe(handle)
            self._kill(handle)
            env_ids = self._mark_lost(handle.env_ids, finished)
            self._workers[index] = self._start_worker(index, handle.env_ids)
            stack_note = f"; worker stack (faulthandler):\n{stack}" if stack else ""
            numbering = f" ({self.numbering_note})" if self.numbering_note else ""
            warnings.warn(f"{description} {reason} during {command!r}; restarted, envs lost: {env_ids}{numbering}"
                          f"{stack_note}", RuntimeWarning, stacklevel=3)
            lost.append({
                "worker": index,
                "env_ids": env_ids,
                "tasks": [self.slots[i].label for i in env_ids],
                "reason": reason,
                "stack": stack,
            })
        return lost

    def _mark_lost(self, env_ids: Sequence[int], finished: np.ndarray | None = None) -> list[int]:
        """The worker is gone, so the parent may write its rows. Nothing of the command ran validly: its
        per-sub-step rows are zeroed. An episode that had already ended (`finished`) keeps its result and its
        last observation; the others are lost: done, not successful, zeroed observations (and frames) so
        nobody consumes stale ones by accident. Returns the lost env ids."""
        buf = self._buffers
        for name in ("rewards", "terminated", "truncated", "valid", "timing"):
            buf[name][env_ids] = 0
        lost = [i for i in env_ids if finished is None or not finished[i]]
        buf["state"][lost] = 0
        for camera in self.cfg.cameras:
            buf[f"{camera}_image"][lost] = 0
            if self.cfg.render_every == "substep":
                buf[f"{camera}_frames"][lost] = 0
        buf["done"][lost] = True
        buf["success"][lost] = False
        self._lost[lost] = True
        return lost

    @contextlib.contextmanager
    def _awaiting_replies(self, command: str):
        """Anything but a worker's reported error (KeyboardInterrupt, a failed restart) can leave replies to
        `command` in the pipes, which the next command would take for its own: the env is unusable then."""
        try:
            yield
        except EnvWorkerError:
            raise  # every worker answered: the pipes are in step
        except BaseException as exc:
            if self._broken is None:
                self._broken = (f"after an interrupted {command!r} ({type(exc).__name__}: {exc}): the workers' "
                                "replies may still be pending; close this env and make a new one")
            raise

    # ---------------------------------------------------------------------- hooks
    def _check_open(self) -> None:
        super()._check_open()
        if self._broken is not None:
            raise RuntimeError(f"the vector env is unusable {self._broken}")

    def _worker_env_ids(self) -> list[list[int]]:
        return [h.env_ids for h in self._workers]

    def _reset_envs(self, plan: list[tuple[int, int, int]]) -> None:
        by_worker = {h.index: [p for p in plan if p[0] in set(h.env_ids)] for h in self._workers}
        attempts = 2 if self.cfg.restart_on_crash else 1
        with self._awaiting_replies("reset"):
            for _ in range(attempts):
                handles = [self._workers[i] for i in by_worker]
                self._wait_created(handles)
                errors, failures = self._exchange(handles, ("reset", by_worker), "reset")
                self._handle_failures(failures, "reset", errors)
                self._raise_errors(errors, "reset")
                if not failures:
                    return
                by_worker = {i: by_worker[i] for i in failures}  # retry on the restarted workers
            self._raise_crash({i: "crashed again after a restart" for i in by_worker}, "reset")

    def _step_envs(self, horizon: int, render: bool = True) -> list[dict]:
        finished = self._buffers["done"].copy()  # episodes that ended before this chunk keep their result
        return self._command("step", (horizon, render), finished)

    def _render_envs(self, unrendered: np.ndarray, workers_at_once: int | None = None) -> list[dict]:
        # a worker lost now loses its unrendered episodes (no final images); its other envs keep theirs
        holders = [h for h in self._workers if unrendered[h.env_ids].any()]
        width = len(holders) if workers_at_once is None else workers_at_once
        lost: list[dict] = []
        for first in range(0, len(holders), max(width, 1)):  # waves: fewer GL contexts share the GPU at once
            wave = np.zeros_like(unrendered)
            for h in holders[first:first + width]:
                wave[h.env_ids] = unrendered[h.env_ids]
            lost += self._command("render", None, ~unrendered, only=wave)
        return lost

    def _command(self, command: str, payload: Any, finished: np.ndarray, only: np.ndarray | None = None
                 ) -> list[dict]:
        """`command` to every worker not rebuilding after a crash (those hold only lost envs) and, with `only`,
        holding an env of that mask; crashes and errors as `_handle_failures` and `_raise_errors` treat them."""
        handles = [h for h in self._workers if not h.creating and (only is None or only[h.env_ids].any())]
        with self._awaiting_replies(command):
            errors, failures = self._exchange(handles, (command, {h.index: payload for h in handles}), command)
            lost = self._handle_failures(failures, command, errors, finished)
            self._raise_errors(errors, command)
        return lost

    def _exchange(self, handles: Sequence[WorkerHandle], message: tuple[str, dict], command: str
                  ) -> tuple[dict[int, str], dict[int, str]]:
        """Send each worker its payload (message[1][index]) and collect the replies: (errors, failures)."""
        kind, payloads = message
        sent = [h for h in handles if self._send(h, (kind, payloads[h.index]))]
        _replies, errors, failures = self._gather(sent, command, self.cfg.worker_timeout_s)
        for h in handles:
            if h not in sent:
                failures[h.index] = process_death_reason(h.process)
        return errors, failures

    def _close_impl(self) -> None:
        self._finalizer()


def gather_replies(
    peers: dict[int, tuple[Any, Any]],
    command: str,
    timeout_s: float,
    on_progress: Callable[[int, Any], None] | None = None,
) -> tuple[dict, dict, dict]:
    """Wait for one reply per peer (index -> (pipe connection, process)) to `command`.

    Returns (ok payloads, error tracebacks, failures), each keyed by index; a failure says why a
    peer gave no reply: it died (exit code or signal, noticed through its process sentinel at
    once) or stayed silent past `timeout_s` (hung). Replies are ("ok" | "error" | "progress",
    payload); "progress" messages go to `on_progress(index, payload)` and do not count."""
    pending = dict(peers)
    replies: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for index in pending:
                failures[index] = f"sent no reply to {command!r} within {timeout_s:g} s (hung)"
            break
        waitables = [conn for conn, _ in pending.values()] + [proc.sentinel for _, proc in pending.values()]
        mp_connection.wait(waitables, timeout=min(remaining, 1.0))
        for index, (conn, process) in list(pending.items()):
            message, gone = _poll(conn)
            if message is None:
                if gone or not process.is_alive():
                    failures[index] = process_death_reason(process)
                    del pending[index]
                continue
            kind, payload = message
            if kind == "progress":
                if on_progress is not None:
                    on_progress(index, payload)
                continue
            del pending[index]
            if kind == "ok":
                replies[index] = payload
            else:
                errors[index] = payload
    return replies, errors, failures


def _poll(conn: Any) -> tuple[tuple | None, bool]:
    """(message or None, pipe closed)."""
    try:
        if conn.poll():
            return conn.recv(), False
    except (EOFError, OSError):
        return None, True
    return None, False


def process_death_reason(process: Any) -> str:
    """Why a worker process that stopped answering is gone: exit code or signal."""
    process.join(timeout=1.0)
    code = process.exitcode
    if code is None:
        return "closed its pipe but is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died (killed by {name})"
    return f"died (exit code {code})"


def _stop_processes(handles: list[WorkerHandle], graceful: bool) -> None:
    """Stop workers together: with `graceful`, the live ones not still creating are asked to close before any is
    waited for, sharing one CLOSE_GRACE_S deadline (`common.processes.stop_processes`), so their exits overlap (a
    worker's took 1.1-1.6 s on a 2-core box, round 61: one after another they held a SIGTERM'd run's exit ~5 s for 4
    workers). A failed worker is killed first; the others are ended (`end_process`)."""
    for handle in handles:
        if handle.failed:
            handle.process.kill()  # SIGKILL also ends a stopped (SIGSTOP) or hung process at once
            handle.process.join(timeout=5.0)
    asked = [h for h in handles if graceful and h.process.is_alive() and not h.creating]
    stop_processes([(h.process, h.conn) for h in asked], CLOSE_GRACE_S, join_s=5.0)
    for handle in handles:
        end_process(handle.process, 5.0)  # the ones not asked (a no-op for those stopped above)
        try:
            handle.conn.close()
        except OSError:
            pass
        try:
            handle.process.close()
        except ValueError:
            pass


def _shutdown(workers: list[WorkerHandle], buffers: SharedBuffers, fault_dir: str) -> None:
    """Stop every worker, then free the shared memory and the fault files. Safe to call more
    than once."""
    try:
        _stop_processes(workers, graceful=True)
        workers.clear()
    finally:
        buffers.close()
        shutil.rmtree(fault_dir, ignore_errors=True)
