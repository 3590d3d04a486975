"""The GeGLU GEMM (policies/fast/geglu.py) against plain PyTorch on fresh random inputs: Triton's
interpreter on CPU, compiled on a CUDA machine."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import geglu  # noqa: E402
from policies.fast import kernels as K  # noqa: E402
from policies.fast.geglu import GegluTile  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GegluTile(block_m=32, block_n=16, block_k=32, group_m=2, warps=4, stages=2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _operands(m, f, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 8, generator=g).to(DEVICE, dtype)[:, :k]  # a row stride wider than the row
    w = (torch.randn(2 * f, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("m,f,group_m", [(64, 48, 2), (70, 32, 2), (100, 64, 8), (7, 16, 1)])
def test_geglu_matches_reference(m, f, group_m):
    """Row counts that are and are not multiples of block_m, and column bands walked in groups
    of row tiles: every output element is written once, from its own row and columns."""
    x, w = _operands(m, f, 64, seed=m + f)
    tile = GegluTile(SMALL.block_m, SMALL.block_n, SMALL.block_k, group_m, SMALL.warps, SMALL.stages)
    got = geglu.geglu_linear(x, w, tile)
    assert got.shape == (m, f) and got.dtype == torch.bfloat16
    assert rel(got, geglu.geglu_linear_reference(x, w)) < 8e-3  # bf16 output rounding
    # and the cuBLAS path it replaces: the bf16 projection, then the GeGLU kernel's reference
    cublas_path = K.gelu_tanh_mul_reference(torch.nn.functional.linear(x.float(), w.float()).to(x.dtype))
    assert rel(got, cublas_path) < 2e-2


def test_geglu_fp32_is_exact_to_fp32_rounding():
    x, w = _operands(40, 32, 96, seed=5, dtype=torch.float32)
    got = geglu.geglu_linear(x, w, SMALL)
    assert rel(got, geglu.geglu_linear_reference(x, w)) < 1e-5


def test_geglu_writes_into_out_and_rejects_bad_shapes():
    x, w = _operands(32, 32, 64, seed=9)
    out = torch.full((32, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert geglu.geglu_linear(x, w, SMALL, out=out) is out
    assert bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="block_n=16"):
        geglu.geglu_linear(x, w[:40], SMALL)  # F = 20 is not a multiple of 16
    with pytest.raises(ValueError, match="block_k=32"):
        geglu.geglu_linear(x[:, :48], w[:, :48], SMALL)
    with pytest.raises(ValueError, match="out must be"):
        geglu.geglu_linear(x, w, SMALL, out=out[:16])


def test_candidates_fit_the_prefix_mlp():
    """Every tile the sweep times fits Gemma-2B's gate_up (2F = 32768, K = 2048) and H100/H200 shared
    memory (227 KB per SM) with its stages."""
    for tile in geglu.candidates():
        assert tile.fits(30976, 32768, 2048) is None
        assert (tile.block_m + 2 * tile.block_n) * tile.block_k * 2 * tile.stages <= 227 * 1024


def test_sampler_with_geglu_gemm_matches_cublas_path(monkeypatch):
    """The whole sampler with the prefix's GeGLU as one GEMM (fp32 tiny policy; Triton interpreter
    on CPU) equals the cuBLAS + GeGLU kernel path; "auto" keeps cuBLAS below AUTO_MIN_ROWS."""
    from policies.config import PolicyConfig
    from policies.fast.config import FastConfig
    from policies.fast.runner import FastSampler
    from policies.policy import build_policy

    from .test_fast_sampler import random_inputs

    monkeypatch.setattr(geglu, "GEGLU_TILE", GegluTile(block_m=32, block_n=16, block_k=16, group_m=2, warps=4,
                                                       stages=2))  # the tiny prefix: F = 96, K = 48
    policy = build_policy(PolicyConfig.preset("tiny"), device=DEVICE)
    cfg = policy.cfg
    inputs, noise, step_noise = random_inputs(cfg, 3, 13, seed=7)
    inputs = type(inputs)(*(t.to(DEVICE) for t in (inputs.images, inputs.image_masks, inputs.tokens,
                                                    inputs.token_mask)))
    stoch = torch.zeros(3, cfg.sampling.num_steps, dtype=torch.bool, device=DEVICE)
    stoch[:, 0] = True
    outs = {}
    for mode in ("cublas", "triton", "auto"):
        fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16],
                                                    geglu_gemm=mode, cuda_graphs=False, attention="sdpa"))
        outs[mode] = fast.sample_chains(inputs, noise.to(DEVICE), step_noise.to(DEVICE), stoch)
        assert (next(iter(fast.buckets.values())).geglu_tile is not None) == (mode == "triton")
    for got, want in zip(outs["triton"], outs["cublas"], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(outs["auto"], outs["cublas"], strict=True))
    with pytest.raises(ValueError, match="policy.fast.geglu_gemm must be one of"):
        geglu.choose_tile("fast", 64, 192, 48, torch.device("cpu"))


@pytest.mark.parametrize("m", [64, 70])
def test_geglu_tma_matches_reference(m):
    """The TMA-descriptor variant (rows past M zero-filled on load, clipped on store)."""
    x, w = _operands(m, 32, 64, seed=11 + m)
    x = x.contiguous()  # a TMA descriptor needs 16-byte aligned row strides
    tma = GegluTile(block_m=32, block_n=16, block_k=32, group_m=2, warps=4, stages=2, tma=True)
    got = geglu.geglu_linear(x, w, tma)
    assert rel(got, geglu.geglu_linear_reference(x, w)) < 8e-3
