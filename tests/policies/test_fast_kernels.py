"""Fused kernels of the fast path against their plain-PyTorch references, on fresh random inputs.

On CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported); on a CUDA machine they run compiled.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import kernels as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "residual", "gated_per_row", "shared_gate_shift"])
def test_add_rms_norm_matches_reference(dtype, variant):
    g = torch.Generator().manual_seed(hash((variant, str(dtype))) % 2**31)
    rows, width = 7, 48
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    h = r(rows, width).to(dtype)
    y = r(rows, width).to(dtype) if variant != "plain" else None
    gate = {"gated_per_row": r(rows, width), "shared_gate_shift": r(width)}.get(variant)
    scale = r(rows, width) if variant == "gated_per_row" else r(width)
    shift = {"gated_per_row": r(rows, width), "shared_gate_shift": r(width)}.get(variant)
    want_h, want = K.add_rms_norm_reference(h.clone(), y, gate, scale, shift, 1e-6)
    got_h, got = K.add_rms_norm_triton(h.clone(), y, gate, scale, shift, 1e-6)
    assert rel(got_h, want_h) < TOL[dtype]
    assert rel(got, want) < TOL[dtype]
    assert got.dtype == dtype and got_h.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,t", [(2, 1, 5), (4, 2, 5), (2, 1, 91), (4, 2, 91)])  # 3 x 91: token blocks
@pytest.mark.parametrize("all_heads", [False, True])  # programs of one head, or of all heads of their tokens
def test_rope_scatter_matches_reference(dtype, heads, kv_heads, t, all_heads, monkeypatch):
    monkeypatch.setattr(K, "ROPE_ALL_HEADS_FROM", 0 if all_heads else 10**9)
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, hd, rows = 3, 16, t + 4
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * hd, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 50, (b, t), generator=g).to(DEVICE)
    from policies.models.gemma import rope_cos_sin

    cos, sin = rope_cos_sin(positions, hd, 10000.0, dtype)
    slots = torch.stack([torch.randperm(rows, generator=g)[:t] for _ in range(b)]).to(DEVICE, torch.int32)
    outs = []
    for fn in (K.rope_scatter_qkv_reference, K.rope_scatter_qkv_triton):
        q = torch.full((b, t, heads, hd), float("nan"), dtype=dtype, device=DEVICE)
        kc = torch.full((b, rows, kv_heads, hd), 7.0, dtype=dtype, device=DEVICE)
        vc = torch.full_like(kc, 7.0)
        fn(qkv, cos, sin, heads, kv_heads, q, kc, vc, slots)
        outs.append((q, kc, vc))
    (q0, k0, v0), (q1, k1, v1) = outs
    assert not torch.isnan(q1).any(), "every query row must be written"
    assert rel(q1, q0) < TOL[dtype] and rel(k1, k0) < TOL[dtype] and rel(v1, v0) < TOL[dtype]
    untouched = torch.ones(b, rows, dtype=torch.bool)
    untouched[torch.arange(b)[:, None], slots.long().cpu()] = False
    assert bool((k1.cpu()[untouched] == 7.0).all()), "rows outside the slots must stay as they were"


def test_rope_reference_matches_model_rope():
    """The reference kernel is the model's own RoPE (gemma.apply_rope) scattered into slots."""
    from policies.models.gemma import apply_rope, rope_cos_sin

    g = torch.Generator().manual_seed(3)
    b, t, heads, hd = 2, 4, 2, 8
    qkv = torch.randn(b, t, (heads + 2) * hd, generator=g)
    cos, sin = rope_cos_sin(torch.arange(t)[None].repeat(b, 1), hd, 10000.0, torch.float32)
    q = torch.empty(b, t, heads, hd)
    kc, vc = torch.zeros(b, t, 1, hd), torch.zeros(b, t, 1, hd)
    K.rope_scatter_qkv_reference(qkv, cos, sin, heads, 1, q, kc, vc, torch.arange(t)[None].repeat(b, 1))
    q_ref = apply_rope(qkv[..., : heads * hd].view(b, t, heads, hd).transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.allclose(q, q_ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(6, 2 * 1500, generator=g) * 3).to(DEVICE, dtype)
    want = K.gelu_tanh_mul_reference(gate_up)
    got = K.gelu_tanh_mul_triton(gate_up)
    assert rel(got, want) < TOL[dtype]
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert rel(want, exact) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_layer_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(11 + with_residual)
    rows, width = 6, 72
    h = (torch.randn(rows, width, generator=g) * 2 + 0.5).to(DEVICE, dtype)
    y = torch.randn(rows, width, generator=g).to(DEVICE, dtype) if with_residual else None
    weight, bias = torch.randn(width, generator=g).to(DEVICE), torch.randn(width, generator=g).to(DEVICE)
    want_h, want = K.add_layer_norm_reference(h.clone(), y, weight, bias, 1e-6)
    got_h, got = K.add_layer_norm_triton(h.clone(), y, weight, bias, 1e-6)
    assert rel(got_h, want_h) < TOL[dtype] and rel(got, want) < TOL[dtype]
    exact = torch.nn.functional.layer_norm(want_h.float(), (width,), weight.float(), bias.float(), 1e-6)
    assert rel(want, exact) < TOL[dtype]


def test_linear_gelu_tanh_matches_plain_layers():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(4, 5, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    want = torch.nn.functional.gelu(x @ w.t() + b, approximate="tanh")
    assert torch.allclose(K.linear_gelu_tanh(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)).cpu(), want, atol=1e-3)


# bf16 tl.dot is wrong under Triton's CPU interpreter (3.9); fp16 exercises the same low-precision
# path there, and the GPU run checks bf16 (the attention selector also rejects a wrong backend).
ATTN_DTYPES = [torch.float32, torch.bfloat16 if DEVICE == "cuda" else torch.float16]


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,target_blocks", [(4, 1, 1), (4, 1, 64), (4, 2, 16)])
def test_split_kv_attention_matches_masked_sdpa(dtype, heads, kv_heads, target_blocks):
    from policies.fast.attention import SdpaAttention
    from policies.fast.triton_attention import TritonSplitKVAttention

    g = torch.Generator().manual_seed(heads + kv_heads + target_blocks)
    b, t, rows, hd = 3, 5, 150, 32
    q = torch.randn(b, t, heads, hd, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, rows, kv_heads, hd, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, rows, kv_heads, hd, generator=g).to(DEVICE, dtype)
    key_len = torch.tensor([1, 70, rows], dtype=torch.int32)  # one key, a split boundary, full
    attention = TritonSplitKVAttention(
        b, t, rows, heads, kv_heads, hd, torch.device(DEVICE), target_blocks=target_blocks
    )
    assert (attention.num_splits > 1) == (target_blocks > 1 and kv_heads == 1 or target_blocks > 3)
    attention.plan(key_len.to(DEVICE))
    exact = SdpaAttention(b, rows, torch.device(DEVICE))
    exact.plan(key_len.to(DEVICE))
    want = exact(q.float(), k.float(), v.float())
    got = attention(q, k, v)
    assert got.shape == (b, t, heads * hd) and got.dtype == dtype
    fp32_tol = 2e-3 if DEVICE == "cuda" else 1e-5  # Triton's fp32 tl.dot uses TF32 on the GPU
    assert rel(got, want) < (fp32_tol if dtype == torch.float32 else 1e-2)


def test_split_kv_attention_large_batch_blocks_match_masked_sdpa():
    """Batch >= 16 with > 128 packed query rows (the prefix, PhyAI's expert at large batch) runs
    default_blocks' 128 x 64 blocks with 8 warps; a row block straddles several query tokens."""
    from policies.fast.attention import SdpaAttention
    from policies.fast.triton_attention import TritonSplitKVAttention, default_blocks

    g = torch.Generator().manual_seed(16)
    b, t, heads, rows, hd = 16, 37, 4, 90, 16
    assert default_blocks(b, t * heads) == (128, 64, 8, 2)
    # the prefix (7744 packed rows in the PhyAI configuration): 128-row blocks from 16384 rows in all
    assert default_blocks(4, 7744) == (128, 64, 8, 2) and default_blocks(1, 7744) == (64, 64, 4, 2)
    assert default_blocks(2, 7744) == (128, 64, 8, 2) and default_blocks(2, 4480) == (64, 64, 4, 2)
    assert default_blocks(1, 400) == (32, 128, 4, 2) and default_blocks(1, 80) == (16, 64, 4, 2)
    assert default_blocks(64, 80) == (64, 64, 4, 2)  # LIBERO's chunk 10 at batch 64
    # LIBERO's prefix at batch 1 (4480 rows): 70 blocks of 64 rows would be KV-split anyway; 128 x 64 with 4
    # splits (140 programs for 132 SMs) instead of 2. PhyAI's (121 blocks) and batch 2 fill the SMs unsplit.
    assert default_blocks(1, 4480) == (128, 64, 8, 2) and default_blocks(1, 4480, target_blocks=64) == (64, 64, 4, 2)
    assert default_blocks(1, 4480, kv_heads=2) == (64, 64, 4, 2)  # 140 blocks of 64 rows: no split needed
    libero_prefix = TritonSplitKVAttention(1, 560, 570, 8, 1, 256, torch.device("cpu"), target_blocks=132)
    assert (libero_prefix.BLOCK_M, libero_prefix.num_splits) == (128, 4)
    # PhyAI's prefix at batch 1 through the TMA kernel: a third K/V stage, unless stages are given
    cpu = torch.device("cpu")
    assert TritonSplitKVAttention(1, 968, 1018, 8, 1, 256, cpu, target_blocks=132, tma=True).STAGES == 3
    assert TritonSplitKVAttention(1, 968, 1018, 8, 1, 256, cpu, target_blocks=132, tma=True, stages=2).STAGES == 2
    assert TritonSplitKVAttention(1, 968, 1018, 8, 1, 256, cpu, target_blocks=132, tma=False).STAGES == 2
    assert TritonSplitKVAttention(2, 968, 1018, 8, 1, 256, cpu, target_blocks=132, tma=True).STAGES == 2
    q = torch.randn(b, t, heads, hd, generator=g).to(DEVICE)
    k, v = (torch.randn(b, rows, 1, hd, generator=g).to(DEVICE) for _ in range(2))
    key_len = torch.randint(1, rows + 1, (b,), generator=g, dtype=torch.int32)
    attention = TritonSplitKVAttention(b, t, rows, heads, 1, hd, torch.device(DEVICE))
    assert (attention.BLOCK_M, attention.BLOCK_N, attention.WARPS) == (128, 64, 8)
    # the KV is split only while the unsplit blocks leave a quarter of the target idle (SPLIT_FREE_FILL)
    expert = dict(queries=50, rows=1018, heads=8, kv_heads=1, head_dim=256, device=torch.device("cpu"),
                  target_blocks=132)
    assert TritonSplitKVAttention(32, **expert).num_splits == 1  # 32 x 4 row blocks = 128 of 132
    assert TritonSplitKVAttention(8, **expert).num_splits == 3  # 8 x 7 blocks of 64 rows: ceil(132 / 56)
    attention.plan(key_len.to(DEVICE))
    exact = SdpaAttention(b, rows, torch.device(DEVICE))
    exact.plan(key_len.to(DEVICE))
    assert rel(attention(q, k, v), exact(q, k, v)) < (2e-3 if DEVICE == "cuda" else 1e-5)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_tma_attention_matches_masked_sdpa(dtype):
    """The one-KV-head TMA kernel: packed rows that straddle samples (5 x 4 = 20 per sample in 16-row
    blocks), key lengths of one key, a whole number of blocks, a partial last block and the full slot;
    garbage (NaN) in the cache rows past each key length must not leak in."""
    from policies.fast.attention import SdpaAttention
    from policies.fast.triton_attention import TritonSplitKVAttention

    g = torch.Generator().manual_seed(21)
    b, t, heads, rows, hd = 4, 5, 4, 70, 32
    q = torch.randn(b, t, heads, hd, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(b, rows, 1, hd, generator=g).to(DEVICE, dtype) for _ in range(2))
    key_len = torch.tensor([1, 32, 45, rows], dtype=torch.int32)
    for i, n in enumerate(key_len.tolist()):
        k[i, n:], v[i, n:] = float("nan"), float("nan")
    q = q * 4  # peaked softmax rows: the running max moves between blocks
    attention = TritonSplitKVAttention(b, t, rows, heads, 1, hd, torch.device(DEVICE), target_blocks=1,
                                       block_m=16, block_n=16, warps=4, stages=2, tma=True)
    assert attention.tma and attention.num_splits == 1 and attention.row_tiles == 2
    attention.plan(key_len.to(DEVICE))
    exact = SdpaAttention(b, rows, torch.device(DEVICE))
    exact.plan(key_len.to(DEVICE))
    want = exact(q.float(), torch.nan_to_num(k.float()), torch.nan_to_num(v.float()))
    got = attention(q, k, v)
    assert got.shape == (b, t, heads * hd) and got.dtype == dtype and bool(got.isfinite().all())
    fp32_tol = 2e-3 if DEVICE == "cuda" else 1e-5  # Triton's fp32 tl.dot uses TF32 on the GPU
    assert rel(got, want) < (fp32_tol if dtype == torch.float32 else 1e-2)


def test_tma_attention_refuses_what_it_cannot_run():
    from policies.fast.triton_attention import TritonSplitKVAttention, tma_default

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="one KV head"):
        TritonSplitKVAttention(2, 5, 70, 4, 2, 32, cpu, target_blocks=1, tma=True)
    with pytest.raises(ValueError, match="2 splits|splits"):
        TritonSplitKVAttention(1, 5, 70, 4, 1, 32, cpu, target_blocks=8, block_n=16, tma=True)
    assert not TritonSplitKVAttention(64, 560, 610, 8, 1, 256, cpu).tma  # auto: CUDA only
    assert tma_default(16) and tma_default(1) and tma_default(2) and not tma_default(8) and not tma_default(3)


def test_flow_step_matches_reference():
    """ODE rows, SDE rows, first step (t = 1) and a later step, against policies.flow's formulas."""
    from policies import flow

    g = torch.Generator().manual_seed(8)
    batch, steps, h, d = 3, 4, 5, 6
    grid = flow.time_grid(steps)
    deltas, sigmas = flow.step_deltas(grid), flow.sde_sigmas(grid, 0.5)
    stochastic = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4]).to(DEVICE)
    for k in (0, 2):
        consts = (float(grid[k]), float(deltas[k]), float(sigmas[k]), -1.0 / steps)
        chains = torch.randn(batch, steps + 1, h, d, generator=g).to(DEVICE)
        v = torch.randn(batch, h, d, generator=g).to(DEVICE)
        noise = torch.randn(batch, steps, h, d, generator=g).to(DEVICE)
        outs = []
        for fn in (K.flow_step_reference, K.flow_step_triton):
            c, lp = chains.clone(), torch.full((batch, steps, h, d), float("nan"), device=DEVICE)
            fn(c, v, noise, stochastic, lp, k, *consts)
            outs.append((c, lp))
        (c0, lp0), (c1, lp1) = outs
        assert torch.allclose(c1, c0, atol=1e-5, rtol=1e-5)
        assert torch.allclose(lp1[:, k], lp0[:, k], atol=1e-4, rtol=1e-5)
        assert bool((lp1[1, k] == 0).all()), "deterministic rows have log-prob 0"
        assert torch.allclose(c0[1, k + 1], chains[1, k] - v[1] / steps, atol=1e-6), "ODE row is Euler"
