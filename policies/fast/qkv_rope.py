"""The expert's qkv projection with RoPE and the cache scatter in its epilogue: one kernel where the
denoise loop ran two (skinny.py's split-K qkv, then kernels.rope_scatter_qkv summing its partials).

Why: round 19's megakernel probe put the floor of a dependent stage at ~1 us of synchronisation plus the
L2 round trips of its inputs, and the per-kernel loop already runs each stage near that floor; what is
left is fewer dependent stages per layer-step. RoPE needs a head's columns d and d + HD/2 together, so
each program here owns BN columns of one head's first half and the BN paired columns HD/2 further (two
accumulators over the whole K: no split, since RoPE needs whole sums), then rotates q and k in fp32 and
stores q, and k / v into their cache rows, as rope_scatter_qkv does.

A SkinnyTile with `rope=True` selects it (skinny.TUNED_BY_ROWS, or profile_denoise's tile sets);
`preload` loads both weight slabs before the PDL wait, as for the other projections. Testable on CPU
through TRITON_INTERPRET=1 against `qkv_rope_reference`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from policies.fast import kernels as K
from policies.fast import skinny
from policies.fast.config import triton_interpreting
from policies.fast.pdl import launch_kwargs

C = None  # policies.fast.triton_common once the kernel factory ran (a module global, which the interpreter sees)


def qkv_rope_reference(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
                       q_out: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """What the kernel computes, in plain PyTorch: the projection in fp32, then rope_scatter_qkv's work."""
    b, t = cos.shape[:2]
    qkv = (x.float() @ weight.float().t()).view(b, t, -1)
    K.rope_scatter_qkv_reference(qkv, cos, sin, num_heads, num_kv_heads, q_out, k_cache, v_cache, slots)


@functools.cache
def _kernel():
    """Compiled on first use, so CPU-only runs never import triton."""
    global C
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def qkv_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, M, tokens_per_sample,
                        cache_rows, stride_xm, stride_wn, K_DIM: tl.constexpr, H: tl.constexpr, KV: tl.constexpr,
                        HD: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                        PRELOAD: tl.constexpr):
        per_head: tl.constexpr = HALF // BN
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        head = pid_n // per_head
        d = (pid_n % per_head) * BN + tl.arange(0, BN)
        cols = head * HD + d  # first-half columns; their RoPE partners are HALF weight rows further
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < M
        C.pdl_trigger_early(PDL)
        if PRELOAD:  # both slabs into registers while the predecessor runs
            w1, w2 = C.load_slab(w_ptr, cols, 0, stride_wn, HALF, K_DIM, True)
        elif PDL and PREFETCH_LINES > 0:
            C.prefetch_slab(w_ptr, cols, 0, stride_wn, HALF, PREFETCH_LINES, True)
        C.pdl_wait(PDL)  # the norm before is done: x is visible, and the caches may be written
        if PRELOAD:
            x1, x2 = C.skinny_preloaded_pair(x_ptr, w1, w2, rows, row_ok, 0, stride_xm, K_DIM, True, UPCAST, IEEE)
        else:
            x1, x2 = C.skinny_accumulate_pair(x_ptr, w_ptr, rows, row_ok, cols, 0, stride_xm, stride_wn, HALF, K_DIM,
                                              True, BM, BN, BK, UPCAST, IEEE)
        token = rows[:, None]
        ok = row_ok[:, None]
        half_cols = d[None, :]
        cache_row, c1, c2, s1, s2 = C.rope_tables(cos_ptr, sin_ptr, slot_ptr, token, ok, half_cols, tokens_per_sample,
                                                  cache_rows, HD, HALF)
        C.rope_store(x1, x2, token, ok, half_cols, head, cache_row, c1, c2, s1, s2, q_ptr, k_ptr, v_ptr, H, KV, HD,
                     HALF)

    return qkv_rope_kernel


def problem(tile: skinny.SkinnyTile, m: int, n: int, k: int, head_dim: int) -> str | None:
    """Why `tile` cannot run an (m, n, k) qkv projection with RoPE at this head_dim, or None."""
    if not tile.rope:
        return "the tile is not a rope tile (SkinnyTile.rope)"
    if (head_dim // 2) % tile.block_n:
        return f"block_n={tile.block_n} must divide half the head dim ({head_dim // 2})"
    if n % head_dim:
        return f"N={n} is not a whole number of heads of {head_dim}"
    return tile.fits(m, n, k)


def qkv_rope(x: Tensor, weight: Tensor, tile: skinny.SkinnyTile, cos: Tensor, sin: Tensor, num_heads: int,
             num_kv_heads: int, q_out: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, pdl: int = 0) -> None:
    """x (B * T, D) @ Wqkv^T with RoPE: q_out (B, T, H, hd) and the caches (B, S, KV, hd) at `slots` (B, T),
    as rope_scatter_qkv after the projection. pdl: pdl.py's mode code."""
    m, k = x.shape
    n = weight.shape[0]
    b, t, hd = cos.shape
    why = problem(tile, m, n, k, hd)
    if why is not None:
        raise ValueError(f"qkv_rope tile {tile} cannot run x {tuple(x.shape)} @ W {tuple(weight.shape)}^T: {why}")
    if m != b * t or n != (num_heads + 2 * num_kv_heads) * hd:
        raise ValueError(f"qkv_rope: x {tuple(x.shape)}, W {tuple(weight.shape)} and cos {tuple(cos.shape)} disagree "
                         f"with {num_heads} q heads and {num_kv_heads} kv heads")
    if x.stride(1) != 1 or not weight.is_contiguous() or not q_out.is_contiguous():
        raise ValueError("qkv_rope needs x with unit column stride and a contiguous weight and q_out")
    if pdl and not skinny.prefetch_lines(k, 1, weight):
        pdl = 0
    grid = (n // 2 // tile.block_n, -(-m // tile.block_m))
    _kernel()[grid](x, weight, cos, sin, q_out, k_cache, v_cache, slots, m, t, k_cache.shape[1], x.stride(0),
                    weight.stride(0), K_DIM=k, H=num_heads, KV=num_kv_heads, HD=hd, HALF=hd // 2, BM=tile.block_m,
                    BN=tile.block_n, BK=tile.block_k, UPCAST=triton_interpreting(), IEEE=x.dtype == torch.float32,
                    PDL=pdl, PREFETCH_LINES=skinny.prefetch_lines(k, tile.prefetch, weight), PRELOAD=tile.preload,
                    num_warps=tile.warps, num_stages=tile.stages, **launch_kwargs(pdl))
