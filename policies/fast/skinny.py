"""Skinny GEMMs for the denoise loop: few rows (M = batch x chunk, 10..128), weights streamed once.

Why: at batch 1 the expert's projections are y = x W^T with M = 50 rows and W up to 8192 x 1024;
each is bound by reading W from HBM once (the FLOPs are ~1% of the card). A GEMM library tiles the
output (M x N) into 128-wide tiles, so the 1024-column projections (`o`, `down`) run on ~8 CTAs of
132 SMs and read their weights at a fraction of the bandwidth. Here the reduction (K) is split
too: each program reads a BN x (K / splits) slab of W, so there are (N / BN) x splits programs in
flight, and writes fp32 partial sums (splits, M, N) that the next kernel, which reads the
projection anyway (kernels.add_rms_norm, kernels.rope_scatter_qkv), adds up in a fixed order:
no extra launch, no atomics, and every row's result depends only on that row (batch invariance:
the consistent recompute re-runs rows at the rollout's bucket shapes and gets the same bits).

`gelu_mul=True` is the GeGLU projection: each program reads the gate rows n and the up rows
F + n of W = [gate; up] (F = N / 2), keeps both accumulators, and writes gelu_tanh(gate) * up
in the activation dtype (one kernel for the projection and its activation; no split there,
since the activation needs whole sums).

`SkinnyTile` (block sizes, splits, warps, stages) per projection shape comes from `TUNED`, the
best of `experiments/profile_denoise.py --sweep` on the H200. Everything here is testable on CPU
through TRITON_INTERPRET=1 against `skinny_linear_reference`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from policies.fast.config import GEMM_CHOICES, triton_interpreting
from policies.fast.pdl import launch_kwargs

C = None  # policies.fast.triton_common once a kernel factory ran (triton is imported on first use only)
PREFETCH_SHARES = (0, 1, 2, 4, 8)  # SkinnyTile.prefetch: none, all, or the first 1/2, 1/4, 1/8 of the slab
# SkinnyTile.preload: the weight slab and the x slab are staged whole in shared memory, at most this many
# elements together (192 KB of bf16 of the H100/H200's 227 KB a block; 256 KB failed to launch on the H200)
PRELOAD_MAX_ELEMENTS = 98304


@dataclass(frozen=True)
class SkinnyTile:
    """block_n x block_k weight tiles, `splits` slices of K (1 for gelu_mul), block_m rows per program;
    with PDL each program first pulls 1/`prefetch` of its weight slab into L2 (0: none), while the
    predecessor still runs. `preload`: each program instead loads its whole weight slab into registers
    before the PDL wait, then its whole x slab and one dot over the K slice (block_k unused): after the
    wait only x's load and the MMAs remain."""

    block_n: int = 32
    block_k: int = 128
    splits: int = 1
    block_m: int = 64
    warps: int = 4
    stages: int = 4
    prefetch: int = 1
    preload: bool = False

    def __post_init__(self):
        if self.prefetch not in PREFETCH_SHARES:
            raise ValueError(f"SkinnyTile.prefetch must be one of {PREFETCH_SHARES}, got {self.prefetch!r}")

    def fits(self, m: int, n: int, k: int, gelu_mul: bool = False) -> str | None:
        """Why this tile cannot run an (m, n, k) projection, or None when it can."""
        cols = n // 2 if gelu_mul else n
        if gelu_mul and (n % 2 or self.splits != 1):
            return f"gelu_mul needs an even N ({n}) and splits=1 (got {self.splits})"
        if k % (self.splits * self.block_k):
            return f"K={k} is not a multiple of splits x block_k = {self.splits} x {self.block_k}"
        if cols % self.block_n:
            return f"N={cols} is not a multiple of block_n={self.block_n}"
        if min(self.block_n, self.block_k, self.block_m) < 16:
            return "tl.dot needs block sizes >= 16"
        if self.preload:
            return self._preload_problem(k // self.splits, gelu_mul)
        return None

    def _preload_problem(self, k_split: int, gelu_mul: bool) -> str | None:
        """Why `preload` cannot hold this slab: one tl.arange over the K slice (a power of two), and at most
        PRELOAD_MAX_ELEMENTS for the weight slab (gate and up with gelu_mul) and the x slab together."""
        if k_split & (k_split - 1):
            return f"preload needs a power-of-two K slice, got {k_split}"
        slab = self.block_n * k_split * (2 if gelu_mul else 1)
        if slab + self.block_m * k_split > PRELOAD_MAX_ELEMENTS:
            return (f"preload holds at most {PRELOAD_MAX_ELEMENTS} elements of weight and x slabs, got weights "
                    f"{slab} and x {self.block_m * k_split}")
        return None


def skinny_linear_reference(x: Tensor, weight: Tensor, splits: int = 1, gelu_mul: bool = False) -> Tensor:
    """What the kernel computes, in plain PyTorch fp32: x (M, K), weight (N, K) ->
    partials (splits, M, N) fp32, or with gelu_mul gelu_tanh(x Wg^T) * (x Wu^T) (M, N/2) in x's dtype."""
    xf, wf = x.float(), weight.float()
    if gelu_mul:
        gate, up = (xf @ wf.t()).chunk(2, dim=-1)
        return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
    k = x.shape[1] // splits
    return torch.stack([xf[:, s * k:(s + 1) * k] @ wf[:, s * k:(s + 1) * k].t() for s in range(splits)])


@functools.cache
def _kernel():
    """Compiled on first use, so CPU-only runs never import triton."""
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, out_ptr, M, N_OUT, stride_xm, stride_wn, pair_offset,
                      K_SPLIT: tl.constexpr, GELU_MUL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                      PREFETCH_LINES: tl.constexpr, PRELOAD: tl.constexpr):
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < M
        k0 = split * K_SPLIT
        C.pdl_trigger_early(PDL)
        if PRELOAD:  # the whole slab into registers while the predecessor runs (it needs nothing from it)
            w, w_up = C.load_slab(w_ptr, cols, k0, stride_wn, pair_offset, K_SPLIT, GELU_MUL)
        elif PDL and PREFETCH_LINES > 0:  # the weights need nothing from the predecessor: into L2 first
            C.prefetch_slab(w_ptr, cols, k0, stride_wn, pair_offset, PREFETCH_LINES, GELU_MUL)
        C.pdl_wait(PDL)  # the predecessor is done: its activations are visible
        if PRELOAD:
            acc = C.skinny_preloaded(x_ptr, w, w_up, rows, row_ok, k0, stride_xm, K_SPLIT, GELU_MUL, UPCAST, IEEE)
        else:
            acc = C.skinny_accumulate(x_ptr, w_ptr, rows, row_ok, cols, k0, stride_xm, stride_wn, pair_offset,
                                      K_SPLIT, GELU_MUL, BM, BN, BK, UPCAST, IEEE)
        dst = out_ptr + split * M * N_OUT + rows[:, None] * N_OUT + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return skinny_kernel


def prefetch_lines(k: int, share: int, weight: Tensor) -> int:
    """128-byte lines per weight row a program prefetches over k columns with SkinnyTile.prefetch = share:
    a power of two of bf16 lines; 0 (none) for share 0, other dtypes, or k that does not split so."""
    lines = k // 64 // share if share else 0
    if weight.element_size() != 2 or lines & (lines - 1) or k % 64:
        return 0
    return lines


def skinny_linear(x: Tensor, weight: Tensor, tile: SkinnyTile, gelu_mul: bool = False,
                  out: Tensor | None = None, pdl: int = 0) -> Tensor:
    """x (M, K) (unit column stride), weight (N, K) contiguous -> partials (splits, M, N) fp32, or
    (gelu_mul) the GeGLU activation (M, N/2) in x's dtype. `out` reuses a buffer of that shape.
    pdl: pdl.py's mode code (bf16 weights only: the L2 prefetch counts 64-element lines)."""
    m, k = x.shape
    n = weight.shape[0]
    problem = tile.fits(m, n, k, gelu_mul)
    if problem is not None:
        raise ValueError(f"skinny tile {tile} cannot run x {tuple(x.shape)} @ W {tuple(weight.shape)}^T: {problem}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"skinny_linear needs x with unit column stride and a contiguous weight, "
                         f"got strides {x.stride()} and {weight.stride()}")
    cols = n // 2 if gelu_mul else n
    shape = (m, cols) if gelu_mul else (tile.splits, m, n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype if gelu_mul else torch.float32, device=x.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"skinny_linear out must be a contiguous {shape}, got {tuple(out.shape)}")
    k_split = k // tile.splits
    if pdl and not prefetch_lines(k_split, 1, weight):
        pdl = 0  # the prefetch walks a power-of-two count of 128-byte lines of bf16 rows
    grid = (cols // tile.block_n, tile.splits, -(-m // tile.block_m))
    _kernel()[grid](x, weight, out, m, cols, x.stride(0), weight.stride(0), cols, K_SPLIT=k_split,
                    GELU_MUL=gelu_mul, BM=tile.block_m, BN=tile.block_n, BK=tile.block_k,
                    UPCAST=triton_interpreting(), IEEE=x.dtype == torch.float32, PDL=pdl,
                    PREFETCH_LINES=prefetch_lines(k_split, tile.prefetch, weight), PRELOAD=tile.preload,
                    num_warps=tile.warps, num_stages=tile.stages, **launch_kwargs(pdl))
    return out


# ----------------------------------------------------------------------------- choosing tiles

# "auto" uses the skinny kernels up to this many rows (batch x chunk); above it cuBLAS's tiles fill
# the card: the sweep measured a tie at 160 rows and cuBLAS 1.3-2x faster at 320.
AUTO_MAX_ROWS = 128
# pi0.5 expert's projections: the fastest tiles of profile_denoise.py's sweep on the H200 at 50
# rows (benchmarks/results/profile_denoise_nvidia-h200_20261201-140223.json), also fastest or
# within 0.3 us at 10 and 20 rows; 1.2-3.2 TB/s against cuBLAS's 0.5-2.0 there.
TUNED: dict[tuple[int, int, bool], SkinnyTile] = {
    (2560, 1024, False): SkinnyTile(block_n=64, block_k=64, splits=4),  # qkv
    (1024, 2048, False): SkinnyTile(block_n=64, block_k=64, splits=8),  # o
    (8192, 1024, True): SkinnyTile(block_n=32, block_k=64, splits=1),  # gate_up + GeGLU
    (1024, 4096, False): SkinnyTile(block_n=64, block_k=64, splits=8),  # down
}
# Row ranges where another tile won inside the whole denoise graph (profile_denoise's tile sets, where
# the weights stream from HBM, not from L2 as between the sweep's repeats): (first row, last row, tile),
# before TUNED. H200, PhyAI b1 (50 rows) / b2 (100) and LIBERO b1 (10) / b2 (20), denoise stage in ms,
# TUNED's tile against these (profile_denoise_nvidia-h200_20261202-062929.json and ..._062950.json):
# gate_up 16 x 128 at 50 rows 6.89 / 6.93 against 7.10 / 7.12 (at 10 rows 2.51 against 2.31, at 100
# rows 9.90 against 9.18); 32 x 128 at 20 rows 2.78 / 2.80 against 2.85 / 2.85 (at 50 rows 7.00). At 50
# rows without the PDL prefetch of its 16.8 MB of weights (which slowed the norm kernel before it):
# 6.62 / 6.63 against 6.89 / 6.90 with it, half of it 6.62 / 6.64 (profile_denoise_nvidia-h200_
# 20261202-081216.json and ..._081230.json). o with 4 K splits instead of 8 at 50 rows (tile set o_s4,
# timed with that gate_up tile): 6.474 / 6.450 / 6.445 against 6.626-6.662 for TUNED's in five
# placements over two calls; at 10, 20 and 100 rows within +0.03 / -0.05 ms of TUNED's
# (profile_denoise_nvidia-h200_20261202-094209.json and ..._094247.json). Then qkv with 2 K splits
# instead of 4 at 50 rows (tile set qkv_s2, with that o tile): 6.355 / 6.351 / 6.338 against 6.458-6.470;
# at 10, 20 and 100 rows -0.02 / +0.02 / -0.03 ms (..._094827.json and ..._094903.json). The two together
# at 100 rows (PhyAI b2, tile set qkv_s2_o_s4, 5 rounds round-robin): 9.117 median (9.074-9.119) against
# 9.216 (9.179-9.227) for TUNED's, faster in every round; at 10 and 20 rows +0.01 / +0.02 ms
# (profile_denoise_nvidia-h200_20261202-104824.json), so their range runs to 128 rows (AUTO_MAX_ROWS;
# 65-99 and 101-128 rows not timed).
# Round 17, SkinnyTile.preload (benchmarks/results/profile_denoise_nvidia-h200_20261202-195219.json, 3 rounds,
# and ..._200212.json / ..._200259.json, 5 rounds round-robin; a call between them, whose LIBERO b1 / b2 rows
# were printed but not written, gave the second qkv pair below), denoise stage in ms, preloaded against not:
# - down, split MLP: 10 rows (LIBERO b1) 2.175 / 2.304, 20 rows 2.563 / 2.728 (chains bit-identical), 40 rows
#   2.444 against 2.494 fused, 50 rows (PhyAI b1) 6.155 against 6.294 fused (fused_mlp.choose's "auto" splits
#   a preloaded down); at 80 rows 3.443 / 3.261 and 100 rows 8.964 / 8.899 it lost; inside the fused MLP at
#   50 rows 6.90 / 6.27 (128 KB of shared memory leave one program per SM);
# - o: 100 rows (PhyAI b2) 8.426 / 8.899 and 8.41 / 8.97 (two calls); 80 rows (LIBERO b8) 3.393 / 3.261; at
#   50 rows 6.33 / 6.27 and at 10 / 20 rows 2.61 / 2.94 against 2.44 / 2.87;
# - qkv with TUNED's 4 K splits: 10 rows 2.162 / 2.175 and 2.176 / 2.181, 20 rows 2.520 / 2.563 and
#   2.530 / 2.561 (bit-identical chains); with 2 splits at 50 rows 6.38 / 6.27.
# Round 19, qkv's PDL weight prefetch at 33-128 rows (profile_denoise_nvidia-h200_20261203-091446.json and
# ..._091516.json, 5 rounds round-robin), denoise stage in ms, the whole slab / a quarter / half / none: 100
# rows (PhyAI b2) 8.416 / 8.358 / 8.391 / 8.423, 80 rows (LIBERO b8) 3.282 / 3.249 / 3.269 / 3.256, the
# quarter faster in each round at both; 50 rows (PhyAI b1) 6.163 / 6.210 / 6.237 / 6.276 and 40 rows 2.457 /
# 2.473 / 2.477 / 2.508, where the whole slab stays (65-79 and 81-99 rows not timed).
# Round 20, down's PDL weight prefetch at 65-128 rows (profile_denoise_nvidia-h200_20261203-173132.json and
# ..._173153.json, 5 rounds round-robin), TUNED's whole slab against a quarter (tile set down_pf4): 100 rows
# 8.384 (8.377-8.397) against 8.205 (8.163-8.211), 80 rows 3.252 (3.236-3.263) against 3.182 (3.173-3.195),
# the quarter faster in each round, chains bit-identical. gate_up's quarter alone (gu_pf4) in the same calls:
# 8.338 and 3.243, within the rounds' spread at 80 rows; on top of down's (tile set mlp_pf4, a later call,
# ..._173546.json / ..._173603.json): 8.023 (8.003-8.055) against 8.189 (8.161-8.207) for down's quarter alone
# (now the default), 3.103 (3.087-3.104) against 3.176 (3.167-3.199), faster in each round: both taken. An
# eighth of down's slab (down_pf8): 8.243 / 3.192.
TUNED_BY_ROWS: dict[tuple[int, int, bool], tuple[tuple[int, int, SkinnyTile], ...]] = {
    (8192, 1024, True): ((17, 32, SkinnyTile(block_n=32, block_k=128, splits=1)),
                         (33, 64, SkinnyTile(block_n=16, block_k=128, splits=1, prefetch=0)),
                         (65, 128, SkinnyTile(block_n=32, block_k=64, splits=1, prefetch=4))),
    (1024, 2048, False): ((33, 80, SkinnyTile(block_n=64, block_k=64, splits=4)),
                          (81, 128, SkinnyTile(block_n=64, block_k=64, splits=4, preload=True))),
    (2560, 1024, False): ((1, 32, SkinnyTile(block_n=64, block_k=64, splits=4, preload=True)),
                          (33, 64, SkinnyTile(block_n=64, block_k=64, splits=2)),
                          (65, 128, SkinnyTile(block_n=64, block_k=64, splits=2, prefetch=4))),
    (1024, 4096, False): ((1, 64, SkinnyTile(block_n=64, block_k=64, splits=8, preload=True)),
                          (65, 128, SkinnyTile(block_n=64, block_k=64, splits=8, prefetch=4))),
}


def tuned_tile(m: int, n: int, k: int, gelu_mul: bool) -> SkinnyTile | None:
    """The tuned tile of an (m, n, k) projection: TUNED_BY_ROWS's where m lies in one of its ranges, else
    TUNED's (None for a shape neither holds)."""
    for first, last, tile in TUNED_BY_ROWS.get((n, k, gelu_mul), ()):
        if first <= m <= last:
            return tile
    return TUNED.get((n, k, gelu_mul))


def rows_block(m: int) -> int:
    """block_m for m rows: the smallest of 16 / 32 / 64 that holds them (more rows: several blocks)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_tile(m: int, n: int, k: int, gelu_mul: bool) -> SkinnyTile:
    """A tile that fits any projection whose dims are multiples of 16: 32-column slabs (16 when
    N is not a multiple of 32) and K split until there are ~128 programs for 132 SMs."""
    cols = n // 2 if gelu_mul else n
    block_m = rows_block(m)
    block_n = 32 if cols % 32 == 0 else 16
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    splits = 1
    while (not gelu_mul and (cols // block_n) * splits < 128 and splits < 16
           and k % (2 * splits * block_k) == 0):
        splits *= 2
    return SkinnyTile(block_n=block_n, block_k=block_k, splits=splits, block_m=block_m)


def choose_tile(mode: str, m: int, n: int, k: int, gelu_mul: bool, device: torch.device) -> SkinnyTile | None:
    """The skinny tile for an (m, n, k) projection, or None for cuBLAS (F.linear).
    mode "auto": skinny on CUDA up to AUTO_MAX_ROWS rows; "skinny": always (where a tile fits);
    "cublas": never."""
    if mode not in GEMM_CHOICES:
        raise ValueError(f"policy.fast.gemm must be one of {GEMM_CHOICES}, got {mode!r}")
    if mode == "cublas" or (mode == "auto" and (device.type != "cuda" or m > AUTO_MAX_ROWS)):
        return None
    if n % 16 or k % 16:
        return None
    tuned = tuned_tile(m, n, k, gelu_mul)
    tile = tuned if tuned is not None else default_tile(m, n, k, gelu_mul)
    tile = replace(tile, block_m=rows_block(m))
    return tile if tile.fits(m, n, k, gelu_mul) is None else None


def expert_tiles(mode: str, rows: int, layer: dict, device: torch.device) -> dict[str, SkinnyTile | None]:
    """Per expert projection ("qkv", "o", "gate_up", "down"; `layer` maps them to LinearW) the
    skinny tile at `rows` rows, or None where cuBLAS runs it (also where it has a bias)."""
    tiles = {}
    for name, lw in layer.items():
        n, k = lw.weight.shape
        tiles[name] = None if lw.bias is not None else choose_tile(mode, rows, n, k, name == "gate_up", device)
    return tiles


def candidates(m: int, n: int, k: int, gelu_mul: bool) -> list[SkinnyTile]:
    """The tiles profile_denoise.py sweeps for an (m, n, k) projection: every block_n / block_k /
    splits combination that fits and puts 96..512 programs on the card's 132 SMs."""
    cols = n // 2 if gelu_mul else n
    block_m = rows_block(m)
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (64, 128, 256):
            for splits in ((1,) if gelu_mul else (1, 2, 4, 8, 16)):
                programs = (cols // block_n) * splits * -(-m // block_m)
                tile = SkinnyTile(block_n, block_k, splits, block_m, warps=8 if block_n == 128 else 4)
                if tile.fits(m, n, k, gelu_mul) is None and (64 if gelu_mul else 96) <= programs <= 512:
                    out.append(tile)
    if not out:  # tiny shapes (CPU smoke): whatever fits
        out.append(default_tile(m, n, k, gelu_mul))
    return out
