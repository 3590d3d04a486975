"""Worker-process plumbing shared by the env workers, the engine's rank processes and the
data-parallel actor's ranks: messages to a pipe whose other end may be gone, stopping, and leaving a
process group whose other members may never leave."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM (`timeout`'s or a scheduler's stop) raised in this process's main thread as SystemExit(143), so the
    `finally` blocks run: worker processes are closed and shared memory unlinked, the trace flushed, instead of the
    process vanishing mid-step. A second SIGTERM during that cleanup kills as before. A process forked meanwhile
    dies of SIGTERM as before: the fork hooks below hand it the default action. Outside the main thread (where
    Python cannot set handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.getpid() != owner:  # forked by code that skips Python's fork hooks: die as it would have
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    handler.terminates_as_exit = True  # type: ignore[attr-defined]  # what the fork hooks look for
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _handler_installed() -> bool:
    return getattr(signal.getsignal(signal.SIGTERM), "terminates_as_exit", False)


_unblock_after_fork = False  # the GIL is held from the before-hook to the after-hooks: no other fork interleaves


def _block_sigterm_before_fork() -> None:
    """A SIGTERM sent to a child as it starts (a worker terminated right after start()) reaches the handler's C
    part on the child's first return from fork(), and CPython's after-fork reset then drops it: the child would
    sleep on. Blocked across the fork, it stays pending until the child has the default action back."""
    global _unblock_after_fork
    _unblock_after_fork = False
    if _handler_installed():
        was_blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _unblock_after_fork = not was_blocked


def _unblock_sigterm_after_fork() -> None:
    if _unblock_after_fork:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _default_sigterm_in_child() -> None:
    try:
        if _handler_installed():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    finally:
        _unblock_sigterm_after_fork()  # a SIGTERM pending since the fork kills the child here


os.register_at_fork(before=_block_sigterm_before_fork, after_in_parent=_unblock_sigterm_after_fork,
                    after_in_child=_default_sigterm_in_child)


def send_quietly(conn: Any, message: tuple) -> bool:
    """conn.send(message); False instead of an error when the other end is gone."""
    try:
        conn.send(message)
        return True
    except (OSError, EOFError):
        return False


def finish_within(fn: Callable[[], Any], timeout_s: float, name: str) -> bool:
    """Run `fn` in a daemon thread and wait for it at most `timeout_s`; False when it had not finished (it is left
    running). For a process group's destroy, collective under NCCL: a member that never destroys its own must
    not hang the caller's teardown."""
    thread = threading.Thread(target=fn, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def end_process(process: Any, join_s: float) -> None:
    """Terminate a process that is still alive, then kill it if that did not end it (join_s each)."""
    if process.is_alive():
        process.terminate()
        process.join(join_s)
    if process.is_alive():
        process.kill()
        process.join(join_s)


def stop_processes(handles: Iterable[tuple[Any, Any]], grace_s: float, ask: bool = True, join_s: float = 2.0) -> None:
    """Stop (process, conn) pairs: ask the live ones to ("close", None) (unless `ask` is False),
    give them `grace_s` in all to exit, end what is left (`end_process`), close every pipe."""
    handles = list(handles)
    if ask:
        for process, conn in handles:
            if process.is_alive():
                send_quietly(conn, ("close", None))
    deadline = time.monotonic() + grace_s
    for process, conn in handles:
        process.join(max(deadline - time.monotonic(), 0.1))
        end_process(process, join_s)
        conn.close()


def start_with_pipe(ctx: Any, target: Callable, args: tuple, name: str,
                    failed: Callable[[Exception], Exception]) -> tuple[Any, Any]:
    """Start `target(child_conn, *args)` as a daemon process of `ctx`; returns (process, parent_conn). A start
    that fails (spawn refused, arguments that do not pickle) closes both pipe ends, which are in no handle yet
    for the caller's close() to find, and raises `failed(exc)` (an error naming the rank) from it."""
    parent, child = ctx.Pipe(duplex=True)
    try:
        process = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        process.start()
    except Exception as exc:
        parent.close()
        raise failed(exc) from exc
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()  # the started process holds its own copy
    return process, parent
