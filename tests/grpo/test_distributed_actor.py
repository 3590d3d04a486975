"""The data-parallel actor with 2 gloo ranks on CPU (this process = rank 0, one spawned worker) against
the single-process Actor over the same rows: the same update within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.actor_group import ActorGroup, ActorRankError
from grpo.config import GRPOConfig
from grpo.distributed import ActorPlan, is_sharded
from tests.grpo.helpers import sampled_rows, tiny_policy

# 12 rows of 6 trajectories (2 rows each); trajectory_mean weights from these lengths
LENGTHS = torch.tensor([1, 3, 3, 3, 2, 2, 4, 4, 2, 2, 5, 5])
# 3 global batches of 4 rows per update epoch, 2 epochs, micro-batches of 2; the clip and the
# gradient-norm clip are active (grad norm ~33 > 0.5); KL to the reference on.
RECIPE = dict(micro_batch=2, global_batch=4, update_epochs=2, lr=3e-4, grad_clip=0.5, loss_agg="trajectory_mean",
              kl_coef=0.05)


def cfg(mode: str = "none", **overrides) -> GRPOConfig:
    parallel = {"mode": mode, "world_size": 2, "torch_threads": 1, "dist_timeout_s": 120,
                "start_timeout_s": 120} if mode != "none" else {}
    return GRPOConfig(**{**RECIPE, **overrides}, actor_parallel=parallel)


def single_process(rows, **overrides):
    policy = tiny_policy()
    actor = Actor(policy, cfg(**overrides))
    metrics = actor.train(rows)
    return policy, actor, metrics


def assert_same_update(single_policy, single_metrics, pushed: dict, metrics: dict) -> None:
    reference = {n: p.detach() for n, p in single_policy.model.named_parameters()}
    trained = [n for n, p in single_policy.model.named_parameters() if p.requires_grad]
    assert set(pushed) == set(trained)
    for name in trained:
        torch.testing.assert_close(pushed[name], reference[name], rtol=0, atol=2e-6, msg=name)
    assert metrics["train/optimizer_steps"] == single_metrics["train/optimizer_steps"] == 6
    assert metrics["train/grad_norm"] > 10 * RECIPE["grad_clip"]  # the clip acted
    for key, value in single_metrics.items():
        if key.startswith("step_time/"):  # wall times: this rank's, not comparable
            continue
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_ddp_two_ranks_equal_the_single_process_update():
    rows = sampled_rows(tiny_policy(), 12, lengths=LENGTHS)
    single_policy, single_actor, single_metrics = single_process(rows)
    policy = tiny_policy()
    frozen_before = {n: p.detach().clone() for n, p in policy.model.named_parameters()
                     if not any(p is q for q in policy.trainable_parameters())}
    # group size 2: groups of 4 rows; 3 groups over 2 ranks -> 8 / 4 rows (rank 1 runs filler passes)
    group = ActorGroup(policy, cfg("ddp"), ActorPlan("ddp", ["cpu", "cpu"], "gloo"), group_size=2)
    try:
        metrics = group.train(rows)
        pushed = group.weights_for_push(full=False)
        everything = group.weights_for_push(full=True)
        workers = [w.process for w in group.workers]
    finally:
        group.close()
    # every rank left the group with the others (NCCL's destroy is collective) and the workers exited cleanly
    assert not torch.distributed.is_initialized() and [p.exitcode for p in workers] == [0]
    assert metrics["train/actor_ranks"] == 2
    assert_same_update(single_policy, single_metrics, pushed, metrics)
    assert set(everything) == {n for n, _ in policy.model.named_parameters()}
    for name, value in frozen_before.items():
        assert torch.equal(everything[name], value), name
    # the shuffling generator advanced exactly as the single-process actor's (checkpoints stay compatible)
    assert torch.equal(group.generator.get_state(), single_actor.generator.get_state())


@pytest.mark.slow
def test_fsdp2_two_ranks_equal_the_single_process_update_with_an_idle_rank():
    rows = sampled_rows(tiny_policy(), 12, lengths=LENGTHS)
    single_policy, _, single_metrics = single_process(rows)
    policy = tiny_policy()
    # one group holds every row: rank 1 owns none and runs only filler passes
    group = ActorGroup(policy, cfg("fsdp2"), ActorPlan("fsdp2", ["cpu", "cpu"], "gloo"), group_size=100)
    try:
        assert all(is_sharded(p) for p in policy.trainable_parameters())  # really FSDP2-sharded here
        metrics = group.train(rows)
        pushed = group.weights_for_push(full=False)  # all-gathered by both ranks
    finally:
        group.close()
    assert_same_update(single_policy, single_metrics, pushed, metrics)


@pytest.mark.slow
def test_a_worker_failure_names_the_rank_and_breaks_the_group():
    group = ActorGroup(tiny_policy(), cfg("ddp"), ActorPlan("ddp", ["cpu", "cpu"], "gloo"), group_size=2)
    try:
        with pytest.raises(ActorRankError, match=r"(?s)actor rank 1 \(cpu\) failed in probe.*unknown actor command"):
            group._together(lambda: None, {1: ("probe", None)}, "probe")
        with pytest.raises(RuntimeError, match="the actor group is broken since probe"):
            group.train(sampled_rows(tiny_policy(), 4))
    finally:
        group.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ranks need 2 GPUs")
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_nccl_two_gpus_equal_the_single_process_update(mode):
    """The same check over NCCL on cuda:0/cuda:1, fp32 (autocast off) so the tolerance stays tight."""
    rows = sampled_rows(tiny_policy(), 12, lengths=LENGTHS)
    single = tiny_policy().to("cuda:0")
    single_metrics = Actor(single, cfg(autocast="none")).train(rows)
    policy = tiny_policy().to("cuda:0")
    group = ActorGroup(policy, cfg(mode, autocast="none"), ActorPlan(mode, ["cuda:0", "cuda:1"], "nccl"), group_size=2)
    try:
        metrics = group.train(rows)
        pushed = group.weights_for_push(full=False)
    finally:
        group.close()
    reference = {n: p.detach() for n, p in single.model.named_parameters() if p.requires_grad}
    assert set(pushed) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(pushed[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert metrics["train/grad_norm"] == pytest.approx(single_metrics["train/grad_norm"], rel=1e-4)
