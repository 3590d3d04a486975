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



def test_auto_times_both_ways_once_and_keeps_one():
    """overlap "auto" (overlap.pick): at the bucket's first call both ways are captured and timed, one way's
    graphs stay, later calls reuse them, and the chains equal the stages-in-order ones bit for bit."""
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 1, seed=5)
    auto = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48]))
    off = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48],
                                               overlap="off"))
    first = auto.sample_chains(inputs, noise, step_noise, stoch)
    bucket = next(iter(auto.buckets.values()))
    assert isinstance(bucket.overlap, bool) and set(bucket.overlap_ms) == {"off", "on"}
    assert set(bucket.graphs) == set(auto.call_stages(bucket))
    graphs = dict(bucket.graphs)
    again = auto.sample_chains(inputs, noise, step_noise, stoch)
    assert bucket.graphs == graphs  # no second timing, no re-capture
    want = off.sample_chains(inputs, noise, step_noise, stoch)
    for got in (first, again):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
