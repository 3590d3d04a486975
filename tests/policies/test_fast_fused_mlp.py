"""The expert MLP in one launch (policies/fast/fused_mlp.py) against the two skinny kernels it joins,
bit for bit, on fresh random inputs: Triton's interpreter on CPU, compiled on a CUDA machine (where
the counters really synchronise programs running at once)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import fused_mlp, skinny  # noqa: E402
from policies.fast.config import FastConfig  # noqa: E402
from policies.fast.skinny import SkinnyTile  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, k, f, n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 8, generator=g).to(DEVICE, dtype)[:, :k]  # a row stride wider than the row
    w_gate_up = (torch.randn(2 * f, k, generator=g) / k**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(n, f, generator=g) / f**0.5).to(DEVICE, dtype)
    return x, w_gate_up, w_down


def _two_kernels(x, w_gate_up, w_down, gate_up, down):
    act = skinny.skinny_linear(x, w_gate_up, gate_up, gelu_mul=True)
    return skinny.skinny_linear(act, w_down, down)


@pytest.mark.parametrize("m,block_m,splits,dtype", [
    (10, 16, 2, torch.float32), (50, 64, 4, torch.bfloat16), (70, 32, 2, torch.bfloat16), (16, 16, 1, torch.float32),
])
def test_fused_equals_the_two_kernels(m, block_m, splits, dtype):
    x, w_gate_up, w_down = _operands(m, 64, 128, 96, seed=m + splits, dtype=dtype)
    gate_up = SkinnyTile(block_n=16, block_k=32, splits=1, block_m=block_m)
    down = SkinnyTile(block_n=32, block_k=32, splits=splits, block_m=block_m)
    got = fused_mlp.fused_mlp(x, w_gate_up, w_down, gate_up, down)
    assert got.shape == (splits, m, 96) and got.dtype == torch.float32
    assert torch.equal(got, _two_kernels(x, w_gate_up, w_down, gate_up, down))


@pytest.mark.parametrize("preload_gate_up,preload_down", [(True, False), (False, True), (True, True)])
def test_fused_with_preloaded_slabs_equals_the_two_kernels(preload_gate_up, preload_down):
    """SkinnyTile.preload in either role: the same as the two skinny kernels with the same tiles."""
    m, dtype = 50, torch.float32
    x, w_gate_up, w_down = _operands(m, 64, 128, 96, seed=5, dtype=dtype)
    gate_up = SkinnyTile(block_n=16, block_k=32, splits=1, block_m=64, preload=preload_gate_up)
    down = SkinnyTile(block_n=32, block_k=32, splits=2, block_m=64, preload=preload_down)
    got = fused_mlp.fused_mlp(x, w_gate_up, w_down, gate_up, down)
    assert torch.equal(got, _two_kernels(x, w_gate_up, w_down, gate_up, down))
    streamed = _two_kernels(x, w_gate_up, w_down, SkinnyTile(16, 32, 1, block_m=64), SkinnyTile(32, 32, 2, block_m=64))
    assert float((got - streamed).norm() / streamed.norm()) < 1e-5


def test_sync_buffer_is_checked_and_counts_every_program():
    m, gate_up, down = 20, SkinnyTile(16, 32, 1, block_m=16), SkinnyTile(32, 32, 2, block_m=16)
    x, w_gate_up, w_down = _operands(m, 64, 64, 64, seed=1, dtype=torch.float32)
    width = fused_mlp.sync_width(m, down)
    assert width == 1 + 2 * 2  # the ticket, then (row tiles) x (K slices) counters
    with pytest.raises(ValueError, match="sync must be a contiguous int32 buffer of 5 entries"):
        fused_mlp.fused_mlp(x, w_gate_up, w_down, gate_up, down, sync=torch.zeros(4, dtype=torch.int32, device=DEVICE))
    sync = torch.zeros(width, dtype=torch.int32, device=DEVICE)
    fused_mlp.fused_mlp(x, w_gate_up, w_down, gate_up, down, sync=sync)
    gate_up_programs, down_programs = (64 // 16) * 2, (64 // 32) * 2 * 2
    assert sync[0].item() == gate_up_programs + down_programs  # every program took one ticket
    assert sync[1:].tolist() == [2] * 4  # each (row tile, slice) counted its 32 / 16 = 2 producers


def test_unfit_names_the_reason():
    gate_up, down = SkinnyTile(16, 32, 1, block_m=64), SkinnyTile(64, 64, 8, block_m=64)
    assert fused_mlp.unfit(50, (8192, 1024), (1024, 4096), gate_up, down) is None
    assert "skinny tiles" in fused_mlp.unfit(50, (8192, 1024), (1024, 4096), None, down)
    assert "twice" in fused_mlp.unfit(50, (8192, 1024), (1024, 2048), gate_up, down)
    assert "warps" in fused_mlp.unfit(50, (8192, 1024), (1024, 4096), gate_up, SkinnyTile(64, 64, 8, warps=8))
    assert "K slice" in fused_mlp.unfit(50, (8192, 1024), (1024, 4096), SkinnyTile(1024, 32, 1), down)
    assert "down: K=4096" in fused_mlp.unfit(50, (8192, 1024), (1024, 4096), gate_up, SkinnyTile(64, 1024, 8))
    with pytest.raises(ValueError, match="fused MLP cannot run"):
        x, w_gate_up, w_down = _operands(10, 64, 64, 64, seed=2, dtype=torch.float32)
        fused_mlp.fused_mlp(x, w_gate_up, w_down, gate_up, SkinnyTile(64, 64, 8, block_m=32))


def test_choose_follows_the_mode_and_pdl():
    gate_up, down = SkinnyTile(16, 128, 1, block_m=64), SkinnyTile(64, 64, 8, block_m=64)
    shapes = (50, (8192, 1024), (1024, 4096), gate_up, down)
    assert fused_mlp.choose("fused", *shapes, 0) and fused_mlp.choose("auto", *shapes, 1)
    assert not fused_mlp.choose("auto", *shapes, 0) and not fused_mlp.choose("split", *shapes, 1)
    assert not fused_mlp.choose("fused", 50, (8192, 1024), (1024, 4096), None, down, 1)
    assert fused_mlp.choose("fused", 20, *shapes[1:], 0) and not fused_mlp.choose("auto", 20, *shapes[1:], 1)
    preloaded = SkinnyTile(64, 64, 8, block_m=64, preload=True)  # split won against fused at 40 and 50 rows
    assert not fused_mlp.choose("auto", 50, (8192, 1024), (1024, 4096), gate_up, preloaded, 1)
    assert fused_mlp.choose("fused", 50, (8192, 1024), (1024, 4096), gate_up, preloaded, 1)
    with pytest.raises(ValueError, match="policy.fast.mlp must be one of"):
        fused_mlp.choose("on", *shapes, 1)
    with pytest.raises(ValueError, match="policy.fast.mlp must be one of"):
        FastConfig(mlp="on")


def test_sampler_chains_fused_equal_split():
    """The tiny policy's whole denoise loop with the MLP fused or split: the same bits, and the fused
    bucket holds one zeroed counter row per (step, layer)."""
    from .test_fast_sampler import eager_sampler, tiny_loop_case

    policy, args = tiny_loop_case(seed=5, stochastic_step=2, device=DEVICE)
    cfg = policy.cfg
    outs = {}
    for mlp in ("split", "fused"):
        fast = eager_sampler(policy.model, gemm="skinny", mlp=mlp)
        for _ in range(2):  # a second call reuses the counters: zeroed again at the stage's start
            outs[mlp] = fast.sample_chains(*args)
        sync = next(iter(fast.buckets.values())).mlp_sync
        assert (sync is None) == (mlp == "split")
    assert sync.shape[:2] == (cfg.sampling.num_steps, cfg.expert.depth)
    for got, want in zip(outs["fused"], outs["split"], strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_code", [0, 1])
def test_fused_at_the_expert_shapes_is_race_free(pdl_code):
    """pi0.5's expert MLP at PhyAI batch 1 (50 rows) with the tuned tiles, 100 launches on one stream
    (each with a fresh zeroed counter row, as the runner gives them): every result equals the two
    kernels' bit for bit; a down program that read its slice before the producers' stores were
    visible would show up here."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the interpreter runs one program at a time")
    from policies.fast import pdl

    if pdl_code and not pdl.supported():
        pytest.skip("PDL needs compute capability >= 9.0")
    m, k, f, n = 50, 1024, 4096, 1024
    gate_up = skinny.choose_tile("skinny", m, 2 * f, k, True, torch.device("cuda"))
    down = skinny.choose_tile("skinny", m, n, f, False, torch.device("cuda"))
    assert fused_mlp.unfit(m, (2 * f, k), (n, f), gate_up, down) is None
    sync = torch.zeros(100, fused_mlp.sync_width(m, down), dtype=torch.int32, device="cuda")
    operands = [_operands(m, k, f, n, seed=seed, dtype=torch.bfloat16) for seed in range(4)]
    wants = [_two_kernels(*ops, gate_up, down) for ops in operands]
    results = [fused_mlp.fused_mlp(*operands[i % 4], gate_up, down, sync[i], pdl=pdl_code) for i in range(100)]
    torch.cuda.synchronize()
    for i, got in enumerate(results):
        assert torch.equal(got, wants[i % 4]), i
    programs = (f // gate_up.block_n) + (n // down.block_n) * down.splits
    assert (sync[:, 0] == programs).all()
