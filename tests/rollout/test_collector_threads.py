"""rollout.collector.driver_torch_threads: the driver's torch threads during an epoch (an inproc engine
predicts there beside the env workers), restored afterwards, also when the epoch fails."""

from __future__ import annotations

import pytest
import torch

from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from tests.rollout.test_collector import EngineAround, countdown_env, make_engine, tiny_policy


class ThreadWatchingEngine(EngineAround):
    """The real engine, recording torch's thread count at every predict (and failing on request)."""

    def __init__(self, engine, fail_at: int | None = None):
        super().__init__(engine)
        self.fail_at, self.seen = fail_at, []

    def predict(self, obs, **kwargs):
        self.seen.append(torch.get_num_threads())
        if self.fail_at is not None and len(self.seen) > self.fail_at:
            raise RuntimeError("predict failed")
        return super().predict(obs, **kwargs)


@pytest.mark.parametrize("threads, fail_at", [(1, None), (1, 1), (None, None)])
def test_epoch_runs_at_the_driver_threads_and_restores_them(threads, fail_at):
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = ThreadWatchingEngine(make_engine(tiny_policy()), fail_at)
        cfg = CollectorConfig(stages=2, in_process=True, driver_torch_threads=threads)
        with RolloutCollector(countdown_env(num_envs=4), engine, cfg) as collector:
            if fail_at is None:
                collector.collect([0, 1], seed=0)
            else:
                with pytest.raises(RuntimeError, match="predict failed"):
                    collector.collect([0, 1], seed=0)
            assert torch.get_num_threads() == 2  # restored after the epoch
        assert engine.seen and set(engine.seen) == {threads or 2}
    finally:
        torch.set_num_threads(previous)


def test_driver_threads_are_validated_by_name():
    with pytest.raises(ValueError, match=r"rollout\.collector\.driver_torch_threads"):
        CollectorConfig(driver_torch_threads=0)
