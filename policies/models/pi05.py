"""The pi0.5 flow VLA: SigLIP + Gemma prefix over images and prompt, Gemma action expert with AdaRMS.

What each piece mirrors in LeRobot 0.6.1 (`lerobot/policies/pi05/modeling_pi05.py`):
- `embed_prefix`     <- `PI05Pytorch.embed_prefix`: per camera SigLIP tokens (pad mask = the
  camera's image mask), then the prompt tokens embedded and scaled by sqrt(width) in the
  embedding dtype (transformers 5.5.4 `GemmaTextScaledWordEmbedding`); all prefix tokens attend
  bidirectionally to every valid prefix token (att_masks all 0).
- `compute_prefix_cache` <- `PI05Pytorch.sample_actions` prefix pass (PiGemmaModel with
  use_cache): positions = cumsum(pad) - 1, K/V after RoPE kept per layer. We stop the last layer
  after its K/V projection: its attention output, MLP and the final norm only feed the prefix
  hidden states, which pi0.5 never reads when sampling actions (exact, saves 1/depth).
- `time_conditioning` <- `PI05Pytorch.embed_suffix`: sincos(t) (min/max period 4e-3 / 4.0,
  float64 math) -> time_mlp_in -> silu -> time_mlp_out -> silu = the AdaRMS condition.
- `modulation_table` <- the `dense` layers of every expert `PiGemmaRMSNorm`: (N, 2L+1, 3W)
  [scale, shift, gate] per norm. It depends on weights and t only, so sampling computes it once
  per call for the K grid times (the fast path can precompute it once per weight version).
- `velocity` <- `PI05Pytorch.denoise_step`: action_in_proj(x_t) -> expert layers whose queries
  attend to [prefix K/V (pad-masked), own K/V] (suffix att_masks [1, 0, ...]: one bidirectional
  block that the prefix cannot see), positions = n_valid_prefix + arange(H), final AdaRMS norm,
  fp32 action_out_proj.
- `apply_precision("bfloat16")` <- `PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`:
  everything bf16 except vision tower + projector and all norms (incl. AdaRMS dense) in fp32;
  action_in/out_proj and the time MLP stay fp32 because LeRobot never casts them.
Padded prefix tokens: LeRobot masks them as queries and keys with a finite -2.38e38; we mask
them only as keys (their own outputs are never read), which keeps every row finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.config import check_choice
from policies.config import DTYPES, PolicyConfig
from policies.flow import sincos_time_embedding
from policies.models.gemma import AdaRMSNorm, GemmaStack, RMSNorm, apply_rope, grouped_attention, join_keys
from policies.models.siglip import SiglipVision


@dataclass
class PrefixCache:
    """What every denoise step needs from the prefix: per-layer K/V and the key mask."""

    keys: list[Tensor]  # per expert layer (B, KV, P, hd), RoPE applied
    values: list[Tensor]  # per expert layer (B, KV, P, hd)
    pad_mask: Tensor  # (B, P) bool, True = valid prefix token
    offsets: Tensor  # (B,) number of valid prefix tokens = first expert position

    def index_select(self, index: Tensor) -> PrefixCache:
        return PrefixCache(
            [k[index] for k in self.keys],
            [v[index] for v in self.values],
            self.pad_mask[index],
            self.offsets[index],
        )

    @staticmethod
    def cat(caches: list[PrefixCache]) -> PrefixCache:
        """The caches' rows one after another (one cache: itself, no copy)."""
        if len(caches) == 1:
            return caches[0]
        return PrefixCache(
            [torch.cat(layer) for layer in zip(*[c.keys for c in caches], strict=True)],
            [torch.cat(layer) for layer in zip(*[c.values for c in caches], strict=True)],
            torch.cat([c.pad_mask for c in caches]),
            torch.cat([c.offsets for c in caches]),
        )


class PI05Model(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        ew = cfg.expert.width
        self.vision = SiglipVision(cfg.vision, cfg.prefix.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.prefix.width)
        self.prefix = GemmaStack(cfg.prefix)
        self.expert = GemmaStack(cfg.expert, cond_dim=ew)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, ew)
        self.action_out_proj = nn.Linear(ew, cfg.max_action_dim)
        self.time_mlp_in = nn.Linear(ew, ew)
        self.time_mlp_out = nn.Linear(ew, ew)

    # ----- weights -----
    @torch.no_grad()
    def init_weights(self, seed: int, scale: float = 1.0) -> None:
        """Random init, deterministic in `seed` per device type (the generator lives on the
        parameters' device, so a 3B model initialises in place). Matrices, convolutions and
        embeddings: N(0, (scale / sqrt(fan_in))^2) with fan_in = row size, which keeps every
        activation O(1) at any width (so the small presets are as sensitive as the full one);
        biases 0; RMSNorm offsets 0; LayerNorm 1/0. AdaRMS dense: the same weights, bias 0 for
        scale/shift and 1 for the gate, so the random expert starts as a residual net whose
        norms depend on t (LeRobot zero-inits the dense weight, making t irrelevant at init)."""
        device = self.action_in_proj.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        for p in self.parameters():
            if p.dim() >= 2:
                std = scale / math.sqrt(p[0].numel())
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * std)
            else:
                p.zero_()
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, AdaRMSNorm):
                m.dense.bias[2 * m.dense.out_features // 3 :] = 1.0

    def apply_precision(self, dtype: str) -> PI05Model:
        if dtype == "float32":
            return self.to(torch.float32)
        if dtype != "bfloat16":
            raise ValueError(f"policy.dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.to(torch.bfloat16)
        keep_fp32 = [
            self.vision,
            self.action_in_proj,
            self.action_out_proj,
            self.time_mlp_in,
            self.time_mlp_out,
        ]
        keep_fp32 += [m for m in self.modules() if isinstance(m, (RMSNorm, AdaRMSNorm))]
        for module in keep_fp32:
            module.float()
        return self

    def frozen_modules(self) -> list[nn.Module]:
        """What policy.train_expert_only freezes: every module but trainable_parameters(True)'s."""
        return [self.vision, self.embed_tokens, self.prefix]

    def apply_frozen_precision(self, dtype: str) -> PI05Model:
        """The frozen modules' weights in `dtype`, the prefix's RMSNorm weights in fp32 (apply_precision's rule).
        A trainer keeps fp32 masters of what it updates; of the rest it needs no master copy, and in bf16 autocast
        then casts none of those weights and the prefix's activations stay bf16."""
        check_choice("policy.frozen_dtype", dtype, DTYPES)  # PolicyConfig's own check, for direct callers
        for module in self.frozen_modules():
            module.to(getattr(torch, dtype))
        for module in self.prefix.modules():
            if isinstance(module, RMSNorm):
                module.float()
        return self

    # ----- prefix -----
    def embed_prefix(
        self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """images (B, C, 3, R, R) in [-1, 1], image_masks (B, C) bool, tokens/token_mask (B, L)
        -> embeddings (B, C*N + L, W) and pad mask (B, C*N + L). All cameras go through SigLIP in
        one batch (B*C images)."""
        b, c = images.shape[:2]
        img = self.vision(images.flatten(0, 1).to(self.vision.patch_embed.weight.dtype))
        n = img.shape[1]
        img = img.view(b, c * n, -1)
        img_pad = image_masks[:, :, None].expand(b, c, n).reshape(b, c * n)
        lang = self.embed_language(tokens)
        # torch.cat promotes (fp32 image tokens + bf16 text in bf16 mode -> fp32), as LeRobot's cat does
        return torch.cat(
            [img, lang.to(torch.promote_types(img.dtype, lang.dtype))], dim=1
        ), torch.cat([img_pad, token_mask.bool()], dim=1)

    def embed_language(self, tokens: Tensor) -> Tensor:
        weight = self.embed_tokens.weight
        scale = torch.tensor(
            self.cfg.prefix.width**0.5, dtype=torch.float32, device=weight.device
        ).to(weight.dtype)
        return self.embed_tokens(tokens) * scale

    def compute_prefix_cache(self, embeddings: Tensor, pad_mask: Tensor) -> PrefixCache:
        stack = self.prefix
        h = embeddings.to(stack.compute_dtype)
        positions = torch.cumsum(pad_mask.long(), dim=1) - 1
        cos, sin = stack.rope(positions, h.dtype)
        key_mask = pad_mask[:, None, None, :]
        keys, values = [], []
        last = len(stack.layers) - 1
        for i, layer in enumerate(stack.layers):
            normed = layer.input_norm(h)
            if i == last:
                k, v = layer.project_kv(normed)
                keys.append(apply_rope(k, cos, sin))
                values.append(v)
                break
            q, k, v = layer.project_qkv(normed)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys.append(k)
            values.append(v)
            attn = grouped_attention(q, k, v, key_mask)
            h = h + layer.attention_output(attn)
            h = h + layer.mlp(layer.post_norm(h))
        return PrefixCache(keys, values, pad_mask, pad_mask.sum(dim=1))

    def prefix_cache(
        self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_mask: Tensor
    ) -> PrefixCache:
        return self.compute_prefix_cache(
            *self.embed_prefix(images, image_masks, tokens, token_mask)
        )

    # ----- time conditioning (weight-derived tables) -----
    def time_conditioning(self, t: Tensor) -> Tensor:
        """t (N,) float32 -> AdaRMS condition (N, expert width)."""
        emb = sincos_time_embedding(
            t, self.cfg.expert.width, self.cfg.min_period, self.cfg.max_period
        )
        x = F.silu(self.time_mlp_in(emb.to(self.time_mlp_in.weight.dtype)))
        return F.silu(self.time_mlp_out(x))

    def modulation_table(self, t: Tensor) -> Tensor:
        """t (N,) -> (N, 2L+1, 3W): [scale, shift, gate] of every expert AdaRMS norm."""
        cond = self.time_conditioning(t)
        return torch.stack([norm.modulation(cond) for norm in self.expert.adaptive_norms()], dim=1)

    # ----- one denoise step -----
    def velocity(self, cache: PrefixCache, x_t: Tensor, modulation: Tensor) -> Tensor:
        """x_t (B, H, D) fp32, modulation (B or 1, 2L+1, 3W) -> v_t (B, H, D) fp32."""
        stack = self.expert
        h = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(stack.compute_dtype)
        b, s, _ = h.shape
        positions = cache.offsets[:, None] + torch.arange(s, device=h.device)[None, :]
        cos, sin = stack.rope(positions, h.dtype)
        key_mask = torch.cat([cache.pad_mask, cache.pad_mask.new_ones(b, s)], dim=1)[
            :, None, None, :
        ]
        for i, layer in enumerate(stack.layers):
            normed, gate = layer.input_norm(h, modulation[:, 2 * i])
            q, k, v = layer.project_qkv(normed)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = grouped_attention(q, join_keys(cache.keys[i], k), join_keys(cache.values[i], v), key_mask)
            h = h + layer.attention_output(attn) * gate
            normed, gate = layer.post_norm(h, modulation[:, 2 * i + 1])
            h = h + layer.mlp(normed) * gate
        out, _ = stack.final_norm(h, modulation[:, -1])
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()

    def trainable_parameters(self, expert_only: bool) -> list[nn.Parameter]:
        if not expert_only:
            return list(self.parameters())
        modules = [
            self.expert,
            self.action_in_proj,
            self.action_out_proj,
            self.time_mlp_in,
            self.time_mlp_out,
        ]
        return [p for m in modules for p in m.parameters()]
