"""Review round 39, the rollout collector: infinite engine actions refused (the clip used to turn
them into +-action_clip before the finiteness check), and errors of a stage's vector env say
which stage raised them and how its env numbering maps to the collector's."""

from __future__ import annotations

import numpy as np
import pytest

from envs.vector.subproc import WorkerCrashedError
from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from tests.rollout.test_collector import (  # noqa: F401 (fixture)
    GROUP_INIT_STATES,
    KillWorkerBeforePredict,
    countdown_env,
    make_engine,
    one_torch_thread,
    tiny_policy,
)
from tests.rollout.test_review38_collector import PoisonedActions


def test_infinite_engine_actions_are_refused_not_clipped_to_the_bound():
    """Before: np.clip made the inf a 1.0 before the check, so env 4 silently executed it and the batch
    recorded it as a valid chunk (only NaN, which clip keeps, was refused)."""
    engine = PoisonedActions(task=2, value=float("inf"))
    with RolloutCollector(countdown_env(), engine, CollectorConfig(stages=2, in_process=True)) as c:
        with pytest.raises(ValueError, match=r"actions for stage 1 chunk 0 \(4 rows\) are not finite: env 4 "
                                             r"\(countdown/2\) has inf at sub-step 1, dim 2"):
            c.collect(GROUP_INIT_STATES, seed=0)
        c.engine.task = -1  # no more infs: the next epoch runs, its actions within the clip
        batch = c.collect(GROUP_INIT_STATES, seed=0)
        assert batch.chunk_valid.any() and (np.abs(batch.actions) <= 1).all()


def test_a_stage_worker_crash_names_the_stage_and_the_collectors_envs():
    """The killed worker serves env 2 (stage 1, row 0). The vector env names it "env worker 0 (..., envs [0])"
    in its own numbering, as it does for stage 0's worker 0 and env 0; before, nothing said which stage."""
    env_cfg = countdown_env(num_envs=4, group_size=1, max_episode_steps=12, task_ids=[3])
    engine = KillWorkerBeforePredict(make_engine(tiny_policy()), call=3)  # stage 1's chunk 1
    note = ("in rollout stage 1 (its own vector env and workers): env i of the stage is the collector's env 2 + i "
            "(envs 2..3)")
    with RolloutCollector(env_cfg, engine, CollectorConfig(stages=2, workers_per_stage=2)) as collector:
        engine.victim = lambda: collector.stages[1].vec.worker_pids[0]
        with pytest.raises(WorkerCrashedError, match=r"env worker 0 .*envs \[0\].* died") as crash:
            collector.collect([2, 2, 2, 2], seed=0)
        assert note in getattr(crash.value, "__notes__", [])
        with pytest.raises(RuntimeError, match="unusable after a worker crash") as unusable:  # the next reset
            collector.collect([2, 2, 2, 2], seed=0)
        assert note in getattr(unusable.value, "__notes__", [])
