"""Skinny split-K GEMMs (policies/fast/skinny.py) and their partial-sum consumers against plain
PyTorch on fresh random inputs: Triton's interpreter on CPU, compiled on a CUDA machine."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import kernels as K  # noqa: E402
from policies.fast import skinny  # noqa: E402
from policies.fast.skinny import SkinnyTile  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _operands(m, n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 8, generator=g).to(DEVICE, dtype)[:, :k]  # a row stride wider than the row
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("m,splits,block_m", [(10, 1, 16), (50, 2, 64), (50, 4, 16), (70, 2, 32)])
def test_split_partials_match_reference(m, splits, block_m):
    x, w = _operands(m, 64, 128, seed=m + splits)
    tile = SkinnyTile(block_n=32, block_k=32, splits=splits, block_m=block_m)
    got = skinny.skinny_linear(x, w, tile)
    want = skinny.skinny_linear_reference(x, w, splits)
    assert got.shape == (splits, m, 64) and got.dtype == torch.float32
    assert rel(got, want) < 1e-5
    # the partials add up to the projection
    assert rel(K.sum_partials(got), x.float() @ w.float().t()) < 1e-5


@pytest.mark.parametrize("m", [10, 50])
def test_gelu_mul_matches_geglu(m):
    x, w = _operands(m, 2 * 48, 64, seed=3 * m)
    got = skinny.skinny_linear(x, w, SkinnyTile(block_n=16, block_k=32, block_m=64), gelu_mul=True)
    want = skinny.skinny_linear_reference(x, w, gelu_mul=True)
    assert got.shape == (m, 48) and got.dtype == torch.bfloat16
    assert rel(got, want) < 8e-3  # bf16 output rounding
    # and what the cuBLAS path computes: the bf16 projection, then the GeGLU kernel's reference
    cublas_path = K.gelu_tanh_mul_reference(torch.nn.functional.linear(x.float(), w.float()).to(x.dtype))
    assert rel(got, cublas_path) < 2e-2


def test_gelu_mul_tails_are_finite_and_exact():
    """Large |gate| hits exp overflow/underflow inside the tanh: the result must be gate*up or 0."""
    x = torch.zeros(16, 16, dtype=torch.float32, device=DEVICE)
    x[:, 0] = torch.linspace(-200, 200, 16)
    w = torch.zeros(32, 16, dtype=torch.float32, device=DEVICE)
    w[:16, 0] = 1.0  # gate = x0
    w[16:, 0] = 1.0  # up = x0
    got = skinny.skinny_linear(x, w, SkinnyTile(block_n=16, block_k=16, block_m=16), gelu_mul=True)
    want = skinny.skinny_linear_reference(x, w, gelu_mul=True)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tile_that_does_not_fit_names_the_problem():
    x, w = _operands(50, 64, 96, seed=1)
    with pytest.raises(ValueError, match="K=96 is not a multiple of splits x block_k"):
        skinny.skinny_linear(x, w, SkinnyTile(block_n=32, block_k=64, splits=1))
    with pytest.raises(ValueError, match="gelu_mul needs an even N"):
        skinny.skinny_linear(x, w[:63], SkinnyTile(block_n=16, block_k=32), gelu_mul=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_add_rms_norm_reads_partials(splits):
    g = torch.Generator().manual_seed(splits)
    rows, width = 6, 48
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    h = r(rows, width).to(torch.bfloat16)
    partials, gate, scale, shift = r(splits, rows, width), r(width), r(width), r(width)
    want_h, want = K.add_rms_norm_reference(h.clone(), K.sum_partials(partials), gate, scale, shift, 1e-6)
    got_h, got = K._add_norm_triton(h.clone(), partials, gate, scale, shift, 1e-6, layer_norm=False,
                                    y_splits=splits)
    assert torch.equal(got_h, want_h) or rel(got_h, want_h) < 1e-2
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("t,all_heads", [(5, False), (150, False), (150, True)])  # 2 x 150 tokens: token blocks
def test_rope_scatter_reads_partials(t, all_heads, monkeypatch):
    monkeypatch.setattr(K, "ROPE_ALL_HEADS_FROM", 0 if all_heads else 10**9)
    from policies.models.gemma import rope_cos_sin

    g = torch.Generator().manual_seed(5)
    splits, b, hd, heads, kv, rows = 3, 2, 16, 2, 1, t + 4
    partials = torch.randn(splits, b, t, (heads + 2 * kv) * hd, generator=g).to(DEVICE)
    cos, sin = rope_cos_sin(torch.randint(0, 50, (b, t), generator=g).to(DEVICE), hd, 10000.0, torch.bfloat16)
    slots = torch.stack([torch.randperm(rows, generator=g)[:t] for _ in range(b)]).to(DEVICE, torch.int32)
    outs = []
    for qkv, fn in ((K.sum_partials(partials), K.rope_scatter_qkv_reference), (partials, K.rope_scatter_qkv_triton)):
        q = torch.zeros(b, t, heads, hd, dtype=torch.bfloat16, device=DEVICE)
        kc, vc = (torch.zeros(b, rows, kv, hd, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        fn(qkv, cos, sin, heads, kv, q, kc, vc, slots)
        outs.append((q, kc, vc))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert rel(got, want) < 1e-2


def test_sampler_with_skinny_gemms_matches_cublas_path():
    """The whole denoise loop with every expert projection through the skinny kernels (fp32 tiny
    policy; Triton interpreter on CPU), with and without the AdaRMS norms folded into them, equals the
    F.linear path."""
    from policies.config import PolicyConfig
    from policies.fast.config import FastConfig
    from policies.fast.runner import FastSampler
    from policies.policy import build_policy

    from .test_fast_sampler import random_inputs

    policy = build_policy(PolicyConfig.preset("tiny"), device=DEVICE)
    cfg = policy.cfg
    inputs, noise, step_noise = random_inputs(cfg, 3, 13, seed=4)
    inputs = type(inputs)(inputs.images.to(DEVICE), inputs.image_masks.to(DEVICE), inputs.tokens.to(DEVICE),
                          inputs.token_mask.to(DEVICE))
    noise, step_noise = noise.to(DEVICE), step_noise.to(DEVICE)
    stoch = torch.zeros(3, cfg.sampling.num_steps, dtype=torch.bool, device=DEVICE)
    stoch[:, 1] = True
    outs = {}
    variants = [("cublas", "off"), ("skinny", "off"), ("skinny", "mlp"), ("skinny", "attention"), ("skinny", "both")]
    for gemm, norms in variants:
        fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16],
                                                    gemm=gemm, cuda_graphs=False, attention="sdpa",
                                                    fused_norms=norms))
        outs[gemm, norms] = fast.sample_chains(inputs, noise, step_noise, stoch)
        bucket = next(iter(fast.buckets.values()))
        assert all((t is None) == (gemm == "cublas") for t in bucket.tiles.values()), bucket.tiles
        assert bucket.fused_norms == ({"mlp", "attention"} if norms == "both" else set() if norms == "off" else {norms})
    for variant in variants[1:]:
        for got, want in zip(outs[variant], outs["cublas", "off"], strict=True):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (variant, (got - want).abs().max())


def test_auto_keeps_cublas_on_cpu_and_above_the_row_limit():
    from policies.fast.weights import LinearW

    layer = {"qkv": LinearW(torch.zeros(2560, 1024), None), "down": LinearW(torch.zeros(1024, 4096), None)}
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert all(t is None for t in skinny.expert_tiles("auto", 50, layer, cpu).values())
    assert all(t is not None for t in skinny.expert_tiles("auto", 50, layer, cuda).values())
    assert all(t is None for t in skinny.expert_tiles("auto", skinny.AUTO_MAX_ROWS + 1, layer, cuda).values())
    assert skinny.expert_tiles("skinny", 500, layer, cpu)["down"].block_m == 64
    with pytest.raises(ValueError, match="policy.fast.gemm must be one of"):
        skinny.choose_tile("fast", 50, 1024, 1024, False, cpu)


def test_gate_up_tile_follows_the_row_count():
    """TUNED_BY_ROWS before TUNED: the GeGLU projection's in-graph winners at 17-32 and 33-64 rows."""
    shape = (8192, 1024, True)
    assert skinny.tuned_tile(10, *shape) == skinny.TUNED[shape]
    assert skinny.tuned_tile(100, *shape) == skinny.TUNED[shape]
    assert (skinny.tuned_tile(20, *shape).block_n, skinny.tuned_tile(20, *shape).block_k) == (32, 128)
    tile = skinny.choose_tile("skinny", 50, *shape, torch.device("cpu"))
    assert (tile.block_n, tile.block_k, tile.block_m) == (16, 128, 64)
    assert skinny.tuned_tile(50, 2560, 1024, False) == skinny.TUNED[(2560, 1024, False)]


def test_prefetch_share_is_validated_and_kept_by_choose_tile(monkeypatch):
    with pytest.raises(ValueError, match="SkinnyTile.prefetch must be one of"):
        SkinnyTile(prefetch=3)
    monkeypatch.setitem(skinny.TUNED, (64, 32, False), SkinnyTile(block_n=16, block_k=16, splits=2, prefetch=0))
    tile = skinny.choose_tile("skinny", 10, 64, 32, False, torch.device("cpu"))
    assert tile.prefetch == 0 and tile.block_m == skinny.rows_block(10)


def _fused_operands(m, width, seed):
    """A residual h (m, width) bf16, a projection x, W into it, a ResidualOut on a copy of h, and the
    next norm's AdaRMS shift."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    h = r(m, width).to(torch.bfloat16)
    x, w = _operands(m, width, 64, seed=seed + 1)
    blocks = -(-m // skinny.rows_block(m))
    nan = lambda *s: torch.full(s, float("nan"), device=DEVICE)  # noqa: E731
    residual = skinny.ResidualOut(h.clone(), r(width), r(width), nan(m, width).to(torch.bfloat16), nan(width // 4, m),
                                  torch.zeros(blocks * width // 16 + 3, dtype=torch.int32, device=DEVICE))
    return h, x, w, residual, r(width)


@pytest.mark.parametrize("m,splits", [(10, 1), (50, 4), (70, 2)])
def test_residual_epilogue_and_norm_in_equal_the_norm_kernel(m, splits):
    """o -> gate_up with the norm folded: the producer's epilogue (ResidualOut) updates h, leaves the
    strips' sums of squares and h (1 + scale); the consumer (NormIn) then equals the projection of
    add_rms_norm's output."""
    width, block_n = 64, 16
    h, x, w, residual, shift = _fused_operands(m, width, seed=m + splits)
    tile = SkinnyTile(block_n=block_n, block_k=16, splits=splits, block_m=skinny.rows_block(m))
    partials = skinny.skinny_linear(x, w, tile, residual=residual)
    want = skinny.ResidualOut(h.clone(), residual.gate, residual.next_scale, residual.scaled.clone(),
                              residual.stats.clone(), residual.counts)
    skinny.residual_reference(partials, want, block_n)
    # bf16 h within its rounding (the CPU interpreter's fp32 -> bf16 cast truncates), far nearer than before
    assert rel(residual.h, want.h) < 1e-2 and rel(residual.h, want.h) < rel(h, want.h) / 50
    assert rel(residual.scaled, want.scaled) < 1e-2
    strips = skinny.strip_stats(residual, tile, width)
    assert strips.shape == (width // block_n, m)
    mine = skinny.ResidualOut(residual.h, residual.gate, residual.next_scale, residual.scaled.clone(),
                              residual.stats.clone(), residual.counts)
    skinny.residual_reference(torch.zeros_like(partials), mine, block_n)  # from the kernel's own h
    assert torch.allclose(strips, skinny.strip_stats(mine, tile, width), rtol=1e-5)
    assert rel(residual.scaled, mine.scaled) < 1e-2
    assert int(residual.counts.abs().sum()) == 0  # left zeroed for the next projection
    # the consumer: 96 outputs (gelu_mul: 48) of the normed residual
    w2 = (torch.randn(96, width, generator=torch.Generator().manual_seed(m)) / width**0.5).to(DEVICE, torch.bfloat16)
    _, normed = K.add_rms_norm_reference(h.clone(), K.sum_partials(partials), residual.gate, residual.next_scale,
                                         shift, 1e-6)
    for gelu_mul, consumer_splits in ((False, 2), (True, 1)):
        norm = skinny.NormIn(strips, shift @ w2.float().t(), 1e-6)
        ctile = SkinnyTile(block_n=16, block_k=16, splits=consumer_splits, block_m=skinny.rows_block(m))
        got = skinny.skinny_linear(residual.scaled, w2, ctile, gelu_mul=gelu_mul, norm_in=norm)
        assert rel(got, skinny.norm_in_reference(residual.scaled, w2, norm, consumer_splits, gelu_mul)) < 1e-2
        plain = skinny.skinny_linear_reference(normed, w2, 1, gelu_mul)
        assert rel(got if gelu_mul else K.sum_partials(got), plain if gelu_mul else plain[0]) < 2e-2


def test_fusion_misuse_names_the_problem():
    h, x, w, residual, shift = _fused_operands(10, 64, seed=3)
    tile = SkinnyTile(block_n=16, block_k=16, splits=2, block_m=16)
    with pytest.raises(ValueError, match="ResidualOut.gate must be"):
        skinny.skinny_linear(x, w, tile, residual=dataclasses.replace(residual, gate=shift[:8]))
    with pytest.raises(ValueError, match="ResidualOut cannot follow a gelu_mul"):
        skinny.skinny_linear(x, torch.cat([w, w]), SkinnyTile(block_n=16, block_k=16, block_m=16), gelu_mul=True,
                             residual=residual)
    with pytest.raises(ValueError, match=r"NormIn.stats must be a contiguous fp32 \(strips, 10\)"):
        skinny.skinny_linear(x, w, tile, norm_in=skinny.NormIn(residual.stats[:, :5], shift, 1e-6))
    with pytest.raises(ValueError, match=r"NormIn.shift_proj must be a contiguous fp32 \(64,\)"):
        skinny.skinny_linear(x, w, tile, norm_in=skinny.NormIn(residual.stats[:, :10].contiguous(), shift[:8], 1e-6))


def test_fused_norms_choice(monkeypatch):
    tiles = {name: SkinnyTile() for name in ("qkv", "o", "gate_up", "down")}
    assert skinny.fused_norms("both", tiles) == {"mlp", "attention"}
    assert skinny.fused_norms("attention", tiles) == {"attention"}
    assert skinny.fused_norms("both", {**tiles, "o": None}) == set()  # a cuBLAS projection: no folding
    monkeypatch.setattr(skinny, "AUTO_FUSED_NORMS", "mlp")
    assert skinny.fused_norms("auto", tiles) == {"mlp"}
    with pytest.raises(ValueError, match="policy.fast.fused_norms must be one of"):
        skinny.fused_norms("all", tiles)


def test_shift_projection_follows_weight_updates_in_place():
    """NormIn's shift W^T per (step, layer): the AdaRMS shift of the norm before the projection, kept in
    fixed buffers that refresh() rewrites (graphs that read them need no re-capture)."""
    from policies.config import PolicyConfig
    from policies.fast.weights import FastWeights
    from policies.policy import build_policy

    policy = build_policy(PolicyConfig.preset("tiny"), device="cpu")
    w = FastWeights(policy.model, torch.float32, num_steps=3)
    width = policy.cfg.expert.width
    got = w.shift_projection("gate_up", 2, 1)
    shift = w.modulation(2, 3)[1]  # layer 1's norm before gate_up: 2 * 1 + 1
    assert torch.allclose(got, shift @ w.expert[1]["gate_up"].weight.float().t(), rtol=1e-5, atol=1e-6)
    assert w.shift_projection("qkv", 0, 0).shape == (w.expert[0]["qkv"].weight.shape[0],) and width == shift.numel()
    with torch.no_grad():
        policy.model.expert.layers[1].gate_up.weight.mul_(2.0)
    w.refresh()
    after = w.shift_projection("gate_up", 2, 1)
    assert after.data_ptr() == got.data_ptr()
    assert torch.allclose(after, shift @ w.expert[1]["gate_up"].weight.float().t(), rtol=1e-5, atol=1e-6)
