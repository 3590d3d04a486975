"""The GRPO training loop, top to bottom (CleanRL style). Entry point: experiments/grpo.py.

Per RL step s = 1..grpo.steps (weight version = s, the global step: the weights after s - 1 updates):
    weight_sync  trainer weights -> the engine (version=s), unless the evaluation after step s - 1
                 already pushed them: everything at the first push of a (re)started run, the
                 trainable parameters after that; by the placement's
                 transport (rollout/placement.py): a state dict through update_weights, or a
                 torch.distributed broadcast from the trainer's GPU when the engine's ranks are
                 processes on other GPUs (run.device=cuda:0 rollout=local
                 'rollout.engine.devices=[cuda:1,...]')
    rollout      grpo.rollout_epochs x collector.collect(): every env reset (groups of G share
                 an init state), chunks until every episode ends (the collector records
                 rollout/reset, rollout/transfer, rollout/predict, rollout/env_step)
    advantages   group-normalised success over all epochs, filtered groups, chunk masks
    actor_train  recompute old log-probs, clipped surrogate with truncated IS, AdamW steps; in this
                 process, or data-parallel over grpo.actor_parallel.world_size ranks (DDP / FSDP2,
                 rank 0 here, the others spawned: grpo/actor_group.py)
each a profiler span inside the "step" span; then one console line, metrics.jsonl + wandb,
an evaluation every eval.every steps, a checkpoint every run.checkpoint_every steps. The evaluation
after step s scores the weights after s updates (those the checkpoint of step s holds): it pushes
them first as version s + 1, which step s + 1 then rolls out with unchanged. When the
loop ends: report.json / trace.json / timeline.png / breakdown.png / success_rate.png and the
wandb run (grpo/artifacts.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from grpo import checkpoint
from grpo.actor_group import build_actor, plan_actor_for_run
from grpo.artifacts import write_profile
from grpo.evaluate import Evaluator
from grpo.memory import card_state_metrics, memory_metrics
from grpo.prefix_store import RowPrefixes
from grpo.reporting import MetricsLog, WandbRun, console_line, phase_metrics, plot_success_curve
from grpo.run_config import ExperimentConfig
from grpo.samples import EpochRows, assemble, rollout_metrics
from policies import PolicyConfig, build_policy
from policies.fast.config import FAST_OFF
from profiler import make_timeline, profiler_environ, set_timeline, write_meta
from rollout.collector import RolloutCollector
from rollout.engine import PolicyEngine
from rollout.placement import plan_placement
from rollout.weights_push import PushTiming, make_pusher

CURVE_FILE = "success_rate.png"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trainer_policy_config(cfg: PolicyConfig) -> PolicyConfig:
    """The trainer keeps fp32 master weights (bf16 compute comes from autocast) and the plain
    forward; the engine runs the configured dtype and fast path. With
    policy.fast.consistent_recompute the trainer keeps the fast path too: its log_prob re-scores
    the stored transitions through the rollout's kernels at the rollout's shapes (bf16 shadows of
    the fp32 masters equal the engine's cast weights), see policies/fast/recompute.py."""
    if cfg.fast.enabled and cfg.fast.consistent_recompute:
        return cfg.replace(dtype="float32")
    return cfg.replace(dtype="float32", fast=FAST_OFF)


def data_position(collector) -> dict:
    """The collector's epoch counter and each stage env's reset counter (episode seeds derive from
    both)."""
    return {"collector_epochs": collector.epochs, "env_resets": [st.vec.reset_count for st in collector.stages]}


def restore_data_position(collector, position: dict) -> None:
    collector.epochs = int(position["collector_epochs"])
    for stage, count in zip(collector.stages, position.get("env_resets", [])):
        stage.vec.reset_count = int(count)


@contextlib.contextmanager
def phase(timeline, name: str, step: int, times: dict[str, float]):
    """A profiler span and the driver's wall time of it (for the live console line)."""
    start = time.perf_counter()
    with timeline.span(name, step=step):
        yield
    times[name] = time.perf_counter() - start


@contextlib.contextmanager
def profiler_env(prof, run_dir: Path):
    """Engine ranks (and their processes) record into this run's trace while the run lasts."""
    saved = dict(os.environ)
    os.environ.update(profiler_environ(prof, run_dir))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Trainer:
    """Owns the run's components; `run()` is the loop. Tests drive it directly."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        resume_from = checkpoint.resolve(cfg.run.resume) if cfg.run.resume else None  # fail before building
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.placement = plan_placement(cfg.run.device, "run.device", cfg.rollout, cuda_count)  # before any process
        self.actor_plan, self.placement = plan_actor_for_run(cfg, self.placement, cuda_count)  # grpo.actor_parallel
        self.device = torch.device(self.placement.trainer_device)
        # memory/* covers the devices this process computes on: an in-process engine's too
        inproc = cfg.rollout.engine.backend == "inproc"
        self.memory_devices = [self.device, *(self.placement.engine_devices if inproc else [])]
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        seed_everything(cfg.run.seed)
        gpu = self.device.type == "cuda"
        self.prof = dataclasses.replace(cfg.profiler, out_dir=str(self.run_dir),
                                        gpu_timing=cfg.profiler.gpu_timing if not gpu or cfg.profiler.gpu_timing
                                        != "none" else "sync")
        write_meta(self.run_dir, profiler_config=dataclasses.asdict(self.prof), workload=self.describe())
        self.timeline = make_timeline(self.prof, rank=0, worker="driver", run_dir=self.run_dir)
        self._previous_timeline = set_timeline(self.timeline)
        self.lanes = [make_timeline(self.prof, rank=0, worker=f"env_stage{s}", run_dir=self.run_dir)
                      for s in range(cfg.collector.stages)]
        self.engine = self.collector = self.evaluator = self.pusher = self.actor = self.prefix_store = None
        try:
            self.policy = build_policy(trainer_policy_config(cfg.policy), self.device)
            with profiler_env(self.prof, self.run_dir):
                self.engine = PolicyEngine(cfg.rollout.engine, cfg.policy, cfg.rollout.weights)
            self.pusher = make_pusher(self.engine, self.placement, cfg.rollout.weights)
            self.collector = RolloutCollector(cfg.env, self.engine, cfg.collector, policy_cfg=cfg.policy,
                                              timeline=self.timeline, stage_timelines=self.lanes)
            # the collector's group size: rollout.collector.group_size may override env.group_size
            self.actor = build_actor(self.policy, cfg.grpo, self.actor_plan, self.collector.group_size,
                                     show_progress=cfg.run.show_progress)
            self.prefix_store = self._engine_prefixes()
            self.state = checkpoint.TrainState(step=1)
            if resume_from is not None:
                self.resume(resume_from)
                if self.state.step > cfg.grpo.steps:  # (experiments/grpo.py says so earlier for step_NNNNNN.pt)
                    raise ValueError(f"run.resume: {resume_from} is step {self.state.step - 1} and grpo.steps is "
                                     f"{cfg.grpo.steps}: nothing is left to train (raise grpo.steps to go on)")
            self.log = MetricsLog(self.run_dir, self.state.history)
            self.log.rewrite()
            self.wandb = WandbRun(cfg.logger, self.run_dir, cfg.raw, resume_id=self.state.wandb_id)
            self.state.wandb_id = self.wandb.id
        except BaseException:
            self.close()
            raise

    def _engine_prefixes(self) -> RowPrefixes | None:
        """grpo.prefix_cache=engine: one store for every row a step's rollout can predict, which the engine fills as
        it predicts (train mode) and the actor reads (grpo/prefix_store.py); emptied before each step's rollout."""
        g = self.cfg.grpo
        if g.prefix_cache != "engine":
            return None
        rows = self.collector.num_envs * self.collector.max_chunks * g.rollout_epochs
        store = RowPrefixes("device", rows=rows, budget_bytes=g.prefix_cache_bytes, setting="engine",
                            spill_bytes=g.prefix_cache_spill_bytes, spill_read=g.prefix_cache_spill_read)
        self.engine.keep_prefixes(store)
        self.collector.keep_prefixes = True
        self.actor.engine_prefixes = store
        return store

    def describe(self) -> str:
        c = self.cfg
        return (f"experiments.grpo: {c.env.env_type}/{c.env.suite} tasks {c.env.task_ids}, {c.env.num_envs} envs in "
                f"groups of {c.collector.group_size or c.env.group_size}, {c.collector.stages} stages, "
                f"{c.policy.name} policy, "
                f"{c.grpo.rollout_epochs} epochs x {c.grpo.steps} steps; trainer on {self.device}"
                f"{self._actor_ranks()}, engine {c.rollout.engine.backend} x{c.rollout.engine.num_ranks} on "
                f"{self.placement.engine_devices}, "
                f"weights by {self.placement.why}")

    def _actor_ranks(self) -> str:
        plan = self.actor_plan
        return "" if plan.mode == "none" else f" (actor {plan.mode} x{len(plan.devices)} on {plan.devices})"

    # ----- the loop -----
    def run(self) -> list[dict]:
        cfg = self.cfg
        steps = range(self.state.step, cfg.grpo.steps + 1)
        if cfg.eval.at_start and self.state.step == 1:
            self.sync_for_eval(0)
            self.evaluate(0)
        bar = tqdm(steps, desc="GRPO steps", disable=not cfg.run.show_progress, dynamic_ncols=True)
        for step in bar:
            metrics = self.train_step(step)
            bar.write(console_line(step - 1, cfg.grpo.steps, metrics))
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.grpo.steps):
                self.sync_for_eval(step)  # the engine is one update behind: evaluate this step's result
                self.evaluate(step)
            self.state.step = step + 1
            every = cfg.run.checkpoint_every
            if every and (step % every == 0 or step == cfg.grpo.steps):
                self.save(step)
            self.timeline.flush()
        return self.state.history

    def train_step(self, step: int) -> dict:
        cfg, tl, times = self.cfg, self.timeline, {}
        with phase(tl, "step", step, times):
            with phase(tl, "weight_sync", step, times):
                push = self.sync_weights(step)  # None: the evaluation after step - 1 pushed them already
            with phase(tl, "rollout", step, times):
                if self.prefix_store is not None:
                    self.prefix_store.reset()  # the last step's rows (the buffers stay)
                epochs, predict_s = [], 0.0
                for _ in tqdm(range(cfg.grpo.rollout_epochs), desc=f"rollout (step {step})", leave=False,
                              disable=not cfg.run.show_progress or cfg.grpo.rollout_epochs == 1):
                    batch = self.collector.collect(seed=cfg.run.seed, mode="train", step=step)
                    epochs.append(EpochRows.from_batch(batch))
                    predict_s += self.collector.last_stats.predict_s
            card = card_state_metrics(self.memory_devices, after="rollout")
            with phase(tl, "advantages", step, times):
                data = assemble(epochs, self.collector.group_size, cfg.grpo)
            with phase(tl, "actor_train", step, times):
                train_metrics = self.actor.train(data.samples)
            card.update(card_state_metrics(self.memory_devices, after="actor"))
        metrics = {"kind": "train", "step": step, **rollout_metrics(data), **train_metrics,
                   **phase_metrics(times, predict_s), **memory_metrics(self.memory_devices), **card,
                   "rollout/stale_rows": int((data.samples.versions != step).sum())}
        if push is not None and push.send_s is not None:  # broadcast: the trainer's send until every rank wrote
            metrics["step_time/weight_send"] = push.send_s
        self.log.append(metrics)
        self.wandb.log(step, metrics)
        return metrics

    def sync_weights(self, version: int) -> PushTiming | None:
        """Make the engine hold the trainer's current weights as `version`, the RL step that rolls out
        with them (its weights after version - 1 updates); None when it already does. The first push
        of this process (engine version 0: a fresh or resumed run) carries every parameter, later ones
        only the trained ones."""
        if self.engine.version == version:
            return None
        full = self.engine.version == 0
        return self.pusher.push(self.actor.weights_for_push(full), version=version, partial=not full)

    def sync_for_eval(self, step: int) -> None:
        """Before the evaluation after `step`: the engine still holds the weights step `step` rolled out
        with, one update behind (step 0: its own initial ones). Push the weights after `step` updates
        as version step + 1, the step that rolls out with them next: its weight_sync finds them there
        and pushes nothing."""
        with self.timeline.span("eval/weight_sync", after_step=step):
            self.sync_weights(step + 1)

    def evaluate(self, step: int) -> dict:
        """Evaluate the engine's weights as those after `step` updates (run() pushes them first)."""
        if self.evaluator is None:
            self.evaluator = Evaluator(self.cfg.env, self.cfg.eval, self.cfg.collector, self.engine, self.cfg.policy,
                                       seed=self.cfg.run.seed)
        with self.timeline.span("eval", after_step=step):
            result = self.evaluator.run(self.run_dir / "videos" / f"step_{step:06d}")
        metrics = {"kind": "eval", "step": step, **result.metrics()}
        tqdm.write(f"evaluation after step {step} ({self.cfg.eval.sampling}):\n{result.table()}")
        self.log.append(metrics)
        self.wandb.log(step, metrics)
        self.wandb.log_table(f"eval/table_step_{step}", result.COLUMNS, result.rows())
        self.wandb.log_videos(result.videos)
        return metrics

    # ----- checkpoints -----
    def save(self, step: int) -> Path:
        rng = checkpoint.rng_state(self.actor.generator, self.engine.generator)
        return checkpoint.save(self.run_dir, step, self.state, self.policy.model, self.actor.optimizer,
                               self.actor.updates, rng, data_position(self.collector), self.cfg.run.keep_checkpoints)

    def resume(self, path: str | Path) -> None:
        payload = checkpoint.load(path)
        self.policy.model.load_state_dict(payload["model"], strict=True)
        # moments and step counts only: the optimizer keeps grpo.lr etc. (grpo/actor.py make_optimizer warns)
        self.actor.optimizer.load_state_dict(payload["optimizer"])
        self.actor.updates = int(payload["actor_updates"])
        self.actor.sync_loaded_state()  # data-parallel ranks take rank 0's loaded weights and optimiser state
        checkpoint.restore_rng(payload["rng"], self.actor.generator, self.engine.generator)
        restore_data_position(self.collector, payload["data"])
        self.state = checkpoint.TrainState(step=int(payload["step"]) + 1, history=list(payload["history"]),
                                           wandb_id=payload.get("wandb_id"))

    # ----- the end -----
    def finish(self) -> dict[str, Path]:
        """Flush the trace, write the profile artifacts and the curve, close the wandb run."""
        self.close()
        written = write_profile(self.run_dir, self.prof, self.wandb, quiet=True) if self.prof.enabled else {}
        c = self.cfg
        title = f"GRPO on {c.env.env_type if c.env.env_type != 'libero' else c.env.suite}, {c.policy.name} policy"
        curve = plot_success_curve(self.log.history, self.run_dir / CURVE_FILE, title=title,
                                   eval_label=f"evaluation ({c.eval.sampling}, {c.eval.init_states} init states "
                                              f"x {c.eval.repeats})")
        if curve is not None:
            written["success_rate"] = curve
            self.wandb.log_images({"success_rate": curve})
        wandb_dir = self.wandb.finish()
        if wandb_dir is not None:
            written["wandb"] = wandb_dir
        return written

    def abort(self) -> None:
        """After an error: stop every process, keep the trace written so far, end the wandb run."""
        self.close()
        if getattr(self, "wandb", None) is not None:
            self.wandb.finish(exit_code=1)

    def close(self) -> None:
        """Stop the envs' workers and the engine, flush the trace (idempotent)."""
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        if self.actor is not None:
            self.actor.close()  # the data-parallel actor's worker ranks (idempotent)
        for part in (self.evaluator, self.collector, self.engine):
            if part is not None:
                part.close()
        self.evaluator = self.collector = self.engine = None
        for lane in self.lanes:
            lane.close()
        self.timeline.close()
        set_timeline(self._previous_timeline)
