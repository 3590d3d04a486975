"""Triton device functions shared by the fast path's kernels (kernels.py, skinny.py, fused_mlp.py, fp8.py,
triton_attention.py, geglu_gemm.py, action_io.py). Imported only inside their kernel factories, so
CPU-only runs never import triton; under TRITON_INTERPRET=1 they run in the interpreter like the
kernels that call them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_trigger_early(PDL: tl.constexpr):
    """pdl.py's mode 2 ("early"): let the dependent kernel launch right at this kernel's start."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the predecessor has completed and its writes are visible (call before the first
    activation read or any write); mode 1 ("on") then lets the dependent kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel with nothing to do before its wait: trigger (mode 2), wait, trigger (mode 1)."""
    pdl_trigger_early(PDL)
    pdl_wait(PDL)


@triton.jit
def gelu_tanh(x):
    """gelu_tanh(x) in fp32 as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function
    as 0.5 x (1 + tanh(u)) in one exp2 and one division (no 1 + (tanh - 1) cancellation for
    negative x). The exponent is capped at 126 so 1 + e^-2u stays finite; the result there is ~0."""
    neg_two_u_log2e = x * (-2.3022081981 - 0.1029432396 * x * x)  # -2u * log2(e), constants folded
    return x / (1.0 + tl.exp2(tl.minimum(neg_two_u_log2e, 126.0)))


@triton.jit
def gelu_tanh_approx(x):
    """gelu_tanh(x) = x/2 + x/2 tanh(u) through the GPU's tanh.approx.f32: one MUFU op and ~7 sm_90
    instructions per element, against gelu_tanh's two MUFU ops (exp2, reciprocal) and ~12 (compiled
    here). For the GeGLU GEMM's epilogue, which runs while no wgmma is in flight. tanh.approx's error
    (~2^-11) is below a bf16 output's rounding; for x << 0 the sum cancels, so the absolute error there
    is ~|x| 2^-12 on a result near 0. CUDA only: the CPU interpreter cannot run inline PTX."""
    u = x * (0.7978845608 + 0.0356774081 * x * x)  # sqrt(2/pi) (x + 0.044715 x^3)
    t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1)
    half = 0.5 * x
    return half + half * t


@triton.jit
def prefetch_l2(addresses):
    """Pull the 128-byte lines holding `addresses` (a tensor of pointers) into L2 (PTX prefetch: no
    register result, nothing waits for it; CUDA only, the interpreter cannot run inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addresses],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_slab(w_ptr, cols, k0, stride_wn, pair_offset, LINES: tl.constexpr, GELU_MUL: tl.constexpr):
    """Pull a skinny program's weight slab (rows `cols`, LINES 128-byte lines of bf16 from column k0; with
    GELU_MUL also the up rows pair_offset further) into L2: it needs nothing from the predecessor."""
    lines = tl.arange(0, LINES)
    slab = w_ptr + cols[:, None].to(tl.int64) * stride_wn + k0 + lines[None, :] * 64
    prefetch_l2(slab)
    if GELU_MUL:
        prefetch_l2(slab + pair_offset * stride_wn)


@triton.jit
def skinny_dot(x, w, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + x @ w in fp32 for the skinny tiles (bf16 or fp32 operands)."""
    if UPCAST:  # the CPU interpreter's bf16 tl.dot returns garbage (Triton 3.x); fp32 there
        x, w = x.to(tl.float32), w.to(tl.float32)
    if IEEE:  # fp32 operands: full fp32 products, as cuBLAS without TF32
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def skinny_accumulate(x_ptr, w_ptr, rows, row_ok, cols, k0, stride_xm, stride_wn, pair_offset,
                      K_SPLIT: tl.constexpr, GELU_MUL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """skinny.py's tile: x[rows, k0:k0+K_SPLIT] @ W[cols, k0:k0+K_SPLIT]^T in fp32 (BM, BN), or with
    GELU_MUL gelu_tanh(x Wg^T) * (x Wu^T), the up rows pair_offset below the gate rows."""
    ks = tl.arange(0, BK)
    x_tile = x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :]
    w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BK):
        x = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
        acc = skinny_dot(x, tl.load(w_tile), acc, UPCAST, IEEE)
        if GELU_MUL:
            acc_up = skinny_dot(x, tl.load(w_tile + pair_offset * stride_wn), acc_up, UPCAST, IEEE)
        x_tile += BK
        w_tile += BK
    if GELU_MUL:  # gelu_tanh(gate) * up, the GeGLU kernel's formula
        acc = gelu_tanh(acc) * acc_up
    return acc


@triton.jit
def load_slab(w_ptr, cols, k0, stride_wn, pair_offset, K_SPLIT: tl.constexpr, GELU_MUL: tl.constexpr):
    """A skinny program's whole weight slab W[cols, k0:k0+K_SPLIT]^T (K_SPLIT, BN) into registers, and
    with GELU_MUL the up rows' too (else the same tensor again). Needs nothing from the predecessor, so
    SkinnyTile.preload issues it before the PDL wait: its HBM latency overlaps the predecessor."""
    ks = tl.arange(0, K_SPLIT)
    tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None]
    w = tl.load(tile)
    w_up = w
    if GELU_MUL:
        w_up = tl.load(tile + pair_offset * stride_wn)
    return w, w_up


@triton.jit
def skinny_preloaded(x_ptr, w, w_up, rows, row_ok, k0, stride_xm, K_SPLIT: tl.constexpr,
                     GELU_MUL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """skinny_accumulate's result from load_slab's slab: the x slab in one load, one dot over K_SPLIT."""
    ks = tl.arange(0, K_SPLIT)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
    acc = skinny_dot(x, w, tl.zeros((x.shape[0], w.shape[1]), dtype=tl.float32), UPCAST, IEEE)
    if GELU_MUL:
        acc_up = skinny_dot(x, w_up, tl.zeros((x.shape[0], w.shape[1]), dtype=tl.float32), UPCAST, IEEE)
        acc = gelu_tanh(acc) * acc_up
    return acc


@triton.jit
def residual_update(h_ptr, y_ptr, gate_ptr, row, cols, mask, width, gate_row_stride, y_split_stride,
                    Y_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr):
    """One row of the residual step h <- h + y * gate (gate optional), y given as Y_SPLITS fp32 split-K
    partials (skinny.py) or one tensor: stored back in h's dtype, returned in fp32."""
    h = tl.load(h_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    if Y_SPLITS == 1:
        y = tl.load(y_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # every partial in one (splits, BLOCK) load, so all of them are in flight before the first add
        y = sum_rows(y_ptr + row * width + cols[None, :], y_split_stride, mask[None, :], Y_SPLITS)
    if HAS_GATE:
        y = y * tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    h = (h + y).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * width + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def sum_rows(ptrs, row_stride, mask, ROWS: tl.constexpr):
    """The sum over ROWS (>= 2) fp32 rows at ptrs + r * row_stride (ptrs, mask: (1, BLOCK)), loaded as one
    (rows, BLOCK) tile: one load op, so every row's loads issue before the first add (ptxas kept only 2-3
    in flight when each row was its own load), reduced inside each thread."""
    ROWS_P2: tl.constexpr = 2 if ROWS <= 2 else 4 if ROWS <= 4 else 8 if ROWS <= 8 else 16
    tl.static_assert(ROWS <= 16, "sum_rows: at most 16 rows")
    r = tl.arange(0, ROWS_P2)[:, None]
    tile = tl.load(ptrs + r * row_stride, mask=mask & (r < ROWS), other=0.0)
    return tl.sum(tile, axis=0)


@triton.jit
def load_linear(w_ptr, b_ptr, out_idx, out_ok, in_idx, in_ok, in_stride, HAS_BIAS: tl.constexpr):
    """A small linear layer's parameters into registers: the (out, in) weight tile of a row-major
    weight with `in_stride` elements per output row, and the fp32 bias (0 without HAS_BIAS)."""
    w = tl.load(w_ptr + out_idx[:, None] * in_stride + in_idx[None, :], mask=out_ok[:, None] & in_ok[None, :],
                other=0.0)
    bias = tl.load(b_ptr + out_idx, mask=out_ok & HAS_BIAS, other=0.0).to(tl.float32)
    return w, bias


@triton.jit
def apply_linear(w, bias, x):
    """One row through load_linear's parameters in fp32: w x + bias, x of the tile's `in` length."""
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1) + bias


@triton.jit
def norm_row(h, mask, width, eps, scale_row, shift_row, HAS_SHIFT: tl.constexpr, LAYER_NORM: tl.constexpr):
    """One row's norm in fp32 (masked columns of h are 0): Gemma RMSNorm / AdaRMS h * rstd * (1 + scale)
    + shift, or with LAYER_NORM (h - mean) * rstd * scale + shift; scale_row / shift_row point at the
    row's parameters (shift only read with HAS_SHIFT)."""
    scale = tl.load(scale_row, mask=mask, other=0.0).to(tl.float32)
    if LAYER_NORM:
        h = tl.where(mask, h - tl.sum(h, axis=0) / width, 0.0)
        normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / width + eps) * scale
    else:
        normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / width + eps) * (1.0 + scale)
    if HAS_SHIFT:
        normed += tl.load(shift_row, mask=mask, other=0.0).to(tl.float32)
    return normed


@triton.jit
def load_activated(src, cols, mask, width, ACT: tl.constexpr):
    """fp8.py's activation of one block of a row, in fp32: ACT 0 x, 1 gelu_tanh(x), 2 gelu_tanh(gate)
    * up with the up half `width` columns after the gate."""
    v = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT != 0:
        v = gelu_tanh(v)
    if ACT == 2:
        v = v * tl.load(src + width + cols, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def fp8_row_scale(abs_values):
    """fp8.py's per-row scale: amax * fp32(1/448), as quantize_rows_reference (bit-equal scales)."""
    return tl.maximum(tl.max(abs_values, axis=0), 1e-12) * (1.0 / 448.0)


@triton.jit
def to_fp8(v, scale, q_ptr):
    """v times the row's reciprocal scale (one IEEE division per row, then a multiply per element,
    as quantize_rows_reference), clamped to e4m3's range and cast to q_ptr's element type."""
    inverse = tl.math.div_rn(1.0, scale)
    q = tl.minimum(tl.maximum(v * inverse, -448.0), 448.0)
    return q.to(q_ptr.dtype.element_ty)


@triton.jit
def rope_one_head(qkv_ptr, q_ptr, k_ptr, v_ptr, token, ok, d, head, cache_row, c1, c2, s1, s2,
                  split_stride, SPLITS: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr,
                  HALF: tl.constexpr):
    """kernels.py rope_scatter_kernel's work for one head of its tokens: RoPE'd q to q_ptr, RoPE'd k
    and plain v to their cache rows."""
    src = qkv_ptr + token.to(tl.int64) * ((H + 2 * KV) * HD) + head * HD
    x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
    for split in tl.static_range(1, SPLITS):  # skinny.py's split-K partials in split order (unrolled: kernels.py)
        x1 += tl.load(src + split * split_stride + d, mask=ok, other=0.0)
        x2 += tl.load(src + split * split_stride + HALF + d, mask=ok, other=0.0)
    if head < H + KV:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        if head < H:
            dst = q_ptr + (token.to(tl.int64) * H + head) * HD
        else:
            dst = k_ptr + (cache_row * KV + head - H) * HD
        tl.store(dst + d, o1.to(dst.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, o2.to(dst.dtype.element_ty), mask=ok)
    else:
        dst = v_ptr + (cache_row * KV + head - H - KV) * HD
        tl.store(dst + d, x1.to(dst.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, x2.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def online_softmax(q, k, m_i, l_i, qk_scale, n_ok, MASKED: tl.constexpr):
    """The softmax half of attend_block: one K block's scores in log2 units (exp2 is one MUFU op) ->
    (new row max, new row sum, the old acc's rescale factor alpha, probabilities p (M, N))."""
    scores = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def accumulate_values(acc, alpha, p, v):
    """The output half of attend_block: acc rescaled by alpha plus p V."""
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def attend_block(q, k, v, m_i, l_i, acc, qk_scale, n_ok, MASKED: tl.constexpr):
    """One K/V block of flash attention's online softmax: q (M, D), k and v (N, D), running row max m_i,
    sum l_i and fp32 output acc (M, D) -> updated (m_i, l_i, acc). MASKED: keys where n_ok is False
    score -inf."""
    m_new, l_i, alpha, p = online_softmax(q, k, m_i, l_i, qk_scale, n_ok, MASKED)
    return m_new, l_i, accumulate_values(acc, alpha, p, v)
