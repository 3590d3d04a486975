"""On CUDA: a host tensor reaches the GPU without a stream synchronisation (common.devices.to_device), and the
consistent actor's update no longer waits for the GPU where round 53's host profile found it waiting (the prefix
store's reads, the chunk plans' row indices, the inputs' masks and tokens, the metrics per micro-batch). The same
wide tiny policy as tests/grpo/test_prefix_cache_gpu.py (the fast path's head_dim 256)."""

from __future__ import annotations

import pytest
import torch

from common.devices import to_device
from experiments.host_profile import host_profile
from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy
from tests.grpo.helpers import sampled_rows
from tests.grpo.test_prefix_cache_gpu import CONSISTENT, WIDE

pytestmark = pytest.mark.gpu

# where the host waited before (file:line (function) of the innermost frame of ours)
FORMER_WAITS = ("(_read_rows)", "(plan)", "(take_rows)", "(pick)", "(model_inputs)", "(_rows_of)", "(add)",
                "(_micro_step)", "(observation_from_rows)", "(reference)")


def test_to_device_copies_without_a_synchronisation():
    host = torch.arange(1000, dtype=torch.float32)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = to_device(host, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), host)


def test_the_consistent_update_waits_only_where_it_reads_results():
    cfg = PolicyConfig.preset("tiny", seed=0, **WIDE, fast=CONSISTENT)
    rows = sampled_rows(build_policy(cfg.replace(fast={"enabled": False, "consistent_recompute": False})), 8,
                        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2))
    policy = build_policy(trainer_policy_config(cfg), device="cuda")
    actor = Actor(policy, GRPOConfig(micro_batch=4, update_epochs=2, prefix_cache="device"), show_progress=False)
    actor.train(rows)  # warm-up: graphs captured, kernels compiled
    report = host_profile(lambda: actor.train(rows), torch.device("cuda"))
    waits = {row["site"].split(" <- ")[0]: row["count"] for row in report["syncs"]}
    former = {site: count for site, count in waits.items() if site.endswith(FORMER_WAITS)}
    assert not former, f"the update still waits at {former} (all waits: {waits})"
