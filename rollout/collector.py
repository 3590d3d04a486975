"""The rollout collector: runs rollout epochs with pipelined vector envs and a policy engine.

    collector = RolloutCollector(env_cfg, engine, CollectorConfig(stages=2), policy_cfg=pcfg)
    batch = collector.collect(init_state_ids=None, seed=None, mode="train")   # one epoch
    collector.close()

The N envs are split into S stages, each its own vector env over its own worker processes
(`collector_stages.py`). One epoch resets every env (groups of G envs share an init state),
then runs chunks until every env is done or `max_chunks` (default ceil(episode_steps / chunk))
is reached. The driver thread predicts; env chunks run in a thread pool (one thread per stage,
each waiting on its stage's workers), so stage i's envs step while the engine predicts stage
i+1:

    driver:  predict s0 | predict s1 | wait s0, predict s0 | wait s1, predict s1 | ...
    stage 0:            | env chunk 0 ...........|                | env chunk 1 ...
    stage 1:                         | env chunk 0 .............. |

Profiler spans: `rollout/reset`, `rollout/transfer` and `rollout/predict` (stage, chunk,
batch) on the driver's timeline, `rollout/env_step` (stage, chunk) on each stage's own lane
(`stage_timelines`), so the overlap shows in the trace. The caller wraps the epoch in its
`rollout` span.

`render_at: before_predict` keeps the env workers' (EGL) rendering off the GPU while a predict
runs: a stage's chunk runs physics only, and the driver renders it (`rollout/render`, keyed by
that env chunk, on the driver's timeline) once it has the chunk back, i.e. after the previous
stage's predict and just before this stage's. The batch is the same bit for bit.

Everything lands in a preallocated `RolloutBatch` (rollout/trajectory.py), reused by every
call (or the caller's own, `out=`, from `allocate_batch()`: e.g. one per rollout epoch of an RL
step), so memory is bounded; its size is logged once. Actions are clipped to [-1, 1] before the
env. Only rows whose episode is still running are predicted (`predict_done_envs` changes that).
An env lost to a worker crash (env.restart_on_crash) gets `lost` and no valid chunk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np
import torch

from envs.config import EnvConfig
from envs.vector.base import first_non_finite
from envs.vector.catalog import env_slots
from policies.config import PolicyConfig
from profiler import NULL_TIMELINE
from rollout.collector_config import CollectorConfig
from rollout.collector_record import (
    BatchShapes,
    engine_inputs,
    finalize,
    record_observation,
    record_prediction,
    record_result,
)
from rollout.collector_stages import Stage, StageChunk, plan_init_states, stage_env_configs
from rollout.collector_stats import CollectStats
from rollout.trajectory import RolloutBatch
from rollout.types import PolicyOutput

log = logging.getLogger(__name__)


class PredictEngine(Protocol):
    """What the collector needs of `rollout.engine.PolicyEngine`."""

    version: int

    def predict(self, obs: dict[str, Any], mode: str = "train", group_size: int | None = None,
                keep_prefix: bool = False) -> PolicyOutput: ...


class RolloutCollector:
    def __init__(
        self,
        env_cfg: EnvConfig,
        engine: PredictEngine,
        cfg: CollectorConfig | None = None,
        policy_cfg: PolicyConfig | None = None,
        timeline: Any = NULL_TIMELINE,
        stage_timelines: Sequence[Any] | None = None,
    ):
        self.cfg = cfg or CollectorConfig()
        self.env_cfg = env_cfg
        self.engine = engine
        policy_cfg = policy_cfg if policy_cfg is not None else getattr(engine, "policy_config", None)
        if policy_cfg is None:
            raise ValueError("RolloutCollector needs the policy config (policy_cfg=, or engine.policy_config) to "
                             "size its buffers")
        self.shapes = BatchShapes.from_configs(env_cfg, policy_cfg)
        # train-mode predicts leave their prefix K/V in the engine's store (PolicyEngine.keep_prefixes; the trainer
        # sets this under grpo.prefix_cache=engine); each row's id there lands in RolloutBatch.prefix_rows
        self.keep_prefixes = False
        self.slots = env_slots(env_cfg)
        self.group_size = self.cfg.effective_group_size(env_cfg)
        self.max_chunks = self.cfg.effective_max_chunks(env_cfg)
        configs = stage_env_configs(env_cfg, self.cfg, self.slots)
        if stage_timelines is not None and len(stage_timelines) != len(configs):
            raise ValueError(f"stage_timelines has {len(stage_timelines)} lanes for {len(configs)} stages")
        self.timeline = timeline
        self.stages: list[Stage] = []
        self._pool = ThreadPoolExecutor(max_workers=len(configs), thread_name_prefix="rollout-stage")
        self._batch: RolloutBatch | None = None
        self.epochs = 0
        self.last_stats: CollectStats | None = None
        try:
            for s, stage_cfg in enumerate(configs):
                lane = stage_timelines[s] if stage_timelines is not None else timeline
                self.stages.append(Stage(s, s * stage_cfg.num_envs, stage_cfg, self.cfg.in_process, lane,
                                         defer_render=self.cfg.render_at == "before_predict",
                                         render_workers_at_once=self.cfg.render_workers_at_once))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public interface
    @property
    def num_envs(self) -> int:
        return self.env_cfg.num_envs

    @property
    def batch(self) -> RolloutBatch:
        """The collector's own buffer (allocated on first use, reused by every collect())."""
        if self._batch is None:
            self._batch = self.allocate_batch()
            log.info("rollout buffer: %d envs x %d chunks, %.1f MiB", self.num_envs, self.max_chunks,
                     self._batch.nbytes / 2**20)
        return self._batch

    def allocate_batch(self) -> RolloutBatch:
        """A new buffer shaped for this collector (pass it to collect(out=...))."""
        return self.shapes.allocate(self.num_envs, self.max_chunks, self.group_size, self.cfg.record_images)

    def collect(
        self,
        init_state_ids: Sequence[int] | np.ndarray | None = None,
        seed: int | None = None,
        mode: str = "train",
        out: RolloutBatch | None = None,
        step: int | None = None,
    ) -> RolloutBatch:
        """One rollout epoch. init_state_ids: one per group or per env (None: drawn per group
        from (`seed` or rollout.collector.seed, epoch)); the same seed seeds the envs' episodes
        (each stage's vector env with `stage_seed(seed, stage)`); `mode` goes to
        engine.predict; `step` tags the profiler spans with the RL step."""
        batch = out if out is not None else self.batch
        self.shapes.check_batch(batch, self.num_envs, self.max_chunks, self.cfg.record_images)
        seed = self.cfg.seed if seed is None else int(seed)
        rng = np.random.default_rng([seed, self.epochs])
        ids = plan_init_states(self.slots, self.group_size, init_state_ids, rng)
        self.epochs += 1
        batch.clear()
        batch.init_state_ids[:] = ids
        batch.task_ids[:] = [slot.task_id for slot in self.slots]
        batch.group_ids[:] = np.arange(self.num_envs) // self.group_size
        batch.prompts = [slot.prompt for slot in self.slots]
        stats = CollectStats(stages=len(self.stages), max_chunks=self.max_chunks)
        with driver_threads(self.cfg.driver_torch_threads):
            self._reset(ids, seed, step, stats)
            try:
                self._run_chunks(batch, mode, step, stats)
            finally:
                self._drain()
        finalize(batch, np.concatenate([st.done for st in self.stages]),
                 np.concatenate([st.lost for st in self.stages]))
        stats.finish(batch)
        self.last_stats = stats
        log.info("rollout epoch %d: %s", self.epochs - 1, stats.describe())
        return batch

    def close(self) -> None:
        """Stop every stage's vector env and the thread pool. Idempotent."""
        errors = []
        for stage in self.stages:
            try:
                stage.close()
            except Exception as exc:  # close every stage even if one fails
                errors.append(exc)
        self.stages = []
        self._pool.shutdown(wait=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> RolloutCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one epoch
    def _span_attrs(self, step: int | None, **attrs: Any) -> dict[str, Any]:
        return attrs if step is None else {"step": step, **attrs}

    def _reset(self, ids: np.ndarray, seed: int, step: int | None, stats: CollectStats) -> None:
        """Reset every stage at once (each waits on its own workers)."""
        if not self.stages:
            raise RuntimeError("the collector is closed")
        start = time.perf_counter()
        with self.timeline.span("rollout/reset", **self._span_attrs(step)):
            futures = [self._pool.submit(st.reset, ids, self.group_size, seed) for st in self.stages]
            wait(futures)
            for future in futures:
                future.result()
        stats.reset_s = time.perf_counter() - start

    def _run_chunks(self, batch: RolloutBatch, mode: str, step: int | None, stats: CollectStats) -> None:
        stats.start()
        for t in range(self.max_chunks):
            running = False
            for stage in self.stages:
                self._collect_result(stage, batch, stats, step)
                if stage.done.all():
                    continue
                self._start_chunk(stage, t, batch, mode, step, stats)
                running = True
            if not running:
                break
        for stage in self.stages:
            self._collect_result(stage, batch, stats, step)

    def _start_chunk(self, stage: Stage, t: int, batch: RolloutBatch, mode: str, step: int | None,
                     stats: CollectStats) -> None:
        """Predict stage's chunk t and hand it to the stage's env thread."""
        predict_all = self.cfg.predict_done_envs
        rows = np.arange(stage.size) if predict_all else stage.active_rows()
        all_rows = len(rows) == stage.size
        attrs = self._span_attrs(step, stage=stage.index, chunk=t)
        # The observation came out of env chunk t - 1 (-1: the reset): keyed so, the profiler's
        # pipeline model puts it on the env side of that chunk, before predict t.
        with self.timeline.span("rollout/transfer", **{**attrs, "chunk": t - 1}, data="observation"):
            inputs = engine_inputs(stage.obs, list(self.shapes.cameras), rows, all_rows)
            record_observation(batch, stage.start + rows, t, inputs)
        start = time.perf_counter()
        with self.timeline.span("rollout/predict", batch=len(rows), **attrs):
            out = self.engine.predict(inputs, mode=mode, group_size=self.group_size if all_rows else None,
                                      keep_prefix=self.keep_prefixes and mode == "train")
        stats.add_predict(stage.index, t, len(rows), time.perf_counter() - start)
        where = f"stage {stage.index} chunk {t} ({len(rows)} rows)"
        self.shapes.check_output(out, len(rows), where)
        with self.timeline.span("rollout/transfer", **attrs, data="actions"):
            raw = out.actions[:, : self.shapes.action_chunk].numpy()
            self._check_finite(raw, stage, rows, where)  # before the clip, which turns +-inf into +-action_clip
            actions = np.clip(raw, -self.cfg.action_clip, self.cfg.action_clip)
            record_prediction(batch, stage.start + rows, t, out, actions)
            env_actions = np.zeros((stage.size, self.shapes.action_chunk, self.shapes.action_dim), np.float32)
            env_actions[rows] = actions
        stepped = rows[~stage.done[rows]]  # predict_done_envs: done rows are predicted, not stepped
        finished_at: list[float] = []
        future = self._pool.submit(stage.step, env_actions, t, step, finished_at)
        stage.pending = StageChunk(t, stepped, future, finished_at)

    def _check_finite(self, actions: np.ndarray, stage: Stage, rows: np.ndarray, where: str) -> None:
        """NaN/inf actions are refused here, naming the collector's env: the stage's vector env
        would refuse them too, but numbered within the stage (env 0 of stage 1 is env N/S)."""
        bad = first_non_finite(actions)
        if bad is not None:
            i, h, d = bad
            env = stage.start + int(rows[i])
            raise ValueError(f"engine output actions for {where} are not finite: env {env} ({self.slots[env].label}) "
                             f"has {actions[i, h, d]} at sub-step {h}, dim {d}")

    def _collect_result(self, stage: Stage, batch: RolloutBatch, stats: CollectStats, step: int | None = None
                        ) -> None:
        """Wait for the stage's chunk in flight (if any), render it (render_at before_predict: the previous
        stage's predict has returned, this stage's comes next) and record the env's answer."""
        pending = stage.pending
        if pending is None:
            return
        stage.pending = None
        result = pending.future.result()
        finished_at = pending.finished_at[0]
        if stage.defer_render:
            attrs = self._span_attrs(step, stage=stage.index, chunk=pending.chunk)
            stats.add_render(stage.render(result, self.timeline, attrs))
            finished_at = time.perf_counter()  # its observation exists only now: the render ends the chunk
        record_result(batch, stage.rows, pending.rows, pending.chunk, result)
        stage.obs = result.obs
        stage.done = result.done.copy()
        stage.lost |= result.lost
        stats.add_env_chunk(stage.index, pending.chunk, int(result.valid.sum()), finished_at,
                            result.info.get("timing", {}).get("wall_s", 0.0))

    def _drain(self) -> None:
        """After an error: wait for every env chunk in flight so no thread outlives the epoch."""
        futures = [st.pending.future for st in self.stages if st.pending is not None]
        wait(futures)
        for stage in self.stages:
            stage.pending = None


@contextlib.contextmanager
def driver_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads in this (driver) process for one epoch, restored afterwards: an inproc
    engine predicts here beside the busy env workers, where spinning intra-op threads slow it (docs/rollout.md:
    a 32-row predict 226 ms with 16 threads, 161 with one, on an H100). None: unchanged."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
