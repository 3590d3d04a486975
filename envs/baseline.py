"""A baseline vector env built the way RLinf runs LIBERO (for experiments/bench_env.py).

RLinf (rlinf/envs/libero/libero_env.py + venv.py, a tianshou-style SubprocVectorEnv) runs one
spawned subprocess per env, talks to it over a Pipe, and executes an action chunk as H
consecutive vector steps. Each sub-step sends one action to every worker, the worker calls
LIBERO's `OffScreenRenderEnv.step` (robosuite renders every camera and computes every
observable, ~40 arrays), pickles the whole observation dict back, and the parent extracts the
rotated images and the 8-dim state from it (`_wrap_obs`) at every sub-step. Episodes start
with `reset()`, `set_init_state()` and no-op steps, each also a full round trip. As in RLinf,
the parent holds the tasks' init states (workers never load them, nor import torch).

Differences from RLinf, all in the baseline's favour or neutral: no torch conversion of the
observations, no video/metrics bookkeeping, no task reconfiguration; the no-op settle action is
openpi's (gripper -1, RLinf uses 0) so both harnesses follow the same trajectory.
Timing: each worker reports the seconds spent in env.step and, within it, in camera rendering
(the camera sensors are wrapped with a timer), so the bench can split physics / render /
transfer for the baseline too.

Failures behave as in our vector env (envs/vector/subproc.py): the parent waits on every
worker's pipe and process sentinel, so a dead worker raises `WorkerCrashedError` at once and a
hung one after `env.worker_timeout_s` (`env.create_timeout_s` while building), naming the env,
its task and pid; an exception in a worker raises `EnvWorkerError` with its traceback. After a
crash the baseline is unusable (no restarts: RLinf has none either).

`env_type=countdown` (envs/testing.py) runs the same process/pipe mechanics without MuJoCo, for
tests.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import signal
import time
import traceback
from typing import Any

import numpy as np

from envs.config import EnvConfig, robosuite_camera
from envs.libero_env import NOOP_ACTION, quat_to_axis_angle, rotate_180, state_vector
from envs.vector.subproc import EnvWorkerError, WorkerCrashedError, gather_replies

CLOSE_GRACE_S = 10.0
BASELINE_ENV_TYPES = ("libero", "countdown")  # the env processes below


def _timed_camera_sensors(robosuite_env: Any, totals: dict) -> None:
    """Wrap every camera observable's sensor to accumulate its time in totals["render_s"]."""
    for camera in robosuite_env.camera_names:
        observable = robosuite_env._observables[f"{camera}_image"]
        sensor = observable._sensor

        # wraps() copies the sensor's __modality__, which robosuite reads on every
        # observation (LIBERO's reset retries forever on any exception, so it must be there).
        @functools.wraps(sensor)
        def timed(obs_cache, _sensor=sensor):
            start = time.perf_counter()
            try:
                return _sensor(obs_cache)
            finally:
                totals["render_s"] += time.perf_counter() - start

        observable._sensor = timed


class _LiberoEnvProcess:
    """What one RLinf env process holds: LIBERO's OffScreenRenderEnv, stepped with full obs."""

    def __init__(self, cfg: EnvConfig, spec: tuple):
        from envs.rendering import configure_gl

        configure_gl(cfg.render_backend)
        from envs.suites import make_robosuite_env

        task, self.init_states = spec
        self.env = make_robosuite_env(task, image_size=cfg.image_size, cameras=cfg.robosuite_cameras,
                                      ignore_done=True)
        self.totals = {"render_s": 0.0}
        if cfg.cameras:
            from envs.render_options import apply_render_options

            # the options that change pixels hold on both sides of a comparison (culling changes none:
            # it stays ours' engineering); without this the baseline rendered LIBERO's look whatever they said
            try:
                apply_render_options(self.env, cfg.render_reflections, cfg.render_multisamples,
                                     cfg.render_mesh_faces)
            except BaseException:
                self.env.close()
                raise
            _timed_camera_sensors(self.env.env, self.totals)

    def reset(self) -> None:
        self.env.reset()

    def set_init_state(self, init_state_id: int) -> dict:
        return self.env.set_init_state(self.init_states[init_state_id])

    def step(self, action: np.ndarray) -> tuple:
        self.totals["render_s"] = 0.0
        start = time.perf_counter()
        obs, reward, done, info = self.env.step(action)
        info = dict(info, step_s=time.perf_counter() - start, render_s=self.totals["render_s"])
        return obs, reward, done, info

    def end_state(self) -> np.ndarray:
        """The 8-dim state at the end of the last step, computed as our harness observes it
        (robosuite's step observation lags it: envs/steppers.py). Not used while timing."""
        from envs.steppers import robosuite_proprio

        self.env.env.sim.forward()
        return state_vector(robosuite_proprio(self.env.env))

    def close(self) -> None:
        self.env.close()


class _CountdownEnvProcess:
    """The countdown test env behind the same calls (observations already in policy format)."""

    def __init__(self, cfg: EnvConfig, task_id: int):
        from envs.testing import CountdownEnv

        self.env = CountdownEnv(task_id, image_size=cfg.image_size, cameras=cfg.cameras)

    def reset(self) -> None:
        self.env.ensure_created()

    def set_init_state(self, init_state_id: int) -> dict:
        self.env.begin_episode(init_state_id, 0)
        return self.env.observation()

    def step(self, action: np.ndarray) -> tuple:
        start = time.perf_counter()
        reward, success = self.env.control_step(action)
        obs = self.env.observation()
        return obs, reward, success, {"step_s": time.perf_counter() - start, "render_s": 0.0}

    def end_state(self) -> np.ndarray:
        return self.env.observation(render=False)["state"]

    def close(self) -> None:
        self.env.close()


def _baseline_worker(conn: Any, cfg_dict: dict, task_id: int, spec: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    env = None
    try:
        cfg = EnvConfig(**cfg_dict)
        env = _CountdownEnvProcess(cfg, task_id) if cfg.env_type == "countdown" else _LiberoEnvProcess(cfg, spec)
        conn.send(("ok", None))
        while True:
            command, data = conn.recv()
            if command == "close":
                conn.send(("ok", None))
                return
            try:
                if command == "step":
                    reply = env.step(data)
                elif command == "reset":
                    reply = env.reset()
                elif command == "set_init_state":
                    reply = env.set_init_state(int(data))
                elif command == "end_state":
                    reply = env.end_state()
                else:
                    raise ValueError(f"unknown baseline command {command!r}")
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", reply))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if env is not None:
            env.close()
        conn.close()


class RlinfStyleVectorEnv:
    """One process per env, pipes, full observations pickled, cameras at every sub-step."""

    def __init__(self, cfg: EnvConfig, task_ids: list[int]):
        from envs.vector.catalog import worker_specs

        if cfg.env_type not in BASELINE_ENV_TYPES:  # else each worker fails to build with a bare TypeError
            raise ValueError(f"the RLinf-style baseline runs env.env_type {list(BASELINE_ENV_TYPES)}, got "
                             f"{cfg.env_type!r}")
        if len(task_ids) != cfg.num_envs:
            raise ValueError(f"baseline needs one task id per env ({cfg.num_envs}), got {len(task_ids)}")
        self.cfg = cfg
        self.task_ids = list(task_ids)
        specs = worker_specs(cfg, self.task_ids)
        self.labels = [f"{cfg.env_type}/{t}" if spec is None else spec[0].label
                       for t, spec in zip(self.task_ids, specs, strict=True)]
        ctx = mp.get_context("spawn")  # as RLinf's ReconfigureSubprocEnvWorker
        self._conns, self._procs = [], []
        self._broken: str | None = None
        self._failed: set[int] = set()  # died or hung: killed without asking on close
        self.last_timing: dict[str, float] = {}
        try:
            for task_id, spec in zip(task_ids, specs, strict=True):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_baseline_worker, args=(child, cfg.to_dict(), task_id, spec), daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._collect("create", self.cfg.create_timeout_s, progress=cfg.show_progress)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ messaging
    def _collect(self, command: str, timeout_s: float, progress: bool = False) -> list:
        """One reply per env, in env order; raises naming the env on a crash, hang or error."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self._conns), desc="creating baseline envs (1 process each)", unit="env")
        try:
            replies, errors, failures = self._gather(timeout_s, command, bar)
        finally:
            if bar is not None:
                bar.close()
        if failures:
            self._failed.update(failures)
            self._broken = "; ".join(f"{self._describe(i)} {why}" for i, why in sorted(failures.items()))
            raise WorkerCrashedError(f"baseline, during {command!r}: {self._broken}")
        if errors:
            index, text = sorted(errors.items())[0]
            raise EnvWorkerError(f"baseline {self._describe(index)} raised during {command!r}:\n{text}")
        return [replies[i] for i in range(len(self._conns))]

    def _gather(self, timeout_s: float, command: str, bar: Any) -> tuple[dict, dict, dict]:
        peers = {i: (conn, proc) for i, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True))}
        replies, errors, failures = gather_replies(peers, command, timeout_s)
        if bar is not None:
            bar.update(len(replies) + len(errors))
        return replies, errors, failures

    def _describe(self, index: int) -> str:
        return f"env {index} ({self.labels[index]}, pid {self._procs[index].pid})"

    def _call_all(self, command: str, data: list) -> list:
        if self._broken is not None:
            raise RuntimeError(f"the baseline is unusable after a worker crash: {self._broken}")
        for conn, item in zip(self._conns, data, strict=True):
            try:
                conn.send((command, item))
            except OSError:
                pass  # a dead worker is reported by _collect, through its sentinel
        return self._collect(command, self.cfg.worker_timeout_s)

    # ------------------------------------------------------------------ the RLinf-style env
    def _wrap_obs(self, raw_obs: list[dict]) -> dict[str, Any]:
        """RLinf's per-step extraction: rotated images and the 8-dim state, stacked."""
        if self.cfg.env_type == "countdown":  # already the policy's keys
            return {key: np.stack([o[key] for o in raw_obs]) for key in raw_obs[0]}
        obs = {
            f"{camera}_image": np.stack([rotate_180(o[f"{robosuite_camera(camera)}_image"]) for o in raw_obs])
            for camera in self.cfg.cameras
        }
        obs["state"] = np.stack([
            np.concatenate([o["robot0_eef_pos"], quat_to_axis_angle(o["robot0_eef_quat"]),
                            o["robot0_gripper_qpos"]]) for o in raw_obs
        ]).astype(np.float32)
        return obs

    def reset(self, init_state_ids: list[int]) -> dict[str, Any]:
        self._call_all("reset", [None] * len(self._conns))
        raw = self._call_all("set_init_state", [int(k) for k in init_state_ids])
        noop = [NOOP_ACTION.copy() for _ in self._conns]
        for _ in range(self.cfg.num_settle_steps):
            raw = [r[0] for r in self._call_all("step", noop)]
        return self._wrap_obs(raw)

    def chunk_step(self, actions: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
        """actions (N, H, 7) -> (obs at chunk end, rewards (N, H), terminations (N, H))."""
        n, horizon = actions.shape[:2]
        rewards = np.zeros((n, horizon), dtype=np.float32)
        terminations = np.zeros((n, horizon), dtype=bool)
        timing = {"wall_s": 0.0, "step_s": 0.0, "render_s": 0.0, "busiest_worker_s": 0.0}
        obs = None
        for h in range(horizon):
            start = time.perf_counter()
            replies = self._call_all("step", list(actions[:, h]))
            obs = self._wrap_obs([r[0] for r in replies])
            timing["wall_s"] += time.perf_counter() - start
            step_s = [r[3]["step_s"] for r in replies]
            timing["step_s"] += sum(step_s)
            timing["render_s"] += sum(r[3]["render_s"] for r in replies)
            timing["busiest_worker_s"] += max(step_s)
            rewards[:, h] = [r[1] for r in replies]
            terminations[:, h] = [bool(r[2]) for r in replies]
        timing["physics_s"] = timing["step_s"] - timing["render_s"]
        timing["transfer_s"] = max(timing["wall_s"] - timing["busiest_worker_s"], 0.0)
        self.last_timing = timing
        return obs, rewards, terminations

    def end_states(self) -> np.ndarray:
        """(N, 8) state at the end of each env's last step (see `_LiberoEnvProcess.end_state`)."""
        return np.stack(self._call_all("end_state", [None] * len(self._conns)))

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Stop every worker (a hung or stopped one is killed). Idempotent."""
        for index, proc in enumerate(self._procs):
            if index in self._failed and proc.is_alive():
                proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) or hung process at once
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

