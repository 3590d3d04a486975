"""Review round 38, the rollout collector: layouts refused when the collector is built, caller
buffers checked in full, non-finite actions named by the collector's env numbering."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from rollout.collector_record import BatchShapes
from tests.rollout.test_collector import (  # noqa: F401 (fixture)
    GROUP_INIT_STATES,
    EngineAround,
    countdown_env,
    make_engine,
    one_torch_thread,
    tiny_policy,
)


def test_collector_group_size_that_mixes_tasks_is_refused_when_built():
    """env.group_size 2 gives tasks per 2 envs (0, 0, 1, 1, ...); collector groups of 4 would mix
    two tasks. Before: the collector was built (every worker's envs too) and the first collect()
    failed in the vector env's reset, naming no collector key."""
    cfg = CollectorConfig(stages=1, in_process=True, group_size=4)
    with pytest.raises(ValueError, match=r"rollout\.collector\.group_size \(4\) puts envs 0\.\.3, which run "
                                         r"tasks \[0, 1\], in one GRPO group"):
        RolloutCollector(countdown_env(group_size=2), make_engine(tiny_policy()), cfg)
    # one task for every env: larger collector groups are fine
    with RolloutCollector(countdown_env(group_size=2, task_ids=[1]), make_engine(tiny_policy()), cfg) as c:
        batch = c.collect([0, 1], seed=0)
    np.testing.assert_array_equal(batch.init_state_ids, [0, 0, 0, 0, 1, 1, 1, 1])


def test_out_batch_must_match_every_buffer_of_the_collector():
    """Before: only chains and the action count were compared, so a buffer without images was
    filled silently without them and one with other image sizes failed on a bare broadcast."""
    with RolloutCollector(countdown_env(), make_engine(tiny_policy()), CollectorConfig(stages=1, in_process=True)) as c:
        no_images = c.shapes.allocate(8, c.max_chunks, 2, record_images=False)
        with pytest.raises(ValueError, match=r"images\[agentview_image\] missing \(needs \(8, 3, 8, 8, 3\)\).*"
                                             r"allocate it with collector\.allocate_batch"):
            c.collect(GROUP_INIT_STATES, seed=0, out=no_images)
        other = BatchShapes.from_configs(countdown_env(image_size=16), tiny_policy()).allocate(8, c.max_chunks, 2, True)
        with pytest.raises(ValueError, match=r"images\[wrist_image\] \(8, 3, 16, 16, 3\) \(needs \(8, 3, 8, 8, 3\)\)"):
            c.collect(GROUP_INIT_STATES, seed=0, out=other)
        assert c.collect(GROUP_INIT_STATES, seed=0, out=c.allocate_batch()).chunk_valid.any()
    eval_cfg = CollectorConfig(stages=1, in_process=True, record_images=False)
    with RolloutCollector(countdown_env(), make_engine(tiny_policy()), eval_cfg) as c:
        assert c.collect(GROUP_INIT_STATES, seed=0, out=c.allocate_batch()).images == {}


class PoisonedActions(EngineAround):
    """The real engine, with one `value` (NaN, inf) in the actions of the predict whose first row runs `task`."""

    def __init__(self, task: int, value: float = float("nan")):
        super().__init__(make_engine(tiny_policy()))
        self.task, self.value = task, value

    def predict(self, obs, **kwargs):
        out = super().predict(obs, **kwargs)
        if obs["state"][0][4] == self.task:  # countdown state[4] is the task id
            out.actions[0, 1, 2] = self.value
        return out


def test_non_finite_actions_name_the_collectors_env():
    """Env 4 is row 0 of stage 1; before, the stage's vector env refused it as "env 0"."""
    with RolloutCollector(countdown_env(), PoisonedActions(task=2), CollectorConfig(stages=2, in_process=True)) as c:
        with pytest.raises(ValueError, match=r"actions for stage 1 chunk 0 \(4 rows\) are not finite: env 4 "
                                             r"\(countdown/2\) has nan at sub-step 1, dim 2"):
            c.collect(GROUP_INIT_STATES, seed=0)
        c.engine.task = -1  # no more NaNs: the next epoch runs normally
        assert c.collect(GROUP_INIT_STATES, seed=0).chunk_valid.any()
