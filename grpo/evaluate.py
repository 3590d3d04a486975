"""Evaluation: success rate per task over fixed init states (ODE sampling, or the flow-SDE
rollout policy with eval.sampling=sde), and videos.

    evaluator = Evaluator(env_cfg, eval_cfg, collector_cfg, engine, policy_cfg, seed)
    result = evaluator.run(run_dir / "eval" / "step_000003")      # EvalResult
    evaluator.close()

The eval vector env has group size 1 and `per_task` envs per task (tasks = eval.tasks, or the
training env's tasks); round r resets env j of task t to init state r * per_task + j, so every
(task, init state < eval.init_states) pair runs once per eval.repeats. Frames of a video are
the chunk-end agent-view observations (turned upright).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.config import UnknownTaskError
from envs.config import EnvConfig
from envs.vector.catalog import env_slots
from grpo.run_config import EvalConfig
from grpo.video import upright, write_video
from profiler import NULL_TIMELINE
from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig

VIDEO_CAMERA = "agentview_image"


@dataclass
class TaskResult:
    task_id: int
    label: str
    episodes: int
    successes: int
    mean_chunks: float

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0


@dataclass
class EvalResult:
    tasks: list[TaskResult]
    videos: list[tuple[str, Path]] = field(default_factory=list)

    @property
    def success_rate(self) -> float:
        episodes = sum(t.episodes for t in self.tasks)
        return sum(t.successes for t in self.tasks) / episodes if episodes else 0.0

    def metrics(self) -> dict[str, float]:
        out = {"eval/success_rate": self.success_rate, "eval/episodes": sum(t.episodes for t in self.tasks)}
        out.update({f"eval/success_rate/task_{t.task_id}": t.success_rate for t in self.tasks})
        return out

    def rows(self) -> list[list]:
        return [[t.task_id, t.label, t.episodes, t.successes, t.success_rate, t.mean_chunks] for t in self.tasks]

    COLUMNS = ["task", "label", "episodes", "successes", "success_rate", "mean_chunks"]

    def table(self) -> str:
        lines = [f"{'task':>4}  {'success':>8}  {'episodes':>8}  {'chunks':>6}  label"]
        for t in self.tasks:
            lines.append(f"{t.task_id:>4}  {t.success_rate:>8.2f}  {t.episodes:>8}  {t.mean_chunks:>6.1f}  {t.label}")
        lines.append(f"{'all':>4}  {self.success_rate:>8.2f}  {sum(t.episodes for t in self.tasks):>8}")
        return "\n".join(lines)


def eval_env_config(env_cfg: EnvConfig, eval_cfg: EvalConfig) -> tuple[EnvConfig, list[int], int]:
    """(the eval env's config, its tasks, envs per task)."""
    tasks = eval_cfg.tasks
    if tasks is None:
        tasks = sorted({slot.task_id for slot in env_slots(env_cfg)})
    wanted = eval_cfg.num_envs or env_cfg.num_envs
    per_task = max(1, min(wanted // len(tasks), eval_cfg.init_states))
    num_envs = per_task * len(tasks)
    cfg = EnvConfig.from_mapping(env_cfg.to_dict(), num_envs=num_envs, group_size=1,
                                 task_ids=[t for t in tasks for _ in range(per_task)],
                                 num_workers=min(env_cfg.num_workers, num_envs), show_progress=False)
    try:
        slots = env_slots(cfg)
    except UnknownTaskError as exc:
        if eval_cfg.tasks is None:
            raise  # the training env's own tasks: its message names env.task_ids rightly
        raise UnknownTaskError("eval.tasks", exc.task_id, exc.source, exc.num_tasks) from None
    for slot in slots:
        if eval_cfg.init_states > slot.num_init_states:
            raise ValueError(f"eval.init_states ({eval_cfg.init_states}) exceeds the {slot.num_init_states} "
                             f"init states of {slot.label}")
    return cfg, tasks, per_task

EVAL_NOISE_SEED = 7919  # added to the run's seed: the evaluations' noise, apart from the rollouts' (engine seed)


class Evaluator:
    def __init__(self, env_cfg: EnvConfig, eval_cfg: EvalConfig, collector_cfg: CollectorConfig, engine,
                 policy_cfg, seed: int = 0):
        self.cfg = eval_cfg
        self.env_cfg, self.tasks, self.per_task = eval_env_config(env_cfg, eval_cfg)
        col = CollectorConfig.from_mapping(collector_cfg.to_dict(), stages=1, workers_per_stage=None, group_size=1,
                                           record_images=eval_cfg.videos > 0)
        self.seed, self.engine = seed, engine
        self.collector = RolloutCollector(self.env_cfg, engine, col, policy_cfg=policy_cfg, timeline=NULL_TIMELINE)
        self.slots = env_slots(self.env_cfg)

    def run(self, video_dir: Path | None = None) -> EvalResult:
        """Every evaluation runs the same episodes with the same noise (comparable across steps, and after a resume,
        whose checkpoint holds no evaluator state) and leaves the engine's noise stream as it found it: a training
        run continues as if it had not evaluated (a resumed finished run, `run.resume=RUN grpo.steps=N`, too)."""
        self.collector.epochs = 0
        for stage in self.collector.stages:
            stage.vec.reset_count = 0  # episode seeds derive from (seed, reset count)
        generator = self.engine.generator
        training_noise = generator.get_state()
        generator.manual_seed(self.seed + EVAL_NOISE_SEED)
        try:
            return self._run(video_dir)
        finally:
            generator.set_state(training_noise)

    def _run(self, video_dir: Path | None) -> EvalResult:
        rounds = math.ceil(self.cfg.init_states / self.per_task)
        successes = {t: 0 for t in self.tasks}
        episodes = {t: 0 for t in self.tasks}
        chunks = {t: 0 for t in self.tasks}
        videos: list[tuple[str, Path]] = []
        mode = "eval" if self.cfg.sampling == "ode" else "train"
        for r in [r for _ in range(self.cfg.repeats) for r in range(rounds)]:
            ids = np.array([r * self.per_task + i % self.per_task for i in range(self.env_cfg.num_envs)])
            # ids past init_states run (the batch keeps its size) but are not counted
            safe = np.minimum(ids, self.cfg.init_states - 1)
            batch = self.collector.collect(init_state_ids=safe, seed=self.seed, mode=mode)
            for n, slot in enumerate(self.slots):
                if ids[n] >= self.cfg.init_states or batch.lost[n]:
                    continue
                episodes[slot.task_id] += 1
                successes[slot.task_id] += int(batch.success[n])
                chunks[slot.task_id] += int(batch.num_chunks[n])
                if video_dir is not None and len(videos) < self.cfg.videos and VIDEO_CAMERA in batch.images:
                    frames = upright(batch.images[VIDEO_CAMERA][n, : max(1, int(batch.num_chunks[n]))])
                    name = f"task{slot.task_id}_init{ids[n]}_{'success' if batch.success[n] else 'failure'}"
                    videos.append((name, write_video(frames, Path(video_dir) / name, self.cfg.video_fps,
                                                     self.cfg.video_format)))
        labels = {slot.task_id: slot.label for slot in self.slots}
        results = [TaskResult(t, labels[t], episodes[t], successes[t], chunks[t] / max(episodes[t], 1))
                   for t in self.tasks]
        return EvalResult(results, videos)

    def close(self) -> None:
        self.collector.close()
