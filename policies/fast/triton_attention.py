"""Split-KV attention over the slot KV layout, in Triton (the third backend of attention.py).

Why: the expert's attention is tiny per sample (H=50 queries x 8 heads against one KV head of
~1000 rows), so library prefill kernels run it on a handful of thread blocks, each walking the
whole KV run: ~60 us per call at batch 1, 180 calls per sample. Here every query head of a KV
head is packed into one row block (GQA: the K/V tile is loaded once for all 8 heads) and the
KV run is split over several blocks when the batch alone cannot fill the GPU; a second small
kernel merges the splits by their log-sum-exp (flash-decoding).

Shapes: q (B, T, H, hd); k_cache, v_cache (B, S, KV, hd); key_len (B,) int32: sample b attends
to rows [0, key_len[b]). Output (B, T, H * hd) in q's dtype.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from policies.fast.pdl import launch_kwargs

LOG2_E = 1.4426950408889634  # scores are scaled into log2 units so the softmax runs on exp2
C = None  # policies.fast.triton_common once a kernel factory ran (triton is imported on first use only)


@functools.cache
def _kernels():
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def split_kv_attention(
        q_ptr, k_ptr, v_ptr, key_len_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, T, S, NUM_SPLITS, SPLIT_ROWS,
        H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, PDL: tl.constexpr,
    ):
        C.pdl_enter(PDL)  # pdl.py: wait for the predecessor before the first activation read
        group = H // KV
        bk = tl.program_id(0)  # b * KV + kv head
        row_tile = tl.program_id(1)
        split = tl.program_id(2)
        b = bk // KV
        kvh = bk % KV
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (t, g) rows
        row_ok = rows < T * group
        t = rows // group
        head = kvh * group + rows % group
        d = tl.arange(0, HD)
        q_off = ((b * T + t) * H + head) * HD
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        key_len = tl.load(key_len_ptr + b)
        start = split * SPLIT_ROWS
        end = tl.minimum(start + SPLIT_ROWS, key_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            kv_off = ((b * S + n) * KV + kvh) * HD
            k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            m_i, l_i, alpha, p = C.online_softmax(q, k, m_i, l_i, qk_scale, n_ok, True)
            # C.attend_block's two halves with v loaded between them, as this kernel was tuned: loading
            # v with k compiled to 3-4% more sm_90 instructions at the batch-1 blocks
            v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            acc = C.accumulate_values(acc, alpha, p, v)
        if DIRECT:  # one split: normalise and write the output
            out = acc / l_i[:, None]
            o_off = ((b * T + t) * H + head) * HD
            tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:  # partial result of this split and its log-sum-exp in log2 units (-inf for an empty split)
            safe_l = tl.where(l_i > 0, l_i, 1.0)
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            part = (bk * NUM_SPLITS + split) * (T * group) + rows
            tl.store(part_lse_ptr + part, lse, mask=row_ok)
            tl.store(part_o_ptr + part[:, None] * HD + d[None, :], acc / safe_l[:, None], mask=row_ok[:, None])

    @triton.jit
    def merge_splits(
        part_o_ptr, part_lse_ptr, out_ptr, T, NUM_SPLITS,
        H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr,
    ):
        C.pdl_enter(PDL)  # pdl.py: wait for the predecessor before the first activation read
        group = H // KV
        bk = tl.program_id(0)
        row = tl.program_id(1)
        b = bk // KV
        kvh = bk % KV
        s = tl.arange(0, SPLITS_P2)
        s_ok = s < NUM_SPLITS
        part = (bk * NUM_SPLITS + s) * (T * group) + row
        lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
        d = tl.arange(0, HD)
        o = tl.load(part_o_ptr + part[:, None] * HD + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        t = row // group
        head = kvh * group + row % group
        tl.store(out_ptr + ((b * T + t) * H + head) * HD + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def kv1_attention_tma(
        q_desc, k_desc, v_desc, key_len_ptr, out_ptr, qk_scale, ROWS, S,
        HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        """One KV head: sample b's packed (t, head) query rows are the contiguous rows [b ROWS, (b + 1) ROWS)
        of q viewed (B T H, HD) and its keys the rows [b S, b S + key_len) of the cache viewed (B S, HD),
        so whole blocks come through TMA and only the last block is masked. Rows of a block past ROWS
        (the next sample's queries) are computed but never stored."""
        C.pdl_enter(PDL)  # pdl.py: wait for the predecessor before the first activation read
        row_tile = tl.program_id(0)
        b = tl.program_id(1)
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < ROWS
        q = q_desc.load([b * ROWS + row_tile * BLOCK_M, 0])
        key_len = tl.load(key_len_ptr + b)
        base = b * S
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        whole = key_len - key_len % BLOCK_N
        for n0 in range(0, whole, BLOCK_N):
            k = k_desc.load([base + n0, 0])
            v = v_desc.load([base + n0, 0])
            m_i, l_i, acc = C.attend_block(q, k, v, m_i, l_i, acc, qk_scale, row_ok, False)
        if whole < key_len:  # the keys' last, partial block
            n_ok = whole + tl.arange(0, BLOCK_N) < key_len
            k = k_desc.load([base + whole, 0])
            v = tl.where(n_ok[:, None], v_desc.load([base + whole, 0]), 0.0)  # rows past key_len: any bits
            m_i, l_i, acc = C.attend_block(q, k, v, m_i, l_i, acc, qk_scale, n_ok, True)
        out = acc / l_i[:, None]
        d = tl.arange(0, HD)
        offsets = (b * ROWS + rows).to(tl.int64)[:, None] * HD + d[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return split_kv_attention, merge_splits, kv1_attention_tma


def default_blocks(batch: int, packed_rows: int, target_blocks: int = 132, prefix_b1: bool = True,
                   kv_heads: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) by the H200 sweeps of profile_denoise.py (packed_rows: one KV head's
    query rows of a sample; target_blocks: the programs aimed for, the SM count; prefix_b1=False: without
    round 22's rule for KV-split prefix runs):
    - <= 128 packed query rows (LIBERO's chunk 10 x 8 heads) below batch 16: 16 x 64, 4 warps (6.8 us
      against 7.8 with 32 x 64 at batch 1, profile_denoise_nvidia-h200_20261201-141251.json); from
      batch 16 64 x 64, 4 warps (LIBERO b64: 26.6 us against 32.9 with 16 x 64 and 39.2 at best with
      128-row blocks, ..._221930.json);
    - batch >= 16, or >= 12288 packed rows in all (96 row blocks of 128 for 132 SMs: the prefix from
      batch 4, and PhyAI's at batch 2; PhyAI's expert at batch 32/64): 128 x 64, 8 warps
      (profile_denoise_nvidia-h200_20261201-160805.json: PhyAI's expert at b32 79 against 88 us with
      64 x 64, the prefix 767 against 1245 us and SDPA's 892; LIBERO's prefix at b64 531 against 736;
      ..._164645.json: PhyAI's prefix at b4 94 against 146 us; ..._20261202-130250.json: PhyAI's prefix
      at b2, 15488 rows, 38.1 against 57.7 us with 64 x 64, 36.8 through TMA);
    - batch 1 with < 1024 rows (PhyAI's chunk 50 in the expert): 32 x 128, 4 warps (9.6 against 11.5 us);
    - a prefix-length run (>= PREFIX_ROWS packed rows) whose 64-row blocks would be KV-split anyway
      (needs_kv_split): 128 x 64, 8 warps, with twice the splits (LIBERO's prefix at
      batch 1, 4480 rows: 23.5 against 28.6 us with 64 x 64 and 2 splits,
      profile_denoise_nvidia-h200_20261204-030044.json; 23.6 against 28.4 on another card, ..._20261202-130250;
      measured at 4480 rows only);
    - else 64 x 64, 4 warps (the expert at batch 2: 13.2 against 15.1 us; the prefix at batch 1,
      ..._164645.json: PhyAI 39 us against 57 with 32 x 128, LIBERO 29 against 35)."""
    if packed_rows <= 128:
        return (16, 64, 4, 2) if batch < 16 else (64, 64, 4, 2)
    if batch >= 16 or batch * packed_rows >= 12288:
        return 128, 64, 8, 2
    if batch == 1 and packed_rows < 1024:
        return 32, 128, 4, 2
    if prefix_b1 and packed_rows >= PREFIX_ROWS and needs_kv_split(batch * kv_heads * math.ceil(packed_rows / 64),
                                                                   target_blocks):
        return 128, 64, 8, 2
    return 64, 64, 4, 2


def tma_default(batch: int) -> bool:
    """Where the TMA kernel runs by default (one KV head, no KV split, Hopper): from batch 16 and at
    batch 1 and 2, with default_blocks' blocks. H200, per layer against the split-KV kernel with the
    same blocks: experiments/sweep_large_batch.py (sweep_large_batch_nvidia-h200_20261201-233827.json)
    the prefix 0.525 against 0.655 ms at PhyAI b32 and 0.429 against 0.483 at LIBERO b64 (128 x 64
    blocks), the expert 42 against 48 us at PhyAI b32 (128 x 64) and 20 against 25 at LIBERO b64
    (64 x 64); `profile_denoise --attention-sweep --attention-stages prefix --attention-tma`
    (profile_denoise_nvidia-h200_20261202-130250.json) the prefix 26.3 against 29.4 us at PhyAI b1
    (64 x 64), 36.8 against 38.1 at PhyAI b2 (128 x 64) and 31.4 against 33.7 at LIBERO b2 (64 x 64);
    at LIBERO b1 the 64-row blocks are KV-split, where TMA cannot run. At batch 1 and 2 the expert's
    attention is KV-split too. Batches 3-15: not measured."""
    return batch >= 16 or batch <= 2


# The prefix at batch 1 through the TMA kernel (Hopper's 227 KB of shared memory: 3 x 64 KB of K/V blocks
# and the 32 KB Q block fit): a third K/V stage. PhyAI b1 (7744 packed rows, 64 x 64, 4 warps): 21.3 against
# 26.4 us per layer (profile_denoise_nvidia-h200_20261204-030816.json); the pointer kernel 28.0 against 29.7.
TMA_PREFIX_B1_STAGES = 3

# No KV split once the unsplit blocks fill this share of the target: on the H200 (profile_stages,
# PhyAI's expert at batch 32: 128 blocks for 132 SMs) splitting in two cost a merge kernel of 21 us
# per call on top of 59 us of attention, for blocks that already filled 97% of the SMs.
SPLIT_FREE_FILL = 0.75
# Packed query rows from which a run is prefix-length (the prefix: 4480-7744 a sample in both configurations;
# the expert's chunk: at most 400), for round 22's batch-1 prefix choices
PREFIX_ROWS = 4096


def needs_kv_split(unsplit_blocks: int, target_blocks: int) -> bool:
    """Whether the row blocks without a KV split leave more than 1 - SPLIT_FREE_FILL of the target idle."""
    return unsplit_blocks < SPLIT_FREE_FILL * target_blocks


class TritonSplitKVAttention:
    """Backend with the `plan(key_len)` / `__call__(q, k_cache, v_cache)` interface of attention.py."""

    name = "triton"
    pdl = 0  # pdl.py's mode code; the fast sampler sets it on the expert's backend
    # keyword arguments (block_m, block_n, warps, stages) the attention selector builds the expert's backend
    # with; profile_denoise's attention settings "triton@<options>" set them to time a layout in the graph
    EXPERT_OPTIONS: dict = {}
    # round 22's batch-1 prefix choices (default_blocks' 128-row blocks for KV-split prefix runs,
    # TMA_PREFIX_B1_STAGES); profile_overlap's "*_r21attn" variants build a sampler without them
    PREFIX_B1_TUNING: bool = True

    def __init__(self, batch: int, queries: int, rows: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, target_blocks: int | None = None, block_m: int | None = None,
                 block_n: int | None = None, warps: int | None = None, stages: int | None = None,
                 tma: bool | None = None):
        """block_m / block_n / warps / stages / target_blocks (programs aimed for; default: the SM
        count) override the class defaults (experiments/profile_denoise.py sweeps them). `tma`: the
        one-KV-head kernel whose whole blocks load through TMA (None: where `tma_default` says)."""
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"triton attention needs a power-of-two head_dim >= 16, got {head_dim}")
        packed_rows = queries * (heads // kv_heads)
        if target_blocks is None:
            cuda = device.type == "cuda"
            target_blocks = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8
        default_m, default_n, default_warps, default_stages = default_blocks(batch, packed_rows, target_blocks,
                                                                             self.PREFIX_B1_TUNING, kv_heads)
        self.BLOCK_M, self.BLOCK_N = block_m or default_m, block_n or default_n
        self.WARPS, self.STAGES = warps or default_warps, stages or default_stages
        self.shape = (batch, queries, rows, heads, kv_heads, head_dim)
        self.key_len = torch.full((batch,), rows, dtype=torch.int32, device=device)
        self.row_tiles = math.ceil(packed_rows / self.BLOCK_M)
        base_blocks = batch * kv_heads * self.row_tiles
        max_splits = math.ceil(rows / self.BLOCK_N)
        if not needs_kv_split(base_blocks, target_blocks):
            self.num_splits = 1
        else:
            self.num_splits = max(1, min(max_splits, math.ceil(target_blocks / base_blocks)))
        # split length: whole BLOCK_N multiples so no block straddles two splits
        self.split_rows = math.ceil(math.ceil(rows / self.num_splits) / self.BLOCK_N) * self.BLOCK_N
        self.tma = self._use_tma(tma, kv_heads, device, batch)
        if (stages is None and self.PREFIX_B1_TUNING and self.tma and batch == 1 and packed_rows >= PREFIX_ROWS
                and self.BLOCK_M == 64):
            self.STAGES = TMA_PREFIX_B1_STAGES
        if self.num_splits > 1:
            self.part_o = torch.empty(batch * kv_heads * self.num_splits * packed_rows, head_dim,
                                      dtype=torch.float32, device=device)
            lse_rows = batch * kv_heads * self.num_splits * packed_rows
            self.part_lse = torch.empty(lse_rows, dtype=torch.float32, device=device)

    def _use_tma(self, tma: bool | None, kv_heads: int, device: torch.device, batch: int) -> bool:
        """The TMA kernel needs one KV head and no KV split (and TMA: Hopper or newer, or the CPU
        interpreter when asked for explicitly)."""
        usable = kv_heads == 1 and self.num_splits == 1
        if tma is None:
            return usable and tma_default(batch) and device.type == "cuda" and \
                torch.cuda.get_device_capability(device)[0] >= 9
        if tma and not usable:
            raise ValueError(f"the TMA attention kernel needs one KV head and no KV split, got kv_heads={kv_heads}, "
                             f"{self.num_splits} splits")
        if tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
            raise ValueError(f"the TMA attention kernel needs a Hopper or newer GPU (TMA), got {device} with "
                             f"compute capability {torch.cuda.get_device_capability(device)}")
        return tma

    def plan(self, key_len: Tensor) -> None:
        self.key_len.copy_(key_len, non_blocking=True)

    def _call_tma(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b, t, heads, hd = q.shape
        if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"the TMA attention kernel needs contiguous q, k and v, got strides {q.stride()}, "
                             f"{k_cache.stride()}, {v_cache.stride()}")
        out = torch.empty_like(q)
        slots = k_cache.shape[1]
        q_desc = TensorDescriptor.from_tensor(q.view(b * t * heads, hd), [self.BLOCK_M, hd])
        k_desc = TensorDescriptor.from_tensor(k_cache.view(b * slots, hd), [self.BLOCK_N, hd])
        v_desc = TensorDescriptor.from_tensor(v_cache.view(b * slots, hd), [self.BLOCK_N, hd])
        _kernels()[2][(self.row_tiles, b)](
            q_desc, k_desc, v_desc, self.key_len, out, hd ** -0.5 * LOG2_E, t * heads, slots,
            HD=hd, BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, PDL=self.pdl,
            num_warps=self.WARPS, num_stages=self.STAGES, **launch_kwargs(self.pdl),
        )
        return out.view(b, t, heads * hd)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        if self.tma:
            return self._call_tma(q, k_cache, v_cache)
        attend, merge = _kernels()[:2]
        b, t, heads, hd = q.shape
        kv = k_cache.shape[2]
        out = torch.empty_like(q)
        direct = self.num_splits == 1
        part_o = out if direct else self.part_o
        part_lse = out if direct else self.part_lse
        attend[(b * kv, self.row_tiles, self.num_splits)](
            q, k_cache, v_cache, self.key_len, out, part_o, part_lse, hd ** -0.5 * LOG2_E, t, k_cache.shape[1],
            self.num_splits, self.split_rows, H=heads, KV=kv, HD=hd, BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N,
            DIRECT=direct, PDL=self.pdl, num_warps=self.WARPS, num_stages=self.STAGES, **launch_kwargs(self.pdl),
        )
        if not direct:
            packed = t * (heads // kv)
            merge[(b * kv, packed)](
                self.part_o, self.part_lse, out, t, self.num_splits, H=heads, KV=kv, HD=hd,
                SPLITS_P2=max(2, 1 << (self.num_splits - 1).bit_length()), PDL=self.pdl, num_warps=4,
                **launch_kwargs(self.pdl),
            )
        return out.view(b, t, heads * hd)
