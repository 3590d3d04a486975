"""Review round 44, grpo: grpo.actor_parallel.dist_timeout_s is refused by key when torch.distributed cannot take
it (inf overflowed the timedelta of init_group in every rank, naming no key), as rollout.weights.dist_timeout_s."""

from __future__ import annotations

import pytest

from grpo.distributed import ActorParallelConfig, RankSpec, init_group, leave_group


@pytest.mark.parametrize("value", [float("inf"), 1e9])
def test_an_unbounded_dist_timeout_is_refused_by_key(value):
    with pytest.raises(ValueError, match=r"grpo\.actor_parallel\.dist_timeout_s must be a finite number of "
                                         r"seconds <= 604800 \(a week\), got "):
        ActorParallelConfig(mode="ddp", world_size=2, dist_timeout_s=value)
    with pytest.raises(ValueError, match=r"grpo\.actor_parallel\.dist_timeout_s"):
        ActorParallelConfig.coerce({"mode": "ddp", "world_size": 2, "dist_timeout_s": value})


def test_the_longest_accepted_dist_timeout_joins_a_group(tmp_path):
    """The bound is one torch.distributed takes: a week's timeout starts a (one-rank, gloo) group."""
    cfg = ActorParallelConfig(mode="ddp", world_size=1, dist_timeout_s=7 * 24 * 3600.0)
    init_group(RankSpec(0, 1, "cpu", "gloo", f"file://{tmp_path / 'rendezvous'}", cfg.dist_timeout_s))
    leave_group()
