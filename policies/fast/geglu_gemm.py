"""The prefix's GeGLU projection as one GEMM: act = gelu_tanh(x Wg^T) * (x Wu^T), no (M, 2F) round trip.

Why: at large batch the prefix's gate/up projection writes an (M, 2 x 16384) bf16 tensor that a
second kernel reads back to apply GeGLU: at LIBERO batch 64 (M ~ 36k rows) that is ~3.4 GB of HBM
traffic per layer, 14 ms of the call's 285 (profile_stages_nvidia-h200_20261201-204441.json). Here
each program owns a BM x BN block of the activation: it streams x (BM x K) once and the matching
BN rows of both the gate half and the up half of W = [gate; up] (2F, K), keeps the two fp32
accumulators, and writes gelu_tanh(gate) * up in bf16: the GEMM's output is F columns, not 2F, and
nothing is read back. Whether it beats cuBLAS + the separate kernel depends on how close a Triton
GEMM gets to cuBLAS on the shape; experiments/sweep_large_batch.py times both on the H200.

Rows are independent (no split-K), so a row's result depends only on that row and the tile:
batch-invariant, as the consistent recompute needs. Loads go through TMA tensor descriptors
(`tma=True`, Hopper; also under the CPU interpreter) or plain pointer blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from policies.fast.config import GEGLU_CHOICES, triton_interpreting

C = None  # policies.fast.triton_common once the kernel factory ran (triton is imported on first use only)
GELU_FORMS = ("exp2", "tanh_approx")


@dataclass(frozen=True)
class GegluTile:
    """BM x BN activation blocks, K walked BK at a time; `group_m` row blocks share a weight column
    block in launch order (L2 reuse); `persistent`: one program per SM walking the blocks, with
    `flatten` its block and K loops pipelined as one (the next block's loads overlap this block's
    epilogue); `wide`: the gate and up blocks as one 2*BN-wide operand (a 3-D TMA box over W viewed
    (2, F, K)), so each K step is one 64 x 2BN wgmma per warpgroup instead of two 64 x BN ones (A is
    read from shared memory once, not twice); GeGLU pairs column c with c + BN of the one accumulator,
    which the wgmma layout keeps in the same thread (no shuffle: checked in the compiled sm_90 code);
    `gelu`: the epilogue's gelu_tanh, "exp2" (triton_common.gelu_tanh: exp2 and a division) or
    "tanh_approx" (triton_common.gelu_tanh_approx: the GPU's tanh.approx, half the MUFU ops; CUDA only)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    tma: bool = True
    persistent: bool = False
    flatten: bool = False
    wide: bool = False
    gelu: str = "exp2"

    def __post_init__(self):
        if self.gelu not in GELU_FORMS:
            raise ValueError(f"GegluTile.gelu must be one of {GELU_FORMS}, got {self.gelu!r}")

    def fits(self, m: int, n: int, k: int) -> str | None:
        """Why this tile cannot run x (m, k) @ W (n, k)^T with GeGLU, or None when it can."""
        if n % 2:
            return f"the gate/up weight needs an even row count, got {n}"
        if (n // 2) % self.block_n:
            return f"F = {n // 2} is not a multiple of block_n = {self.block_n}"
        if k % self.block_k:
            return f"K = {k} is not a multiple of block_k = {self.block_k}"
        if min(self.block_m, self.block_n, self.block_k) < 16:
            return "tl.dot needs block sizes >= 16"
        return None


# "auto" fuses from this many prefix rows up. H200 sweeps, cuBLAS gate/up + GeGLU kernel against the
# tuned tile, per layer: with today's wide tile (sweep_large_batch_nvidia-h200_20261202-064525) 968
# rows (PhyAI b1) 0.196 against 0.187 ms, 560 rows (LIBERO b1) 0.119 against 0.121; with the earlier
# two-dot tile (..._20261201-220235 / -220255 / -220703) 968 rows 0.197 against 0.207, 30976 rows
# (PhyAI b32) 6.78-6.85 against 6.54, 35840 rows (LIBERO b64) 7.93-8.04 against 7.52-7.62. Between
# 968 and 30976 rows nothing was measured.
AUTO_MIN_ROWS = 968
# Wide (one 64 x 256 wgmma per K step) with group 16, timed in one run beside the earlier tuned tile
# (group 8, gate and up as two dots; sweep_large_batch_nvidia-h200_20261202-012308): 6.17 against
# 6.51 ms at PhyAI b32, 7.41 against 7.53 at LIBERO b64. The variants differ only in block order and
# in how the gate/up columns are grouped into wgmmas: the same products summed in the same K order,
# bit-identical activations (GPU test). Group 16 with two dots: 6.29-6.30 at PhyAI b32 on two cards,
# at LIBERO b64 7.38 on one and 7.95 on another. Loop flattening was slower at both shapes (ptxas 3.9
# here warns it serialises the wgmmas). The epilogue's gelu_tanh through tanh.approx, three rounds alternating
# with the exp2 form on one card (sweep_large_batch_nvidia-h200_20261202-074458, --geglu-tiles epilogue):
# 6.16 / 6.17 / 6.23 against 6.28 / 6.30 / 6.44 ms at PhyAI b32, 7.18 / 7.33 / 7.18 against 7.46 / 7.34 /
# 7.33 at LIBERO b64; both forms 3.45e-3 from cuBLAS + the GeGLU kernel.
TUNED = GegluTile(block_m=128, block_n=128, block_k=64, group_m=16, stages=3, warps=8, persistent=True, wide=True,
                  gelu="tanh_approx")


def choose_tile(mode: str, rows: int, n: int, k: int, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> GegluTile | None:
    """The fused kernel's tile for `rows` x K @ (n = 2F, K)^T, or None for cuBLAS + the GeGLU kernel.
    mode (policy.fast.geglu): "fused" wherever the tile fits, "auto" on CUDA from AUTO_MIN_ROWS rows,
    "cublas" never. On CUDA only 2-byte operands: TUNED's shared-memory stages are sized for them."""
    if mode not in GEGLU_CHOICES:
        raise ValueError(f"policy.fast.geglu must be one of {GEGLU_CHOICES}, got {mode!r}")
    if mode == "cublas" or (mode == "auto" and (device.type != "cuda" or rows < AUTO_MIN_ROWS)):
        return None
    if device.type == "cuda" and dtype.itemsize != 2:
        return None
    tile = TUNED if device.type == "cuda" else _fitting_small_tile(n, k)
    return tile if tile is not None and tile.fits(rows, n, k) is None else None


def tile_label(tile: GegluTile | None) -> str | None:
    """The tile's name in sweep rows and result JSONs (None: cuBLAS + the GeGLU kernel)."""
    if tile is None:
        return None
    return (f"m{tile.block_m}n{tile.block_n}k{tile.block_k}s{tile.stages}w{tile.warps}g{tile.group_m}"
            + "_ptr" * (not tile.tma) + "_persistent" * tile.persistent + "_flat" * tile.flatten + "_wide" * tile.wide
            + "_tanh" * (tile.gelu == "tanh_approx"))


def _fitting_small_tile(n: int, k: int) -> GegluTile | None:
    """CPU (the interpreter, tests): the largest 16..128 blocks that divide the shape."""
    block_n = next((b for b in (128, 64, 32, 16) if (n // 2) % b == 0), None)
    block_k = next((b for b in (64, 32, 16) if k % b == 0), None)
    if block_n is None or block_k is None:
        return None
    return GegluTile(block_m=32, block_n=block_n, block_k=block_k, stages=2, warps=4)


@functools.cache
def _kernel():
    """Compiled on first use, so CPU-only runs never import triton."""
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def geglu_gemm_kernel(x_desc, w_desc, out_desc, x_ptr, w_ptr, out_ptr, M, F, K,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          TMA: tl.constexpr, PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr,
                          FLATTEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                          TANH_APPROX: tl.constexpr):
        row_blocks = tl.cdiv(M, BM)
        col_blocks = F // BN
        blocks = row_blocks * col_blocks
        step = PROGRAMS if PERSISTENT else blocks
        for block in tl.range(tl.program_id(0), blocks, step, flatten=FLATTEN):
            # grouped order: GROUP_M row blocks walk the column blocks together (x and W reuse in L2)
            per_group = GROUP_M * col_blocks
            first_m = (block // per_group) * GROUP_M
            group_rows = tl.minimum(row_blocks - first_m, GROUP_M)
            pid_m = first_m + (block % per_group) % group_rows
            pid_n = (block % per_group) // group_rows
            off_m, off_n = pid_m * BM, pid_n * BN
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            ks = tl.arange(0, BK)
            if WIDE:  # one (BM, 2BN) accumulator: columns [0, BN) gate, [BN, 2BN) up
                acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
                pair = tl.arange(0, 2 * BN)
                pair_rows = (pair // BN) * F + off_n + pair % BN  # the pointer path's rows of W
            else:
                acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
                acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                if TMA:  # out-of-range rows of x come back as zeros
                    x = x_desc.load([off_m, k0])
                else:
                    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :],
                                mask=(rows < M)[:, None], other=0.0)
                if UPCAST:  # the CPU interpreter's bf16 tl.dot returns garbage (Triton 3.x): fp32 there
                    x = x.to(tl.float32)
                if WIDE:
                    if TMA:  # the (2, BN, BK) box [gate rows; up rows] is one (2BN, BK) tile in shared memory
                        w = w_desc.load([0, off_n, k0]).reshape(2 * BN, BK)
                    else:
                        w = tl.load(w_ptr + pair_rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :])
                    if UPCAST:
                        w = w.to(tl.float32)
                    acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
                else:
                    if TMA:
                        w_gate = w_desc.load([off_n, k0])
                        w_up = w_desc.load([F + off_n, k0])
                    else:
                        w_rows = w_ptr + cols[:, None].to(tl.int64) * K + (k0 + ks)[None, :]
                        w_gate = tl.load(w_rows)
                        w_up = tl.load(w_rows + F.to(tl.int64) * K)
                    if UPCAST:
                        w_gate, w_up = w_gate.to(tl.float32), w_up.to(tl.float32)
                    acc_gate = tl.dot(x, w_gate.T, acc_gate, input_precision=PRECISION)
                    acc_up = tl.dot(x, w_up.T, acc_up, input_precision=PRECISION)
            if WIDE:  # column c pairs with c + BN (the same thread's registers in the wgmma layout)
                acc_gate, acc_up = acc.reshape(BM, 2, BN).permute(0, 2, 1).split()
            gelu = C.gelu_tanh_approx(acc_gate) if TANH_APPROX else C.gelu_tanh(acc_gate)
            act = (gelu * acc_up).to(out_ptr.dtype.element_ty)
            if TMA:  # the store drops rows past M
                out_desc.store([off_m, off_n], act)
            else:
                tl.store(out_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], act, mask=(rows < M)[:, None])

    return geglu_gemm_kernel


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 operands as full fp32 products ("ieee"; the GPU's default for fp32
    dots is TF32); for 2-byte operands the setting has no effect and "tf32" is Triton's own default."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def geglu_linear(x: Tensor, weight: Tensor, tile: GegluTile, out: Tensor | None = None,
                 max_programs: int | None = None) -> Tensor:
    """x (M, K), weight (2F, K) = [gate; up], both contiguous bf16/fp32 -> gelu_tanh(x Wg^T) * (x Wu^T)
    (M, F) in x's dtype (fp32 accumulation, one rounding). `out` reuses a contiguous (M, F) buffer.
    A persistent tile runs min(blocks, SMs) programs, or `max_programs` (tests: the loop on CPU)."""
    m, k = x.shape
    n = weight.shape[0]
    problem = tile.fits(m, n, k)
    if problem is None and tile.gelu == "tanh_approx" and triton_interpreting():
        problem = "gelu 'tanh_approx' is inline PTX, which the Triton interpreter cannot run"
    if problem is None and (weight.shape[1] != k or x.dtype != weight.dtype):
        problem = f"x {tuple(x.shape)} {x.dtype} does not match the weight {tuple(weight.shape)} {weight.dtype}"
    if problem is not None:
        raise ValueError(f"GeGLU tile {tile} cannot run x {tuple(x.shape)} @ W {tuple(weight.shape)}^T: {problem}")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"geglu_linear needs a contiguous x and weight, "
                         f"got strides {x.stride()} and {weight.stride()}")
    f = n // 2
    if out is None:
        out = torch.empty(m, f, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, f) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"geglu_linear out must be a contiguous {(m, f)} {x.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    blocks = -(-m // tile.block_m) * (f // tile.block_n)
    programs = blocks
    if tile.persistent:
        limit = max_programs if max_programs is not None else _sm_count(x.device.index or 0) if x.is_cuda else blocks
        programs = max(1, min(blocks, limit))
    x_desc = w_desc = out_desc = None
    if tile.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k])
        w_desc = (TensorDescriptor.from_tensor(weight.view(2, f, k), [2, tile.block_n, tile.block_k]) if tile.wide
                  else TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]))
        out_desc = TensorDescriptor.from_tensor(out, [tile.block_m, tile.block_n])
    _kernel()[(programs,)](x_desc, w_desc, out_desc, x, weight, out, m, f, k,
                           BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
                           TMA=tile.tma, PERSISTENT=tile.persistent, PROGRAMS=programs, FLATTEN=tile.flatten,
                           UPCAST=triton_interpreting(), PRECISION=_dot_precision(x.dtype), WIDE=tile.wide,
                           TANH_APPROX=tile.gelu == "tanh_approx", num_warps=tile.warps, num_stages=tile.stages)
    return out


def candidates() -> list[GegluTile]:
    """The tiles experiments/sweep_large_batch.py times against cuBLAS + the GeGLU kernel on the H200
    (each program holds two BM x BN fp32 accumulators: 128 x 128 needs 8 warps). The first sweep
    (sweep_large_batch_nvidia-h200_20261201-220235.json) ran the first 15; the persistent 128 x 128 x 64
    3-stage tile won at PhyAI b32 and LIBERO b64, so the others vary its grouping and loop flattening."""
    tiles = []
    for bm, bn, bk, stages, warps in ((128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4),
                                      (128, 64, 64, 4, 8), (64, 128, 64, 4, 4), (128, 128, 128, 2, 8),
                                      (256, 64, 64, 3, 8)):
        for persistent in (False, True):
            tiles.append(GegluTile(bm, bn, bk, stages=stages, warps=warps, persistent=persistent))
    tiles.append(GegluTile(128, 128, 64, stages=3, warps=8, tma=False))
    for group_m, flatten, stages in ((4, False, 3), (16, False, 3), (8, True, 3), (4, True, 3), (16, True, 3),
                                     (8, True, 4), (1, True, 3)):
        tiles.append(GegluTile(128, 128, 64, group_m=group_m, stages=stages, warps=8, persistent=True, flatten=flatten))
    # one 2BN-wide operand (64 x 256 wgmmas): the tuned tile's neighbours
    for bk, stages, group_m, persistent in ((64, 3, 8, True), (64, 4, 8, True), (64, 3, 16, True), (64, 3, 8, False),
                                            (32, 6, 8, True)):
        tiles.append(GegluTile(128, 128, bk, group_m=group_m, stages=stages, warps=8, persistent=persistent, wide=True))
    return tiles + [tile for tile in epilogue_candidates() if tile not in tiles]


def epilogue_candidates() -> list[GegluTile]:
    """TUNED with each form of the epilogue's gelu_tanh (TUNED's own first)."""
    return [TUNED] + [replace(TUNED, gelu=form) for form in GELU_FORMS if form != TUNED.gelu]


def neighbour_candidates() -> list[GegluTile]:
    """TUNED and its one-field neighbours (stages, grouping, two dots), each timed after TUNED again: with
    a shorter epilogue the best pipeline depth and block order may move."""
    neighbours = [replace(TUNED, stages=4), replace(TUNED, group_m=8), replace(TUNED, wide=False)]
    return [tile for other in neighbours for tile in (TUNED, other)]
