"""The cluster-attention probe's shape rules and its plain-PyTorch reference (CPU; the kernel itself:
test_cluster_attention_gpu.py)."""

import math

import pytest
import torch

from experiments.cluster_attention import fused as CA


def test_shape_of_the_pi05_expert_at_batch_1():
    phyai = CA.ClusterShape(rows=50, slots=1018)
    assert (phyai.rows_pad, phyai.keys, phyai.ncols, phyai.threads) == (64, 64, 64, 128)
    assert phyai.smem_bytes() == (64 + 2 * 64 + 64) * 264 * 2 + (2 + 3 * 16) * 64 * 4
    assert phyai.problem() is None
    assert CA.ClusterShape(rows=40, slots=1018).threads == 6 * 32  # 3 row warps, twice
    assert not phyai.late_w
    eight = CA.ClusterShape(rows=50, slots=1018, splits=8)  # 128 keys and 128 o columns a CTA
    assert eight.late_w and eight.problem() is None
    assert eight.smem_bytes() == (64 + 2 * 128) * 264 * 2 + (2 + 3 * 8) * 64 * 4 < eight.smem_bytes(late=False)
    libero = CA.ClusterShape(rows=10, slots=570)  # 570 keys / 16 CTAs = 36 -> 48 a CTA
    assert (libero.rows_pad, libero.keys, libero.threads) == (16, 48, 128)
    assert libero.problem() is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(rows=80, slots=1018), "80 query rows"),
    (dict(rows=50, slots=1018, width=1000), "width 1000"),
    (dict(rows=50, slots=1018, splits=32), "32 CTAs"),
    (dict(rows=50, slots=1018, splits=0), "0 CTAs"),
    (dict(rows=64, slots=100), "O partial does not fit"),  # 7 keys a CTA -> 16 < 64 rows
    (dict(rows=50, slots=8000), "512 keys a CTA"),
    (dict(rows=64, slots=1018, splits=8, head_dim=512, width=512), "neither shared-memory layout fits"),
])
def test_shapes_the_kernel_cannot_run_are_named(kwargs, words):
    assert words in CA.ClusterShape(**kwargs).problem()


def _inputs(batch, rows, slots, heads, hd, width, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, heads, hd, generator=g).bfloat16()
    k = torch.randn(batch, slots, 1, hd, generator=g).bfloat16()
    v = torch.randn(batch, slots, 1, hd, generator=g).bfloat16()
    w = (torch.randn(width, heads * hd, generator=g) / math.sqrt(heads * hd)).bfloat16()
    key_len = torch.randint(slots // 2, slots + 1, (batch,), generator=g, dtype=torch.int32)
    return q, k, v, w, key_len


def test_reference_sums_to_attention_then_o_projection():
    q, k, v, w, key_len = _inputs(2, 5, 40, 4, 16, 24, seed=0)
    parts = CA.reference(q, k, v, w, key_len)
    assert parts.shape == (4, 2 * 5, 24)
    mask = (torch.arange(40)[None, :] < key_len[:, None])[:, None, None, :]
    kk = k.float().transpose(1, 2).expand(2, 4, 40, 16)
    vv = v.float().transpose(1, 2).expand(2, 4, 40, 16)
    attn = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(1, 2), kk, vv, attn_mask=mask)
    attn = attn.transpose(1, 2).bfloat16().float().reshape(10, 64)
    torch.testing.assert_close(parts.sum(0), attn @ w.float().t(), rtol=1e-4, atol=1e-4)


def test_reference_against_a_slow_loop():
    q, k, v, w, key_len = _inputs(2, 3, 30, 2, 8, 12, seed=1)
    parts = CA.reference(q, k, v, w, key_len)
    for b in range(2):
        n = int(key_len[b])
        for h in range(2):
            for t in range(3):
                scores = [float(q[b, t, h].float() @ k[b, s, 0].float()) / math.sqrt(8) for s in range(n)]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                out = sum(wt * v[b, s, 0].float() for s, wt in enumerate(weights)) / sum(weights)
                want = out.bfloat16().float() @ w[:, h * 8:(h + 1) * 8].float().t()
                torch.testing.assert_close(parts[h, b * 3 + t], want, rtol=1e-4, atol=1e-5)
