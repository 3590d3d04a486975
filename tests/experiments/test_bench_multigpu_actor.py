"""experiments/bench_multigpu_actor.py: the actor part's CPU smoke run (1 process vs DDP / FSDP2 on 2
gloo ranks), its device planning and the rows it trains on."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.bench_multigpu import BenchMultiGPUConfig, observation_batches, report, run
from experiments.bench_multigpu_actor import actor_devices, synthetic_samples, update_agreement
from grpo.trainer import trainer_policy_config
from policies import build_policy
from tests.rollout.engine_fixtures import TINY, one_thread  # noqa: F401 - fixture used by pytestmark

pytestmark = pytest.mark.usefixtures("one_thread")
POLICY = TINY.replace(chunk_size=10)


def test_actor_devices():
    assert actor_devices(2, 0, max_cpu_ranks=2) == ["cpu", "cpu"]
    assert "4 ranks > bench.max_cpu_ranks=2" in actor_devices(4, 0, max_cpu_ranks=2)
    assert actor_devices(4, 8, max_cpu_ranks=2) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert "8 actor ranks need 8 GPUs, 4 visible" in actor_devices(8, 4, max_cpu_ranks=2)


def test_synthetic_rows_are_the_policys_own_samples_in_trajectories():
    policy = build_policy(trainer_policy_config(POLICY))
    batches = observation_batches(POLICY, 4, image_size=32, count=2, seed=0)
    samples = synthetic_samples(policy, batches, rows=10, chunks=4, micro=4, seed=0)
    assert len(samples) == 10 and samples.trajectory.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert samples.trajectory_length.tolist() == [4] * 8 + [2, 2]
    assert torch.equal(samples.advantages[:4], samples.advantages[0].expand(4))  # one advantage per trajectory
    assert samples.images["agentview_image"].shape == (10, 32, 32, 3)
    # the rollout log-probs are the policy's own: the trainer's recompute gives them back
    from grpo.actor import Actor
    from grpo.config import GRPOConfig

    torch.testing.assert_close(Actor(policy, GRPOConfig(micro_batch=4)).recompute(samples), samples.rollout_logprob,
                               rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (gloo, CPU ranks)")
def test_cpu_smoke_run_of_the_actor_part(tmp_path):
    bench = BenchMultiGPUConfig(parts=["actor"], actor_ranks=[1, 2, 4], actor_rows=32, actor_micro_batch=8,
                                actor_group_size=2, image_size=32, actor_iters=1, out_dir=str(tmp_path))
    results = run(bench, POLICY)
    single, ddp2, ddp4, fsdp2, fsdp4 = results["actor"]
    assert (single["mode"], single["ranks"], single["efficiency"]) == ("none", 1, 1.0) and "_delta" not in single
    assert "bench.max_cpu_ranks=2" in ddp4["skipped"] and "bench.max_cpu_ranks=2" in fsdp4["skipped"]
    for entry in (ddp2, fsdp2):
        assert entry["backend"] == "gloo" and entry["devices"] == ["cpu", "cpu"] and entry["rows"] == 32
        assert entry["grad_norm_rel_diff"] < 1e-5  # fp32 on CPU: the same global gradient
        assert entry["update_rel_diff"] < 1e-2  # AdamW's first step is about +-lr per element
        assert entry["update_rel_l2"] < 1e-2 and entry["update_disagree_frac"] == 0.0
        assert entry["efficiency"] == entry["rows_per_s"] / (2 * single["rows_per_s"])
    summary = json.loads(report(bench, POLICY, results).read_text())["summary"]
    assert summary["actor_rows_per_s_ddp_2"] == ddp2["rows_per_s"] and summary["actor_rows_per_s_ddp_4"] is None
    assert summary["actor_gather_s_fsdp2_2"] == fsdp2["gather_s"]


def test_update_agreement_by_hand():
    lr = 1e-4
    ref = {"a": torch.tensor([lr, -lr, lr, 0.0]), "b": torch.tensor([[-lr, lr]])}
    delta = {"a": torch.tensor([lr, lr, lr, 0.0]), "b": torch.tensor([[-lr, 0.8 * lr]])}  # one element stepped apart
    got = update_agreement(delta, ref)
    assert got["update_rel_diff"] == pytest.approx(2.0)  # 2 lr / lr
    assert got["update_rel_l2"] == pytest.approx(((2 * lr) ** 2 + (0.2 * lr) ** 2) ** 0.5 / (5 * lr**2) ** 0.5)
    assert got["update_disagree_frac"] == pytest.approx(1 / 6)  # 0.2 lr is under half a step: not counted
    assert update_agreement(ref, ref) == {"update_rel_diff": 0.0, "update_rel_l2": 0.0, "update_disagree_frac": 0.0}
