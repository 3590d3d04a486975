"""The fast sampler's per-layer operations around its kernels: SigLIP's patch embedding as one GEMM, the
projections (cuBLAS, the skinny kernel's split-K partials, FP8 shadows) and the residual + norm that consumes
each of them."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from policies.fast import fp8, skinny
from policies.fast import kernels as K


def patch_embed(images: Tensor, patch, pos: Tensor, size: int) -> Tensor:
    """SigLIP's patch embedding, (N, 3, R, R) -> (N * R*R/size^2, width) with the position embedding
    added: the stride-`size` convolution as one GEMM over the unfolded patches (on the H200 cuDNN's
    convolution plus its NCHW/NHWC layout kernels took ~2 ms at 128 images; the GEMM ~0.1 ms)."""
    n, c, res, _ = images.shape
    side = res // size
    patches = images.view(n, c, side, size, side, size).permute(0, 2, 4, 1, 3, 5).reshape(n * side * side, -1)
    x = F.linear(patches, patch.weight.view(patch.weight.shape[0], -1), patch.bias)
    return x.view(n, side * side, -1).add_(pos).view(n * side * side, -1)


def project(x: Tensor, lw, tile, pdl_code: int = 0) -> Tensor:
    """x (M, K) @ W^T: cuBLAS (M, N) in x's dtype, or the skinny kernel's (splits, M, N) fp32 partials,
    which the consumer (rope_scatter_qkv, add_norm) sums."""
    if tile is None:
        return F.linear(x, lw.weight)
    return skinny.skinny_linear(x, lw.weight, tile, pdl=pdl_code)


def project_tail(x: Tensor, lw, skip: int) -> Tensor:
    """The projection's output columns from `skip` on (the last prefix layer's K/V without its q:
    ~80% of that layer's qkv GEMM); FP8 shadows only project whole (skip 0)."""
    if skip == 0:
        return fp8.project(x, lw)
    bias = lw.bias[skip:] if lw.bias is not None else None
    return F.linear(x, lw.weight[skip:], bias)


def add_projection_norm(h: Tensor, x: Tensor, lw, norm_weight: Tensor, eps: float,
                         act: str = "none") -> tuple[Tensor, Tensor]:
    """h += act(x) W^T in place, then Gemma's RMSNorm of h: (h, normed). A bias-free bf16 projection adds
    into h in cuBLAS's GEMM epilogue (addmm, beta 1), so the norm kernel reads h once instead of
    reading h and the projection and writing h back (H200, experiments/sweep_large_batch.py: prefix
    o 589 -> 555 us and down 3.44 -> 3.39 ms per layer at LIBERO b64). On the H200 the actions at
    batch 32 and 64 came out bit-identical to the separate add's (cuBLAS's beta-add epilogue rounds
    the product to bf16 before adding there); at batch 1 they moved within the parity tolerance.
    An FP8 projection keeps the add in the norm kernel (torch._scaled_mm has no beta)."""
    if lw.fp8 is None and lw.bias is None:
        h.addmm_(fp8.activated(x, act), lw.weight.t())
        return K.add_rms_norm(h, None, None, norm_weight, None, eps)
    return K.add_rms_norm(h, fp8.project(x, lw, act), None, norm_weight, None, eps)


def add_norm(h: Tensor, y: Tensor, gate, scale, shift, eps, pdl_code: int = 0):
    if y.dim() == 3:  # split-K partials
        return K.add_rms_norm_partials(h, y, gate, scale, shift, eps, pdl_code)
    return K.add_rms_norm(h, y, gate, scale, shift, eps, pdl_code)
