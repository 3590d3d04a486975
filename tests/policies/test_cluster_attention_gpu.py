"""The fused attention + merge + o kernel (policies/fast/cluster_attention.py; marker gpu): against
its plain-PyTorch reference on fresh random inputs, cache rows past each key length poisoned with NaN
(they must never be read into a result), and inside the fast sampler against the separate kernels."""

import pytest
import torch

from policies.fast import cluster_attention as CA
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy

from .test_fast_gpu import gpu_cfg, inputs_for

pytestmark = pytest.mark.gpu


def _case(batch, rows, slots, width, key_len, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, rows, 8, 256, generator=g, device="cuda").bfloat16()
    k = torch.randn(batch, slots, 1, 256, generator=g, device="cuda").bfloat16()
    v = torch.randn(batch, slots, 1, 256, generator=g, device="cuda").bfloat16()
    w = (torch.randn(width, 2048, generator=g, device="cuda") / 2048 ** 0.5).bfloat16()
    key_len = torch.tensor(key_len, dtype=torch.int32)
    for b, n in enumerate(key_len.tolist()):
        k[b, n:], v[b, n:] = float("nan"), float("nan")
    return q, k, v, w, key_len


@pytest.mark.parametrize("batch, rows, slots, width, key_len, splits", [
    (1, 50, 1018, 1024, [1011], 16),           # PhyAI b1 (a 193-token prompt in the 200 bucket)
    (1, 50, 1018, 1024, [1011], 8),            # the late W_o layout
    (2, 50, 1018, 1024, [1018, 700], 16),
    (1, 10, 570, 1024, [570], 16),             # LIBERO b1
    (3, 10, 570, 1024, [570, 31, 300], 16),    # 31 keys: most CTAs of that cluster have none
    (3, 10, 570, 1024, [570, 31, 300], 8),
    (2, 10, 100, 256, [100, 64], 16),          # the tiny test policy's expert width
])
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_matches_reference(batch, rows, slots, width, key_len, splits, pdl):
    q, k, v, w, lengths = _case(batch, rows, slots, width, key_len, seed=batch * 100 + rows)
    shape = CA.ClusterShape(rows=rows, slots=slots, width=width, splits=splits)
    fused = CA.ClusterAttentionO(batch, shape, torch.device("cuda"), pdl=pdl)
    fused.plan(lengths.cuda())
    got = fused(q, k, v, w).clone()
    want = CA.reference(q, k.nan_to_num(), v.nan_to_num(), w, lengths.cuda())
    assert torch.isfinite(got).all()
    assert relative_l2(got, want) < 1e-2
    assert relative_l2(got.sum(0), want.sum(0)) < 1e-2
    fused(q, k, v, w)
    assert torch.equal(fused.out, got)  # deterministic


def test_kernel_in_a_cuda_graph_replays():
    q, k, v, w, lengths = _case(1, 50, 1018, 1024, [900], seed=5)
    fused = CA.ClusterAttentionO(1, CA.ClusterShape(rows=50, slots=1018), torch.device("cuda"), pdl=True)
    fused.plan(lengths.cuda())
    eager = fused(q, k, v, w).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused(q, k, v, w)
    fused.out.zero_()
    graph.replay()
    assert torch.equal(fused.out, eager)
    q.mul_(-1)
    graph.replay()
    assert relative_l2(fused.out, CA.reference(q, k.nan_to_num(), v.nan_to_num(), w, lengths.cuda())) < 1e-2


def _sampler(policy, attn_o, pdl="auto", buckets=(1, 4)):
    return FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=list(buckets), prompt_buckets=[48],
                                                attn_o=attn_o, pdl=pdl))


@pytest.mark.parametrize("batch", [1, 3])
def test_sampler_with_the_fused_kernel_matches_the_separate_kernels(batch):
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, batch, seed=21 + batch)
    fused = _sampler(policy, "cluster")
    runs = [fused.sample_chains(inputs, noise, step_noise, stoch) for _ in range(3)]
    assert next(iter(fused.buckets.values())).attn_o is not None
    for run in runs[1:]:  # graph replays: the same bits
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)
    want = _sampler(policy, "off").sample_chains(inputs, noise, step_noise, stoch)
    got = runs[0]
    assert relative_l2(got[0], want[0]) < 2e-2 and relative_l2(got[1], want[1]) < 2e-2
    no_pdl = _sampler(policy, "cluster", pdl="off").sample_chains(inputs, noise, step_noise, stoch)
    for a, b in zip(no_pdl, got, strict=True):  # PDL never changes a bit
        assert torch.equal(a, b)


def test_fused_kernel_sees_weight_updates_without_recapture():
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 1, seed=4)
    fast = _sampler(policy, "cluster", buckets=(1,))
    before = fast.sample_chains(inputs, noise, step_noise, stoch)
    graphs = dict(next(iter(fast.buckets.values())).graphs)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.02)
    fast.refresh_weights()
    after = fast.sample_chains(inputs, noise, step_noise, stoch)
    fresh = _sampler(policy, "cluster", buckets=(1,)).sample_chains(inputs, noise, step_noise, stoch)
    assert relative_l2(after[0], before[0]) > 1e-3
    for a, b in zip(after, fresh, strict=True):
        assert torch.equal(a, b)
    assert next(iter(fast.buckets.values())).graphs == graphs
