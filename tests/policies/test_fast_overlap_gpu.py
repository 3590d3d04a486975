"""The first denoise step under the prefix (policies/fast/overlap.py; marker gpu).

Overlap changes which stream and when, never what is computed: the chains and log-probs of the
overlapped graph must equal, bit for bit, those of the prefix and denoise graphs run one after the
other (a missing wait on a prefix layer's K/V, or the prefix's scatter landing after the expert's in
a pad slot, would show up here: the prompts are ragged, so the suffix slots overlap the pad slots).
"""

import pytest
import torch

from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.policy import build_policy

from .test_fast_gpu import gpu_cfg, inputs_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_overlap_is_bit_identical(batch, attention):
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, batch, seed=11 + batch)
    stoch[:, 0] = True  # step 0 (the overlapped one) stochastic: its noise and log-prob path too
    outs = {}
    for label, overlap, step0_pdl in (("off", "off", True), ("on", "on", True), ("on_nopdl", "on", False)):
        fast = FastSampler(policy.model, FastConfig(attention=attention, batch_buckets=[1, 4], prompt_buckets=[48],
                                                    overlap=overlap))
        fast.step0_pdl = step0_pdl
        for _ in range(3):  # replays, not just the capture run
            outs[label] = fast.sample_chains(inputs, noise, step_noise, stoch)
        bucket = next(iter(fast.buckets.values()))
        want = {"vision", "prefix_denoise"} if overlap == "on" else {"vision", "prefix", "denoise"}
        assert set(bucket.graphs) == want
    for label in ("on", "on_nopdl"):
        for got, want in zip(outs[label], outs["off"], strict=True):
            assert torch.equal(got, want), label


def test_overlapped_graph_sees_weight_updates_without_recapture():
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 1, seed=3)
    fast = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48],
                                                overlap="on"))
    fast.sample_chains(inputs, noise, step_noise, stoch)
    graph = next(iter(fast.buckets.values())).graphs["prefix_denoise"]
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.02)
    fast.refresh_weights()
    got = fast.sample_chains(inputs, noise, step_noise, stoch)
    want = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48],
                                                overlap="off")).sample_chains(inputs, noise, step_noise, stoch)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert next(iter(fast.buckets.values())).graphs["prefix_denoise"] is graph


def test_sm_carveout_keeps_the_stages_consistent():
    """With the prefix's GEMMs on all SMs but 16 (`prefix_sm_carveout`), the overlapped call and the
    bucket's stages one by one (the consistent recompute's path: "prefix" then "denoise") capture the
    same kernels, so they agree bit for bit; against the sampler on every SM they agree closely (cuBLAS
    may pick other kernels for fewer SMs). The settings are restored after each capture."""
    from policies.fast import overlap
    from policies.lerobot_bridge import relative_l2

    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 1, seed=5)
    stoch[:, 0] = True
    fast = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48],
                                                overlap="on"))
    fast.prefix_sm_carveout = 16
    for _ in range(2):
        chains, logps = fast.sample_chains(inputs, noise, step_noise, stoch)
    assert fast.geglu_max_programs is None and torch._C._get_sm_carveout_experimental() is None
    bucket = fast.prepare(inputs, noise, step_noise, stoch)
    for stage in ("vision", "prefix", "denoise"):
        fast.run_stage(bucket, stage)
    assert torch.equal(bucket.tensors["chains"][:1], chains)
    assert torch.equal(bucket.tensors["step_logprobs"][:1], logps)
    full = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48],
                                                overlap="off")).sample_chains(inputs, noise, step_noise, stoch)
    assert relative_l2(chains, full[0]) < 2e-2
    with pytest.raises(ValueError, match="SM carveout"):
        with overlap.prefix_sm_carveout(fast, 10_000):
            pass
