"""A baseline vector env built the way RLinf runs LIBERO (for experiments/bench_env.py).

RLinf (rlinf/envs/libero/libero_env.py + venv.py, a tianshou-style SubprocVectorEnv) runs one
spawned subprocess per env, talks to it over a Pipe, and executes an action chunk as H
consecutive vector steps. Each sub-step sends one action to every worker, the worker calls
LIBERO's `OffScreenRenderEnv.step` (robosuite renders every camera and computes every
observable, ~40 arrays), pickles the whole observation dict back, and the parent extracts the
rotated images and the 8-dim state from it (`_wrap_obs`) at every sub-step. Episodes start
with `reset()`, `set_init_state()` and no-op steps, each also a full round trip.

Differences from RLinf, all in the baseline's favour or neutral: no torch conversion of the
observations, no video/metrics bookkeeping, no task reconfiguration; the no-op settle action is
openpi's (gripper -1, RLinf uses 0) so both harnesses follow the same trajectory.
Timing: each worker reports the seconds spent in env.step and, within it, in camera rendering
(the camera sensors are wrapped with a timer), so the bench can split physics / render /
transfer for the baseline too.
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
from envs.libero_env import NOOP_ACTION, quat_to_axis_angle, rotate_180

READY_TIMEOUT_S = 900.0


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


def _baseline_worker(conn: Any, cfg_dict: dict, task_id: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    env = None
    try:
        cfg = EnvConfig(**cfg_dict)
        from envs.rendering import configure_gl

        configure_gl(cfg.render_backend)
        from envs.suites import get_task, load_init_states, make_robosuite_env

        task = get_task(cfg.suite, task_id)
        env = make_robosuite_env(
            task, image_size=cfg.image_size, cameras=cfg.robosuite_cameras, ignore_done=True
        )
        totals = {"render_s": 0.0}
        if cfg.cameras:
            _timed_camera_sensors(env.env, totals)
        conn.send(("ready", None))
        while True:
            command, data = conn.recv()
            if command == "step":
                totals["render_s"] = 0.0
                start = time.perf_counter()
                obs, reward, done, info = env.step(data)
                info = dict(info, step_s=time.perf_counter() - start, render_s=totals["render_s"])
                conn.send((obs, reward, done, info))
            elif command == "reset":
                conn.send(env.reset())
            elif command == "set_init_state":
                conn.send(env.set_init_state(load_init_states(task)[data]))
            elif command == "close":
                conn.send(None)
                return
            else:
                raise ValueError(f"unknown command {command!r}")
    except (EOFError, BrokenPipeError):
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
        if len(task_ids) != cfg.num_envs:
            raise ValueError(f"baseline needs one task id per env ({cfg.num_envs}), got {len(task_ids)}")
        self.cfg = cfg
        self.task_ids = list(task_ids)
        ctx = mp.get_context("spawn")  # as RLinf's ReconfigureSubprocEnvWorker
        self._conns, self._procs = [], []
        try:
            for task_id in task_ids:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_baseline_worker, args=(child, cfg.to_dict(), task_id), daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.last_timing: dict[str, float] = {}

    def _wait_ready(self) -> None:
        bar = None
        if self.cfg.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self._conns), desc="creating baseline envs (1 process each)", unit="env")
        try:
            for index, conn in enumerate(self._conns):
                if not conn.poll(READY_TIMEOUT_S):
                    raise TimeoutError(f"baseline env {index} not ready after {READY_TIMEOUT_S} s")
                self._check(index, conn.recv())
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    @staticmethod
    def _check(index: int, reply: Any) -> Any:
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "error":
            raise RuntimeError(f"baseline env {index} failed:\n{reply[1]}")
        return reply

    def _call_all(self, command: str, data: list) -> list:
        for conn, item in zip(self._conns, data, strict=True):
            conn.send((command, item))
        return [self._check(i, conn.recv()) for i, conn in enumerate(self._conns)]

    def _wrap_obs(self, raw_obs: list[dict]) -> dict[str, Any]:
        """RLinf's per-step extraction: rotated images and the 8-dim state, stacked."""
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

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
