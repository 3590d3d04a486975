"""The fused attention + merge + o kernel (experiments/cluster_attention/fused.py; marker gpu): against
its plain-PyTorch reference on fresh random inputs, cache rows past each key length poisoned with NaN
(they must never be read into a result), eager and replayed in a CUDA graph."""

import pytest
import torch

from experiments.cluster_attention import fused as CA
from policies.lerobot_bridge import relative_l2

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
