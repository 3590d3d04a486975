"""SigLIP's self-attention read straight from the fused QKV projection, in Triton.

Why: the vision tower's heads are 72 wide. Library kernels pad them to 128 (cuDNN's SDPA kernel on
the H200 ran at ~60 TFLOP/s, 4.5 ms of LIBERO b64's 51 ms vision stage), and SDPA needs q, k, v as
strided views of the projection. Here a head is split into a power-of-two part (64) and a 16-wide
rest (72 = 64 + 8, padded to 16), so the dots waste 11% instead of 78%, and q, k, v are read in
place from the (N * T, 3 * H * hd) projection; the output is (N * T, H * hd), the layout the
output projection reads. No mask: every image token attends to every token of its image.

`vision_attention_reference` is the plain-PyTorch twin (the CPU path and the tests' reference).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

LOG2_E = 1.4426950408889634  # scores are scaled into log2 units so the softmax runs on exp2


def head_split(head_dim: int) -> tuple[int, int]:
    """(main, rest): main the largest power of two <= head_dim, rest the remainder padded to a power
    of two >= 16 (tl.dot's smallest K), or 0 when head_dim is a power of two."""
    if head_dim < 16:
        raise ValueError(f"vision attention needs head_dim >= 16, got {head_dim}")
    main = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - main
    return main, 0 if rest == 0 else max(16, 1 << (rest - 1).bit_length())


def vision_attention_reference(qkv: Tensor, images: int, heads: int) -> Tensor:
    """qkv (N * T, 3 * H * hd) -> (N * T, H * hd): softmax(q k^T / sqrt(hd)) v per image and head."""
    rows, width3 = qkv.shape
    tokens, hd = rows // images, width3 // (3 * heads)
    q, k, v = qkv.view(images, tokens, 3, heads, hd).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, heads * hd)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def vision_attention_kernel(
        qkv_ptr, out_ptr, tokens, qk_scale,
        H: tl.constexpr, HD: tl.constexpr, MAIN: tl.constexpr, REST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        image_head = tl.program_id(0)
        image = image_head // H
        head = image_head % H
        row_stride = 3 * H * HD
        base = qkv_ptr + image * tokens * row_stride + head * HD  # q of (image, token 0, head)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < tokens
        d0 = tl.arange(0, MAIN)
        q0 = tl.load(base + m[:, None] * row_stride + d0[None, :], mask=m_ok[:, None], other=0.0)
        acc0 = tl.zeros([BLOCK_M, MAIN], tl.float32)
        if REST > 0:
            d1 = MAIN + tl.arange(0, REST)
            d1_ok = d1 < HD
            q1 = tl.load(base + m[:, None] * row_stride + d1[None, :], mask=m_ok[:, None] & d1_ok[None, :], other=0.0)
            acc1 = tl.zeros([BLOCK_M, REST], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        k_base = base + H * HD
        v_base = base + 2 * H * HD
        for n0 in range(0, tokens, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < tokens
            k0 = tl.load(k_base + n[:, None] * row_stride + d0[None, :], mask=n_ok[:, None], other=0.0)
            scores = tl.dot(q0, tl.trans(k0))
            if REST > 0:
                k1 = tl.load(k_base + n[:, None] * row_stride + d1[None, :], mask=n_ok[:, None] & d1_ok[None, :],
                             other=0.0)
                scores += tl.dot(q1, tl.trans(k1))
            scores = tl.where(n_ok[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v0 = tl.load(v_base + n[:, None] * row_stride + d0[None, :], mask=n_ok[:, None], other=0.0)
            acc0 = acc0 * alpha[:, None] + tl.dot(p.to(v0.dtype), v0)
            if REST > 0:
                v1 = tl.load(v_base + n[:, None] * row_stride + d1[None, :], mask=n_ok[:, None] & d1_ok[None, :],
                             other=0.0)
                acc1 = acc1 * alpha[:, None] + tl.dot(p.to(v1.dtype), v1)
            m_i = m_new
        out_base = out_ptr + image * tokens * H * HD + head * HD
        out_rows = out_base + m[:, None] * (H * HD)
        tl.store(out_rows + d0[None, :], (acc0 / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        if REST > 0:
            tl.store(out_rows + d1[None, :], (acc1 / l_i[:, None]).to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & d1_ok[None, :])

    return vision_attention_kernel


# H200 sweep (experiments/sweep_large_batch.py): 64 x 64 blocks, 4 warps.
DEFAULT_BLOCKS = (64, 64, 4, 2)


def vision_attention_triton(qkv: Tensor, images: int, heads: int,
                            blocks: tuple[int, int, int, int] = DEFAULT_BLOCKS) -> Tensor:
    """The Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); blocks = (BLOCK_M, BLOCK_N, warps, stages)."""
    rows, width3 = qkv.shape
    if width3 % (3 * heads) or rows % images:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not split into {images} images x 3 x {heads} heads")
    if not qkv.is_contiguous():
        raise ValueError("vision attention reads the QKV projection in place: qkv must be contiguous")
    tokens, hd = rows // images, width3 // (3 * heads)
    main, rest = head_split(hd)
    block_m, block_n, warps, stages = blocks
    out = torch.empty(rows, heads * hd, dtype=qkv.dtype, device=qkv.device)
    grid = (images * heads, -(-tokens // block_m))
    _kernel()[grid](qkv, out, tokens, hd ** -0.5 * LOG2_E, H=heads, HD=hd, MAIN=main, REST=rest,
                    BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out
