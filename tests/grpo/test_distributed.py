"""grpo.actor_parallel without processes: config validation, rank placement, sharding, what gets wrapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo.actor import Actor, _Accumulator
from grpo.actor_group import plan_actor_for_run
from grpo.actor_parallel import split_batch
from grpo.config import GRPOConfig
from grpo.distributed import ActorParallelConfig, plan_actor, shard_rows, trainable_modules
from grpo.run_config import ExperimentConfig
from rollout.placement import plan_placement
from tests.experiments.test_grpo_config import composed
from tests.grpo.helpers import sampled_rows, tiny_policy

# the actor on cuda:0-1 (DDP), six engine ranks on cuda:2..7
ACTOR2_ENGINE6 = ["+experiment=libero10_pi05", "rollout=local", "rollout.engine.num_ranks=6",
                  "rollout.engine.devices=[cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7]", "run.device=cuda:0",
                  "grpo.actor_parallel.mode=ddp", "grpo.actor_parallel.world_size=2", "run.checkpoint_every=0"]


def parallel(**values) -> ActorParallelConfig:
    return GRPOConfig.from_mapping({"actor_parallel": values}).actor_parallel


def test_default_is_the_single_process_actor():
    cfg = GRPOConfig()
    assert (cfg.actor_parallel.mode, cfg.actor_parallel.world_size) == ("none", 1)
    assert cfg.to_dict()["actor_parallel"]["mode"] == "none"


@pytest.mark.parametrize("values, message", [
    ({"mode": "zero"}, "grpo.actor_parallel.mode must be one of"),
    ({"world_size": 2}, "grpo.actor_parallel.world_size=2 needs grpo.actor_parallel.mode ddp or fsdp2"),
    ({"mode": "ddp", "world_size": 0}, "grpo.actor_parallel.world_size must be a positive integer, got 0"),
    ({"mode": "ddp", "world_size": 2, "devices": ["cpu"]}, "grpo.actor_parallel.devices lists 1 device"),
    ({"mode": "ddp", "backend": "mpi"}, "grpo.actor_parallel.backend must be one of"),
    ({"mode": "ddp", "shard": "token"}, "grpo.actor_parallel.shard must be one of"),
    ({"mode": "ddp", "bogus": 1}, r"grpo.actor_parallel.bogus"),
])
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        parallel(**values)


def test_hydra_overrides_compose_and_unknown_keys_stop():
    exp = ExperimentConfig.from_hydra(composed(*ACTOR2_ENGINE6))
    assert (exp.grpo.actor_parallel.mode, exp.grpo.actor_parallel.world_size) == ("ddp", 2)
    with pytest.raises(Exception, match="bogus"):
        composed("grpo.actor_parallel.bogus=1")


def test_plan_places_ranks_from_the_trainer_device():
    plan = plan_actor(parallel(mode="ddp", world_size=4), "cuda:2", cuda_count=8)
    assert (plan.devices, plan.backend) == (["cuda:2", "cuda:3", "cuda:4", "cuda:5"], "nccl")
    plan = plan_actor(parallel(mode="fsdp2", world_size=2), "cpu", cuda_count=0)
    assert (plan.devices, plan.backend) == (["cpu", "cpu"], "gloo")
    with pytest.raises(ValueError, match=r"world_size=4 from run.device=cuda:6 needs cuda:6..cuda:9, but only 8"):
        plan_actor(parallel(mode="ddp", world_size=4), "cuda:6", cuda_count=8)
    with pytest.raises(ValueError, match=r"mode=fsdp2 with grpo.actor_parallel.backend=gloo on GPU devices"):
        plan_actor(parallel(mode="fsdp2", world_size=2, devices=["cuda:0", "cuda:0"], backend="gloo"), "cuda:0",
                   cuda_count=1)
    assert plan_actor(parallel(mode="ddp", world_size=2, devices=["cuda:0", "cuda:0"], backend="gloo"), "cuda:0",
                      cuda_count=1).backend == "gloo"
    with pytest.raises(ValueError, match=r"devices\[0\] is 'cuda:1', but rank 0 is the trainer's own process"):
        plan_actor(parallel(mode="ddp", world_size=2, devices=["cuda:1", "cuda:0"]), "cuda:0", cuda_count=2)
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        plan_actor(parallel(mode="ddp", world_size=2, devices=["cuda:0", "cuda:0"]), "cuda:0", cuda_count=1)
    shared = plan_actor(parallel(mode="ddp", world_size=2, devices=["cuda:0", "cuda:0"], backend="gloo"), "cuda:0", 1)
    assert shared.backend == "gloo"


def test_run_plan_falls_back_to_tensors_and_refuses_what_cannot_work():
    exp = ExperimentConfig.from_hydra(composed(*ACTOR2_ENGINE6))
    placement = plan_placement(exp.run.device, "run.device", exp.rollout, cuda_count=8)
    assert placement.transport == "broadcast"  # what the single-process actor would get
    plan, placement = plan_actor_for_run(exp, placement, cuda_count=8)
    assert plan.devices == ["cuda:0", "cuda:1"] and placement.transport == "tensors"
    assert "actor group" in placement.why
    # refused with the config, before the run directory exists
    with pytest.raises(ValueError, match="rollout.weights.transport=broadcast with grpo.actor_parallel.mode=ddp"):
        ExperimentConfig.from_hydra(composed(*ACTOR2_ENGINE6, "rollout.weights.transport=broadcast"))
    with pytest.raises(ValueError, match="fsdp2 shards the optimiser state.*run.checkpoint_every=0"):
        ExperimentConfig.from_hydra(composed(*ACTOR2_ENGINE6[:-1], "grpo.actor_parallel.mode=fsdp2"))
    # and again by the plan, for a Trainer given a config changed after its checks
    fsdp = ExperimentConfig.from_hydra(composed(*ACTOR2_ENGINE6, "grpo.actor_parallel.mode=fsdp2"))
    fsdp.run.checkpoint_every = 1
    with pytest.raises(ValueError, match="fsdp2 shards the optimiser state.*run.checkpoint_every=0"):
        plan_actor_for_run(fsdp, placement, cuda_count=8)


def test_group_sharding_by_hand():
    # trajectories 0..7, G=2 -> group sizes (rows): g0 2, g1 5, g2 3, g3 1
    trajectory = torch.tensor([0, 1, 2, 2, 3, 3, 3, 4, 5, 5, 7])
    owner = shard_rows(trajectory, world=2, group_size=2)
    # largest first onto the least-loaded rank: g1 -> 0, g2 -> 1, g0 -> 1 (3 < 5), g3 -> 0 (5 = 5: lower rank)
    assert owner.tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert shard_rows(torch.arange(5), world=2, group_size=None).tolist() == [0, 0, 0, 1, 1]


def test_group_sharding_never_splits_a_group_and_balances():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 30, (64,), generator=gen)
    trajectory = torch.repeat_interleave(torch.arange(64), lengths)
    owner = shard_rows(trajectory, world=4, group_size=8)
    for g in range(8):
        assert len(set(owner[trajectory // 8 == g].tolist())) == 1
    loads = torch.bincount(owner, minlength=4)
    group_rows = torch.bincount(trajectory // 8)
    assert int(loads.max() - loads.min()) <= int(group_rows.max())  # LPT's bound: at most one group apart


def test_split_batch_covers_every_row_once_and_lends_a_row_to_an_idle_rank():
    policy = tiny_policy()
    rows = sampled_rows(policy, 4)
    owner = torch.tensor([0, 2, 0, 2])
    batches = split_batch(rows, owner, world=3, orders=[torch.arange(4)])
    assert [b.ids.tolist() for b in batches] == [[0, 2], [], [1, 3]]
    assert len(batches[1].rows) == 1  # a borrowed row for its filler passes
    assert torch.equal(batches[2].rows.chains, rows.chains[[1, 3]])


def test_trainable_modules_are_exactly_the_trained_parameters():
    policy = tiny_policy()
    expert = trainable_modules(policy.model, {id(p) for p in policy.trainable_parameters()})
    assert set(expert) == {"expert", "action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"}
    assert set(trainable_modules(policy.model, {id(p) for p in policy.model.parameters()})) == {"model"}
    mixed = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"holds trainable parameters \['weight'\] next to frozen ones"):
        trainable_modules(mixed, {id(mixed.weight)})


def test_accumulator_keys_are_what_the_single_process_actor_reports():
    policy = tiny_policy()
    metrics = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-3)).train(sampled_rows(policy, 4))
    assert set(_Accumulator.KEYS) <= set(metrics)
    assert metrics["step_time/actor_old_logprob"] > 0.0  # the old-log-prob pass's wall time
    assert {k for k in metrics if k.startswith("train/")} - set(_Accumulator.KEYS) == {
        "train/is_weight_mean", "train/is_weight_truncated_frac", "train/clip_frac_first_mb", "train/grad_norm",
        "train/optimizer_steps", "train/rows", "train/lr"}
