"""The env worker process: an explicit command loop over a few envs.

Runs in a spawned (or forkserver) process. It chooses the GL backend before anything imports
MuJoCo, attaches the parent's shared memory, builds its envs lazily on "create", and answers
every command with ("ok", payload) or ("error", traceback). Observations and results go
through shared memory, never through the pipe. Envs and the mapping are released in
`finally`, whatever ends the loop.

A crash that kills the process (a segfault in MuJoCo or the GL driver) leaves no exception to
forward: `faulthandler` writes the Python stack of such a crash to `fault_path`, which the
parent reads into its error message.

Commands (parent -> worker):  ("create", None)  ("reset", plan)  ("step", (horizon, render))
                              ("render", None)  ("pid", None)  ("close", None)
                              (render=False defers the chunk-end render; "render" renders the envs
                              such a step left pending: `runner.EnvRunner.render_pending`)
Replies (worker -> parent):   ("progress", env_id) during create, then ("ok", payload) or
                              ("error", "<traceback>")
"""

from __future__ import annotations

import faulthandler
import os
import signal
import traceback
from typing import Any

from common.processes import send_quietly


def worker_main(
    conn: Any, worker_index: int, env_ids: list, task_ids: list, cfg_dict: dict, shm_name: str,
    specs: list | None = None, fault_path: str | None = None,
) -> None:
    """specs: per env, `catalog.worker_specs` (what the parent read for it); fault_path: where
    faulthandler writes the stack of a fatal crash."""
    # Ctrl-C reaches the whole process group; the parent decides how to shut workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = buffers = fault_file = None
    try:
        if fault_path is not None:
            fault_file = open(fault_path, "w")  # stays open: faulthandler writes to it on a crash
            faulthandler.enable(file=fault_file)
        from envs.config import EnvConfig

        cfg = EnvConfig(**cfg_dict)
        if cfg.worker_nice:
            os.nice(cfg.worker_nice)  # env stepping yields the CPU to the driver (env.worker_nice)
        if cfg.env_type == "libero":
            from envs.rendering import configure_gl

            configure_gl(cfg.render_backend)  # before anything imports mujoco
        from envs.vector.buffers import SharedBuffers
        from envs.vector.catalog import make_env
        from envs.vector.runner import EnvRunner

        buffers = SharedBuffers.attach(cfg, shm_name)
        specs = specs if specs is not None else [None] * len(task_ids)
        envs = [make_env(cfg, task_id, spec) for task_id, spec in zip(task_ids, specs, strict=True)]
        runner = EnvRunner(cfg, env_ids, envs, buffers.arrays)
        _command_loop(conn, runner)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent went away: nothing to report to
    except BaseException:
        send_quietly(conn, ("error", f"worker {worker_index} (pid {os.getpid()}) failed to start:\n"
                              + traceback.format_exc()))
    finally:
        try:
            if runner is not None:
                runner.close()
        finally:
            if buffers is not None:
                buffers.close()
            conn.close()
            if fault_file is not None:
                faulthandler.disable()
                fault_file.close()


def _command_loop(conn: Any, runner: Any) -> None:
    while True:
        command, payload = conn.recv()
        if command == "close":
            runner.close()
            conn.send(("ok", None))
            return
        try:
            if command == "create":
                runner.create(on_created=lambda env_id: conn.send(("progress", env_id)))
                reply = None
            elif command == "reset":
                runner.reset(payload)
                reply = None
            elif command == "step":
                horizon, render = payload
                runner.step_chunk(int(horizon), bool(render))
                reply = None
            elif command == "render":
                runner.render_pending()
                reply = None
            elif command == "pid":
                reply = os.getpid()
            else:
                raise ValueError(f"unknown worker command {command!r}")
        except Exception:
            conn.send(("error", traceback.format_exc()))
        else:
            conn.send(("ok", reply))
