"""Run directories and the evaluation-only run (`mode=eval`)."""

from __future__ import annotations

import json
from pathlib import Path

from grpo.run_config import ExperimentConfig

CONFIG_FILE = "config.yaml"


def check_checkpoints(cfg: ExperimentConfig) -> None:
    """The checkpoint the run reads (run.resume, or eval.checkpoint in mode eval), checked before the run
    directory exists: a missing path, a file that is not one of our checkpoints, and a resume with no step
    left to train (the step inside the file: a copy under another name counts too)."""
    from grpo import checkpoint

    key, path, needed = (("eval.checkpoint", cfg.eval.checkpoint, checkpoint.WEIGHT_KEYS) if cfg.mode == "eval"
                         else ("run.resume", cfg.run.resume, checkpoint.RESUME_KEYS))
    if not path:
        return
    try:
        payload = checkpoint.load(path, needed, mmap=True)
    except ValueError as exc:
        raise ValueError(f"{key}={path}: {exc}") from None
    step = int(payload["step"])
    if cfg.mode == "train" and step >= cfg.grpo.steps:
        raise ValueError(f"run.resume: {checkpoint.resolve(path)} is step {step} and grpo.steps is {cfg.grpo.steps}: "
                         f"nothing is left to train (raise grpo.steps to go on)")


def check_devices(cfg: ExperimentConfig) -> None:
    """The devices the run names against this machine's GPUs, before the run directory exists: a GPU it
    lacks (run.device=cuda:1 on one GPU, cuda on a CPU box) was refused only by the trainer, after the run
    directory, with a traceback; an evaluation failed in torch ("Torch not compiled with CUDA enabled",
    "invalid device ordinal") naming no key."""
    import torch

    from rollout.placement import plan_placement, resolve_device, resolve_rank_devices

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.mode == "train":
        from grpo.actor_group import plan_actor_for_run

        plan_actor_for_run(cfg, plan_placement(cfg.run.device, "run.device", cfg.rollout, cuda_count), cuda_count)
        return
    # an evaluation pushes weights to the engine as tensors: only its devices count, and run.device where it
    # loads eval.checkpoint
    resolve_rank_devices(cfg.rollout.engine, cuda_count)
    if cfg.eval.checkpoint:
        resolve_device("run.device", cfg.run.device, cuda_count)


def make_run_dir(path: str | Path) -> Path:
    """Create the run directory; an existing non-empty one gets a fresh sibling (-1, -2, ...)."""
    base = Path(path)
    candidate, n = base, 0
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate.resolve()


def write_config(run_dir: Path, cfg: ExperimentConfig) -> Path:
    """The resolved Hydra config, as composed (before any default was filled in by the dataclasses)."""
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.raw)))
    return path


def run_evaluation(cfg: ExperimentConfig, run_dir: Path) -> dict:
    """ODE evaluation of the initial weights or eval.checkpoint: table, eval.json, videos, wandb."""
    from common.devices import auto_device
    from grpo import checkpoint
    from grpo.distributed import full_parameters
    from grpo.evaluate import Evaluator
    from grpo.reporting import WandbRun
    from grpo.trainer import seed_everything, trainer_policy_config
    from policies import build_policy
    from rollout.engine import PolicyEngine

    seed_everything(cfg.run.seed)
    if cfg.run.torch_threads:  # as the trainer: the inproc engine predicts in this process, beside the env workers
        import torch

        torch.set_num_threads(cfg.run.torch_threads)
    wandb_run = WandbRun(cfg.logger, run_dir, cfg.raw)
    engine = evaluator = None
    try:
        engine = PolicyEngine(cfg.rollout.engine, cfg.policy, cfg.rollout.weights)
        step = 0
        if cfg.eval.checkpoint:
            policy = build_policy(trainer_policy_config(cfg.policy), auto_device(cfg.run.device))
            step = checkpoint.load_model_weights(policy.model, cfg.eval.checkpoint)
            engine.update_weights(full_parameters(policy.model, full=True), version=max(step, 1))
            del policy
        evaluator = Evaluator(cfg.env, cfg.eval, cfg.collector, engine, cfg.policy, seed=cfg.run.seed)
        result = evaluator.run(run_dir / "videos")
    except BaseException:
        # as Trainer.abort: the wandb run ends as failed (left open, the next wandb.init of this process, e.g. the
        # next job of a sweep, finished it with exit code 0)
        wandb_run.finish(exit_code=1)
        raise
    finally:
        for part in (evaluator, engine):
            if part is not None:
                part.close()
    print(f"evaluation ({cfg.eval.sampling.upper()}) of {cfg.eval.checkpoint or 'the initial weights'}:\n"
          f"{result.table()}")
    summary = {"checkpoint": cfg.eval.checkpoint, "step": step, **result.metrics(),
               "tasks": [dict(zip(result.COLUMNS, row)) for row in result.rows()],
               "videos": [str(p) for _, p in result.videos]}
    (run_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    wandb_run.log(step, result.metrics())
    wandb_run.log_table("eval/table", result.COLUMNS, result.rows())
    wandb_run.log_videos(result.videos)
    wandb_run.finish()
    return summary
