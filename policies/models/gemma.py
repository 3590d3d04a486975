"""Gemma decoder blocks with fused QKV and gate/up weights, RMSNorm and AdaRMS.

Mirrors transformers 5.5.4 `models/gemma/modeling_gemma.py` and LeRobot 0.6.1
`policies/pi_gemma.py` (PiGemmaRMSNorm, _gated_residual, PiGemmaModel):
- RMSNorm: variance in fp32, x * rsqrt(mean(x^2) + eps) * (1 + w), cast back to x's dtype
  (`PiGemmaRMSNorm` without cond; weights stored as offsets from 1, init 0).
- AdaRMS (the expert's norms, `PiGemmaRMSNorm` with cond): dense(cond) -> [scale, shift, gate]
  (torch.chunk order), out = normed * (1 + scale) + shift; the gate multiplies the residual
  branch (`_gated_residual`: x + y * gate). The final norm uses scale/shift only.
- Attention (`GemmaAttention`, eager): q/k/v without bias, RoPE (`rotate_half`, theta 10000,
  cos/sin computed in fp32 and cast to the activations' dtype), GQA (KV heads repeated),
  scale head_dim^-0.5, o_proj without bias.
- MLP (`GemmaMLP`): down(gelu_tanh(gate(x)) * up(x)) ("gelu_pytorch_tanh").
Fused layout: `qkv.weight` = cat([q (H*hd), k (KV*hd), v (KV*hd)]) rows; `gate_up.weight` =
cat([gate, up]) rows. `q_k_v_weights()` / `gate_up_weights()` give the split views that the
plain reference forward and the loaders use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policies.config import GemmaConfig


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) with the variance in fp32 (result fp32, as LeRobot's `_norm`)."""
    var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """RMSNorm modulated by a conditioning vector; `modulation(cond)` is weight-derived only."""

    def __init__(self, dim: int, cond_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: Tensor) -> Tensor:
        """(N, cond_dim) -> (N, 3 * dim) = [scale, shift, gate], in the dense layer's dtype."""
        return self.dense(cond.to(self.dense.weight.dtype))

    def forward(self, x: Tensor, modulation: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, D), modulation (B or 1, 3D) -> (normed x, gate (B or 1, 1, D)) in x's dtype."""
        scale, shift, gate = modulation[:, None, :].chunk(3, dim=-1)
        normed = rms_normalize(x, self.eps) * (1 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """positions (B, T) -> cos, sin (B, T, head_dim), computed in fp32 then cast (GemmaRotaryEmbedding)."""
    exponent = (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    )
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, heads, T, hd); cos/sin (B, T, hd)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def join_keys(cached: Tensor, new: Tensor) -> Tensor:
    """cat([cached, new], dim=2) in the dtype attention will read it in: under autocast (CPU and CUDA alike put
    scaled_dot_product_attention in their lower-precision lists) each part is cast to the autocast dtype first.
    The same values as casting the promoted join, since a cast is elementwise, and the same gradients, which are
    cast back per part. Why: under bf16 autocast the suffix's keys are fp32 (RoPE in the residual stream's dtype),
    so a plain cat promoted the whole bf16 prefix to fp32 (4 bytes a value, ~84 MB a layer for 128 rows of LIBERO's
    640-slot prefix) only for the attention to cast it back, and its backward cast the prefix's dK/dV up again."""
    device = new.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return torch.cat([cached.to(dtype), new.to(dtype)], dim=2)
    return torch.cat([cached, new], dim=2)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor) -> Tensor:
    """q (B, H, S, hd), k and v (B, KV, T, hd), key_mask (B, 1, 1, T) bool, the same for every query -> (B, H, S, hd).

    The H/KV query heads that share a KV head attend as one sequence of (H/KV)*S queries against that head's keys:
    the same products as repeating K/V per head, but the attention kernel reads each K/V once instead of H/KV
    times and its backward accumulates no per-head dK/dV that are summed afterwards (pi0.5: 8 heads, 1 KV head, and
    the expert's 10-50 queries a row fill an attention tile only after the fold). Exact only because the mask
    does not depend on the query (padding only, no causal part), as in both pi0.5 stacks."""
    b, heads, s, hd = q.shape
    kv = k.shape[1]
    if key_mask.shape[-2] != 1:
        raise ValueError(f"grouped_attention needs a key mask without a query dimension, got {tuple(key_mask.shape)}")
    folded = q.reshape(b, kv, (heads // kv) * s, hd)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=key_mask)
    return out.reshape(b, heads, s, hd)


class GemmaBlock(nn.Module):
    """One decoder layer; AdaRMS norms when `cond_dim` is given (the action expert)."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None):
        super().__init__()
        self.cfg = cfg
        w, hd = cfg.width, cfg.head_dim
        if cond_dim is None:
            self.input_norm: nn.Module = RMSNorm(w, cfg.rms_norm_eps)
            self.post_norm: nn.Module = RMSNorm(w, cfg.rms_norm_eps)
        else:
            self.input_norm = AdaRMSNorm(w, cond_dim, cfg.rms_norm_eps)
            self.post_norm = AdaRMSNorm(w, cond_dim, cfg.rms_norm_eps)
        self.qkv = nn.Linear(w, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, w, bias=False)
        self.gate_up = nn.Linear(w, 2 * cfg.mlp_dim, bias=False)
        self.down = nn.Linear(cfg.mlp_dim, w, bias=False)

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        hd = self.cfg.head_dim
        return self.cfg.num_heads * hd, self.cfg.num_kv_heads * hd, self.cfg.num_kv_heads * hd

    def q_k_v_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv.weight.split(self.qkv_sizes, dim=0)
        return q, k, v

    def gate_up_weights(self) -> tuple[Tensor, Tensor]:
        gate, up = self.gate_up.weight.chunk(2, dim=0)
        return gate, up

    def project_qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h (B, T, W) -> q (B, H, T, hd), k and v (B, KV, T, hd), before RoPE."""
        b, t, _ = h.shape
        hd = self.cfg.head_dim
        q, k, v = self.qkv(h).split(self.qkv_sizes, dim=-1)
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        return q, k, v

    def project_kv(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Only k and v (the last prefix layer needs nothing else)."""
        b, t, _ = h.shape
        _, k_size, v_size = self.qkv_sizes
        weight = self.qkv.weight[-(k_size + v_size) :]
        k, v = F.linear(h, weight).split((k_size, v_size), dim=-1)
        hd = self.cfg.head_dim
        return k.view(b, t, -1, hd).transpose(1, 2), v.view(b, t, -1, hd).transpose(1, 2)

    def attention_output(self, attn: Tensor) -> Tensor:
        """attn (B, H, T, hd) -> o_proj over the merged heads (B, T, W)."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1).to(self.o_proj.weight.dtype))

    def mlp(self, h: Tensor) -> Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class GemmaStack(nn.Module):
    """The layers and final norm of one Gemma (prefix LLM or action expert); no embeddings."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(GemmaBlock(cfg, cond_dim) for _ in range(cfg.depth))
        self.final_norm = (
            RMSNorm(cfg.width, cfg.rms_norm_eps)
            if cond_dim is None
            else AdaRMSNorm(cfg.width, cond_dim, cfg.rms_norm_eps)
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.layers[0].qkv.weight.dtype

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def adaptive_norms(self) -> list[AdaRMSNorm]:
        """All AdaRMS norms in table order: layer i input (2i), layer i post (2i+1), final (2L)."""
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)] + [
            self.final_norm
        ]
        if not all(isinstance(n, AdaRMSNorm) for n in norms):
            raise TypeError("this Gemma stack has no AdaRMS norms (built without cond_dim)")
        return norms  # type: ignore[return-value]
