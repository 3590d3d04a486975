"""The Triton device code of persistent.py: one jit function per phase and the kernel that runs
them for every layer between grid-wide barriers. Imported only when the kernel is first launched
(CPU-only runs never import triton); module-level, so the CPU interpreter resolves the calls."""

from __future__ import annotations

import triton
import triton.language as tl

from policies.fast import triton_common as C


@triton.jit
def prefetch_share(w_ptr, numel, pid, NP, LINES: tl.constexpr, ENABLED: tl.constexpr):
    """This program's share of a weight's 128-byte lines (2-byte elements) pulled into L2. The
    L2 is shared, so the shares need not match the tiles a program computes later."""
    if ENABLED:
        for start in range(pid * LINES, tl.cdiv(numel, 64), NP * LINES):
            offsets = (start + tl.arange(0, LINES)).to(tl.int64) * 64
            ptrs = w_ptr + tl.where(offsets < numel, offsets, 0)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)

@triton.jit
def mma(x, w, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:  # the CPU interpreter's bf16 tl.dot is wrong; fp32 there
        x, w = x.to(tl.float32), w.to(tl.float32)
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)

@triton.jit
def norm_phase(h_ptr, part_ptr, mod_ptr, x_ptr, M, eps, norm, pid, NP, ADD: tl.constexpr,
               SPLITS: tl.constexpr, D: tl.constexpr):
    """Rows of the residual: h += gate(norm - 1) * sum(partials) (ADD), x = AdaRMS(norm)(h)."""
    cols = tl.arange(0, D)
    scale = tl.load(mod_ptr + norm * 3 * D + cols)
    shift = tl.load(mod_ptr + norm * 3 * D + D + cols)
    for row in range(pid, M, NP):
        h = tl.load(h_ptr + row * D + cols).to(tl.float32)
        if ADD:
            y = tl.load(part_ptr + row * D + cols)
            for split in tl.static_range(1, SPLITS):
                y += tl.load(part_ptr + (split * M + row) * D + cols)
            gate = tl.load(mod_ptr + (norm - 1) * 3 * D + 2 * D + cols)
            h = (h + y * gate).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * D + cols, h)
            h = h.to(tl.float32)
        normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps) * (1.0 + scale) + shift
        tl.store(x_ptr + row * D + cols, normed.to(x_ptr.dtype.element_ty))

@triton.jit
def qkv_rope_phase(x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, M, T, cache_rows, pid, NP,
                   D: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, BM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """x (M, D) @ Wqkv^T in tiles of one head's RoPE pair (cols d and d + HD/2), RoPE on the
    fp32 sums, q -> q_ptr (M, H, HD), k / v -> the cache rows of the tokens' slots."""
    HALF: tl.constexpr = HD // 2
    per_head: tl.constexpr = HALF // BN
    rows = tl.arange(0, BM)
    row_ok = rows < M
    ks = tl.arange(0, BK)
    for tile in range(pid, (H + 2 * KV) * per_head, NP):
        head = tile // per_head
        d = (tile % per_head) * BN + tl.arange(0, BN)
        cols = head * HD + d
        x_tile = x_ptr + rows[:, None] * D + ks[None, :]
        w_tile = w_ptr + cols[None, :].to(tl.int64) * D + ks[:, None]
        acc1 = tl.zeros((BM, BN), tl.float32)
        acc2 = tl.zeros((BM, BN), tl.float32)
        for _ in range(0, D, BK):
            x = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
            acc1 = mma(x, tl.load(w_tile), acc1, UPCAST, IEEE)
            acc2 = mma(x, tl.load(w_tile + HALF * D), acc2, UPCAST, IEEE)
            x_tile += BK
            w_tile += BK
        token = rows[:, None]
        ok = row_ok[:, None]
        slot = tl.load(slot_ptr + token, mask=ok, other=0).to(tl.int64)
        cache_row = (token // T).to(tl.int64) * cache_rows + slot
        if head < H + KV:
            trig = token.to(tl.int64) * HD + d[None, :]
            c1 = tl.load(cos_ptr + trig, mask=ok, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + trig + HALF, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + trig, mask=ok, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + trig + HALF, mask=ok, other=0.0).to(tl.float32)
            o1 = acc1 * c1 - acc2 * s1
            o2 = acc2 * c2 + acc1 * s2
            if head < H:
                dst = q_ptr + (token.to(tl.int64) * H + head) * HD + d[None, :]
            else:
                dst = k_ptr + (cache_row * KV + head - H) * HD + d[None, :]
            tl.store(dst, o1.to(dst.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, o2.to(dst.dtype.element_ty), mask=ok)
        else:
            dst = v_ptr + (cache_row * KV + head - H - KV) * HD + d[None, :]
            tl.store(dst, acc1.to(dst.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, acc2.to(dst.dtype.element_ty), mask=ok)

@triton.jit
def attention_phase(q_ptr, k_ptr, v_ptr, key_len_ptr, part_o_ptr, part_lse_ptr, B, T, S, qk_scale,
                    splits, split_rows, pid, NP, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """triton_attention.split_kv_attention's work, items (b * KV + kv head, row block, split)
    walked by the persistent programs; always writes partials (merge_phase normalises)."""
    group: tl.constexpr = H // KV
    packed = T * group
    row_blocks = tl.cdiv(packed, BLOCK_M)
    d = tl.arange(0, HD)
    for item in range(pid, B * KV * row_blocks * splits, NP):
        bk = item // (row_blocks * splits)
        row_block = (item // splits) % row_blocks
        split = item % splits
        b = bk // KV
        kvh = bk % KV
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < packed
        t = rows // group
        head = kvh * group + rows % group
        q = tl.load(q_ptr + (((b * T + t) * H + head) * HD)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        key_len = tl.load(key_len_ptr + b)
        start = split * split_rows
        end = tl.minimum(start + split_rows, key_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            kv_off = ((b * S + n) * KV + kvh) * HD
            k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            scores = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, IEEE) * qk_scale
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
            m_i = m_new
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        part = (bk * splits + split) * packed + rows
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_o_ptr + part[:, None] * HD + d[None, :], acc / safe_l[:, None], mask=row_ok[:, None])

@triton.jit
def merge_phase(part_o_ptr, part_lse_ptr, out_ptr, B, T, splits, pid, NP, H: tl.constexpr, KV: tl.constexpr,
                HD: tl.constexpr, SPLITS_P2: tl.constexpr):
    group: tl.constexpr = H // KV
    packed = T * group
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < splits
    d = tl.arange(0, HD)
    for item in range(pid, B * KV * packed, NP):
        bk = item // packed
        row = item % packed
        part = (bk * splits + s) * packed + row
        lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
        o = tl.load(part_o_ptr + part[:, None] * HD + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        b = bk // KV
        t = row // group
        head = (bk % KV) * group + row % group
        tl.store(out_ptr + ((b * T + t) * H + head) * HD + d, out.to(out_ptr.dtype.element_ty))

@triton.jit
def linear_phase(x_ptr, w_ptr, out_ptr, M, pid, NP, N: tl.constexpr, K: tl.constexpr, SPLITS: tl.constexpr,
                 GELU_MUL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """x (M, K) @ W^T: split-K fp32 partials (SPLITS, M, N), or with GELU_MUL (W = [gate; up],
    2N rows) gelu_tanh(gate) * up (M, N) in out's dtype (skinny.py's two modes)."""
    K_SPLIT: tl.constexpr = K // SPLITS
    rows = tl.arange(0, BM)
    row_ok = rows < M
    ks = tl.arange(0, BK)
    for tile in range(pid, (N // BN) * SPLITS, NP):
        split = tile % SPLITS
        cols = (tile // SPLITS) * BN + tl.arange(0, BN)
        k0 = split * K_SPLIT
        x_tile = x_ptr + rows[:, None] * K + (k0 + ks)[None, :]
        w_tile = w_ptr + cols[None, :].to(tl.int64) * K + (k0 + ks)[:, None]
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
        for _ in range(0, K_SPLIT, BK):
            x = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
            acc = mma(x, tl.load(w_tile), acc, UPCAST, IEEE)
            if GELU_MUL:
                acc_up = mma(x, tl.load(w_tile + N * K), acc_up, UPCAST, IEEE)
            x_tile += BK
            w_tile += BK
        if GELU_MUL:
            acc = C.gelu_tanh(acc) * acc_up
        dst = out_ptr + split * M * N + rows[:, None] * N + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

# SKIP: persistent.SKIP_BITS, phases left out (profiling only: the results are garbage).


@triton.jit
def table_ptr(base, table, index):
    """base + entry `index` of a table of element offsets from `base`, declared multiples of 8
    (16 bytes; persistent.py checks it): the compiler then knows the tensor is 16-byte aligned, as it
    knows of a pointer argument, and vectorises the loads (an address loaded from memory and cast to
    a pointer carries no alignment: every load was a scalar 2-byte one)."""
    return base + tl.multiple_of(tl.load(table + index), 8)


@triton.jit
def sync(counter_ptr, barrier, NP, SKIP: tl.constexpr):
    """The next grid-wide barrier (its count `barrier` + 1 is returned)."""
    barrier += 1
    if (SKIP & 128) == 0:
        C.grid_barrier(counter_ptr, barrier * NP, False)
    return barrier


@triton.jit
def expert_step_kernel(
    base_ptr, wqkv_tab, wo_tab, wgu_tab, wdown_tab, kc_tab, vc_tab, mod_ptr, h_ptr, x_ptr, q_ptr, attn_ptr,
    part_o_ptr, part_lse_ptr, proj_ptr, act_ptr, cos_ptr, sin_ptr, slot_ptr, key_len_ptr, counter_ptr,
    M, B, T, cache_rows, eps, qk_scale, att_splits, att_split_rows, num_layers,
    D: tl.constexpr, F: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr,
    ROPE_N: tl.constexpr, O_N: tl.constexpr, O_SPLITS: tl.constexpr, GU_N: tl.constexpr,
    DOWN_N: tl.constexpr, DOWN_SPLITS: tl.constexpr, ATT_M: tl.constexpr, ATT_N: tl.constexpr,
    BK: tl.constexpr, BM: tl.constexpr, SPLITS_P2: tl.constexpr, PROJ_SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, SKIP: tl.constexpr,
):
    pid = tl.program_id(0)
    NP = tl.num_programs(0)
    QKV_N: tl.constexpr = (H + 2 * KV) * HD
    barrier = 0
    if (SKIP & 1) == 0:
        norm_phase(h_ptr, proj_ptr, mod_ptr, x_ptr, M, eps, 0, pid, NP, False, PROJ_SPLITS, D)
    for layer in range(num_layers):
        w_qkv = table_ptr(base_ptr, wqkv_tab, layer)
        w_o = table_ptr(base_ptr, wo_tab, layer)
        w_gu = table_ptr(base_ptr, wgu_tab, layer)
        w_down = table_ptr(base_ptr, wdown_tab, layer)
        k_cache = table_ptr(base_ptr, kc_tab, layer)
        v_cache = table_ptr(base_ptr, vc_tab, layer)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 2) == 0:
            qkv_rope_phase(x_ptr, w_qkv, cos_ptr, sin_ptr, q_ptr, k_cache, v_cache, slot_ptr, M, T, cache_rows,
                           pid, NP, D, H, KV, HD, ROPE_N, BK, BM, UPCAST, IEEE)
        # weights stream into L2 one phase or more ahead of their GEMM (what PDL's prefetch does for
        # the per-kernel loop): o and gate_up while the attention and its merge run
        prefetch_share(w_o, D * H * HD, pid, NP, 256, PREFETCH)
        prefetch_share(w_gu, 2 * F * D, pid, NP, 256, PREFETCH)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 4) == 0:
            attention_phase(q_ptr, k_cache, v_cache, key_len_ptr, part_o_ptr, part_lse_ptr, B, T, cache_rows,
                            qk_scale, att_splits, att_split_rows, pid, NP, H, KV, HD, ATT_M, ATT_N, UPCAST, IEEE)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 8) == 0:
            merge_phase(part_o_ptr, part_lse_ptr, attn_ptr, B, T, att_splits, pid, NP, H, KV, HD, SPLITS_P2)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 16) == 0:
            linear_phase(attn_ptr, w_o, proj_ptr, M, pid, NP, D, H * HD, O_SPLITS, False, O_N, BK, BM, UPCAST, IEEE)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 1) == 0:
            norm_phase(h_ptr, proj_ptr, mod_ptr, x_ptr, M, eps, 2 * layer + 1, pid, NP, True, O_SPLITS, D)
        prefetch_share(w_down, D * F, pid, NP, 256, PREFETCH)  # down while gate_up runs
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 32) == 0:
            linear_phase(x_ptr, w_gu, act_ptr, M, pid, NP, F, D, 1, True, GU_N, BK, BM, UPCAST, IEEE)
        if layer + 1 < num_layers:  # the next layer's qkv while down and the norm run
            w_next = table_ptr(base_ptr, wqkv_tab, layer + 1)
            prefetch_share(w_next, QKV_N * D, pid, NP, 256, PREFETCH)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 64) == 0:
            linear_phase(act_ptr, w_down, proj_ptr, M, pid, NP, D, F, DOWN_SPLITS, False, DOWN_N, BK, BM, UPCAST,
                         IEEE)
        barrier = sync(counter_ptr, barrier, NP, SKIP)
        if (SKIP & 1) == 0:
            norm_phase(h_ptr, proj_ptr, mod_ptr, x_ptr, M, eps, 2 * layer + 2, pid, NP, True, DOWN_SPLITS, D)
