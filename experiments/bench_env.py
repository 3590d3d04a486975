"""Benchmark: our vector env against an RLinf-style baseline, same tasks, same actions.

    python -m experiments.bench_env                      # CPU acceptance setup (conf/bench_env.yaml)
    python -m experiments.bench_env env.suite=libero_10 env.num_envs=64 env.num_workers=16 \
        env.image_size=224 env.chunk_size=10             # GPU machine (EGL is picked automatically)

Ours: `AsyncVectorEnv` (several envs per worker, shared memory, cameras rendered once per
chunk). Baseline: `envs.baseline.RlinfStyleVectorEnv` (one process per env, as RLinf runs
LIBERO: 64 envs are 64 processes whatever the core count; pipes, full observation pickled and
cameras rendered at every sub-step). Both reset to the same init states and execute the same
random action chunks; the bench reports env steps/s and chunks/s of both, per-phase time
(physics, render, transfer; physics and render are summed over envs, transfer is wall time not
covered by the busiest worker), the CPU count, and checks that both did the same work
(experiments/bench_env_checks.py): it exits non-zero when a final-state check fails.

Two speed-ups: `speedup` (ours in the env's step mode, lean by default, vs the baseline) and
`speedup_harness_only` (ours with robosuite's own env.step vs the baseline: what the harness
alone gives; lean stepping could be adopted by RLinf too).

`bench.step_modes` measures ours once per stepper ("robosuite", "lean"); with
`bench.step_mode_comparison=true` it adds, per mode, one env in this process (first, before any
worker process exists) and all workers without images. The one-process rates are medians of
`bench.repeats` interleaved passes after one untimed warm-up pass of every mode.

The JSON goes to runs/bench_env/ (experiments/results.py); `bench.commit=true` (or
VLA_COMMIT_RESULTS=1) writes it to benchmarks/results/ for committing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from common.config import reject_unknown_keys
from envs.config import EnvConfig, register_hydra_schema
from experiments.bench_env_checks import describe_checks, final_state_checks, lean_vs_robosuite_check
from experiments.results import write_result

register_hydra_schema()


@dataclass
class BenchConfig:
    num_chunks: int = 6  # timed chunks
    warmup_chunks: int = 1
    step_modes: list[str] = field(default_factory=lambda: ["lean", "robosuite"])
    baseline: bool = True
    step_mode_comparison: bool = True  # per-process and all-worker section per step mode
    step_mode_steps: int = 200  # control steps per per-process measurement
    repeats: int = 3  # timed passes per per-process mode (median reported)
    action_scale: float = 0.5  # actions ~ U(-scale, scale)
    seed: int = 0
    out_dir: str | None = None  # None: experiments.results decides (runs/bench_env/)
    commit: bool = False  # write the JSON to benchmarks/results/ (a result to commit)

    def __post_init__(self) -> None:
        for key in ("num_chunks", "step_mode_steps", "repeats"):
            if getattr(self, key) < 1:
                raise ValueError(f"bench.{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup_chunks < 0:
            raise ValueError(f"bench.warmup_chunks must be >= 0, got {self.warmup_chunks}")
        if not self.step_modes:
            raise ValueError("bench.step_modes must name at least one step mode")
        if not 0 < self.action_scale <= 1:
            raise ValueError(f"bench.action_scale must be in (0, 1], got {self.action_scale}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> BenchConfig:
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
        end_state = vec.end_states()  # after the timing: robosuite's step observation lags it
    finally:
        vec.close()
    steps = len(walls) * actions.shape[1] * actions.shape[2]
    return {**_rates(create_s, reset_s, walls, steps, timings, final_state), "final_end_state": end_state}


def per_process_section(env_cfg: EnvConfig, bench: BenchConfig) -> dict[str, Any]:
    """Per step mode, one env in this process (see experiments/bench_env_single.py)."""
    from experiments.bench_env_single import measure_single_process

    section = {}
    for mode in bench.step_modes:
        log(f"one env in this process, step_mode={mode}: {bench.repeats} rounds of {bench.step_mode_steps} steps "
            "per mode after a warm-up pass")
        try:
            section[mode] = measure_single_process(dataclasses.replace(env_cfg, step_mode=mode), bench.repeats,
                                                   bench.step_mode_steps, bench.action_scale, bench.seed)
        except Exception as exc:  # e.g. a step mode that cannot run here: report, keep going
            log(f"one process with step_mode={mode} failed: {exc!r}")
            section[mode] = {"error": repr(exc)}
    return section


def step_mode_comparison(env_cfg: EnvConfig, bench: BenchConfig, actions: np.ndarray,
                         ours: dict[str, dict], per_process: dict[str, dict]) -> dict[str, Any]:
    """Per step mode: one process, and all workers, without images / cameras at chunk end."""
    section: dict[str, Any] = {}
    for mode, measured in ours.items():
        if "error" in measured or "error" in per_process.get(mode, {"error": "not measured"}):
            section[mode] = {"error": measured.get("error") or per_process.get(mode, {}).get("error")}
            continue
        log(f"step-mode comparison: {mode}, all workers without images")
        no_cam = measure_ours(dataclasses.replace(env_cfg, step_mode=mode, cameras=[]), actions, bench.warmup_chunks)
        section[mode] = {
            "per_process": per_process[mode],
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
    # one process first: no worker process of an earlier phase is running or exiting
    per_process = per_process_section(env_cfg, bench) if bench.step_mode_comparison else {}
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
        "timed_chunks": bench.num_chunks,
        "ours": ours,
        "baseline": baseline,
    }
    if bench.step_mode_comparison:
        payload["step_mode_comparison"] = step_mode_comparison(env_cfg, bench, actions, ours, per_process)
    payload["checks"] = checks(env_cfg, bench, payload)
    return payload


def checks(env_cfg: EnvConfig, bench: BenchConfig, payload: dict[str, Any]) -> dict[str, Any]:
    """Did ours and the baseline (and ours in both step modes) do the same work?"""
    out: dict[str, Any] = {}
    ours_all, baseline = payload["ours"], payload["baseline"]
    headline = ours_all.get(headline_mode(env_cfg, ours_all), {})
    if baseline is not None and "final_state" in headline:
        out.update(final_state_checks(headline["final_state"], baseline["final_state"],
                                      baseline.get("final_end_state"), bench.action_scale))
    if all("final_state" in ours_all.get(m, {}) for m in ("lean", "robosuite")):
        out["lean_vs_robosuite"] = lean_vs_robosuite_check(ours_all["lean"]["final_state"],
                                                           ours_all["robosuite"]["final_state"])
    return out


def headline_mode(env_cfg: EnvConfig, ours_all: dict[str, Any]) -> str:
    return env_cfg.step_mode if env_cfg.step_mode in ours_all else next(iter(ours_all))


def summarize(env_cfg: EnvConfig, payload: dict[str, Any]) -> dict[str, Any]:
    ours_all = payload["ours"]
    mode = headline_mode(env_cfg, ours_all)
    ours, baseline = ours_all[mode], payload["baseline"]
    summary: dict[str, Any] = {
        "suite": env_cfg.suite,
        "task_ids": sorted(set(payload.get("task_ids", []))),
        "num_envs": env_cfg.num_envs,
        "num_workers": env_cfg.num_workers,
        "image_size": env_cfg.image_size,
        "cameras": len(env_cfg.cameras),
        "chunk": env_cfg.chunk_size,
        "timed_chunks": payload.get("timed_chunks"),
        "cpu_count": os.cpu_count(),
        "step_mode": mode,
        "ours_env_steps_per_s": ours.get("env_steps_per_s"),
        "ours_chunks_per_s": ours.get("chunks_per_s"),
    }
    for other, measured in ours_all.items():
        if other != mode:
            summary[f"ours_{other}_env_steps_per_s"] = measured.get("env_steps_per_s")
    for other, section in payload.get("step_mode_comparison", {}).items():
        if "error" in section:
            continue
        for scope, values in section.items():
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    summary[f"{other}_{scope}_{key}"] = value
    summary.update(issue_keys(payload, env_cfg))
    if baseline is not None:
        summary["baseline_env_steps_per_s"] = baseline["env_steps_per_s"]
        summary["baseline_chunks_per_s"] = baseline["chunks_per_s"]
        summary["baseline_processes"] = env_cfg.num_envs
        if ours.get("env_steps_per_s"):
            summary["speedup"] = ours["env_steps_per_s"] / baseline["env_steps_per_s"]
            diff = np.abs(np.asarray(ours["final_state"]) - np.asarray(baseline["final_state"]))
            summary["max_final_state_diff"] = float(diff.max())
        harness = ours_all.get("robosuite", {}).get("env_steps_per_s")
        if harness:
            summary["speedup_harness_only"] = harness / baseline["env_steps_per_s"]
    for name, check in payload.get("checks", {}).items():
        summary[f"check_{name}_ok"] = check["ok"]
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
          f"{'(physics only)':>15s} {'all workers, no images':>23s} {'all workers, cams at end':>25s}"
          "   (env steps/s; 1 process: median of passes)")
    for mode, r in section.items():
        if "error" in r:
            print(f"{mode:12s} unavailable: {r['error']}")
            continue
        p, w = r["per_process"], r["all_workers"]
        print(f"{mode:12s} {p['no_images_steps_per_s']:21.1f} {p['cameras_at_chunk_end_steps_per_s']:23.1f} "
              f"{p['cameras_at_chunk_end_physics_steps_per_s']:15.1f} {w['no_images_env_steps_per_s']:23.1f} "
              f"{w['cameras_at_chunk_end_env_steps_per_s']:25.1f}")


def check_episode_covers_bench(env_cfg: EnvConfig, bench: BenchConfig) -> None:
    """Ours stops an env at env.max_episode_steps, the baseline (as RLinf's env loop) steps on: past it the
    two would do different work (and the final-state check would fail for that reason alone)."""
    steps = (bench.warmup_chunks + bench.num_chunks) * env_cfg.chunk_size
    horizon = env_cfg.episode_steps  # env.max_episode_steps, or the suite's default when it is null
    if steps > horizon:
        raise ValueError(f"bench.warmup_chunks + bench.num_chunks ({bench.warmup_chunks} + {bench.num_chunks}) chunks "
                         f"of env.chunk_size ({env_cfg.chunk_size}) are {steps} steps, past env.max_episode_steps "
                         f"({horizon}): lower the chunks or raise the episode length")


def check_baseline_runs(env_cfg: EnvConfig, bench: BenchConfig) -> None:
    """Refused before ours is timed, not after: the baseline has env processes for these types only."""
    from envs.baseline import BASELINE_ENV_TYPES

    if bench.baseline and env_cfg.env_type not in BASELINE_ENV_TYPES:
        raise ValueError(f"bench.baseline=true runs env.env_type {list(BASELINE_ENV_TYPES)} only, got "
                         f"{env_cfg.env_type!r} (set bench.baseline=false)")


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_env")
def main(cfg: DictConfig) -> None:
    env_cfg = EnvConfig.from_mapping(cfg.env)
    bench = BenchConfig.from_mapping(OmegaConf.to_container(cfg.bench, resolve=True))
    check_episode_covers_bench(env_cfg, bench)
    check_baseline_runs(env_cfg, bench)
    log(f"{os.cpu_count()} CPUs; env: {env_cfg.suite}, {env_cfg.num_envs} envs, "
        f"{env_cfg.num_workers} workers, {env_cfg.image_size} px, cameras {env_cfg.cameras}, "
        f"chunk {env_cfg.chunk_size}")
    payload = run(env_cfg, bench)
    print_table(payload)
    if "step_mode_comparison" in payload:
        print_step_mode_table(payload["step_mode_comparison"])
    for line in describe_checks(payload["checks"]):
        print(line)
    summary = summarize(env_cfg, payload)
    write_result("bench_env", payload, summary, bench.out_dir, commit=bench.commit)
    failed = [name for name, check in payload["checks"].items() if not check["ok"]]
    if failed:
        raise SystemExit(f"bench_env: final-state check(s) failed: {failed} (see the [FAIL] lines above)")


if __name__ == "__main__":
    main()
