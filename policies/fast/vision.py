"""The vision stage: SigLIP over every camera image of a bucket, as one batch or as parallel graph branches.

Why branches (`FastSampler.vision_branches`): at batch 1-2 the tower runs 256-768 rows, and each of its
GEMMs is a handful of output tiles on 132 SMs. In the PhyAI b1 stage profile (768 rows) cuBLAS's `o`
and `fc2` ran 112 x 64 tiles, `fc1` 136 tiles of 208 x 128 (one full wave and 4 tiles of a second),
at 300-490 TFLOP/s, and the stage at ~40% of the card's bf16 rate. Images are independent through
the whole tower, so groups of them can run on separate streams of the same graph: one group's
kernels fill the SMs that the other's tile waves leave idle. Each row's result depends only on its
image; the kernels cuBLAS picks for fewer rows may round differently, so a bucket's graph is
consistent with itself (the consistent recompute replays the same graph), not bit-identical to the
one-branch tower.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from policies.fast import fp8
from policies.fast import kernels as K


def image_groups(images: int, branches: int) -> list[int]:
    """`images` split into at most `branches` contiguous groups, as even as possible, larger ones first:
    3 images in 2 -> [2, 1]; never an empty group."""
    if branches < 1:
        raise ValueError(f"vision branches must be >= 1, got {branches}")
    count = min(branches, images)
    base, extra = divmod(images, count)
    return [base + (i < extra) for i in range(count)]


def stage_vision(sampler, bk) -> None:
    """Every camera image of the bucket through the tower into `image_embeddings`; with more than one
    group, group i > 0 on side stream i (forked from and joined back into the current stream: graph
    branches under capture). Off CUDA the groups run one after another."""
    imgs = bk.tensors["images"].flatten(0, 1)
    out = bk.tensors["image_embeddings"].view(imgs.shape[0], -1, sampler.cfg.prefix.width)
    groups = image_groups(imgs.shape[0], sampler.vision_branches)
    cuda = sampler.device.type == "cuda" and len(groups) > 1
    main = torch.cuda.current_stream(sampler.device) if cuda else None
    sides = sampler.vision_streams(len(groups) - 1) if cuda else []
    for side in sides:
        side.wait_stream(main)  # fork: the images are in place
    start = 0
    for i, count in enumerate(groups):
        stream = torch.cuda.stream(sides[i - 1]) if cuda and i else contextlib.nullcontext()
        with stream:
            rows = out[start:start + count].flatten(0, 1)
            vision_tower(sampler.w.vision, sampler.cfg.vision, imgs[start:start + count], rows)
        start += count
    for side in sides:
        main.wait_stream(side)  # join: the prefix reads every image's tokens


def vision_tower(w: dict, cfg, imgs: Tensor, out: Tensor) -> None:
    """SigLIP on imgs (n, 3, R, R) -> out (n * tokens, prefix width): patch embedding, the layers with
    residual + LayerNorm fused (each layer's second norm and the next layer's first), post-norm, the
    projection into the prefix's width."""
    h = patch_embed(imgs, w["patch"], w["pos"], cfg.patch_size)  # residual stream, updated in place
    n, (tok, width) = imgs.shape[0], w["pos"].shape
    layers, eps = w["layers"], cfg.layer_norm_eps
    _, y = K.add_layer_norm(h, None, layers[0]["ln1"].weight, layers[0]["ln1"].bias, eps)
    for i, lw in enumerate(layers):
        qkv = fp8.project(y, lw["qkv"]).view(n, tok, 3, cfg.num_heads, -1)  # FP8 or bf16 (fp8.py)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(n * tok, width)
        attn_out = fp8.project(a, lw["out"])
        h, y = K.add_layer_norm(h, attn_out, lw["ln2"].weight, lw["ln2"].bias, eps)
        mlp = fp8.mlp(y, lw["fc1"], lw["fc2"], "gelu_tanh")
        norm = layers[i + 1]["ln1"] if i + 1 < len(layers) else w["post_ln"]  # next pre-norm, or post_ln
        h, y = K.add_layer_norm(h, mlp, norm.weight, norm.bias, eps)
    out.copy_(fp8.project(y, w["proj"]))


def patch_embed(images: Tensor, patch, pos: Tensor, size: int) -> Tensor:
    """SigLIP's patch embedding, (N, 3, R, R) -> (N * R*R/size^2, width) with the position embedding
    added: the stride-`size` convolution as one GEMM over the unfolded patches (on the H200 cuDNN's
    convolution plus its NCHW/NHWC layout kernels took ~2 ms at 128 images; the GEMM ~0.1 ms)."""
    n, c, res, _ = images.shape
    side = res // size
    patches = images.view(n, c, side, size, side, size).permute(0, 2, 4, 1, 3, 5).reshape(n * side * side, -1)
    x = F.linear(patches, patch.weight.view(patch.weight.shape[0], -1), patch.bias)
    return x.view(n, side * side, -1).add_(pos).view(n * side * side, -1)
