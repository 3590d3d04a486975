"""Analytic FLOPs of one model pass over a chunk (for MFU) and memory sizes.

Per block and token: self-attention q, k, v, o (4 d^2), cross-attention q and o (2 d^2; its K/V
come from the fixed context, computed once), FFN (2 d f): 2 FLOP per multiply-add. Attention:
QK^T and PV over the keys a token sees (2 x 2 x keys x d per token), self and cross.
"""

from __future__ import annotations

from dataclasses import dataclass

from worldmodels.config import WorldModelConfig


@dataclass(frozen=True)
class PassFlops:
    block_gemm: float  # the linear layers of all blocks
    attention: float  # QK^T and PV, self + cross
    other: float  # patch embedding, head, conditioning (small)

    @property
    def total(self) -> float:
        return self.block_gemm + self.attention + self.other


def pass_flops(cfg: WorldModelConfig, tokens: int | None = None, keys: int | None = None,
               context_len: int | None = None) -> PassFlops:
    """One pass of `tokens` query tokens (default: a chunk) seeing `keys` self-attention keys
    (default: a full window of W chunks plus its own)."""
    d, f, blocks = cfg.dit.width, cfg.dit.ffn_dim, cfg.dit.num_blocks
    tokens = cfg.chunk_tokens if tokens is None else tokens
    keys = (cfg.context_chunks + 1) * cfg.chunk_tokens if keys is None else keys
    ctx = cfg.dit.context_len if context_len is None else context_len
    per_token_gemm = 2 * (6 * d * d + 2 * d * f)
    block_gemm = blocks * tokens * per_token_gemm
    attention = blocks * tokens * 4 * d * (keys + ctx)
    patch = cfg.dit.latent_channels * cfg.dit.patch_size[1] * cfg.dit.patch_size[2]
    other = tokens * 2 * d * patch * 2 + cfg.frames_per_chunk * 2 * 6 * d * d
    return PassFlops(float(block_gemm), float(attention), float(other))


def block_parameters(cfg: WorldModelConfig) -> int:
    """Parameters of the blocks (Wan2.1-1.3B: 1.39B): two attentions (8 d^2 + 8 d), their q/k RMS
    norms (4 d), norm3 (2 d), the FFN (2 d f + f + d), the modulation (6 d)."""
    d, f = cfg.dit.width, cfg.dit.ffn_dim
    per_block = 8 * d * d + 8 * d + 4 * d + 2 * d + 2 * d * f + f + d + 6 * d
    return cfg.dit.num_blocks * per_block


def kv_bytes(cfg: WorldModelConfig, streams: int) -> int:
    """The K/V pages `streams` streams reserve on a one-stage ring."""
    return streams * cfg.kv_pages_per_stream() * cfg.kv_bytes_per_page()
