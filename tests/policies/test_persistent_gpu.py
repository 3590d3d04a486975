"""The persistent expert kernel (policies/fast/persistent.py) on the GPU: one program per SM, grid-wide
barriers, inside the denoise graph, against the per-kernel denoise loop on the same inputs."""

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy

from .test_fast_gpu import gpu_cfg, inputs_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def sampler(policy, mode, batch_buckets=(4,)):
    return FastSampler(policy.model, FastConfig(dtype=policy.cfg.dtype, batch_buckets=list(batch_buckets),
                                                prompt_buckets=[48], persistent=mode))


def pi05_expert_cfg() -> PolicyConfig:
    """pi0.5's expert (18 layers, width 1024, heads 8 x 256) and PhyAI's chunk of 50, small prefix widths."""
    return PolicyConfig.preset(
        "tiny", dtype="bfloat16", vocab_size=1024, chunk_size=50, max_token_len=48,
        prefix={"width": 512, "depth": 18, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
        expert={"width": 1024, "depth": 18, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
        sampling={"num_steps": 10},
    )


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 2e-2)])  # fp32: TF32 dots on the GPU
def test_persistent_matches_per_kernel_loop(dtype, tol):
    policy = build_policy(gpu_cfg(dtype), device="cuda")
    runs = {}
    for mode in ("off", "on"):
        fast = sampler(policy, mode)
        runs[mode] = [fast.sample_chains(*inputs_for(policy.cfg, 3, seed)) for seed in (0, 1)]
        assert (next(iter(fast.buckets.values())).persistent is not None) == (mode == "on")
    for (chains, logps), (want_chains, want_logps) in zip(runs["on"], runs["off"], strict=True):
        assert torch.isfinite(chains).all()
        assert relative_l2(chains.float(), want_chains.float()) < tol
        assert relative_l2(logps.float(), want_logps.float()) < tol


def test_persistent_replays_bit_identically_and_sees_weight_updates():
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    fast = sampler(policy, "on")
    first = fast.sample_chains(*inputs_for(policy.cfg, 2, 5))[0]
    again = fast.sample_chains(*inputs_for(policy.cfg, 2, 5))[0]
    assert torch.equal(first, again)  # barriers and fixed-order sums: the same bits every replay
    with torch.no_grad():
        policy.model.expert.layers[0].gate_up.weight.mul_(0.5)
    fast.refresh_weights()
    updated = fast.sample_chains(*inputs_for(policy.cfg, 2, 5))[0]
    want = sampler(policy, "off").sample_chains(*inputs_for(policy.cfg, 2, 5))[0]
    assert not torch.equal(updated, first)
    assert relative_l2(updated.float(), want.float()) < 2e-2


def test_pi05_expert_at_batch_1():
    """The real expert shape (the default blocks, 18 layers, 50 rows, KV split over the SMs)."""
    policy = build_policy(pi05_expert_cfg(), device="cuda")
    outs = {}
    for mode in ("off", "on"):
        fast = sampler(policy, mode, batch_buckets=(1,))
        outs[mode] = fast.sample_chains(*inputs_for(policy.cfg, 1, 3))
        bucket = next(iter(fast.buckets.values()))
    assert bucket.persistent.att_splits > 1
    assert relative_l2(outs["on"][0].float(), outs["off"][0].float()) < 2e-2
