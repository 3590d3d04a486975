"""Skinny split-K GEMMs (policies/fast/skinny.py) and their partial-sum consumers against plain
PyTorch on fresh random inputs: Triton's interpreter on CPU, compiled on a CUDA machine."""

import os
from dataclasses import replace

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


@pytest.mark.parametrize("m,splits,block_m,gelu_mul,dtype", [
    (50, 2, 64, False, torch.bfloat16), (10, 4, 16, False, torch.float32), (70, 1, 32, False, torch.bfloat16),
    (50, 1, 64, True, torch.bfloat16), (20, 1, 32, True, torch.float32),
])
def test_preloaded_slab_matches_streamed_tile(m, splits, block_m, gelu_mul, dtype):
    """SkinnyTile.preload (whole slab before the PDL wait, one dot) computes what the K loop does."""
    x, w = _operands(m, 96, 256, seed=7 * m + splits, dtype=dtype)
    streamed = SkinnyTile(block_n=16 if gelu_mul else 32, block_k=32, splits=splits, block_m=block_m)
    preloaded = SkinnyTile(**{**vars(streamed), "preload": True})
    got = skinny.skinny_linear(x, w, preloaded, gelu_mul=gelu_mul)
    want = skinny.skinny_linear(x, w, streamed, gelu_mul=gelu_mul)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel(got, want) < (8e-3 if gelu_mul and dtype == torch.bfloat16 else 1e-5)
    assert rel(got, skinny.skinny_linear_reference(x, w, splits, gelu_mul)) < (8e-3 if gelu_mul else 1e-5)


def test_preload_refuses_what_it_cannot_hold():
    assert "power-of-two K slice" in SkinnyTile(32, 32, 3, preload=True).fits(50, 64, 288)
    too_wide = SkinnyTile(block_n=128, block_k=64, splits=1, preload=True)
    assert "at most 98304 elements" in too_wide.fits(50, 1024, 1024)
    # gate and up 32 wide over K = 1024 with 64 rows of x: 256 KB of shared memory, which failed to launch
    assert "got weights 65536 and x 65536" in SkinnyTile(32, 64, 1, preload=True).fits(50, 8192, 1024, True)
    assert SkinnyTile(16, 128, 1, preload=True).fits(50, 8192, 1024, True) is None
    assert SkinnyTile(block_n=64, block_k=64, splits=2, preload=True).fits(50, 2560, 1024) is None


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
    policy; Triton interpreter on CPU) equals the F.linear path."""
    from .test_fast_sampler import eager_sampler, tiny_loop_case

    policy, args = tiny_loop_case(seed=4, stochastic_step=1, device=DEVICE)
    outs = {}
    for gemm in ("cublas", "skinny"):
        fast = eager_sampler(policy.model, gemm=gemm)
        outs[gemm] = fast.sample_chains(*args)
        tiles = next(iter(fast.buckets.values())).tiles
        assert all((t is None) == (gemm == "cublas") for t in tiles.values()), tiles
    for got, want in zip(outs["skinny"], outs["cublas"], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


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
    """TUNED_BY_ROWS before TUNED: the GeGLU projection's in-graph winners at 17-32, 33-64 and 65-128 rows."""
    shape = (8192, 1024, True)
    assert skinny.tuned_tile(10, *shape) == skinny.TUNED[shape]
    assert skinny.tuned_tile(100, *shape) == replace(skinny.TUNED[shape], prefetch=4)
    assert skinny.tuned_tile(129, *shape) == skinny.TUNED[shape]
    assert (skinny.tuned_tile(20, *shape).block_n, skinny.tuned_tile(20, *shape).block_k) == (32, 128)
    tile = skinny.choose_tile("skinny", 50, *shape, torch.device("cpu"))
    assert (tile.block_n, tile.block_k, tile.block_m) == (16, 128, 64)
    assert skinny.tuned_tile(20, 2560, 1024, False) == replace(skinny.TUNED[(2560, 1024, False)], preload=True)


@pytest.mark.parametrize("shape,splits", [((1024, 2048, False), 4), ((2560, 1024, False), 2)])
def test_o_and_qkv_split_k_less_at_33_to_128_rows(shape, splits):
    """The in-graph winners at PhyAI b1 and b2 (50 and 100 rows): o with 4 K splits, qkv with 2; TUNED's
    at 32 rows and fewer, and past the skinny kernels' 128 rows."""
    for rows in (33, 50, 64, 100, 128):
        assert skinny.tuned_tile(rows, *shape).splits == splits
    assert replace(skinny.tuned_tile(10, *shape), preload=False) == skinny.TUNED[shape]
    assert skinny.tuned_tile(10, *shape) == skinny.tuned_tile(32, *shape)
    assert skinny.tuned_tile(129, *shape) == skinny.TUNED[shape]
    assert skinny.choose_tile("skinny", 50, *shape, torch.device("cpu")).splits == splits


def test_qkv_prefetches_a_quarter_of_its_slab_from_65_rows():
    """Round 19: at 80 and 100 rows qkv's PDL prefetch of a quarter of its slab beat the whole slab; at 40 and
    50 rows the whole slab stays."""
    qkv = (2560, 1024, False)
    assert [skinny.tuned_tile(rows, *qkv).prefetch for rows in (33, 50, 64, 65, 100, 128)] == [1, 1, 1, 4, 4, 4]
    assert replace(skinny.tuned_tile(100, *qkv), prefetch=1) == skinny.tuned_tile(50, *qkv)


def test_preload_follows_the_row_count():
    """Round 17's in-graph winners: down preloaded up to 64 rows (the MLP then split), qkv up to 32, o at
    81-128; none past the skinny kernels' 128 rows."""
    down, o, qkv = (1024, 4096, False), (1024, 2048, False), (2560, 1024, False)
    for rows in (1, 10, 32, 50, 64):
        assert skinny.tuned_tile(rows, *down).preload and skinny.tuned_tile(rows, *down).splits == 8
    assert not any(skinny.tuned_tile(rows, *down).preload for rows in (65, 80, 100, 129))
    assert [skinny.tuned_tile(rows, *o).preload for rows in (10, 32, 50, 64, 80, 81, 100, 128, 129)] == [
        False, False, False, False, False, True, True, True, False]
    assert [(t.preload, t.splits) for t in (skinny.tuned_tile(r, *qkv) for r in (10, 32, 33, 129))] == [
        (True, 4), (True, 4), (False, 2), (False, 4)]
    assert skinny.choose_tile("skinny", 10, *down, torch.device("cpu")).preload
    # down's and gate_up's PDL prefetch: a quarter of the slab at 65-128 rows (round 20)
    assert [skinny.tuned_tile(r, *down).prefetch for r in (64, 65, 100, 128, 129)] == [1, 4, 4, 4, 1]
    assert [skinny.tuned_tile(r, 8192, 1024, True).prefetch for r in (64, 65, 128, 129)] == [0, 4, 4, 1]


def test_prefetch_share_is_validated_and_kept_by_choose_tile(monkeypatch):
    with pytest.raises(ValueError, match="SkinnyTile.prefetch must be one of"):
        SkinnyTile(prefetch=3)
    monkeypatch.setitem(skinny.TUNED, (64, 32, False), SkinnyTile(block_n=16, block_k=16, splits=2, prefetch=0))
    tile = skinny.choose_tile("skinny", 10, 64, 32, False, torch.device("cpu"))
    assert tile.prefetch == 0 and tile.block_m == skinny.rows_block(10)
