"""The causal video DiT (Wan2.1 family) with action conditioning and a fixed learned context.

Parameter names and shapes follow Self-Forcing / CausVid's `CausalWanModel`
(wan/modules/causal_model.py) so their checkpoints load key for key (worldmodels/loader.py):
`patch_embedding`, `text_embedding.{0,2}`, `time_embedding.{0,2}`, `time_projection.1`,
`blocks.{i}.{self_attn,cross_attn}.{q,k,v,o,norm_q,norm_k}`, `blocks.{i}.norm3`,
`blocks.{i}.ffn.{0,2}`, `blocks.{i}.modulation`, `head.head`, `head.modulation`.
Ours adds `action_embedding.{0,2}` (the action chunk, embedded per latent frame and added to
the timestep embedding, so it reaches every block's modulation and the head's) and
`context_tokens` (num_contexts x context_len x text_dim: a learned stand-in for the T5 prompt,
fed through the same `text_embedding`; with a real checkpoint one may load a real prompt
embedding there).

Everything is batched over "items" (one stream's chunk at one denoise step): per-item timestep,
actions, context id, RoPE offset and past K/V, so the server can run one block over many
streams' items at once. Per-frame modulation (n, F, 6, width) as in CausalWanModel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldmodels.config import WorldModelConfig
from worldmodels.functional import RopeTables, apply_rope, patchify, sinusoidal_embedding, unpatchify


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # WanRMSNorm: x / rms(x) in float32, times the weight. One fused call (it accumulates in
        # float32 for bf16 inputs; Wan rounds to bf16 before the weight: a last-bit difference)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """q, k, v, o projections with RMS-normalised q and k over the full width (Wan)."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """x (1 + scale) + shift with per-frame shift/scale (n, F, d): tokens of frame f use row f."""
    n, length, d = x.shape
    frames = shift.shape[1]
    xf = x.view(n, frames, length // frames, d)
    return torch.addcmul(shift[:, :, None], xf, 1 + scale[:, :, None]).view(n, length, d)


def add_gated(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """x + y * gate with a per-frame gate (n, F, d), as one kernel."""
    n, length, d = y.shape
    frames = gate.shape[1]
    view = (n, frames, length // frames, d)
    return torch.addcmul(x.view(view), y.view(view), gate[:, :, None]).view(n, length, d)


class WanBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.self_attn = Attention(dim, num_heads, eps)
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
        self.cross_attn = Attention(dim, num_heads, eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.fused_qkv: tuple[Tensor, Tensor] | None = None  # (weight, bias), see fuse()

    def fuse(self) -> None:
        """Concatenate q/k/v into one GEMM (inference); call again after changing weights."""
        att = self.self_attn
        with torch.no_grad():
            weight = torch.cat([att.q.weight, att.k.weight, att.v.weight], dim=0).contiguous()
            bias = torch.cat([att.q.bias, att.k.bias, att.v.bias], dim=0).contiguous()
        current = self.fused_qkv
        if current is not None and current[0].shape == weight.shape and current[0].device == weight.device:
            self.fused_qkv[0].copy_(weight)  # in place: captured CUDA graphs keep their pointers
            self.fused_qkv[1].copy_(bias)
        else:
            self.fused_qkv = (weight, bias)

    def context_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention K/V of embedded context tokens (c, Lctx, dim) -> (c, Lctx, H, D)."""
        att = self.cross_attn
        return att.heads(att.norm_k(att.k(context))), att.heads(att.v(context))

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        att = self.self_attn
        if self.fused_qkv is not None:
            q, k, v = F.linear(h, *self.fused_qkv).chunk(3, dim=-1)
        else:
            q, k, v = att.q(h), att.k(h), att.v(h)
        return att.heads(att.norm_q(q)), att.heads(att.norm_k(k)), att.heads(v)

    def forward(
        self,
        x: Tensor,
        e0: Tensor,
        rope: tuple[Tensor, Tensor],
        ctx_kv: tuple[Tensor, Tensor],
        past_kv: tuple[Tensor, Tensor] | None = None,
        past_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (n, L, d); e0 (n, F, 6, d); rope cos/sin (n, L, D/2); ctx_kv (n, Lctx, H, D) each;
        past_kv (n, Lp, H, D) each, attended together with the chunk's own tokens (block-causal:
        the chunk sees itself bidirectionally and its past); past_mask (n, Lp) marks real past
        tokens (None: all real). Returns x and the chunk's own RoPE'd K and V (n, L, H, D)."""
        mod = (self.modulation.unsqueeze(1) + e0).unbind(2)  # 6 x (n, F, d)
        h = modulate(self.norm1(x), mod[0], mod[1])
        q, k, v = self.qkv(h)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        x = add_gated(x, self._self_attention(q, k, v, past_kv, past_mask), mod[2])
        x = x + self._cross_attention(self.norm3(x), ctx_kv)
        x = add_gated(x, self.feed_forward(modulate(self.norm2(x), mod[3], mod[4])), mod[5])
        return x, k, v

    def feed_forward(self, h: Tensor) -> Tensor:
        """ffn.2(gelu_tanh(ffn.0(h))); on CUDA the GELU runs in cuBLASLt's GEMM epilogue."""
        up, down = self.ffn[0], self.ffn[2]
        if h.is_cuda:
            flat = torch._addmm_activation(up.bias, h.reshape(-1, h.shape[-1]), up.weight.t(), use_gelu=True)
            return down(flat.view(*h.shape[:-1], -1))
        return down(F.gelu(up(h), approximate="tanh"))

    def _self_attention(self, q, k, v, past_kv, past_mask) -> Tensor:
        keys, values, mask = k, v, None
        if past_kv is not None and past_kv[0].shape[1] > 0:
            keys = torch.cat([past_kv[0], k], dim=1)
            values = torch.cat([past_kv[1], v], dim=1)
            if past_mask is not None:
                own = past_mask.new_ones(past_mask.shape[0], k.shape[1])
                mask = torch.cat([past_mask, own], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )
        return self.self_attn.o(out.transpose(1, 2).flatten(2))

    def _cross_attention(self, h: Tensor, ctx_kv: tuple[Tensor, Tensor]) -> Tensor:
        att = self.cross_attn
        q = att.heads(att.norm_q(att.q(h)))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), ctx_kv[0].transpose(1, 2), ctx_kv[1].transpose(1, 2))
        return att.o(out.transpose(1, 2).flatten(2))


class Head(nn.Module):
    def __init__(self, dim: int, out_features: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out_features)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: Tensor, e: Tensor) -> Tensor:
        mod = (self.modulation.unsqueeze(1) + e[:, :, None]).unbind(2)  # shift, scale (n, F, d)
        return self.head(modulate(self.norm(x), mod[0], mod[1]))


class CausalWanDiT(nn.Module):
    def __init__(self, cfg: WorldModelConfig):
        super().__init__()
        d = cfg.dit
        self.cfg = cfg
        dim = d.width
        self.patch = (d.patch_size[1], d.patch_size[2])
        self.patch_embedding = nn.Conv3d(d.latent_channels, dim, kernel_size=tuple(d.patch_size),
                                         stride=tuple(d.patch_size))
        self.text_embedding = nn.Sequential(nn.Linear(d.text_dim, dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(d.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        action_in = d.actions_per_frame * (d.action_dim + 1)
        self.action_embedding = nn.Sequential(nn.Linear(action_in, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.context_tokens = nn.Parameter(torch.randn(d.num_contexts, d.context_len, d.text_dim))
        self.blocks = nn.ModuleList(WanBlock(dim, d.ffn_dim, d.num_heads, d.eps) for _ in range(d.num_blocks))
        self.head = Head(dim, d.patch_size[1] * d.patch_size[2] * d.latent_channels, d.eps)
        h, w = cfg.latent_hw
        self.grid = (cfg.frames_per_chunk, h // self.patch[0], w // self.patch[1])
        self.rope = RopeTables(d.head_dim, d.max_frames, self.grid)
        self._clip_tables: dict[tuple, RopeTables] = {}
        self._context_cache: list[tuple[Tensor, Tensor]] | None = None
        self.init_weights()

    # ------------------------------------------------------------------ weights
    def init_weights(self) -> None:
        """Wan's init (xavier linears, zero biases, N(0, 0.02) embeddings), except that the head
        is random too (Wan zeroes it; a zero head would make random weights generate nothing)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding, self.action_embedding):
            for m in seq.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        if self.cfg.dit.action_init == "zero":
            nn.init.zeros_(self.action_embedding[2].weight)
        self.refresh()

    def refresh(self) -> None:
        """Drop weight-derived caches (context K/V, fused QKV); call after changing weights."""
        self._context_cache = None
        for block in self.blocks:
            if block.fused_qkv is not None:
                block.fuse()

    def fuse(self) -> None:
        for block in self.blocks:
            block.fuse()

    # ------------------------------------------------------------------ pieces
    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    def embed(self, latents: Tensor) -> Tensor:
        """(n, F, C, h, w) -> tokens (n, L, width) (the conv3d patch embedding as one GEMM)."""
        weight = self.patch_embedding.weight.flatten(1)
        return F.linear(patchify(latents.to(weight.dtype), self.patch), weight, self.patch_embedding.bias)

    def conditioning(self, t: Tensor, actions_pf: Tensor) -> tuple[Tensor, Tensor]:
        """Per item timestep t (n,) and per-frame actions (n, F, A*(dim+1)) -> e (n, F, width)
        for the head and e0 (n, F, 6, width) for the blocks."""
        freq = sinusoidal_embedding(self.cfg.dit.freq_dim, t).to(self.dtype)
        e = self.time_embedding(freq)[:, None, :] + self.action_embedding(actions_pf.to(self.dtype))
        e0 = self.time_projection(e).unflatten(-1, (6, e.shape[-1]))
        return e, e0

    def context_kv(self) -> list[tuple[Tensor, Tensor]]:
        """Per block the cross-attention K/V of every context table (computed once per weights)."""
        if self._context_cache is None:
            with torch.no_grad():
                ctx = self.text_embedding(self.context_tokens.to(self.dtype))
                self._context_cache = [block.context_kv(ctx) for block in self.blocks]
        return self._context_cache

    def readout(self, x: Tensor, e: Tensor, frames: int) -> Tensor:
        """Head -> velocity (n, F, C, h, w)."""
        out = self.head(x, e)
        return unpatchify(out, frames, self.cfg.latent_hw, self.patch, self.cfg.dit.latent_channels).float()

    # ------------------------------------------------------------------ one chunk, plain
    def forward_chunk(
        self,
        latents: Tensor,
        t: Tensor,
        actions_pf: Tensor,
        frame0: Tensor,
        ctx_ids: Tensor,
        past: list[tuple[Tensor, Tensor]] | None = None,
        past_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Velocity of a chunk (n, F, C, h, w) at timestep t given per-block past K/V; returns
        the velocity and the chunk's own K/V per block (what a cache stores)."""
        frames = latents.shape[1]
        x = self.embed(latents)
        e, e0 = self.conditioning(t, actions_pf)
        rope = self.rope_for(frame0, frames)
        new_kv = []
        for index, block in enumerate(self.blocks):
            ck, cv = self.context_kv()[index]
            x, k, v = block(x, e0, rope, (ck[ctx_ids], cv[ctx_ids]), None if past is None else past[index], past_mask)
            new_kv.append((k, v))
        return self.readout(x, e, frames), new_kv

    def rope_for(self, frame0: Tensor, frames: int) -> tuple[Tensor, Tensor]:
        tables = self.rope
        if frames != self.grid[0]:  # other clip lengths (the whole-clip baseline): a table of that length
            key = ("clip", frames)
            if key not in self._clip_tables:
                self._clip_tables[key] = RopeTables(self.cfg.dit.head_dim, self.cfg.dit.max_frames,
                                                    (frames, *self.grid[1:]))
            tables = self._clip_tables[key]
        tables.check(int(frame0.max()) + frames - 1)
        return tables.cos_sin(frame0, self.dtype, self.device)


def build_model(cfg: WorldModelConfig, device: str | torch.device = "cpu") -> CausalWanDiT:
    """Random weights from cfg.seed (built directly on `device`), or cfg.checkpoint when set."""
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = CausalWanDiT(cfg)
    if cfg.checkpoint:
        from worldmodels.loader import load_checkpoint

        load_checkpoint(model, cfg.checkpoint)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    return model.to(dtype).eval().requires_grad_(False)
