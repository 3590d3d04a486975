"""What a run tells its user: the per-step console line, metrics.jsonl, curves, the wandb run.

Metric names are namespaced: train/* (loss, clip_frac, approx_kl, grad_norm, ...), rollout/*
(success_rate, logprob_gap, ...), advantages/*, eval/*, step_time/* (the driver's clocks, live),
and from the profiler's trace when the run ends: time/* (RLinf's names, profiler.export_wandb:
time/step, time/sync_weights, time/generate_rollouts, time/cal_adv_and_returns,
time/actor_training, time/rollout/predict, ...) and profile/* (predict share, Amdahl projections);
memory/cuda<i>/* (GiB) on a GPU: each step's peaks in this process and the device's use by every process
(grpo/memory.py).
wandb is imported only when the logger is not disabled (machines without wandb use logger=none).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from profiler.config import WandbConfig

METRICS_FILE = "metrics.jsonl"


def console_line(step: int, steps: int, m: dict[str, Any]) -> str:
    """One line per RL step: success, loss, clip fraction, approx KL, log-prob gap, time, predict share."""
    def f(key: str, fmt: str) -> str:
        value = m.get(key)
        return "-" if value is None else format(value, fmt)

    return (f"step {step + 1}/{steps} | success {f('rollout/success_rate', '.2f')} | loss {f('train/loss', '+.4f')}"
            f" | clip {f('train/clip_frac', '.3f')} | approx_kl {f('train/approx_kl', '.2e')}"
            f" | gap {f('rollout/logprob_gap', '.4f')} nats (max {f('rollout/logprob_gap_max', '.3f')})"
            f" | {f('step_time/step', '.1f')} s, predict {f('step_time/predict_share', '.0%')}"
            f" | rows {m.get('train/rows', 0)}{_memory_note(m)}")


def _memory_note(m: dict[str, Any]) -> str:
    """" | gpu 71.2/79.2 GiB" for the first CUDA device with memory/* metrics (the trainer's); "" on the CPU."""
    used = next((k for k in m if k.startswith("memory/") and k.endswith("/device_used_gib")), None)
    if used is None:
        return ""
    total = m.get(used.replace("/device_used_gib", "/device_total_gib"))
    return f" | gpu {m[used]:.1f}/{total:.1f} GiB" if total is not None else ""


def phase_metrics(phases: dict[str, float], predict_s: float) -> dict[str, float]:
    """Live step breakdown from the driver's own clocks (step_time/*); the trace-based report
    (time/*, profile/*: max over ranks, critical path) is logged per step when the run ends."""
    out = {f"step_time/{name}": seconds for name, seconds in phases.items()}
    out["step_time/predict"] = predict_s
    if phases["step"] > 0:
        out["step_time/predict_share"] = predict_s / phases["step"]
    return out


class MetricsLog:
    """metrics.jsonl in the run dir: one JSON object per RL step (and per evaluation)."""

    def __init__(self, run_dir: Path, history: list[dict] | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.history: list[dict] = history if history is not None else []  # shared with the train state

    def append(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self.history.append(clean)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(clean, allow_nan=False) + "\n")

    def rewrite(self) -> None:
        """After a resume: the file holds exactly the checkpoint's history (later lines dropped)."""
        with open(self.path, "w", encoding="utf-8") as fh:
            for record in self.history:
                fh.write(json.dumps(record, allow_nan=False) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def plot_success_curve(history: list[dict], path: Path, title: str = "GRPO success rate",
                       eval_label: str = "evaluation") -> Path | None:
    """Training success per RL step (and evaluation points); None when there is nothing to draw."""
    # x = RL steps of updates behind the weights: step s's rollout ran the weights of s - 1 updates,
    # the evaluation after step s those of s updates (evaluation "after step 0": the initial weights)
    train = [(r["step"] - 1, r["rollout/success_rate"]) for r in history
             if r.get("kind") == "train" and r.get("rollout/success_rate") is not None]
    evals = [(r["step"], r["eval/success_rate"]) for r in history
             if r.get("kind") == "eval" and r.get("eval/success_rate") is not None]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if train:
        ax.plot(*zip(*train), marker="o", ms=3, label="rollout (flow-SDE)")
    if evals:
        ax.plot(*zip(*evals), marker="s", ms=6, ls="none", label=eval_label)
    ax.set_xlabel("policy updates (RL steps done)")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


class WandbRun:
    """One wandb run per experiment (offline by default); every call is a no-op when disabled."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any], resume_id: str | None = None):
        self.cfg, self.run = cfg, None
        if cfg.mode == "disabled":
            return
        import wandb

        directory = Path(cfg.dir or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or Path(run_dir).name,
                              group=cfg.group, tags=cfg.tags or None, mode=cfg.mode, dir=str(directory),
                              config=config, id=resume_id, resume="allow" if resume_id else None,
                              settings=wandb.Settings(silent=True))
        # every series is plotted against the RL step (the profile report is logged at the end)
        self.run.define_metric("rl_step")
        for prefix in ("train/*", "rollout/*", "advantages/*", "eval/*", "time/*", "profile/*", "step_time/*"):
            self.run.define_metric(prefix, step_metric="rl_step")

    @property
    def id(self) -> str | None:
        return None if self.run is None else self.run.id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.run is not None:
            values = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.run.log({**values, "rl_step": step})

    def log_images(self, images: dict[str, Path]) -> None:
        if self.run is None:
            return
        import wandb

        self.run.log({f"plots/{name}": wandb.Image(str(path)) for name, path in images.items()})

    def log_videos(self, videos: list[tuple[str, Path]]) -> None:
        if self.run is None or not videos:
            return
        import wandb

        # the file's own frame rate applies (wandb ignores fps for files)
        self.run.log({f"videos/{name}": wandb.Video(str(path), format=path.suffix.lstrip("."))
                      for name, path in videos})

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        if self.run is None:
            return
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=rows)})

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self, exit_code: int = 0) -> Path | None:
        if self.run is None:
            return None
        path = Path(self.run.dir).parent
        self.run.finish(exit_code=exit_code)
        self.run = None
        return path
