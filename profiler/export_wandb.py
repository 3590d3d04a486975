"""wandb logging with RLinf-compatible metric names. wandb is imported only here, on use.

Names (seconds; phase times are the max over ranks, as RLinf's ScopedTimer(reduction="max")):
  time/step, time/sync_weights (weight_sync), time/generate_rollouts (rollout),
  time/cal_adv_and_returns (advantages), time/actor_training (actor_train),
  time/rollout/<x> for rollout/<x> (time/rollout/predict, time/rollout/transfer),
  time/env/<x> for rollout/env_<x>... spans (time/env/env_step), time/<name> for anything else;
  profile/predict_share_step, profile/predict_share_rollout, profile/exposed_predict,
  profile/overlapped_predict, profile/projected_step/<target>@<s>x (ideal and critical path).
Offline by default: mode="offline", files under <dir or run_dir>/wandb/offline-run-*.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from profiler.breakdown import StepBreakdown
from profiler.config import WandbConfig

RLINF_NAMES = {
    "step": "time/step", "weight_sync": "time/sync_weights", "rollout": "time/generate_rollouts",
    "advantages": "time/cal_adv_and_returns", "actor_train": "time/actor_training",
}


def metric_name(span_name: str) -> str:
    if span_name in RLINF_NAMES:
        return RLINF_NAMES[span_name]
    head, _, leaf = span_name.partition("/")
    if head == "rollout" and leaf.startswith("env"):
        return f"time/env/{leaf}"
    return f"time/{span_name}"


def _speed_label(s: float) -> str:
    return "inf" if math.isinf(s) else f"{s:g}x"


def step_metrics(step: StepBreakdown) -> dict[str, float]:
    metrics = {"time/step": step.total_s}
    metrics.update({metric_name(name): value for name, value in step.phases.items()})
    metrics["profile/predict_max_rank_s"] = step.predict_max_s
    metrics["profile/predict_share_step"] = step.predict_share_step
    if step.predict_share_rollout is not None:
        metrics["profile/predict_share_rollout"] = step.predict_share_rollout
    if step.exposed_predict_s is not None:
        metrics["profile/exposed_predict"] = step.exposed_predict_s
        metrics["profile/overlapped_predict"] = step.overlapped_predict_s or 0.0
    for p in step.projections:
        key = f"{p.target}@{_speed_label(p.speedup)}"
        metrics[f"profile/projected_step_ideal/{key}"] = p.ideal_step_s
        metrics[f"profile/projected_step_critical_path/{key}"] = p.critical_path_step_s
    return metrics


def log_report(report, cfg: WandbConfig, run_dir: str | os.PathLike,
               images: dict[str, Path] | None = None, config: dict[str, Any] | None = None,
               skip_first: int = 0) -> Path | None:
    """Log every step's metrics, the projection table and the PNGs; returns the run's directory.
    The table and the `mean/*` summary are of the mean over steps[skip_first:], as report.json's."""
    if cfg.mode == "disabled":
        return None
    import wandb

    directory = Path(cfg.dir or run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=cfg.project, entity=cfg.entity, name=cfg.name, group=cfg.group, tags=cfg.tags or None,
        mode=cfg.mode, dir=str(directory), config=config or {}, settings=wandb.Settings(silent=True),
    )
    try:
        for step in report.steps:
            index = step.step if isinstance(step.step, int) else None
            run.log(step_metrics(step), step=index)
        mean = report.mean(skip_first)
        table = wandb.Table(columns=["target", "speedup", "phase_s", "ideal_step_s", "ideal_speedup",
                                     "critical_path_step_s", "critical_path_speedup"])
        for p in mean.projections:
            table.add_data(p.target, _speed_label(p.speedup), p.phase_s, p.ideal_step_s, p.ideal_speedup,
                           p.critical_path_step_s, p.critical_path_speedup)
        run.log({"profile/amdahl": table})
        for name, path in (images or {}).items():
            run.log({f"profile/{name}": wandb.Image(str(path))})
        run.summary.update({f"mean/{k}": v for k, v in step_metrics(mean).items()})
        run_path = Path(run.dir).parent  # <dir>/wandb/<offline-run-...>/files -> the run folder
    finally:
        run.finish()
    return run_path
