"""SigLIP vision tower + PaliGemma multi-modal projector, with a fused QKV weight per layer.

Mirrors transformers 5.5.4 `models/siglip/modeling_siglip.py` as LeRobot 0.6.1 configures it
(`PaliGemmaWithExpertModel.__init__`: So400m/14, intermediate 4304, `vision_use_head=False`):
- `SiglipVisionEmbeddings`: Conv2d(3, W, P, stride P, "valid", bias) -> flatten -> + a learned
  position embedding per patch (no class token, no interpolation at the trained size).
- `SiglipEncoderLayer` (pre-norm): x + attn(LN1(x)); x + fc2(gelu_tanh(fc1(LN2(x)))); LayerNorm
  eps 1e-6, attention scale head_dim^-0.5, q/k/v/out projections with biases, no mask.
- `SiglipVisionTransformer.post_layernorm` on the last hidden state.
- `PaliGemmaMultiModalProjector.linear` (W -> prefix width, bias). With transformers 5.x
  `PaliGemmaModel.get_image_features` does NOT scale image features (4.x divided them by
  sqrt(text width) to cancel the embedding scaling that moved into the token embedding);
  LeRobot's `embed_image` uses them as they are, and so do we.
Fused layout: `qkv.weight` = cat([q, k, v]) rows, (3W, W); `qkv.bias` likewise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policies.config import VisionConfig


class SiglipBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        w = cfg.width
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(w, 3 * w)
        self.out_proj = nn.Linear(w, w)
        self.ln2 = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(w, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, w)

    def forward(self, x: Tensor) -> Tensor:
        b, n, w = x.shape
        hd = w // self.num_heads
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.num_heads, hd).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.out_proj(attn.transpose(1, 2).reshape(b, n, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class SiglipVision(nn.Module):
    """Images (N, 3, R, R) in [-1, 1] -> projected patch tokens (N, R*R/P^2, out_width)."""

    def __init__(self, cfg: VisionConfig, out_width: int):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(
            3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Parameter(torch.zeros(cfg.num_patches, cfg.width))
        self.layers = nn.ModuleList(SiglipBlock(cfg) for _ in range(cfg.depth))
        self.post_ln = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.projector = nn.Linear(cfg.width, out_width)

    def embed_patches(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images.to(self.patch_embed.weight.dtype))
        return x.flatten(2).transpose(1, 2) + self.position_embedding

    def forward(self, images: Tensor) -> Tensor:
        x = self.embed_patches(images)
        for layer in self.layers:
            x = layer(x)
        return self.projector(self.post_ln(x))
