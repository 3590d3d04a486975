"""grpo.prefix_cache on CUDA, where the actor runs under bf16 autocast and keeps the plain path's prefix keys in
bf16 (RoPE leaves them fp32), or, with the consistent recompute, the fast path's K/V (bf16, CUDA graphs) as they
are: the update must equal the recomputing one, as on the CPU (tests/grpo/test_prefix_cache.py).

The consistent case runs the fast path, so its prefix and expert take the head_dim-256 widths every fast-path GPU
test uses (tests/policies/test_fast_gpu.py): a first version on the tiny preset's head_dim 16 (round 48) diverged
and left the process's CUDA graph state broken for the GPU tests after it (that version also built a second policy
for the kept run, whose fast path could time other "auto" choices than the first's)."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy
from tests.grpo.helpers import assert_same_update_to_rounding, sampled_rows

pytestmark = pytest.mark.gpu

CONSISTENT = {"enabled": True, "consistent_recompute": True, "attention": "sdpa", "batch_buckets": [4],
              "prompt_buckets": [128]}
WIDE = {"prefix": {"width": 512, "depth": 2, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
        "expert": {"width": 256, "depth": 2, "mlp_dim": 512, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256}}


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("consistent", [False, True], ids=["plain", "consistent"])
def test_the_cuda_update_with_kept_prefixes_equals_the_recomputing_one(where, consistent):
    cfg = PolicyConfig.preset("tiny", seed=0, **({**WIDE, "fast": CONSISTENT} if consistent else {}))
    # rows as a rollout stores them (on the host), sampled once on the CPU: both updates read the same rows
    rows = sampled_rows(build_policy(cfg.replace(fast={"enabled": False, "consistent_recompute": False})), 8,
                        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2))
    # one policy for both updates, its weights put back in between: a second fast sampler would time its own "auto"
    # choices (GEMM algorithms, overlap) and could pick others, whose bf16 results differ in the last bits
    policy = build_policy(trainer_policy_config(cfg), device="cuda")  # fp32 masters (and the bf16 fast path)
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = {}
    for name in ("off", where):
        policy.load_state_dict(initial)  # in place: the fast path's bf16 shadows follow (version counters)
        actor = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-2, update_epochs=3, prefix_cache=name),
                      show_progress=False)
        assert actor.autocast_dtype() == torch.bfloat16
        metrics = actor.train(rows)
        if name != "off":
            assert metrics["train/prefix_cache_rows"] == 8
        weights[name] = [p.detach().clone() for p in policy.trainable_parameters()]
    # the kept K/V are the recomputed ones bit for bit; the backward's CUDA kernels need not be deterministic, and
    # AdamW can make their rounding a rounding-sized share of a step (test_engine_prefixes_gpu, round 59)
    assert_same_update_to_rounding(weights[where], weights["off"], lr=1e-2)
