"""The fast path on CUDA at the tiny preset's own widths (vision 32, prefix 48, expert 32, head_dim 16), which no
other fast-path GPU test uses (they take head_dim 256). Round 48's GRPO prefix-cache test ran the consistent
recompute at these widths, got different updates and left the process's CUDA graph state broken: this file checks
the tiny widths alone, in eager mode and graphed, against the fp32 reference. Marker gpu.

    python -m pytest tests/policies/test_fast_tiny_gpu.py -q -s      # -s prints the measured differences
"""

from __future__ import annotations

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy
from tests.policies.test_fast_gpu import inputs_for

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def policy():
    """fp32 weights: the reference samples in fp32, the fast path in bf16 (as test_fast_gpu's bf16 check)."""
    cfg = PolicyConfig.preset("tiny", dtype="float32", chunk_size=10, max_token_len=48, sampling={"num_steps": 4})
    return build_policy(cfg, device="cuda")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_tiny_widths_match_the_fp32_reference(policy, graphs, attention):
    cfg = policy.cfg
    sampler = FastSampler(policy.model, FastConfig(dtype="bfloat16", cuda_graphs=graphs, attention=attention))
    for seed in (1, 2):  # the second call replays what the first captured
        inputs, noise, step_noise, stoch = inputs_for(cfg, 3, seed)
        got, logprob = sampler.sample_chains(inputs, noise, step_noise, stoch)
        inds = torch.full((3, cfg.sampling.num_steps), 1, device="cuda")  # inputs_for's stochastic step
        want = policy.sample(inputs, mode="sde", noise=noise, step_noise=step_noise, denoise_inds=inds).chains
        err = relative_l2(got, want)
        print(f"tiny {attention} graphs={graphs} seed {seed}: chains rel L2 against fp32 {err:.2e}")
        assert torch.isfinite(got).all() and torch.isfinite(logprob).all()
        assert err < 3e-2
