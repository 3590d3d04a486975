"""Benchmark: env.steps/s of the lean path against robosuite's step, side by side in one run.

`run_benchmark` measures, on one LIBERO task, for 1 worker process and for N worker processes
(spawn; all workers step at the same time, started together by a barrier):
- `robosuite`: `envs.steppers.RobosuiteStepper` (robosuite's `env.step` with its observables
  switched off, the harness's reference mode);
- `lean`: `envs.lean.LeanStepper`;
each without images, and "cam": with every configured camera rendered at chunk end (one
`observe(render=True)` every `chunk` steps). In every worker both modes run on the same env
from the same snapshot with the same actions, alternating over `rounds` rounds; a phase's rate is
the total steps of all workers divided by the phase's wall time (the slowest worker counts).
`robosuite_native_steps_per_s_1proc` is robosuite's unmodified `env.step` with its non-image
observables on (as LIBERO's own evaluation runs it without cameras).
CLI: `python -m envs.lean.bench --help`; `--profile` prints cProfile tables of native robosuite,
the reference stepper and the lean stepper instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MODES = ("robosuite", "lean")
BARRIER_TIMEOUT_S = 900.0  # env creation (~13 s on CPU) and a phase both fit in it
# BLAS thread pools buy nothing for 7x7 matrices and oversubscribe cores across workers.
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class BenchConfig:
    suite: str = "libero_10"
    task_id: int = 0
    num_workers: int = 2
    steps: int = 200  # per worker, per mode and round, without cameras
    cam_chunks: int = 3  # chunks per worker, per mode and round, with cameras
    chunk: int = 10
    rounds: int = 2
    image_size: int = 128
    cameras: tuple[str, ...] = ("agentview", "robot0_eye_in_hand")
    with_cameras: bool = True
    native_steps: int = 100  # robosuite's unmodified env.step, 1 process
    render_backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("num_workers", "steps", "chunk", "rounds", "image_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"bench.{key} must be a positive integer, got {value!r}")
        for key in ("cam_chunks", "native_steps", "task_id", "seed"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"bench.{key} must be a non-negative integer, got {value!r}")
        self.cameras = tuple(self.cameras)


def _phases(cfg: BenchConfig) -> list[tuple[str, bool]]:
    """(mode, render) per timed phase, alternating modes within each round."""
    out = []
    for _ in range(cfg.rounds):
        out += [(mode, False) for mode in MODES]
    if cfg.with_cameras and cfg.cam_chunks:
        for _ in range(cfg.rounds):
            out += [(mode, True) for mode in MODES]
    return out


class _BenchEnv:
    """One LIBERO env with both steppers, replayable from one snapshot."""

    def __init__(self, cfg: BenchConfig):
        from envs.lean import LeanStepper
        from envs.lean.snapshot import capture
        from envs.rendering import configure_gl
        from envs.steppers import RobosuiteStepper
        from envs.suites import get_task, load_init_states, make_robosuite_env

        configure_gl(cfg.render_backend)
        self.cfg = cfg
        task = get_task(cfg.suite, cfg.task_id)
        use_cameras = cfg.with_cameras and cfg.cam_chunks > 0
        self.libero_env = make_robosuite_env(
            task, image_size=cfg.image_size, cameras=cfg.cameras, use_camera_obs=use_cameras
        )
        self.env = self.libero_env.env
        self.libero_env.reset()
        self.libero_env.set_init_state(load_init_states(task)[0])
        # robosuite's own step with its non-image observables, as LIBERO runs without cameras.
        self.native_observables = [
            o for o in self.env._observables.values() if o.is_enabled() and o.modality != "image"
        ]
        self.steppers = {"robosuite": RobosuiteStepper(self.libero_env)}
        self.steppers["lean"] = LeanStepper(self.libero_env)
        self.snapshot = capture(self.env)
        rng = np.random.default_rng(cfg.seed)
        most = max(cfg.steps, cfg.cam_chunks * cfg.chunk, cfg.native_steps, 1)
        self.actions = rng.uniform(-1.0, 1.0, size=(most, 7))

    def restore(self) -> None:
        from envs.lean.snapshot import restore

        restore(self.env, self.snapshot)

    def run(self, mode: str, render: bool) -> int:
        """Step from the snapshot; returns the number of env.steps taken."""
        self.restore()
        stepper, cfg = self.steppers[mode], self.cfg
        num = cfg.cam_chunks * cfg.chunk if render else cfg.steps
        for i in range(num):
            stepper.step(self.actions[i])
            if render and (i + 1) % cfg.chunk == 0:
                stepper.observe(render=True)
        return num

    def run_native(self, steps: int) -> float:
        """robosuite's unmodified env.step (non-image observables on), steps/s."""
        for observable in self.native_observables:
            observable.set_enabled(True)
        try:
            self.restore()
            start = time.perf_counter()
            for i in range(steps):
                self.env.step(self.actions[i])
            return steps / (time.perf_counter() - start)
        finally:
            for observable in self.native_observables:
                observable.set_enabled(False)

    def warm_up(self) -> None:
        """Compile/load numba kernels and touch every path once (untimed)."""
        for mode in MODES:
            self.restore()
            for i in range(3):
                self.steppers[mode].step(self.actions[i])
        if self.cfg.with_cameras and self.cfg.cam_chunks:
            self.steppers["lean"].observe(render=True)

    def close(self) -> None:
        self.libero_env.close()


def _worker(cfg: BenchConfig, barrier: Any, conn: Any, measure_native: bool) -> None:
    """Create the env, then step each phase between two barrier waits; report or forward errors."""
    bench = None
    try:
        bench = _BenchEnv(cfg)
        bench.warm_up()
        native = bench.run_native(cfg.native_steps) if measure_native and cfg.native_steps else None
        counts = []
        for mode, render in _phases(cfg):
            barrier.wait(BARRIER_TIMEOUT_S)
            counts.append(bench.run(mode, render))
            barrier.wait(BARRIER_TIMEOUT_S)
        conn.send(("ok", {"counts": counts, "native": native}))
    except BaseException:  # noqa: BLE001 - forward everything to the parent, with its traceback
        barrier.abort()
        conn.send(("error", traceback.format_exc()))
    finally:
        if bench is not None:
            bench.close()
        conn.close()


def _run_workers(cfg: BenchConfig, num_workers: int) -> dict[str, Any]:
    """Time each phase in the parent, between the barriers all workers pass together."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(num_workers + 1)
    saved_env = {k: os.environ.get(k) for k in SINGLE_THREAD_ENV}
    os.environ.update(SINGLE_THREAD_ENV)  # inherited by the spawned workers
    procs, pipes = [], []
    try:
        for rank in range(num_workers):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(cfg, barrier, child_conn, rank == 0 and num_workers == 1),
                daemon=True,
            )
            proc.start()
            child_conn.close()
            procs.append(proc)
            pipes.append(parent_conn)
        phase_times = []
        try:
            for _ in _phases(cfg):
                barrier.wait(BARRIER_TIMEOUT_S)
                start = time.perf_counter()
                barrier.wait(BARRIER_TIMEOUT_S)
                phase_times.append(time.perf_counter() - start)
        except Exception as exc:  # a worker aborted the barrier: show its traceback
            raise RuntimeError(
                _collect_errors(pipes) or f"benchmark workers failed: {exc}"
            ) from exc
        reports = [_receive(conn, rank) for rank, conn in enumerate(pipes)]
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    return _summarise(cfg, num_workers, phase_times, reports)


def _receive(conn: Any, rank: int) -> dict[str, Any]:
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(f"benchmark worker {rank} failed:\n{payload}")
    return payload


def _collect_errors(pipes: list[Any]) -> str:
    errors = []
    for rank, conn in enumerate(pipes):
        if conn.poll(5):
            status, payload = conn.recv()
            if status == "error":
                errors.append(f"benchmark worker {rank} failed:\n{payload}")
    return "\n".join(errors)


def _summarise(cfg, num_workers, phase_times, reports) -> dict[str, Any]:
    rates: dict[tuple[str, bool], list[float]] = {}
    for index, (mode, render) in enumerate(_phases(cfg)):
        steps = sum(report["counts"][index] for report in reports)
        rates.setdefault((mode, render), []).append(steps / phase_times[index])
    out = {
        f"{mode}{'_cam' if render else ''}": float(np.median(values))
        for (mode, render), values in rates.items()
    }
    out["native"] = reports[0]["native"]
    return out


def run_benchmark(cfg: BenchConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Steps/s of both modes for 1 process and for `num_workers` processes (see module doc)."""
    cfg = cfg or BenchConfig(**overrides)
    one = _run_workers(cfg, 1)
    every = _run_workers(cfg, cfg.num_workers) if cfg.num_workers > 1 else one
    result: dict[str, Any] = {"num_workers": cfg.num_workers}
    for scope, rates in (("1proc", one), ("all", every)):
        for mode in MODES:
            result[f"{mode}_steps_per_s_{scope}"] = rates[mode]
            if f"{mode}_cam" in rates:
                result[f"{mode}_cam_steps_per_s_{scope}"] = rates[f"{mode}_cam"]
        result[f"lean_speedup_{scope}"] = rates["lean"] / rates["robosuite"]
        if "lean_cam" in rates:
            result[f"lean_cam_speedup_{scope}"] = rates["lean_cam"] / rates["robosuite_cam"]
    result["robosuite_native_steps_per_s_1proc"] = one["native"]
    result["config"] = asdict(cfg)
    return result


def profile_modes(cfg: BenchConfig, steps: int = 200, top: int = 25) -> None:
    """cProfile of `steps` env.steps per mode in this process, sorted by own time."""
    import cProfile
    import pstats

    cfg = BenchConfig(**{**asdict(cfg), "with_cameras": False, "steps": steps})
    bench = _BenchEnv(cfg)
    runs = {
        "robosuite_native (env.step, observables on)": lambda: bench.run_native(steps),
        "robosuite (RobosuiteStepper)": lambda: bench.run("robosuite", render=False),
        "lean (LeanStepper)": lambda: bench.run("lean", render=False),
    }
    try:
        bench.warm_up()
        for label, run in runs.items():
            profiler = cProfile.Profile()
            bench.restore()
            profiler.enable()
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            profiler.disable()
            print(f"\n=== {label}: {steps} env.steps, {steps / elapsed:.1f} steps/s under cProfile")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    finally:
        bench.close()


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m envs.lean.bench", description=__doc__)
    parser.add_argument("--suite", default="libero_10")
    parser.add_argument("--task-id", type=int, default=0)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cam-chunks", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--no-cameras", action="store_true")
    parser.add_argument("--native-steps", type=int, default=100)
    parser.add_argument("--render-backend", default="auto")
    parser.add_argument("--profile", action="store_true", help="print cProfile tables instead")
    parser.add_argument("--write", action="store_true",
                        help="also write the result JSON (runs/bench_lean_step/, or benchmarks/results/ "
                             "with VLA_COMMIT_RESULTS=1)")
    args = parser.parse_args(argv)
    cfg = BenchConfig(
        suite=args.suite, task_id=args.task_id, num_workers=args.workers, steps=args.steps,
        cam_chunks=args.cam_chunks, chunk=args.chunk, rounds=args.rounds,
        image_size=args.image_size, with_cameras=not args.no_cameras,
        native_steps=args.native_steps, render_backend=args.render_backend,
    )  # fmt: skip
    if args.profile:
        profile_modes(cfg, steps=args.steps)
        return None
    result = run_benchmark(cfg)
    print(json.dumps(result, indent=2))
    if args.write:
        from experiments.results import write_result  # lazy: envs does not need experiments

        summary = {k: v for k, v in result.items() if k != "config"}
        write_result("bench_lean_step", result, summary)
    return result


if __name__ == "__main__":
    main()
