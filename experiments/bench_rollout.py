"""End-to-end rollout benchmark: env steps/s with the policy in the loop, ours vs RLinf-style.

    python -m experiments.bench_rollout                  # CPU smoke run (tiny policy, 2 envs)
    python -m experiments.bench_rollout policy=pi05 env.num_envs=64 env.num_workers=16 env.group_size=8 \
        env.image_size=224 env.chunk_size=10 'env.task_ids=[2,8,2,8,2,8,2,8]' \
        'bench.variants=[no_pipeline,disjoint_workers]'                        # the GPU box

In one run, on the same tasks and init states:
- ours: the lean vector env + `PolicyEngine` (fast path on CUDA) + `RolloutCollector` with
  rollout.collector.stages pipeline stages (stage i's envs step while the engine predicts i+1);
- variants of ours (bench.variants): "no_pipeline" (1 stage, all workers) and
  "disjoint_workers" (each stage on env.num_workers / stages workers) show where the gain is;
  "other_render_at" runs the other `rollout.collector.render_at` schedule (cameras rendered
  with the env step, or only after the other stage's predict returned: GPU renders kept apart from
  the engine's work); "no_reflections" runs ours with `env.render_reflections=false` (the opt-in
  render without MuJoCo's reflection passes: other pixels, so other actions and trajectories);
  "culled" / "unculled" with `env.render_culling` true / false (frustum culling: the same pixels);
  "meshes_4000" with `env.render_mesh_faces=4000` (coarser scenery and arm meshes for the cameras:
  other pixels, envs/render_lod.py); "no_reflections_meshes_4000" with both opt-ins;
- env alone: the same vector envs (ours' stages, stepped together) without the policy, replaying
  the (random-weight) policy's actions ours executed, so the env work is exactly ours';
- engine alone: the same engine on the same observation batches ours predicted;
- RLinf-style (experiments/bench_rollout_baseline.py): one process per env, cameras every
  sub-step, LeRobot's PI05 (eager bf16), sequential: predict the batch, then step every env.
All rates are env steps/s (engine alone: env steps of actions predicted per second). Each
measurement runs bench.warmup_chunks + bench.timed_chunks chunks and times only the timed ones;
ours runs one whole warm-up epoch first (CUDA graphs, numba kernels in the workers), then its
timed epoch, and its rate is the steady state: steps of the timed chunks over the time from the
end of the last warm-up chunk to the end of the last chunk (both ends are the last stage's env
chunk ending, so the window holds whole pipeline rounds). overlap_efficiency = ours /
min(env alone, engine alone): 1.0 means the pipeline hides the faster side completely.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from common.config import (
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    reject_unknown_keys,
    repeated_entries,
)
from common.devices import auto_device
from envs.config import EnvConfig, register_hydra_schema
from experiments.bench_rollout_baseline import measure_baseline
from experiments.results import write_result
from policies import PolicyConfig
from profiler import NULL_TIMELINE, ProfilerConfig, make_timeline, write_meta
from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from rollout.config import RolloutConfig
from rollout.engine import PolicyEngine

register_hydra_schema()

VARIANTS = ("no_pipeline", "disjoint_workers", "other_render_at", "no_reflections", "culled", "unculled",
            "meshes_4000", "no_reflections_meshes_4000")
ENV_VARIANTS = {  # name -> the env keys the variant sets, with their values
    "no_reflections": {"render_reflections": False}, "culled": {"render_culling": True},
    "unculled": {"render_culling": False}, "meshes_4000": {"render_mesh_faces": 4000},
    "no_reflections_meshes_4000": {"render_reflections": False, "render_mesh_faces": 4000}}


@dataclass
class BenchRolloutConfig:
    warmup_chunks: int = 1
    timed_chunks: int = 3
    baseline_timed_chunks: int | None = None  # None: timed_chunks
    mode: str = "train"  # ours' sampling mode (RL rollouts: one SDE step per call)
    baseline: bool = True
    env_only: bool = True
    predict_only: bool = True
    variants: list[str] = field(default_factory=list)  # of VARIANTS
    env_only_actions: str = "replay"  # env alone: "replay" ours' executed actions, or "uniform" random ones
    action_scale: float = 0.5  # "uniform": actions ~ U(-scale, scale)
    seed: int = 0
    device: str = "auto"
    torch_threads: int | None = None  # None: 1 (the env workers share the cores; on CPU and on CUDA)
    trace_dir: str | None = None  # profiler trace of ours' epochs (+ report, Perfetto) here
    out_dir: str | None = None
    commit: bool = False

    def __post_init__(self) -> None:
        check_nonnegative_int("bench.warmup_chunks", self.warmup_chunks)
        check_positive_int("bench.timed_chunks", self.timed_chunks)
        if self.baseline_timed_chunks is not None:
            check_positive_int("bench.baseline_timed_chunks", self.baseline_timed_chunks)
        check_choice("bench.mode", self.mode, ("train", "eval", "ode", "sde", "sde_all"))
        check_choice("bench.env_only_actions", self.env_only_actions, ("replay", "uniform"))
        check_choice("bench.device", self.device, ("auto", "cpu", "cuda"))
        if self.torch_threads is not None:
            check_positive_int("bench.torch_threads", self.torch_threads)
        for name in self.variants:
            check_choice("bench.variants entries", name, VARIANTS)
        repeated = repeated_entries(self.variants)
        if repeated:  # each variant's result is keyed by its name: a second run would overwrite the first
            raise ValueError(f"bench.variants names {repeated} more than once: {list(self.variants)}")
        if not 0 < self.action_scale <= 1:
            raise ValueError(f"bench.action_scale must be in (0, 1], got {self.action_scale}")

    @property
    def chunks(self) -> int:
        return self.warmup_chunks + self.timed_chunks


def log(message: str) -> None:
    print(f"[bench_rollout {time.strftime('%H:%M:%S')}] {message}", flush=True)


def group_init_state_ids(env_cfg: EnvConfig) -> list[int]:
    return [g % 50 for g in range(env_cfg.num_groups)]  # every LIBERO task has 50


# ----------------------------------------------------------------------------- ours


def measure_ours(env_cfg: EnvConfig, coll_cfg: CollectorConfig, engine: PolicyEngine, bench: BenchRolloutConfig,
                 label: str, alone: bool = False, tracing: dict | None = None) -> dict[str, Any]:
    """Warm-up epoch, then the timed epoch; with `alone`, env alone and engine alone on the same
    vector envs and batches; with `tracing`, spans of both epochs land in the trace."""
    tracing = tracing or {}
    timeline = tracing.get("driver", NULL_TIMELINE)
    log(f"{label}: {coll_cfg.stages} stage(s) x {coll_cfg.envs_per_stage(env_cfg)} envs over "
        f"{coll_cfg.stage_workers(env_cfg)} workers each")
    start = time.perf_counter()
    collector = RolloutCollector(env_cfg, engine, coll_cfg, timeline=timeline, stage_timelines=tracing.get("lanes"))
    out: dict[str, Any] = {"create_s": time.perf_counter() - start, "collector": coll_cfg.to_dict()}
    try:
        ids = group_init_state_ids(env_cfg)
        for epoch in range(2):
            with timeline.span("step", step=epoch), timeline.span("rollout", step=epoch):
                batch = collector.collect(ids, seed=bench.seed, mode=bench.mode, step=epoch)
        stats = collector.last_stats
        out.update(
            env_steps_per_s=stats.env_steps_per_s(skip_chunks=bench.warmup_chunks),
            epoch_env_steps_per_s=stats.env_steps_per_s(),
            stats=stats.to_dict(),
            buffer_mib=batch.nbytes / 2**20,
            prompt_tokens_max=int(batch.token_mask.sum(axis=-1).max()),
        )
        log(f"{label}: {out['env_steps_per_s']:.1f} env steps/s steady, {out['epoch_env_steps_per_s']:.1f} over "
            f"the whole epoch ({stats.describe()})")
        # env alone and engine alone are sides of their own: a failure is recorded beside ours' numbers
        # (raised, it lost ours' measured epoch, the variants and the baseline)
        if alone and bench.env_only:
            out["env_only"] = recorded_failure(lambda: env_alone(collector, batch, bench), "env alone")
        if alone and bench.predict_only:
            out["predict_only"] = recorded_failure(lambda: engine_alone(engine, collector, batch, bench),
                                                   "engine alone")
    finally:
        collector.close()
    return out


def env_alone(collector: RolloutCollector, batch, bench: BenchRolloutConfig) -> dict[str, Any]:
    """Ours' vector envs without the policy: every stage runs its chunks back to back in its own
    thread (no barrier between stages, as in ours), the timed chunks start together after the
    warm-up. bench.env_only_actions "replay": the actions ours executed in its timed epoch, from
    the same init states and seeds, so the envs redo ours' trajectories (same physics work;
    `replay_matches`: the states equal ours bit for bit, as they must for LIBERO, deterministic
    from its init state; the vector env draws new episode seeds per reset, so an env whose state
    shows its seed differs there); "uniform": U(-action_scale, action_scale)."""
    ids = np.repeat(group_init_state_ids(collector.env_cfg), collector.group_size)
    stages, replay = collector.stages, bench.env_only_actions == "replay"
    barrier = threading.Barrier(len(stages))

    def run_stage(stage) -> tuple[int, float, float, bool]:
        try:
            return timed_stage(stage)
        except BaseException:
            barrier.abort()  # the other stages' wait raises instead of hanging with this error unseen
            raise

    def timed_stage(stage) -> tuple[int, float, float, bool]:
        rng = np.random.default_rng([bench.seed, stage.index])
        shape = (stage.size, collector.env_cfg.chunk_size, 7)
        stage.reset(ids, collector.group_size, bench.seed)
        steps, matches, start = 0, True, 0.0
        for chunk in range(bench.chunks):
            if chunk == bench.warmup_chunks:
                barrier.wait()
                start = time.perf_counter()
            actions = batch.actions[stage.rows, chunk] if replay else rng.uniform(
                -bench.action_scale, bench.action_scale, shape)
            result = stage.vec.step_chunk(actions)
            if chunk >= bench.warmup_chunks:
                steps += int(result.valid.sum())
            if replay and chunk + 1 < bench.chunks:  # rows ours recorded (a finished env's row stays zero)
                recorded = batch.chunk_valid[stage.rows, chunk + 1]
                matches &= bool(np.array_equal(result.obs["state"][recorded],
                                               batch.states[stage.rows, chunk + 1][recorded]))
        return steps, start, time.perf_counter(), matches

    with ThreadPoolExecutor(len(stages)) as pool:
        runs = list(pool.map(run_stage, stages))
    steps = sum(r[0] for r in runs)
    wall = max(r[2] for r in runs) - min(r[1] for r in runs)
    log(f"env alone ({bench.env_only_actions} actions): {steps / wall:.1f} env steps/s")
    out = {"actions": bench.env_only_actions, "env_steps": steps, "wall_s": wall, "env_steps_per_s": steps / wall,
           "stage_walls_s": [r[2] - r[1] for r in runs]}
    if replay:
        out["replay_matches"] = all(r[3] for r in runs)
    return out


def engine_alone(engine: PolicyEngine, collector: RolloutCollector, batch, bench: BenchRolloutConfig) -> dict[str, Any]:
    """The engine on the observation batches ours predicted (same stage rows, same chunks: a stage's
    chunks end where its last env finished)."""
    ha, walls, rows, timings = collector.env_cfg.chunk_size, [], 0, []
    for t in range(bench.chunks):
        for stage in collector.stages:
            sl = stage.rows
            if t >= int(batch.num_chunks[sl].max()):
                continue  # ours predicted nothing more for this stage
            obs = {key: images[sl, t] for key, images in batch.images.items()}
            obs["state"] = batch.states[sl, t]
            obs["prompt"] = batch.prompts[sl]
            start = time.perf_counter()
            out = engine.predict(obs, mode=bench.mode, group_size=collector.group_size)
            if t >= bench.warmup_chunks:
                walls.append(time.perf_counter() - start)
                rows += stage.size
                timings += out.timings
    if not walls:
        return {"calls": 0, "skipped": "ours predicted no timed chunk: every episode ended in the warm-up chunks"}
    wall = sum(walls)
    log(f"engine alone: {rows * ha / wall:.1f} env steps/s of actions ({rows / wall:.1f} samples/s)")
    # where a call's time goes on the ranks: preprocessing (raw obs -> model inputs on the device),
    # sampling (device-synchronised), the rest of the rank's reply (outputs to the CPU)
    per_rank = {k: [getattr(t, k) for t in timings] for k in ("preprocess_s", "predict_s", "total_s")}
    return {"calls": len(walls), "rows": rows, "wall_s": wall, "samples_per_s": rows / wall,
            "env_steps_per_s": rows * ha / wall, "call_walls_s": walls, "rank_timings_s": per_rank}


def resolved_render_setting(env_cfg: EnvConfig, key: str) -> Any:
    """A render setting as the env workers will apply it (render_culling null: on under OSMesa only)."""
    value = getattr(env_cfg, key)
    if key == "render_culling":
        from envs.render_culling import culling_enabled
        from envs.rendering import chosen_backend

        return culling_enabled(value, chosen_backend(env_cfg.render_backend))
    return value


def variant_env(name: str, env_cfg: EnvConfig) -> EnvConfig:
    """The env config of a variant: the bench's own but for the render variants (ENV_VARIANTS)."""
    if name in ENV_VARIANTS:
        settings = ENV_VARIANTS[name]
        applied = {key: resolved_render_setting(env_cfg, key) for key in settings}
        if env_cfg.env_type != "libero" or applied == settings:
            wanted = " ".join(f"env.{key}={value}" for key, value in settings.items())
            own = ", ".join(f"env.{key} {getattr(env_cfg, key)} (as applied: {applied[key]})" for key in settings)
            raise ValueError(f"bench.variants entry {name!r} compares LIBERO renders with {wanted} "
                             f"against the bench's own; env_type is {env_cfg.env_type!r}, {own}")
        return dataclasses.replace(env_cfg, **settings)
    return env_cfg


def variant_config(name: str, base: CollectorConfig, env_cfg: EnvConfig) -> CollectorConfig:
    if name in ENV_VARIANTS:
        return base
    if name == "no_pipeline":
        return dataclasses.replace(base, stages=1, workers_per_stage=None)
    if name == "other_render_at":  # the other render schedule of the same pipeline
        if base.render_at == "before_predict":  # waves apply to deferred renders only
            return dataclasses.replace(base, render_at="env_step", render_workers_at_once=None)
        return dataclasses.replace(base, render_at="before_predict")
    return dataclasses.replace(base, workers_per_stage=max(1, env_cfg.num_workers // base.stages))


# ----------------------------------------------------------------------------- tracing


def open_tracing(trace_dir: str | None, stages: int, workload: str) -> dict:
    if not trace_dir:
        return {}
    prof = ProfilerConfig(out_dir=str(Path(trace_dir).resolve()), exports=["json", "perfetto"])
    write_meta(prof.out_dir, profiler_config=dataclasses.asdict(prof), workload=workload)
    return {"config": prof, "driver": make_timeline(prof, rank=0, worker="driver"),
            "lanes": [make_timeline(prof, rank=0, worker=f"env_stage{s}") for s in range(stages)]}


def close_tracing(tracing: dict) -> dict[str, str]:
    if not tracing:
        return {}
    for timeline in [tracing["driver"], *tracing["lanes"]]:
        timeline.close()
    from profiler.report import build_exports

    _, written = build_exports(tracing["config"].out_dir, tracing["config"], skip_first=1, quiet=True)
    return {name: str(path) for name, path in written.items()}


# ----------------------------------------------------------------------------- run


def run(env_cfg: EnvConfig, policy_cfg: PolicyConfig, rollout: RolloutConfig, bench: BenchRolloutConfig) -> dict:
    device = auto_device(bench.device)
    if device.type == "cuda":
        policy_cfg = policy_cfg.replace(fast={"enabled": True})
    # intra-op threads spinning against the busy env workers slow a CPU predict ~10x, and a CUDA one's
    # host side too (round 38 on an H100: a 32-row predict beside env physics 226 ms with torch's 16
    # threads, 161 with one; whole rollouts 1042-1202 against 1255-1292 env steps/s)
    torch.set_num_threads(bench.torch_threads or 1)
    coll_cfg = dataclasses.replace(rollout.collector or CollectorConfig(), max_chunks=bench.chunks)
    for name in bench.variants:  # a variant that cannot apply fails here, not after ours' measured epoch
        variant_env(name, env_cfg)
        if name == "other_render_at":  # before_predict needs env.render_every chunk_end and a renderer
            other = variant_config(name, coll_cfg, env_cfg)
            try:
                other.check_against_env(env_cfg)
            except ValueError as exc:
                raise ValueError(f"bench.variants entry 'other_render_at' runs rollout.collector.render_at="
                                 f"{other.render_at!r}, which this env cannot: {exc}") from exc
    if bench.predict_only and not coll_cfg.record_images:  # engine alone replays the observations ours recorded
        raise ValueError("bench.predict_only=true needs rollout.collector.record_images=true (the engine-alone "
                         "phase predicts on the observations ours recorded); or set bench.predict_only=false")
    engine_cfg = dataclasses.replace(rollout.engine, devices=str(device) if rollout.engine.devices == "auto"
                                     else rollout.engine.devices)
    log(f"{os.cpu_count()} CPUs, device {device}; {env_cfg.suite} tasks {sorted(set(env_cfg.task_ids or []))}, "
        f"{env_cfg.num_envs} envs, {env_cfg.image_size} px, chunk {env_cfg.chunk_size}; policy {policy_cfg.name} "
        f"({policy_cfg.dtype}, fast={policy_cfg.fast.enabled}, {policy_cfg.sampling.num_steps} steps)")
    start = time.perf_counter()
    engine = PolicyEngine(engine_cfg, policy_cfg)
    payload: dict[str, Any] = {"engine_create_s": time.perf_counter() - start}
    tracing = open_tracing(bench.trace_dir, coll_cfg.stages,
                           f"experiments.bench_rollout: {env_cfg.num_envs} envs, {coll_cfg.stages} stages")
    try:
        payload["ours"] = measure_ours(env_cfg, coll_cfg, engine, bench, "ours", alone=True, tracing=tracing)
        payload["trace_exports"] = close_tracing(tracing)
        payload["variants"] = {name: recorded_failure(lambda name=name: measure_ours(
            variant_env(name, env_cfg), variant_config(name, coll_cfg, env_cfg), engine, bench, f"ours[{name}]"),
            f"ours[{name}]")
            for name in bench.variants}
    finally:
        engine.close()
    if bench.baseline:
        init_ids = np.repeat(group_init_state_ids(env_cfg), env_cfg.group_size)
        timed = bench.baseline_timed_chunks or bench.timed_chunks
        payload["baseline"] = recorded_failure(lambda: measure_baseline(
            env_cfg, policy_cfg, device, init_ids, bench.warmup_chunks, timed, log), "baseline")
    payload["config"] = {"env": env_cfg.to_dict(), "policy": policy_cfg.to_dict(), "engine": engine_cfg.to_dict(),
                         "collector": coll_cfg.to_dict(), "bench": dataclasses.asdict(bench)}
    return payload


def recorded_failure(measure, label: str) -> dict[str, Any]:
    """A side measured after ours: its failure is recorded in the JSON (with ours' numbers kept), not raised."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - any failure of one side is that side's result
        log(f"{label} failed: {exc!r}")
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def summarize(env_cfg: EnvConfig, payload: dict) -> dict[str, Any]:
    ours, baseline = payload["ours"], payload.get("baseline")
    if baseline is not None and "error" in baseline:
        baseline = None  # the summary holds measured numbers only; the error is in the JSON
    collector = ours["collector"]
    summary: dict[str, Any] = {
        "suite": env_cfg.suite, "num_envs": env_cfg.num_envs, "image_size": env_cfg.image_size,
        "chunk": env_cfg.chunk_size, "stages": collector["stages"], "cpu_count": os.cpu_count(),
        "policy": payload["config"]["policy"]["name"], "warmup_chunks": payload["config"]["bench"]["warmup_chunks"],
        "timed_chunks": payload["config"]["bench"]["timed_chunks"],
        "ours_env_steps_per_s": ours["env_steps_per_s"], "ours_epoch_env_steps_per_s": ours["epoch_env_steps_per_s"],
        "ours_prompt_tokens_max": ours["prompt_tokens_max"], "rollout_buffer_mib": ours["buffer_mib"],
    }
    for name, result in payload.get("variants", {}).items():
        if "error" not in result:
            summary[f"ours_{name}_env_steps_per_s"] = result["env_steps_per_s"]
    bounds = []
    if "env_steps_per_s" in ours.get("env_only", {}):  # not when env alone failed (its error is in the JSON)
        summary["env_only_env_steps_per_s"] = ours["env_only"]["env_steps_per_s"]
        bounds.append(summary["env_only_env_steps_per_s"])
    if "env_steps_per_s" in ours.get("predict_only", {}):
        summary["predict_only_sps"] = ours["predict_only"]["env_steps_per_s"]  # env steps of actions / s
        summary["predict_only_samples_per_s"] = ours["predict_only"]["samples_per_s"]
        bounds.append(summary["predict_only_sps"])
    if bounds:
        summary["overlap_bound_env_steps_per_s"] = min(bounds)
        summary["overlap_efficiency"] = ours["env_steps_per_s"] / min(bounds)
    if baseline is not None:
        summary.update(baseline_env_steps_per_s=baseline["env_steps_per_s"], baseline_policy=baseline["policy"],
                       baseline_prompt_tokens=baseline["prompt_tokens"],
                       speedup=ours["env_steps_per_s"] / baseline["env_steps_per_s"])
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_rollout")
def main(cfg: DictConfig) -> None:
    env_cfg = EnvConfig.from_mapping(cfg.env)
    policy_cfg = PolicyConfig.from_mapping(cfg.policy)
    rollout = RolloutConfig.from_mapping(cfg.rollout)
    bench_data = reject_unknown_keys(BenchRolloutConfig, OmegaConf.to_container(cfg.bench, resolve=True), "bench")
    bench = BenchRolloutConfig(**bench_data)
    payload = run(env_cfg, policy_cfg, rollout, bench)
    write_result("bench_rollout", payload, summarize(env_cfg, payload), bench.out_dir, commit=bench.commit,
                 device=auto_device(bench.device))


if __name__ == "__main__":
    main()
