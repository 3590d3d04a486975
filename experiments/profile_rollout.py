"""Profile real rollouts: LIBERO vector envs + the policy, pipelined, recorded with the profiler.

    python -m experiments.profile_rollout                        # CPU: tiny policy, libero_10
    python -m experiments.profile_rollout policy=pi05 env.num_envs=64 env.num_workers=16 ...

Each RL step: `weight_sync` (the current weights plus `rollout.weight_noise` x N(0, 1) pushed
through `engine.update_weights`, which also refreshes the fast path's tables), then `rollout`:
one epoch of the pipelined collector (rollout/collector.py) over `rollout.stages` stages of
worker-process vector envs: stage s's chunk runs in the env workers (`rollout/env_step`, on the
stage's own lane) while the driver predicts stage s+1 (`rollout/transfer`, `rollout/predict`).
No trainer runs here, so steps have no advantages / actor_train phases (experiments.grpo has them).
Writes RUN_DIR/trace, then the report, Perfetto trace, PNGs and an offline wandb run under
RUN_DIR/profile (rebuild them with `python -m profiler.report RUN_DIR`). RUN_DIR is new for each
run (`rollout.run_dir`, timestamped by default); one whose trace already holds spans is refused,
since an earlier run's spans would merge into this run's steps. The numbers the README quotes
(mean step, PhyAI-style rows, control roofline) also go to a result JSON through
experiments/results.py: runs/profile_rollout/, or benchmarks/results/ with `rollout.commit=true`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from common.devices import auto_device
from envs.config import EnvConfig, register_hydra_schema
from experiments.results import write_result
from policies import PolicyConfig
from profiler import ProfilerConfig, make_timeline, write_meta
from profiler.report import build_exports
from profiler.trace import strict_json, trace_dir
from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine

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
        if self.device != "auto" and _device_type(self.device) not in ("cpu", "cuda"):
            raise ValueError(f"rollout.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def resolved_device(self) -> str:
        return str(auto_device(self.device))


def _device_type(name: str) -> str | None:
    try:
        return torch.device(name).type
    except (RuntimeError, TypeError):
        return None


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
    # with one step there is nothing after the warm-up: its compile and first-call costs are in every number
    summary = {"steps": len(report.steps), "mean_from_step": skip_first, "includes_warmup_step": skip_first == 0,
               "step_s": mean.total_s,
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


def collector_config(env_cfg: EnvConfig, cfg: RolloutProfileConfig) -> CollectorConfig:
    """rollout.stages stages of env.num_workers / stages workers each, rollout.chunks chunks per epoch."""
    if env_cfg.num_workers % cfg.stages:
        raise ValueError(f"env.num_workers ({env_cfg.num_workers}) must be a multiple of rollout.stages "
                         f"({cfg.stages}): each stage gets its own workers")
    return CollectorConfig(stages=cfg.stages, workers_per_stage=env_cfg.num_workers // cfg.stages,
                           max_chunks=cfg.chunks)


def perturbed_weights(engine: PolicyEngine, noise: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A trainer's update arriving: the engine's weights plus noise x N(0, 1), in their dtypes."""
    return {name: (p.float() + noise * torch.randn(p.shape, generator=generator)).to(p.dtype)
            for name, p in engine.state_dict().items()}


@hydra.main(version_base="1.3", config_path="../conf", config_name="profile_rollout")
def main(cfg: DictConfig) -> None:
    rcfg = RolloutProfileConfig(**OmegaConf.to_container(cfg.rollout, resolve=True))
    env_cfg = EnvConfig.from_mapping(cfg.env)
    device = rcfg.resolved_device()
    # by type: rollout.device=cuda:0 is a GPU run too (compared with "cuda", it ran without the fast
    # path and without GPU span timing)
    on_gpu = torch.device(device).type == "cuda"
    pcfg = PolicyConfig.from_mapping(cfg.policy)
    if on_gpu:
        pcfg = pcfg.replace(fast={"enabled": True})
    ccfg = collector_config(env_cfg, rcfg)  # checked before the run directory exists
    run_dir = fresh_run_dir(rcfg.run_dir)
    prof = dataclasses.replace(ProfilerConfig.from_dict(cfg.profiler, logger=cfg.logger), out_dir=str(run_dir),
                               gpu_timing="sync" if on_gpu else "none")
    write_meta(run_dir, profiler_config=dataclasses.asdict(prof),
               workload=f"experiments.profile_rollout: {env_cfg.suite}, {env_cfg.num_envs} envs / "
                        f"{env_cfg.num_workers} workers in {rcfg.stages} stages, chunk {env_cfg.chunk_size}, "
                        f"{pcfg.name} policy on {device}, {rcfg.chunks} chunks x {rcfg.steps} steps")
    timeline = make_timeline(prof, rank=0, worker="driver", run_dir=run_dir)
    env_lanes = [make_timeline(prof, rank=0, worker=f"env_stage{s}", run_dir=run_dir) for s in range(rcfg.stages)]
    generator = torch.Generator().manual_seed(0)
    engine = collector = None
    try:
        engine = PolicyEngine(EngineConfig(devices=device), pcfg)
        collector = RolloutCollector(env_cfg, engine, ccfg, timeline=timeline, stage_timelines=env_lanes)
        for step in range(rcfg.steps):
            new_weights = perturbed_weights(engine, rcfg.weight_noise, generator)  # the trainer's side: untimed
            with timeline.span("step", step=step):
                with timeline.span("weight_sync"):
                    engine.update_weights(new_weights, version=step + 1)
                with timeline.span("rollout"):
                    batch = collector.collect(seed=step, step=step)
            print(f"step {step}: success rate {batch.success[~batch.lost].mean():.2f}")
            timeline.flush()
    finally:
        if collector is not None:
            collector.close()
        if engine is not None:
            engine.close()
        for lane in env_lanes:
            lane.close()
        timeline.close()
    skip_first = 1 if rcfg.steps > 1 else 0
    if not skip_first:
        print("rollout.steps=1: the summary is of the warm-up step (first calls, compiles); use >= 2 steps to time "
              "a warm one")
    report, written = build_exports(run_dir, prof, skip_first=skip_first)
    for name, path in written.items():
        print(f"{name}: {path}")
    payload = {"run_dir": str(run_dir), "config": OmegaConf.to_container(cfg, resolve=True),
               "report": strict_json(report.to_dict(skip_first))}
    # labelled with the device it ran on (rollout.device=cpu on a GPU host is a CPU run)
    write_result("profile_rollout", payload, result_summary(report, skip_first), commit=rcfg.commit, device=device)


if __name__ == "__main__":
    main()
