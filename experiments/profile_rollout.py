"""Profile real rollouts: LIBERO vector envs + the policy, pipelined, recorded with the profiler.

    python -m experiments.profile_rollout                        # CPU: tiny policy, libero_10
    python -m experiments.profile_rollout policy=pi05 env.num_envs=64 env.num_workers=16 ...

Each RL step: `weight_sync` (new weights copied into the policy in place, then its fast-path
tables refreshed: what the engine's in-process sync does), then `rollout`: the envs are split
into `rollout.stages` pipeline stages, each its own worker-process vector env; stage s's chunk
runs in the env workers (`rollout/env_step`, recorded on the stage's own lane) while the driver
predicts stage s+1 (`rollout/transfer` = observation -> policy batch, `rollout/predict`). There
is no trainer yet (the GRPO issue), so steps have no advantages / actor_train phases.
Writes RUN_DIR/trace, then the report, Perfetto trace, PNGs and an offline wandb run under
RUN_DIR/profile (rebuild them with `python -m profiler.report RUN_DIR`). RUN_DIR is new for each
run (`rollout.run_dir`, timestamped by default); one whose trace already holds spans is refused,
since an earlier run's spans would merge into this run's steps. The numbers the README quotes
(mean step, PhyAI-style rows, control roofline) also go to a result JSON through
experiments/results.py: runs/profile_rollout/, or benchmarks/results/ with `rollout.commit=true`.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from envs.config import EnvConfig, register_hydra_schema
from experiments.results import write_result
from policies import PolicyConfig, build_policy
from profiler import ProfilerConfig, make_timeline, write_meta
from profiler.report import build_exports
from profiler.trace import strict_json, trace_dir

register_hydra_schema()


@dataclass
class RolloutProfileConfig:
    steps: int = 3  # RL steps (the first is reported separately as warm-up)
    chunks: int = 6  # chunks per rollout
    stages: int = 2  # pipeline stages (env groups alternating with predict)
    weight_noise: float = 1e-3  # size of the simulated weight update
    run_dir: str = "runs/profile_rollout/run"  # must not hold a trace yet (conf: timestamped)
    device: str = "auto"
    commit: bool = False  # result JSON to benchmarks/results/ (the README's numbers) instead of runs/

    def __post_init__(self):
        for key in ("steps", "chunks", "stages"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key} must be >= 1, got {getattr(self, key)}")


POLICY_KEYS = ("agentview_image", "wrist_image", "state", "prompt")


def fresh_run_dir(path: str | Path) -> Path:
    """The run directory, created; refused if its trace already holds spans of another run."""
    run_dir = Path(path).resolve()
    old = sorted(trace_dir(run_dir).glob("spans_*.jsonl"))
    if old:
        raise FileExistsError(
            f"{trace_dir(run_dir)} already holds {len(old)} span file(s) of an earlier run; their steps would "
            "merge with this run's. Choose a new rollout.run_dir (the default is timestamped)."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def result_summary(report, skip_first: int) -> dict:
    """The numbers the README quotes: mean step (after `skip_first` warm-up steps), PhyAI-style
    rows, control roofline."""
    mean = report.mean(skip_first)
    summary = {"steps": len(report.steps), "mean_from_step": skip_first, "step_s": mean.total_s,
               "predict_max_s": mean.predict_max_s, "predict_share_step": mean.predict_share_step,
               "predict_share_rollout": mean.predict_share_rollout, "other_s": mean.other_s}
    for name in ("weight_sync", "rollout", "rollout/reset", "rollout/env_step", "rollout/predict"):
        summary[f"{name.replace('/', '_')}_s"] = mean.phases.get(name)
    for row in report.phyai_rows(mean):
        if row.label.startswith("Projected step time"):
            summary["projected_step_s_" + ("amdahl" if "Amdahl" in row.label else "critical_path")] = row.seconds
    if report.control is not None:
        control = report.control.summary()
        summary.update({f"control_{k}": control[k] for k in ("median_x", "median_y", "median_l_env_s",
                                                              "median_l_inference_s", "overlap_efficiency", "bound")})
    return summary


def stage_configs(env_cfg: EnvConfig, stages: int) -> list[EnvConfig]:
    if env_cfg.num_envs % stages or env_cfg.num_workers % stages:
        raise ValueError(f"env.num_envs ({env_cfg.num_envs}) and env.num_workers ({env_cfg.num_workers}) "
                         f"must be multiples of rollout.stages ({stages})")
    per_stage = env_cfg.num_envs // stages
    return [dataclasses.replace(env_cfg, num_envs=per_stage, num_workers=env_cfg.num_workers // stages,
                                group_size=min(env_cfg.group_size, per_stage), show_progress=False)
            for _ in range(stages)]


def weight_sync(policy, noise: float, generator: torch.Generator) -> None:
    """A trainer's update arriving: new tensors copied into the parameters, tables refreshed."""
    with torch.no_grad():
        for p in policy.model.parameters():
            p.copy_(p + noise * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    policy.refresh_weights()


def rollout(timeline, env_lanes, policy, vecs, cfg: RolloutProfileConfig, step: int, chunk_len: int) -> float:
    """Pipelined: stage s's env chunk runs (worker processes) while the driver predicts s+1."""
    pool = ThreadPoolExecutor(max_workers=len(vecs))
    with timeline.span("rollout/reset"):
        obs = [vec.reset(seed=step * len(vecs) + s) for s, vec in enumerate(vecs)]
    pending: list = [None] * len(vecs)
    successes = []
    try:
        for chunk in range(cfg.chunks):
            for s, vec in enumerate(vecs):
                if pending[s] is not None:
                    result = pending[s].result()
                    obs[s] = result.obs
                    successes.append(result.success)
                with timeline.span("rollout/transfer", stage=s, chunk=chunk, step=step):
                    batch = policy.make_batch({k: obs[s][k] for k in POLICY_KEYS})
                with timeline.span("rollout/predict", stage=s, chunk=chunk, step=step, batch=vec.num_envs):
                    out = policy.sample(batch, mode="train")
                actions = np.clip(out.actions[:, :chunk_len].float().cpu().numpy(), -1.0, 1.0)
                pending[s] = pool.submit(_env_chunk, env_lanes[s], vec, actions, s, chunk, step)
        for s in range(len(vecs)):
            successes.append(pending[s].result().success)
    finally:
        pool.shutdown(wait=True)
    return float(np.mean(np.concatenate(successes))) if successes else 0.0


def _env_chunk(lane, vec, actions, stage: int, chunk: int, step: int):
    with lane.span("rollout/env_step", stage=stage, chunk=chunk, step=step):
        return vec.step_chunk(actions)


@hydra.main(version_base="1.3", config_path="../conf", config_name="profile_rollout")
def main(cfg: DictConfig) -> None:
    from envs.vector import AsyncVectorEnv

    rcfg = RolloutProfileConfig(**OmegaConf.to_container(cfg.rollout, resolve=True))
    env_cfg = EnvConfig.from_mapping(cfg.env)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if rcfg.device == "auto" else rcfg.device
    pcfg = PolicyConfig.from_mapping(cfg.policy)
    if device == "cuda":
        pcfg = pcfg.replace(fast={"enabled": True})
    run_dir = fresh_run_dir(rcfg.run_dir)
    prof = dataclasses.replace(ProfilerConfig.from_dict(cfg.profiler, logger=cfg.logger), out_dir=str(run_dir),
                               gpu_timing="sync" if device == "cuda" else "none")
    policy = build_policy(pcfg, device=device)
    write_meta(run_dir, profiler_config=dataclasses.asdict(prof),
               workload=f"experiments.profile_rollout: {env_cfg.suite}, {env_cfg.num_envs} envs / "
                        f"{env_cfg.num_workers} workers in {rcfg.stages} stages, chunk {env_cfg.chunk_size}, "
                        f"{pcfg.name} policy on {device}, {rcfg.chunks} chunks x {rcfg.steps} steps")
    timeline = make_timeline(prof, rank=0, worker="driver", run_dir=run_dir)
    env_lanes = [make_timeline(prof, rank=0, worker=f"env_stage{s}", run_dir=run_dir) for s in range(rcfg.stages)]
    vecs = []
    generator = torch.Generator().manual_seed(0)
    try:
        vecs = [AsyncVectorEnv(c) for c in stage_configs(env_cfg, rcfg.stages)]
        for step in range(rcfg.steps):
            with timeline.span("step", step=step):
                with timeline.span("weight_sync"):
                    weight_sync(policy, rcfg.weight_noise, generator)
                with timeline.span("rollout"):
                    success = rollout(timeline, env_lanes, policy, vecs, rcfg, step, env_cfg.chunk_size)
            print(f"step {step}: success rate {success:.2f}")
            timeline.flush()
    finally:
        for vec in vecs:
            vec.close()
        for lane in env_lanes:
            lane.close()
        timeline.close()
    skip_first = 1 if rcfg.steps > 1 else 0
    report, written = build_exports(run_dir, prof, skip_first=skip_first)
    for name, path in written.items():
        print(f"{name}: {path}")
    payload = {"run_dir": str(run_dir), "config": OmegaConf.to_container(cfg, resolve=True),
               "report": strict_json(report.to_dict(skip_first))}
    write_result("profile_rollout", payload, result_summary(report, skip_first), commit=rcfg.commit)


if __name__ == "__main__":
    main()
