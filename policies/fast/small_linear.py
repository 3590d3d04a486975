"""fp32 projections with one small dimension in one Triton kernel: the denoise loop's action_in
(K = 32 action dims -> 1024) and action_out (1024 -> 32) projections, which pi0.5 keeps in fp32.

Why: cuBLAS runs x (50, 1024) @ W_out^T (1024 -> 32) at batch 1 as a split-K fp32 GEMM (a memset,
`sgemm_largek`, a scaling and an epilogue kernel: ~15 us per call on the H200,
profile_denoise_nvidia-h200_20261201-141825.json), and action_in's input is a strided step slice of
the chains (a copy first) with a bf16 cast after: ~8 kernels per denoise step around ~360 kernels
of real work. Here each projection is one kernel: rows in blocks, fp32 products (IEEE, as cuBLAS
without TF32), the bias added, the result written in the output's dtype, the input read in place.

`small_linear_reference` is the plain-PyTorch twin (the CPU path; the tests' reference through
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def small_linear_reference(x: Tensor, weight: Tensor, bias: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x (B, T, K) or (M, K) -> (x W^T + b) (M, N) in fp32, cast to out_dtype."""
    out = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    return out.reshape(-1, weight.shape[0]).to(out_dtype)


@functools.cache
def _kernel():
    """Compiled on first use, so CPU-only runs never import triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def small_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, rows_per_sample, x_sample_stride,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # x's rows are sample-major: rows_per_sample rows of K contiguous values per sample, the
        # samples x_sample_stride elements apart (the chains' step slice, read where it lies)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok = rows < M
        x_row = (rows // rows_per_sample).to(tl.int64) * x_sample_stride + (rows % rows_per_sample) * K
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + x_row[:, None] + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[None, :] * K + (k0 + ks)[:, None]).to(tl.float32)  # (BK, BN) of W^T
            acc = tl.dot(x, w, acc, input_precision="ieee")
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        dst = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return small_linear_kernel


def small_linear_triton(x: Tensor, weight: Tensor, bias: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The one-kernel `small_linear_reference`. x (B, T, K) with unit strides inside a sample (any
    sample stride) or (M, K) contiguous; weight (N, K) contiguous; N and K multiples of 16."""
    k = x.shape[-1]
    n = weight.shape[0]
    if x.dim() == 2:
        x = x.unsqueeze(0)
    samples, per_sample = x.shape[0], x.shape[1]
    if x.stride(2) != 1 or x.stride(1) != k or not weight.is_contiguous() or n % 16 or k % 16:
        raise ValueError(f"small_linear needs rows of K contiguous values, a contiguous weight and N, K multiples "
                         f"of 16; got x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    m = samples * per_sample
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_n = min(n, 128)
    block_k = min(k, 128)
    _kernel()[(-(-m // 16), n // block_n)](x, weight, bias, out, m, n, k, per_sample, x.stride(0),
                                           BM=16, BN=block_n, BK=block_k, num_warps=4)
    return out


def small_linear(x: Tensor, weight: Tensor, bias: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(x W^T + b) in fp32, as (M, N) in out_dtype: the Triton kernel on CUDA, PyTorch elsewhere."""
    if x.is_cuda and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return small_linear_triton(x, weight, bias, out_dtype)
    return small_linear_reference(x, weight, bias, out_dtype)
