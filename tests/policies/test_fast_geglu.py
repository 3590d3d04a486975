"""The one-kernel GeGLU GEMM (policies/fast/geglu_gemm.py) against plain PyTorch on fresh random
inputs: Triton's interpreter on CPU, compiled on a CUDA machine (the `gpu` test: real shapes)."""

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.config import PolicyConfig  # noqa: E402
from policies.fast import geglu_gemm  # noqa: E402
from policies.fast import kernels as K  # noqa: E402
from policies.fast.config import FastConfig  # noqa: E402
from policies.fast.geglu_gemm import GegluTile  # noqa: E402
from policies.fast.runner import FastSampler  # noqa: E402
from policies.fast.skinny import skinny_linear_reference  # noqa: E402
from policies.lerobot_bridge import relative_l2  # noqa: E402
from policies.observation import ModelInputs  # noqa: E402
from policies.policy import build_policy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, f, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(2 * f, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("m", [5, 37, 64])
def test_matches_reference_fp32(m, tma, wide):
    """Ragged row counts (M not a multiple of block_m): TMA's zero fill and the pointer path's masks;
    `wide`: gate and up as one (BM, 2BN) accumulator, split after the K loop."""
    x, w = _operands(m, 48, 64, seed=m, dtype=torch.float32)
    tile = GegluTile(16, 16, 32, group_m=2, stages=2, warps=4, tma=tma, wide=wide)
    got = geglu_gemm.geglu_linear(x, w, tile)
    assert got.shape == (m, 48) and got.dtype == torch.float32
    assert relative_l2(got, skinny_linear_reference(x, w, gelu_mul=True)) < 1e-5


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_persistent_loop_covers_every_block(programs, flatten):
    """A persistent tile walks blocks program, program + P, ...: every block written exactly as the
    one-program-per-block launch writes it, whatever the program count."""
    x, w = _operands(40, 64, 32, seed=programs, dtype=torch.float32)
    flat = geglu_gemm.geglu_linear(x, w, GegluTile(16, 16, 32, group_m=2, stages=2, warps=4))
    out = torch.full_like(flat, float("nan"))
    tile = GegluTile(16, 16, 32, group_m=2, stages=2, warps=4, persistent=True, flatten=flatten)
    geglu_gemm.geglu_linear(x, w, tile, out=out, max_programs=programs)
    assert torch.equal(out, flat)
    wide = torch.full_like(flat, float("nan"))
    tile = GegluTile(16, 16, 32, group_m=2, stages=2, warps=4, persistent=True, flatten=flatten, wide=True)
    geglu_gemm.geglu_linear(x, w, tile, out=wide, max_programs=programs)
    assert torch.allclose(wide, flat, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wide", [False, True])
def test_bf16_matches_the_cublas_path(wide):
    """bf16 operands: within the bf16 output rounding of the fp32 reference, and close to what the
    runner computed before (bf16 gate/up projection, then the GeGLU kernel)."""
    x, w = _operands(50, 64, 64, seed=11, dtype=torch.bfloat16)
    got = geglu_gemm.geglu_linear(x, w, GegluTile(16, 32, 32, group_m=4, stages=2, warps=4, wide=wide))
    assert got.dtype == torch.bfloat16
    assert relative_l2(got, skinny_linear_reference(x, w, gelu_mul=True)) < 8e-3
    cublas_path = K.gelu_tanh_mul_reference(torch.nn.functional.linear(x.float(), w.float()).to(x.dtype))
    assert relative_l2(got, cublas_path) < 2e-2


def test_rejects_shapes_it_cannot_run():
    x, w = _operands(16, 40, 64, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_n"):
        geglu_gemm.geglu_linear(x, w, GegluTile(16, 16, 32))  # F = 40
    with pytest.raises(ValueError, match="block_k"):
        geglu_gemm.geglu_linear(x[:, :48].contiguous(), w[:, :48].contiguous(), GegluTile(16, 8 * 5, 32))
    with pytest.raises(ValueError, match="contiguous"):
        geglu_gemm.geglu_linear(x.t().contiguous().t(), w, GegluTile(16, 40, 32))
    with pytest.raises(ValueError, match="out must be"):
        geglu_gemm.geglu_linear(x, w, GegluTile(16, 40, 32), out=torch.empty(16, 41, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [968, 4133])
def test_gpu_prefix_shapes_every_candidate(m):
    """pi0.5's prefix MLP (K 2048, F 16384) at a batch-1 row count and a ragged one: every tile the
    sweep times, compiled, against the fp32 reference."""
    x, w = _operands(m, 16384, 2048, seed=m, dtype=torch.bfloat16)
    want = skinny_linear_reference(x, w, gelu_mul=True)
    for tile in geglu_gemm.candidates():
        got = geglu_gemm.geglu_linear(x, w, tile)
        assert relative_l2(got, want) < 8e-3, tile


def test_gelu_form_is_validated_and_labelled():
    with pytest.raises(ValueError, match="GegluTile.gelu must be one of"):
        GegluTile(gelu="erf")
    exp2 = replace(geglu_gemm.TUNED, gelu="exp2")
    assert geglu_gemm.TUNED.gelu == "tanh_approx"
    assert geglu_gemm.tile_label(geglu_gemm.TUNED) == geglu_gemm.tile_label(exp2) + "_tanh"
    assert geglu_gemm.epilogue_candidates() == [geglu_gemm.TUNED, exp2]
    candidates = geglu_gemm.candidates()
    assert geglu_gemm.TUNED in candidates and exp2 in candidates and len(set(candidates)) == len(candidates)
    neighbours = geglu_gemm.neighbour_candidates()
    assert neighbours[::2] == [geglu_gemm.TUNED] * 3 and geglu_gemm.TUNED not in neighbours[1::2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's refusal; the GPU runs the form")
def test_interpreter_refuses_the_inline_ptx_gelu():
    x, w = _operands(16, 32, 32, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="tanh_approx"):
        geglu_gemm.geglu_linear(x, w, GegluTile(16, 16, 32, stages=2, warps=4, gelu="tanh_approx"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [968, 4133])
def test_gpu_tanh_approx_epilogue_near_exp2(m):
    """TUNED with the tanh.approx epilogue against TUNED's exp2 form and the fp32 reference: the same
    accumulators, so the activations differ only by the two gelu_tanh forms' error, far under bf16's."""
    x, w = _operands(m, 16384, 2048, seed=m + 2, dtype=torch.bfloat16)
    exact = geglu_gemm.geglu_linear(x, w, replace(geglu_gemm.TUNED, gelu="exp2"))
    fast = geglu_gemm.geglu_linear(x, w, replace(geglu_gemm.TUNED, gelu="tanh_approx"))
    want = skinny_linear_reference(x, w, gelu_mul=True)
    assert relative_l2(fast, exact) < 4e-3
    assert relative_l2(fast, want) < 8e-3
    assert (fast.float() - exact.float()).abs().max() < 0.05 * exact.float().abs().max()


def test_choose_tile_follows_the_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert geglu_gemm.choose_tile("cublas", 10**5, 32768, 2048, cuda) is None
    assert geglu_gemm.choose_tile("auto", 560, 32768, 2048, cuda) is None  # below AUTO_MIN_ROWS
    assert geglu_gemm.choose_tile("auto", 968, 32768, 2048, cuda) == geglu_gemm.TUNED
    assert geglu_gemm.choose_tile("auto", 35840, 32768, 2048, cuda) == geglu_gemm.TUNED
    assert geglu_gemm.choose_tile("auto", 35840, 32768, 2048, cpu) is None
    assert geglu_gemm.choose_tile("fused", 35840, 32768, 2048, cuda, torch.float32) is None  # fp32: cuBLAS
    assert geglu_gemm.choose_tile("fused", 50, 192, 48, cpu).fits(50, 192, 48) is None
    assert geglu_gemm.choose_tile("fused", 50, 2 * 36, 48, cpu) is None  # F = 36: no 16-multiple block
    with pytest.raises(ValueError, match="policy.fast.geglu"):
        geglu_gemm.choose_tile("triton", 50, 192, 48, cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [968, 4133])
def test_gpu_tile_variants_write_identical_activations(m):
    """TUNED (wide, group 16) against the earlier tuned tile (two dots, group 8) and the two mixes: block
    order and wgmma width change no product and no summation order, so the activations agree bit for bit."""
    x, w = _operands(m, 16384, 2048, seed=m + 1, dtype=torch.bfloat16)
    tiles = [geglu_gemm.TUNED] + [replace(geglu_gemm.TUNED, wide=wide, group_m=g) for wide, g in
                                  ((False, 8), (False, 16), (True, 8))]
    outs = [geglu_gemm.geglu_linear(x, w, tile) for tile in tiles]
    for tile, out in zip(tiles, outs):
        assert torch.equal(out, outs[0]), tile


def _sampler_outputs(model, cfg, geglu, device, dtype):
    fast = FastSampler(model, FastConfig(dtype=dtype, batch_buckets=[4], prompt_buckets=[16], geglu=geglu,
                                         attention="sdpa" if device == "cpu" else "triton"))
    g = torch.Generator().manual_seed(5)
    b, cams, res = 3, len(cfg.cameras), cfg.vision.image_size
    inputs = ModelInputs((torch.rand(b, cams, 3, res, res, generator=g) * 2 - 1).to(device),
                         torch.ones(b, cams, dtype=torch.bool, device=device),
                         torch.randint(0, cfg.vocab_size, (b, 12), generator=g).to(device),
                         torch.ones(b, 12, dtype=torch.bool, device=device))
    noise = torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g).to(device)
    step_noise = torch.randn(b, cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim, generator=g).to(device)
    stoch = torch.ones(b, cfg.sampling.num_steps, dtype=torch.bool, device=device)
    chains, logp = fast.sample_chains(inputs, noise, step_noise, stoch)
    return fast, (chains, logp), lambda: fast.sample_chains(inputs, noise, step_noise, stoch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU twin of test_gpu_sampler_fused_near_cublas")
def test_sampler_with_the_fused_geglu_matches_cublas_path():
    """The tiny policy in fp32 on CPU: the prefix MLP through the fused kernel (interpreter) gives the
    chains and log-probs of the unfused path."""
    cfg = PolicyConfig.preset("tiny")
    model = build_policy(cfg).model
    fused, got, _ = _sampler_outputs(model, cfg, "fused", "cpu", "float32")
    plain, want, _ = _sampler_outputs(model, cfg, "cublas", "cpu", "float32")
    assert next(iter(fused.buckets.values())).geglu_tile is not None
    assert next(iter(plain.buckets.values())).geglu_tile is None
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sampler_fused_near_cublas_and_sees_weight_updates():
    """bf16 graphs with the fused prefix MLP: near the cuBLAS path, replays bit-identical, and an
    in-place update of the prefix weights reaches the captured graphs without re-capture."""
    from .test_fast_gpu import gpu_cfg  # a GPU-sized tiny policy (that module is GPU-marked)

    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    cfg = policy.cfg
    fused, got, replay = _sampler_outputs(policy.model, cfg, "fused", "cuda", "bfloat16")
    assert next(iter(fused.buckets.values())).geglu_tile == geglu_gemm.TUNED
    _, want, _ = _sampler_outputs(policy.model, cfg, "cublas", "cuda", "bfloat16")
    assert relative_l2(got[0], want[0]) < 2e-2
    for a, b in zip(replay(), got, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.05)
    fused.refresh_weights()
    after = replay()
    _, fresh, _ = _sampler_outputs(policy.model, cfg, "fused", "cuda", "bfloat16")
    assert not torch.equal(after[0], got[0])
    for a, b in zip(after, fresh, strict=True):
        assert torch.equal(a, b)
