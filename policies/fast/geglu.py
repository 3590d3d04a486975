"""GeGLU projection in one GEMM: gelu_tanh(x Wg^T) * (x Wu^T) with W = [Wg; Wu] (Gemma's gate_up).

Why: at large batch the prefix's MLP is cuBLAS's gate_up GEMM writing (M, 2F) in bf16, then a
kernel reading it back to write gelu_tanh(gate) * up (M, F): on the H200 at PhyAI batch 32
(M = 30976, F = 16384) that pass moves 3 GB per layer, 0.73 ms at the copy bandwidth, 12.5 ms of the
prefix's 199 (profile_stages_nvidia-h200_20261201-161504.json). Here each program computes a
BM x BN tile of the gate and the matching tile of up from the same x tile (two accumulators, the
weights read in place: no interleaved copy of the 134 MB per-layer weight), applies GeGLU to the
fp32 sums and writes only the (M, F) activation. Whether it beats cuBLAS + the pass depends on
how close this Triton GEMM gets to cuBLAS: `experiments/profile_stages.py --geglu-sweep` measures
it; `GEGLU_TILE` is its best tile and `policy.fast.geglu_gemm` picks the path.

Numerics: GeGLU on the fp32 accumulators (the cuBLAS path rounds gate and up to bf16 first).
Tested on CPU through TRITON_INTERPRET=1 against `geglu_linear_reference` (fp32).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from policies.fast.config import GEGLU_CHOICES

C = None  # policies.fast.triton_common once the kernel factory ran (triton is imported on first use only)


@dataclass(frozen=True)
class GegluTile:
    """block_m x block_n output tiles (block_n gate and block_n up columns), block_k per step;
    group_m row tiles share a column band (L2 reuse of the weight tiles)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    warps: int = 8
    stages: int = 3
    tma: bool = False  # tiles through TMA tensor descriptors (Hopper's bulk copy engine), not pointer loads

    def fits(self, m: int, n: int, k: int) -> str | None:
        """Why this tile cannot run an (m, n = 2F, k) GeGLU projection, or None when it can."""
        if n % 2 or (n // 2) % self.block_n:
            return f"N={n} must be even with N/2 a multiple of block_n={self.block_n}"
        if k % self.block_k:
            return f"K={k} is not a multiple of block_k={self.block_k}"
        if min(self.block_m, self.block_n, self.block_k) < 16:
            return "tl.dot needs block sizes >= 16"
        return None


# The tile the fast path uses (profile_stages --geglu-sweep on the H200).
GEGLU_TILE = GegluTile()
# "auto" runs the one-GEMM GeGLU from this many rows (batch x prefix tokens) on.
AUTO_MIN_ROWS = 1 << 62  # not measured faster yet: cuBLAS everywhere


def choose_tile(mode: str, rows: int, n: int, k: int, device: torch.device) -> GegluTile | None:
    """The tile for the prefix's GeGLU at `rows` rows, (n = 2F, k) weights, or None for cuBLAS + the
    GeGLU kernel. mode: policy.fast.geglu_gemm."""
    if mode not in GEGLU_CHOICES:
        raise ValueError(f"policy.fast.geglu_gemm must be one of {GEGLU_CHOICES}, got {mode!r}")
    if mode == "cublas" or (mode == "auto" and (device.type != "cuda" or rows < AUTO_MIN_ROWS)):
        return None
    return GEGLU_TILE if GEGLU_TILE.fits(rows, n, k) is None else None


def geglu_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """What the kernel computes, in fp32: x (M, K), weight (2F, K) -> (M, F) in x's dtype."""
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)


@functools.cache
def _kernel():
    """Compiled on first use, so CPU-only runs never import triton."""
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def geglu_gemm_kernel(x_ptr, w_ptr, out_ptr, M, F, K, stride_xm, stride_wn, stride_om,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          UPCAST: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = F // BN
        per_group = GROUP_M * tiles_n  # GROUP_M row tiles walk the column bands together
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok = rows < M
        x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        gate_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # (BK, BN) of Wg^T
        up_offset = F.to(tl.int64) * stride_wn
        acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            x = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
            w_gate = tl.load(gate_tile)
            w_up = tl.load(gate_tile + up_offset)
            if UPCAST:  # the CPU interpreter's bf16 tl.dot returns garbage (Triton 3.x); fp32 there
                x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            if IEEE:  # fp32 operands: full fp32 products, as cuBLAS without TF32
                acc_gate = tl.dot(x, w_gate, acc_gate, input_precision="ieee")
                acc_up = tl.dot(x, w_up, acc_up, input_precision="ieee")
            else:
                acc_gate = tl.dot(x, w_gate, acc_gate)
                acc_up = tl.dot(x, w_up, acc_up)
            x_tile += BK
            gate_tile += BK
        out = C.gelu_tanh(acc_gate) * acc_up
        dst = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def geglu_gemm_tma_kernel(x_desc, w_desc, out_desc, M, F, K,
                              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                              UPCAST: tl.constexpr):
        # geglu_gemm_kernel with its tiles moved by TMA: x (BM, BK), gate rows and up rows (BN, BK)
        # of W, the output (BM, BN); rows past M are zero-filled on load and clipped on store.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = F // BN
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        row0 = (first_m + (pid % per_group) % group_rows) * BM
        col0 = ((pid % per_group) // group_rows) * BN
        acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x, w_gate, w_up = x_desc.load([row0, k]), w_desc.load([col0, k]), w_desc.load([F + col0, k])
            if UPCAST:  # as geglu_gemm_kernel: the CPU interpreter's bf16 tl.dot is wrong
                x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            acc_gate = tl.dot(x, w_gate.T, acc_gate)
            acc_up = tl.dot(x, w_up.T, acc_up)
        out = C.gelu_tanh(acc_gate) * acc_up
        out_desc.store([row0, col0], out.to(out_desc.dtype))

    return geglu_gemm_kernel, geglu_gemm_tma_kernel


def geglu_linear(x: Tensor, weight: Tensor, tile: GegluTile = GEGLU_TILE, out: Tensor | None = None) -> Tensor:
    """x (M, K) (unit column stride), weight (2F, K) contiguous -> gelu_tanh(x Wg^T) * (x Wu^T), (M, F)
    in x's dtype. `out` reuses a contiguous (M, F) buffer."""
    m, k = x.shape
    n = weight.shape[0]
    problem = tile.fits(m, n, k)
    if problem is None and weight.shape[1] != k:
        problem = f"x has K={k} columns, the weight {weight.shape[1]}"
    if problem is not None:
        raise ValueError(f"GeGLU tile {tile} cannot run x {tuple(x.shape)} @ W {tuple(weight.shape)}^T: {problem}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"geglu_linear needs x with unit column stride and a contiguous weight, "
                         f"got strides {x.stride()} and {weight.stride()}")
    f = n // 2
    if out is None:
        out = torch.empty(m, f, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, f) or not out.is_contiguous():
        raise ValueError(f"geglu_linear out must be a contiguous {(m, f)}, got {tuple(out.shape)}")
    grid = (-(-m // tile.block_m) * (f // tile.block_n),)
    pointers, tma = _kernel()
    if tile.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
        tma[grid](TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
                  TensorDescriptor.from_tensor(out, [bm, bn]), m, f, k, BM=bm, BN=bn, BK=bk, GROUP_M=tile.group_m,
                  UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=tile.warps, num_stages=tile.stages)
        return out
    pointers[grid](x, weight, out, m, f, k, x.stride(0), weight.stride(0), out.stride(0),
                   BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
                   UPCAST=os.environ.get("TRITON_INTERPRET") == "1", IEEE=x.dtype == torch.float32,
                   num_warps=tile.warps, num_stages=tile.stages)
    return out


def candidates() -> list[GegluTile]:
    """The tiles profile_stages.py --geglu-sweep times (shared memory per stage: (BM + 2 BN) x BK x 2 B)."""
    tiles = [GegluTile(128, 128, 64, 8, 8, 3)]  # the best pointer-load tile of the first sweep (..._180100)
    for block_m, block_n, warps in ((128, 128, 8), (128, 64, 4), (128, 64, 8), (256, 64, 8)):
        for block_k, stages in ((64, 3), (64, 4)):
            tiles.append(GegluTile(block_m, block_n, block_k, 8, warps, stages, tma=True))
    return tiles
