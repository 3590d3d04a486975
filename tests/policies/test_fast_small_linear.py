"""The fp32 action projections (policies/fast/small_linear.py) against plain PyTorch on fresh random
inputs: Triton's interpreter on CPU, compiled on a CUDA machine."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import small_linear as S  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_action_in_reads_the_chains_step_slice_in_place():
    """x = chains[:, k] (B, H, D): rows contiguous within a sample, samples (K+1) H D apart; the
    output (B * H, W) in bf16, as F.linear in fp32 then the cast."""
    g = torch.Generator().manual_seed(1)
    chains = torch.randn(3, 5, 50, 32, generator=g).to(DEVICE)
    w, b = (torch.randn(256, 32, generator=g) / 32**0.5).to(DEVICE), torch.randn(256, generator=g).to(DEVICE)
    x = chains[:, 2]
    got = S.small_linear_triton(x, w, b, torch.bfloat16)
    want = S.small_linear_reference(x, w, b, torch.bfloat16)
    assert got.shape == (150, 256) and got.dtype == torch.bfloat16
    # within one bf16 step of the reference's (the CPU interpreter's bf16 cast truncates)
    assert bool(((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs() + 1e-30).all())
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double()).reshape(150, 256)
    assert rel(S.small_linear_triton(x, w, b, torch.float32), exact) < 1e-6  # fp32 products, no TF32


@pytest.mark.parametrize("rows", [10, 50, 77])
def test_action_out_from_bf16_rows_in_fp32(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=g).to(DEVICE, torch.bfloat16)
    w, b = (torch.randn(32, 1024, generator=g) / 32).to(DEVICE), torch.randn(32, generator=g).to(DEVICE)
    got = S.small_linear_triton(x, w, b, torch.float32)
    assert got.shape == (rows, 32) and got.dtype == torch.float32
    assert rel(got, S.small_linear_reference(x, w, b, torch.float32)) < 1e-6


def test_rejects_rows_that_are_not_contiguous():
    x = torch.randn(32, 64, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="small_linear needs rows of K contiguous values"):
        S.small_linear_triton(x, torch.randn(16, 32, device=DEVICE), torch.zeros(16, device=DEVICE), torch.float32)
