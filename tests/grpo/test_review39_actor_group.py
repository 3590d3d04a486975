"""The data-parallel actor group's process plumbing (review round 39): a worker rank that cannot start."""

from __future__ import annotations

import pytest

from grpo.actor_group import ActorGroup, ActorRankError
from grpo.distributed import ActorPlan
from tests.grpo.helpers import tiny_policy
from tests.grpo.test_distributed_actor import cfg
from tests.rollout.test_review39_engine import failing_start


def test_a_worker_that_cannot_start_closes_its_pipe_and_is_named(monkeypatch):
    """Both ends of the worker's pipe were in no _Worker yet: close() did not close them, and the bare
    OSError named no rank."""
    ends = failing_start(monkeypatch)
    with pytest.raises(ActorRankError, match=r"actor rank 1 \(cpu\) could not start its process: .*"
                                             r"Cannot allocate memory"):
        ActorGroup(tiny_policy(), cfg("ddp"), ActorPlan("ddp", ["cpu", "cpu"], "gloo"), group_size=2)
    assert ends and all(end.closed for end in ends)
