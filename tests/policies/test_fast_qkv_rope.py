"""The qkv projection with RoPE and the cache scatter in its epilogue (policies/fast/qkv_rope.py) against
plain PyTorch on fresh random inputs: Triton's interpreter on CPU, compiled on a CUDA machine."""

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import qkv_rope, skinny  # noqa: E402
from policies.fast.skinny import SkinnyTile  # noqa: E402
from policies.models.gemma import rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _case(b, t, hd, heads, kv, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = t + 3
    x = torch.randn(b * t, k + 8, generator=g).to(DEVICE, dtype)[:, :k]  # a row stride wider than the row
    w = (torch.randn((heads + 2 * kv) * hd, k, generator=g) / k**0.5).to(DEVICE, dtype)
    cos, sin = rope_cos_sin(torch.randint(0, 50, (b, t), generator=g).to(DEVICE), hd, 10000.0, dtype)
    slots = torch.stack([torch.randperm(rows, generator=g)[:t] for _ in range(b)]).to(DEVICE, torch.int32)
    return x, w, cos, sin, slots, rows


def _run(fn, x, w, cos, sin, slots, rows, heads, kv, *tile):
    b, t, hd = cos.shape
    q = torch.zeros(b, t, heads, hd, dtype=x.dtype, device=DEVICE)
    kc, vc = (torch.zeros(b, rows, kv, hd, dtype=x.dtype, device=DEVICE) for _ in range(2))
    fn(x, w, *tile, cos, sin, heads, kv, q, kc, vc, slots)
    return q, kc, vc


@pytest.mark.parametrize("b,t,block_m", [(1, 10, 16), (2, 25, 64), (3, 10, 16)])
@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_matches_projection_then_rope_scatter(b, t, block_m, preload, dtype, tol):
    heads, kv, hd, k = 2, 1, 32, 64
    x, w, cos, sin, slots, rows = _case(b, t, hd, heads, kv, k, dtype, seed=b * 10 + t)
    tile = SkinnyTile(block_n=16, block_k=32, splits=1, block_m=block_m, preload=preload, rope=True)
    got = _run(qkv_rope.qkv_rope, x, w, cos, sin, slots, rows, heads, kv, tile)
    want = _run(qkv_rope.qkv_rope_reference, x, w, cos, sin, slots, rows, heads, kv)
    for g, r in zip(got, want, strict=True):
        assert rel(g, r) < tol
    untouched = torch.ones(b, rows, dtype=torch.bool)
    untouched[torch.arange(b)[:, None], slots.long().cpu()] = False
    assert not got[1][untouched].any() and not got[2][untouched].any()  # only the chunk's slots are written


def test_tiles_that_cannot_run_name_the_problem():
    x, w, cos, sin, slots, rows = _case(1, 4, 32, 2, 1, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="must divide half the head dim"):
        _run(qkv_rope.qkv_rope, x, w, cos, sin, slots, rows, 2, 1, SkinnyTile(block_n=32, block_k=32, rope=True))
    with pytest.raises(ValueError, match="not a rope tile"):
        _run(qkv_rope.qkv_rope, x, w, cos, sin, slots, rows, 2, 1, SkinnyTile(block_n=16, block_k=32))
    assert "splits=1" in SkinnyTile(block_n=16, block_k=32, splits=2, rope=True).fits(4, 128, 64)
    with pytest.raises(ValueError, match="runs through qkv_rope"):
        skinny.skinny_linear(x, w, SkinnyTile(block_n=16, block_k=32, rope=True))
    # a preloaded rope tile holds both halves' slabs
    big = SkinnyTile(block_n=32, block_k=128, preload=True, rope=True)
    assert "preload holds at most" in big.fits(64, 2560, 1024)
    assert SkinnyTile(block_n=16, block_k=128, preload=True, rope=True).fits(64, 2560, 1024) is None


def test_sampler_with_the_rope_tile_matches_cublas_path(monkeypatch):
    """The whole denoise loop of a tiny fp32 policy with 32-wide heads, its qkv through a rope tile, equals
    the F.linear + rope_scatter path (Triton interpreter on CPU)."""
    from policies.config import PolicyConfig
    from policies.policy import build_policy

    from .test_fast_sampler import eager_sampler, random_inputs

    cfg = PolicyConfig.preset("tiny")
    cfg = replace(cfg, prefix=replace(cfg.prefix, head_dim=32), expert=replace(cfg.expert, head_dim=32))
    policy = build_policy(cfg, device=DEVICE)
    inputs, noise, step_noise = random_inputs(policy.cfg, 3, 13, seed=3, device=DEVICE)
    stoch = torch.zeros(3, policy.cfg.sampling.num_steps, dtype=torch.bool, device=DEVICE)
    stoch[:, 1] = True
    layer = policy.model.expert.layers[0]
    qkv_shape = (*layer.qkv.weight.shape, False)
    monkeypatch.setitem(skinny.TUNED, qkv_shape, SkinnyTile(block_n=16, block_k=16, splits=1, rope=True))
    monkeypatch.setitem(skinny.TUNED_BY_ROWS, qkv_shape, ())
    outs = {}
    for gemm in ("cublas", "skinny"):
        fast = eager_sampler(policy.model, gemm=gemm)
        outs[gemm] = fast.sample_chains(inputs, noise, step_noise, stoch)
        tiles = next(iter(fast.buckets.values())).tiles
        assert (tiles["qkv"] is not None and tiles["qkv"].rope) == (gemm == "skinny"), tiles
    for got, want in zip(outs["skinny"], outs["cublas"], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_rope_tile_keeps_its_flag_through_choose_tile(monkeypatch):
    monkeypatch.setitem(skinny.TUNED_BY_ROWS, (2560, 1024, False),
                        ((1, 64, SkinnyTile(block_n=16, block_k=128, splits=1, preload=True, rope=True)),))
    tile = skinny.choose_tile("auto", 50, 2560, 1024, False, torch.device("cuda"))
    assert tile == replace(tile, rope=True, preload=True, block_m=64)
