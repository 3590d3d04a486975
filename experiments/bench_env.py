"""Benchmark: our vector env against an RLinf-style baseline, same tasks, same actions.

    python -m experiments.bench_env                      # CPU acceptance setup (conf/bench_env.yaml)
    python -m experiments.bench_env env.suite=libero_10 env.num_envs=64 env.num_workers=16 \
        env.image_size=224 env.chunk_size=10             # GPU machine (EGL is picked automatically)

Ours: `AsyncVectorEnv` (several envs per worker, shared memory, cameras rendered once per
chunk). Baseline: `envs.baseline.RlinfStyleVectorEnv` (one process per env, pipes, full
observation pickled and cameras rendered at every sub-step). Both reset to the same init
states and execute the same random action chunks; the bench reports env steps/s and chunks/s
of both, per-phase time (physics, render, transfer; physics and render are summed over envs,
transfer is wall time not covered by the busiest worker), the CPU count, and the largest
state difference between the two at the end (a check that both did the same work).

`bench.step_modes` measures ours once per stepper ("robosuite", "lean"); with
`bench.step_mode_comparison=true` it adds, per mode, one env in this process and all workers
without images and with cameras at chunk end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, List, Mapping

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from common.config import reject_unknown_keys
from envs.config import EnvConfig, register_hydra_schema
from experiments.results import write_result

register_hydra_schema()


@dataclass
class BenchConfig:
    num_chunks: int = 6  # timed chunks
    warmup_chunks: int = 1
    step_modes: List[str] = field(default_factory=lambda: ["lean", "robosuite"])
    baseline: bool = True
    step_mode_comparison: bool = True  # per-process and all-worker section per step mode
    step_mode_steps: int = 200  # control steps per per-process measurement
    action_scale: float = 0.5  # actions ~ U(-scale, scale)
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("num_chunks", "step_mode_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"bench.{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup_chunks < 0:
            raise ValueError(f"bench.warmup_chunks must be >= 0, got {self.warmup_chunks}")
        if not self.step_modes:
            raise ValueError("bench.step_modes must name at least one step mode")
        if not 0 < self.action_scale <= 1:
            raise ValueError(f"bench.action_scale must be in (0, 1], got {self.action_scale}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "BenchConfig":
        return cls(**reject_unknown_keys(cls, mapping, "bench", "bench config"))


def log(message: str) -> None:
    print(f"[bench_env {time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_actions(env_cfg: EnvConfig, bench: BenchConfig) -> np.ndarray:
    """(warmup + timed chunks, N, H, 7) actions, identical for ours and the baseline."""
    rng = np.random.default_rng(bench.seed)
    shape = (bench.warmup_chunks + bench.num_chunks, env_cfg.num_envs, env_cfg.chunk_size, 7)
    return rng.uniform(-bench.action_scale, bench.action_scale, shape)


def group_init_state_ids(env_cfg: EnvConfig) -> list[int]:
    """Init state per group: 0, 1, 2, ... (every LIBERO task has 50)."""
    return [g % 50 for g in range(env_cfg.num_groups)]


def _phase_sums(timings: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    return {f"{k}": float(sum(t[k] for t in timings)) for k in keys}


def _rates(create_s: float, reset_s: float, walls: list[float], steps: int, timings: list[dict],
           final_state: np.ndarray) -> dict[str, Any]:
    """Throughput and per-phase sums of one measured run (ours or the baseline)."""
    wall = float(sum(walls))
    return {
        "create_s": create_s,
        "reset_s": reset_s,
        "chunks": len(walls),
        "env_steps": steps,
        "wall_s": wall,
        "env_steps_per_s": steps / wall,
        "chunks_per_s": len(walls) / wall,
        "chunk_wall_median_s": float(np.median(walls)),
        "phases_s": _phase_sums(timings, ("physics_s", "render_s", "transfer_s", "busiest_worker_s")),
        "final_state": final_state,
    }


def measure_ours(env_cfg: EnvConfig, actions: np.ndarray, warmup: int) -> dict[str, Any]:
    from envs.vector import AsyncVectorEnv

    log(f"ours: {env_cfg.num_envs} envs over {env_cfg.num_workers} workers, "
        f"step_mode={env_cfg.step_mode}, cameras={env_cfg.cameras}")
    start = time.perf_counter()
    vec = AsyncVectorEnv(env_cfg)
    try:
        create_s = time.perf_counter() - start
        vec.reset(group_init_state_ids(env_cfg))
        reset_s = vec.last_reset_s
        for chunk in actions[:warmup]:
            vec.step_chunk(chunk)
        walls, timings, steps = [], [], 0
        for chunk in actions[warmup:]:
            t0 = time.perf_counter()
            result = vec.step_chunk(chunk)
            walls.append(time.perf_counter() - t0)
            timings.append(result.info["timing"])
            steps += int(result.valid.sum())
        final_state = result.obs["state"].copy()
    finally:
        vec.close()
    return _rates(create_s, reset_s, walls, steps, timings, final_state)


def measure_baseline(env_cfg: EnvConfig, task_ids: list[int], actions: np.ndarray, warmup: int) -> dict[str, Any]:
    from envs.baseline import RlinfStyleVectorEnv

    log(f"baseline: {env_cfg.num_envs} envs, one process each, cameras every sub-step")
    start = time.perf_counter()
    vec = RlinfStyleVectorEnv(env_cfg, task_ids)
    try:
        create_s = time.perf_counter() - start
        init_ids = [k for k in group_init_state_ids(env_cfg) for _ in range(env_cfg.group_size)]
        t0 = time.perf_counter()
        vec.reset(init_ids)
        reset_s = time.perf_counter() - t0
        for chunk in actions[:warmup]:
            vec.chunk_step(chunk)
        walls, timings = [], []
        for chunk in actions[warmup:]:
            t0 = time.perf_counter()
            obs, _, _ = vec.chunk_step(chunk)
            walls.append(time.perf_counter() - t0)
            timings.append(vec.last_timing)
        final_state = obs["state"].copy()
    finally:
        vec.close()
    steps = len(walls) * actions.shape[1] * actions.shape[2]
    return _rates(create_s, reset_s, walls, steps, timings, final_state)


def measure_single_process(env_cfg: EnvConfig, bench: BenchConfig) -> dict[str, float]:
    """One env in this process: control steps/s without images, and with both cameras
    rendered once per chunk of env.chunk_size steps."""
    from envs.libero_env import LiberoEnv
    from envs.vector.catalog import env_slots

    env = LiberoEnv.from_config(env_cfg, env_slots(env_cfg)[0].task_id)
    try:
        env.begin_episode(0, bench.seed)
        rng = np.random.default_rng(bench.seed)
        actions = rng.uniform(-bench.action_scale, bench.action_scale, (bench.step_mode_steps, 7))
        for action in actions[:5]:  # warm-up: the lean kernel's first call compiles (numba)
            env.control_step(action)
        env.begin_episode(0, bench.seed)
        t0 = time.perf_counter()
        for action in actions:
            env.control_step(action)
        no_images = len(actions) / (time.perf_counter() - t0)
        env.begin_episode(0, bench.seed)
        t0 = time.perf_counter()
        for k, action in enumerate(actions):
            env.control_step(action)
            if (k + 1) % env_cfg.chunk_size == 0:
                env.observation(render=True)
        chunk_end = len(actions) / (time.perf_counter() - t0)
    finally:
        env.close()
    return {"no_images_steps_per_s": no_images, "cameras_at_chunk_end_steps_per_s": chunk_end}


def step_mode_comparison(env_cfg: EnvConfig, bench: BenchConfig, actions: np.ndarray,
                         ours: dict[str, dict]) -> dict[str, Any]:
    """Per step mode: one process, and all workers, without images / cameras at chunk end."""
    section: dict[str, Any] = {}
    for mode, measured in ours.items():
        if "error" in measured:
            section[mode] = {"error": measured["error"]}
            continue
        cfg = dataclasses.replace(env_cfg, step_mode=mode)
        log(f"step-mode comparison: {mode}, one env in this process")
        per_process = measure_single_process(cfg, bench)
        no_cam = measure_ours(dataclasses.replace(cfg, cameras=[]), actions, bench.warmup_chunks)
        section[mode] = {
            "per_process": per_process,
            "all_workers": {
                "no_images_env_steps_per_s": no_cam["env_steps_per_s"],
                "cameras_at_chunk_end_env_steps_per_s": measured["env_steps_per_s"],
            },
        }
    return section


def run(env_cfg: EnvConfig, bench: BenchConfig) -> dict[str, Any]:
    from envs.vector.catalog import env_slots

    task_ids = [slot.task_id for slot in env_slots(env_cfg)]
    actions = make_actions(env_cfg, bench)
    ours: dict[str, dict] = {}
    for mode in bench.step_modes:
        try:
            ours[mode] = measure_ours(dataclasses.replace(env_cfg, step_mode=mode), actions, bench.warmup_chunks)
        except Exception as exc:  # e.g. "lean" before envs.lean exists: report, keep going
            log(f"ours with step_mode={mode} failed: {exc!r}")
            ours[mode] = {"error": repr(exc)}
    baseline = measure_baseline(env_cfg, task_ids, actions, bench.warmup_chunks) if bench.baseline else None
    payload: dict[str, Any] = {
        "env_config": env_cfg.to_dict(),
        "bench_config": dataclasses.asdict(bench),
        "task_ids": task_ids,
        "ours": ours,
        "baseline": baseline,
    }
    if bench.step_mode_comparison:
        payload["step_mode_comparison"] = step_mode_comparison(env_cfg, bench, actions, ours)
    return payload


def summarize(env_cfg: EnvConfig, payload: dict[str, Any]) -> dict[str, Any]:
    ours_all = payload["ours"]
    headline_mode = env_cfg.step_mode if env_cfg.step_mode in ours_all else next(iter(ours_all))
    ours, baseline = ours_all[headline_mode], payload["baseline"]
    summary: dict[str, Any] = {
        "suite": env_cfg.suite,
        "num_envs": env_cfg.num_envs,
        "num_workers": env_cfg.num_workers,
        "image_size": env_cfg.image_size,
        "cameras": len(env_cfg.cameras),
        "chunk": env_cfg.chunk_size,
        "cpu_count": os.cpu_count(),
        "step_mode": headline_mode,
        "ours_env_steps_per_s": ours.get("env_steps_per_s"),
        "ours_chunks_per_s": ours.get("chunks_per_s"),
    }
    for mode, measured in ours_all.items():
        if mode != headline_mode:
            summary[f"ours_{mode}_env_steps_per_s"] = measured.get("env_steps_per_s")
    for mode, section in payload.get("step_mode_comparison", {}).items():
        if "error" in section:
            continue
        for scope, values in section.items():
            for key, value in values.items():
                summary[f"{mode}_{scope}_{key}"] = value
    summary.update(issue_keys(payload, env_cfg))
    if baseline is not None:
        summary["baseline_env_steps_per_s"] = baseline["env_steps_per_s"]
        summary["baseline_chunks_per_s"] = baseline["chunks_per_s"]
        if ours.get("env_steps_per_s"):
            summary["speedup"] = ours["env_steps_per_s"] / baseline["env_steps_per_s"]
            diff = np.abs(np.asarray(ours["final_state"]) - np.asarray(baseline["final_state"]))
            summary["max_final_state_diff"] = float(diff.max())
    return summary


def issue_keys(payload: dict[str, Any], env_cfg: EnvConfig) -> dict[str, Any]:
    """The lean-vs-robosuite headline numbers (no images): one process and all workers, and the
    largest state difference between the two modes after the same actions (0 when identical)."""
    out: dict[str, Any] = {}
    section = payload.get("step_mode_comparison", {})
    for mode in ("lean", "robosuite"):
        values = section.get(mode, {})
        if "per_process" in values:
            out[f"{mode}_steps_per_s_1proc"] = values["per_process"]["no_images_steps_per_s"]
            out[f"{mode}_steps_per_s_all"] = values["all_workers"]["no_images_env_steps_per_s"]
    ours = payload["ours"]
    if all("final_state" in ours.get(m, {}) for m in ("lean", "robosuite")):
        diff = np.abs(np.asarray(ours["lean"]["final_state"]) - np.asarray(ours["robosuite"]["final_state"]))
        out["lean_vs_robosuite_max_state_diff"] = float(diff.max())
    if out:
        out["num_workers"] = env_cfg.num_workers
    return out


def print_table(payload: dict[str, Any]) -> None:
    rows = [(f"ours[{m}]", r) for m, r in payload["ours"].items() if "error" not in r]
    if payload["baseline"] is not None:
        rows.append(("baseline (RLinf-style)", payload["baseline"]))
    print(f"{'':24s} {'env steps/s':>12s} {'chunks/s':>9s} {'create s':>9s} "
          f"{'physics s':>10s} {'render s':>9s} {'transfer s':>10s}")
    for name, r in rows:
        p = r["phases_s"]
        print(f"{name:24s} {r['env_steps_per_s']:12.2f} {r['chunks_per_s']:9.3f} {r['create_s']:9.1f} "
              f"{p['physics_s']:10.2f} {p['render_s']:9.2f} {p['transfer_s']:10.3f}")


def print_step_mode_table(section: dict[str, Any]) -> None:
    print(f"{'step mode':12s} {'1 process, no images':>21s} {'1 process, cams at end':>23s} "
          f"{'all workers, no images':>23s} {'all workers, cams at end':>25s}   (env steps/s)")
    for mode, r in section.items():
        if "error" in r:
            print(f"{mode:12s} unavailable: {r['error']}")
            continue
        p, w = r["per_process"], r["all_workers"]
        print(f"{mode:12s} {p['no_images_steps_per_s']:21.1f} {p['cameras_at_chunk_end_steps_per_s']:23.1f} "
              f"{w['no_images_env_steps_per_s']:23.1f} {w['cameras_at_chunk_end_env_steps_per_s']:25.1f}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_env")
def main(cfg: DictConfig) -> None:
    env_cfg = EnvConfig.from_mapping(cfg.env)
    bench = BenchConfig.from_mapping(OmegaConf.to_container(cfg.bench, resolve=True))
    log(f"{os.cpu_count()} CPUs; env: {env_cfg.suite}, {env_cfg.num_envs} envs, "
        f"{env_cfg.num_workers} workers, {env_cfg.image_size} px, cameras {env_cfg.cameras}, "
        f"chunk {env_cfg.chunk_size}")
    payload = run(env_cfg, bench)
    print_table(payload)
    if "step_mode_comparison" in payload:
        print_step_mode_table(payload["step_mode_comparison"])
    summary = summarize(env_cfg, payload)
    write_result("bench_env", payload, summary)


if __name__ == "__main__":
    main()
