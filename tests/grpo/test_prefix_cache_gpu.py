"""grpo.prefix_cache on CUDA, where the actor runs under bf16 autocast and keeps the prefix keys in bf16 (RoPE
leaves them fp32): the update must equal the recomputing one, as on the CPU (tests/grpo/test_prefix_cache.py)."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from policies import PolicyConfig, build_policy
from tests.grpo.helpers import sampled_rows, tiny_policy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("where", ["device", "host"])
def test_the_cuda_update_with_kept_bf16_keys_equals_the_recomputing_one(where):
    # rows as a rollout stores them (on the host), sampled once on the CPU: both updates read the same rows
    rows = sampled_rows(tiny_policy(), 8, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2))
    weights = {}
    for name in ("off", where):
        policy = build_policy(PolicyConfig.preset("tiny", seed=0), device="cuda")
        actor = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-2, update_epochs=3, prefix_cache=name),
                      show_progress=False)
        assert actor.autocast_dtype() == torch.bfloat16
        metrics = actor.train(rows)
        if name != "off":
            assert metrics["train/prefix_cache_rows"] == 8
        weights[name] = [p.detach().clone() for p in policy.trainable_parameters()]
    for a, b in zip(weights["off"], weights[where], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
