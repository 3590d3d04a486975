"""Skinny GEMMs, Triton attention and programmatic dependent launch in the denoise graph (marker gpu).

PDL changes when kernels start, never what they compute: the chains and log-probs of a graph
with PDL must equal, bit for bit, those of the same graph without it (a missing wait would show
up as a race). The skinny path stays near the cuBLAS path, and an in-place weight update is seen
by the captured graphs without re-capture.
"""

import pytest
import torch

from policies.fast import pdl
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy

from .test_fast_gpu import gpu_cfg, inputs_for

pytestmark = pytest.mark.gpu


def _sampler(model, **fast) -> FastSampler:
    return FastSampler(model, FastConfig(attention="triton", batch_buckets=[1, 4], prompt_buckets=[48], **fast))


@pytest.mark.parametrize("batch", [1, 3])
def test_pdl_is_bit_identical_and_skinny_near_cublas(batch):
    if not pdl.supported():
        pytest.skip("PDL needs compute capability >= 9.0 and Triton's grid-dependency control")
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, batch, seed=batch)
    outs = {}
    for gemm, mode in (("skinny", "off"), ("skinny", "on"), ("skinny", "early"), ("cublas", "off")):
        fast = _sampler(policy.model, gemm=gemm, pdl=mode)
        assert fast.pdl == pdl.CODES[mode]
        for _ in range(3):  # replays, not just the capture run
            outs[gemm, mode] = fast.sample_chains(inputs, noise, step_noise, stoch)
    for mode in ("on", "early"):
        for got, want in zip(outs["skinny", mode], outs["skinny", "off"], strict=True):
            assert torch.equal(got, want)
    chains, logp = outs["skinny", "off"]
    ref_chains, ref_logp = outs["cublas", "off"]
    assert relative_l2(chains, ref_chains) < 2e-2
    assert relative_l2(logp, ref_logp) < 5e-2


def test_skinny_graphs_see_weight_updates_without_recapture():
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 2, seed=7)
    fast = _sampler(policy.model, gemm="skinny", pdl="auto")
    fast.sample_chains(inputs, noise, step_noise, stoch)
    graphs = {k: dict(b.graphs) for k, b in fast.buckets.items()}
    with torch.no_grad():
        for p in policy.model.expert.parameters():
            p.mul_(1.05)
    fast.refresh_weights()
    got = fast.sample_chains(inputs, noise, step_noise, stoch)
    want = _sampler(policy.model, gemm="skinny", pdl="auto").sample_chains(inputs, noise, step_noise, stoch)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert all(b.graphs[s] is graphs[k][s] for k, b in fast.buckets.items() for s in graphs[k])
