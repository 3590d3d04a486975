"""Plain reference forward of pi0.5: no fused GEMMs, no KV reuse, eager attention.

Written the way LeRobot 0.6.1's eager code runs (`modeling_pi05.compute_layer_complete`, the
joint prefix+expert layer of `PaliGemmaWithExpertModel.forward`; transformers
`eager_attention_forward`; `make_att_2d_masks`, `prepare_attention_masks_4d` with the finite
-2.3819763e38 mask), using split views of our fused weights (q/k/v, gate/up). Every denoise step
reruns SigLIP-free prefix + suffix jointly: each layer concatenates the prefix and expert
queries/keys/values, attends with the 2D block mask, and splits the result back per stream.
It is the slow ground truth the normal path (`PI05Model.prefix_cache` + `velocity`) is tested
against; it reads the same parameters, so it also works on a bf16 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from policies import flow
from policies.models.gemma import GemmaBlock, rms_normalize, rotate_half
from policies.models.pi05 import PI05Model
from policies.models.siglip import SiglipBlock, SiglipVision

MASK_VALUE = -2.3819763e38  # lerobot.utils.constants.OPENPI_ATTENTION_MASK_VALUE


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, additive_mask: Tensor | None, scale: float
) -> Tensor:
    """(B, H, T, hd) x (B, KV, S, hd) -> (B, H, T, hd); softmax in fp32 like transformers."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if additive_mask is not None:
        scores = scores + additive_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def make_att_2d_masks(pad_masks: Tensor, att_masks: Tensor) -> Tensor:
    """big_vision / openpi rule: token i sees valid token j iff cumsum(att)[j] <= cumsum(att)[i]."""
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d = cumsum[:, None, :] <= cumsum[:, :, None]
    return att_2d & (pad_masks[:, None, :] & pad_masks[:, :, None])


def additive_mask(mask_2d: Tensor) -> Tensor:
    return torch.where(mask_2d[:, None], 0.0, MASK_VALUE)


# ----- vision -----
def siglip_block(block: SiglipBlock, x: Tensor) -> Tensor:
    b, n, w = x.shape
    heads, hd = block.num_heads, w // block.num_heads
    h = F.layer_norm(x, (w,), block.ln1.weight, block.ln1.bias, block.ln1.eps)
    wq, wk, wv = block.qkv.weight.chunk(3, dim=0)
    bq, bk, bv = block.qkv.bias.chunk(3, dim=0)
    q, k, v = (
        F.linear(h, wt, bs).view(b, n, heads, hd).transpose(1, 2)
        for wt, bs in ((wq, bq), (wk, bk), (wv, bv))
    )
    attn = eager_attention(q, k, v, None, hd**-0.5).transpose(1, 2).reshape(b, n, w)
    x = x + F.linear(attn, block.out_proj.weight, block.out_proj.bias)
    h = F.layer_norm(x, (w,), block.ln2.weight, block.ln2.bias, block.ln2.eps)
    h = F.gelu(F.linear(h, block.fc1.weight, block.fc1.bias), approximate="tanh")
    return x + F.linear(h, block.fc2.weight, block.fc2.bias)


def siglip(vision: SiglipVision, image: Tensor) -> Tensor:
    """One camera (B, 3, R, R) -> (B, N, prefix width), computed in the tower's dtype."""
    x = vision.embed_patches(image)
    for block in vision.layers:
        x = siglip_block(block, x)
    x = F.layer_norm(
        x, x.shape[-1:], vision.post_ln.weight, vision.post_ln.bias, vision.post_ln.eps
    )
    return F.linear(x, vision.projector.weight, vision.projector.bias)


def embed_prefix(
    model: PI05Model, images: Tensor, image_masks: Tensor, tokens: Tensor, token_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """LeRobot `embed_prefix`: a Python loop over cameras, then the scaled token embeddings."""
    embs, pads = [], []
    for c in range(images.shape[1]):
        emb = siglip(model.vision, images[:, c].to(model.vision.patch_embed.weight.dtype))
        embs.append(emb)
        pads.append(image_masks[:, c, None].expand(emb.shape[0], emb.shape[1]))
    lang = model.embed_tokens.weight[tokens] * torch.tensor(model.cfg.prefix.width**0.5).to(
        model.embed_tokens.weight.dtype
    )
    embs.append(lang)
    pads.append(token_mask.bool())
    dtype = torch.promote_types(embs[0].dtype, lang.dtype)
    return torch.cat([e.to(dtype) for e in embs], dim=1), torch.cat(pads, dim=1)


# ----- gemma -----
def norm(module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """PiGemmaRMSNorm.forward with the AdaRMS dense applied directly to cond."""
    normed = rms_normalize(x, module.eps)
    if cond is None:
        return (normed * (1.0 + module.weight.float())).to(x.dtype), None
    modulation = F.linear(
        cond.to(module.dense.weight.dtype), module.dense.weight, module.dense.bias
    )
    scale, shift, gate = modulation[:, None].chunk(3, dim=-1)
    return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def rope(q: Tensor, positions: Tensor, head_dim: int, theta: float) -> Tensor:
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=q.device).float() / head_dim)
    )
    freqs = (inv_freq[None, :, None] @ positions[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]
    return q * cos + rotate_half(q) * sin


def joint_layer(
    blocks: list[GemmaBlock], streams: list[Tensor], conds: list, mask4d: Tensor, positions: Tensor
) -> list[Tensor]:
    """`compute_layer_complete`: one layer of the prefix and expert streams attending jointly."""
    qs, ks, vs, gates = [], [], [], []
    for block, x, cond in zip(blocks, streams, conds):
        h, gate = norm(block.input_norm, x, cond)
        gates.append(gate)
        b, t, _ = h.shape
        hd = block.cfg.head_dim
        wq, wk, wv = block.q_k_v_weights()
        qs.append(F.linear(h, wq).view(b, t, -1, hd).transpose(1, 2))
        ks.append(F.linear(h, wk).view(b, t, -1, hd).transpose(1, 2))
        vs.append(F.linear(h, wv).view(b, t, -1, hd).transpose(1, 2))
    cfg = blocks[0].cfg
    q = rope(torch.cat(qs, dim=2), positions, cfg.head_dim, cfg.rope_theta)
    k = rope(torch.cat(ks, dim=2), positions, cfg.head_dim, cfg.rope_theta)
    attn = eager_attention(q, k, torch.cat(vs, dim=2), mask4d, cfg.head_dim**-0.5)
    attn = attn.transpose(1, 2).reshape(attn.shape[0], attn.shape[2], -1)
    out, start = [], 0
    for block, x, gate, cond in zip(blocks, streams, gates, conds):
        end = start + x.shape[1]
        y = F.linear(attn[:, start:end].to(block.o_proj.weight.dtype), block.o_proj.weight)
        x = x + y if gate is None else x + y * gate
        h, gate = norm(block.post_norm, x, cond)
        wg, wu = block.gate_up_weights()
        y = F.linear(
            F.gelu(F.linear(h, wg), approximate="tanh") * F.linear(h, wu), block.down.weight
        )
        out.append(x + y if gate is None else x + y * gate)
        start = end
    return out


def velocity(
    model: PI05Model, prefix_embs: Tensor, prefix_pad: Tensor, x_t: Tensor, t: Tensor
) -> Tensor:
    """One full joint forward (prefix recomputed) -> v_t (B, H, D) fp32."""
    cfg = model.cfg
    emb = flow.sincos_time_embedding(t, cfg.expert.width, cfg.min_period, cfg.max_period)
    cond = F.silu(F.linear(emb, model.time_mlp_in.weight, model.time_mlp_in.bias))
    cond = F.silu(F.linear(cond, model.time_mlp_out.weight, model.time_mlp_out.bias))
    suffix = F.linear(
        x_t.to(model.action_in_proj.weight.dtype),
        model.action_in_proj.weight,
        model.action_in_proj.bias,
    )
    b, s = suffix.shape[:2]
    pad = torch.cat([prefix_pad, prefix_pad.new_ones(b, s)], dim=1)
    att = torch.zeros_like(pad, dtype=torch.long)
    att[:, prefix_pad.shape[1]] = 1  # the action block starts here: prefix tokens cannot see it
    mask4d = additive_mask(make_att_2d_masks(pad, att))
    positions = torch.cumsum(pad.long(), dim=1) - 1
    dtype = model.prefix.compute_dtype
    streams = [prefix_embs.to(dtype), suffix.to(dtype)]
    for blocks in zip(model.prefix.layers, model.expert.layers):
        streams = joint_layer(list(blocks), streams, [None, cond], mask4d, positions)
    out, _ = norm(model.expert.final_norm, streams[1], cond)
    return F.linear(
        out.float(), model.action_out_proj.weight.float(), model.action_out_proj.bias.float()
    )


def sample_chain(
    model: PI05Model,
    images: Tensor,
    image_masks: Tensor,
    tokens: Tensor,
    token_mask: Tensor,
    noise: Tensor,
    stochastic_steps: list[bool],
    step_noise: Tensor | None,
    noise_level: float,
) -> tuple[Tensor, Tensor]:
    """Slow chain (B, K+1, H, D) and step log-probs (B, K, H, D): LeRobot Euler steps, RLinf
    flow-SDE steps where stochastic_steps[k] (noise step_noise[:, k])."""
    num_steps = len(stochastic_steps)
    prefix_embs, prefix_pad = embed_prefix(model, images, image_masks, tokens, token_mask)
    grid = flow.time_grid(num_steps, noise.device)
    deltas, sigmas = flow.step_deltas(grid), flow.sde_sigmas(grid, noise_level)
    dt = -1.0 / num_steps  # LeRobot's Euler step (a Python float, like euler_integrate)
    x, chain, logps = noise, [noise], []
    for k in range(num_steps):
        t = grid[k].expand(x.shape[0])
        v = velocity(model, prefix_embs, prefix_pad, x, t)
        if stochastic_steps[k]:
            mean, std = flow.sde_step_mean_std(x, v, grid[k], deltas[k], sigmas[k])
            x = mean + std * step_noise[:, k]
            logps.append(flow.gaussian_log_prob(x, mean, std))
        else:
            x = flow.euler_step(x, v, dt)
            logps.append(torch.zeros_like(x))
        chain.append(x)
    return torch.stack(chain, dim=1), torch.stack(logps, dim=1)
