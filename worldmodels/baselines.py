"""The whole-clip regeneration baseline: what RLinf's world-model envs do every env step.

RLinf's Wan env (rlinf/envs/world_model/world_model_wan_env.py, 256 x 256, chunk of 8 actions,
13 frames, 5 inference steps) rebuilds the whole clip each step: it VAE-encodes the last
condition frames again, denoises the clip (condition + new frames) with full bidirectional
attention and no K/V cache, decodes every frame, and keeps the new ones. `regenerate_chunk`
does that with our model, batch 1 (one env at a time, as its per-env loop prepares the
inputs): condition latent frames at t = 0, new frames from noise over `steps` Euler steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worldmodels.functional import frame_actions, sigma_schedule
from worldmodels.model import CausalWanDiT
from worldmodels.vae import SmallCausalVAE


@torch.no_grad()
def clip_velocity(model: CausalWanDiT, clip: Tensor, cond_frames: int, sigma: float, actions_pf: Tensor,
                  ctx_ids: Tensor) -> Tensor:
    """Velocity of the new frames of clip (n, Fc + Fn, C, h, w): condition frames at t = 0,
    new frames at sigma, every token attending every other (bidirectional, no cache)."""
    n, frames = clip.shape[:2]
    x = model.embed(clip)
    zeros = torch.zeros(n, device=clip.device)
    new = frames - cond_frames
    e_c, e0_c = model.conditioning(zeros, torch.zeros(n, cond_frames, actions_pf.shape[-1], device=clip.device))
    e_n, e0_n = model.conditioning(torch.full((n,), sigma * 1000.0, device=clip.device), actions_pf[:, :new])
    e, e0 = torch.cat([e_c, e_n], dim=1), torch.cat([e0_c, e0_n], dim=1)
    rope = model.rope_for(torch.zeros(n, dtype=torch.long), frames)
    context = model.context_kv()
    for index, block in enumerate(model.blocks):
        ck, cv = context[index]
        x, _, _ = block(x, e0, rope, (ck[ctx_ids], cv[ctx_ids]))
    velocity = model.readout(x, e, frames)
    return velocity[:, cond_frames:]


@torch.no_grad()
def regenerate_chunk(model: CausalWanDiT, vae: SmallCausalVAE, condition_video: Tensor, actions: Tensor,
                     new_frames: int, steps: int, shift: float, noise: Tensor, context_id: int = 0) -> Tensor:
    """One env step the RLinf way for one env: condition_video (1, T, 3, H, W) in [-1, 1]
    (T = 1 + stride (Fc - 1)), actions (1, H, dim) -> the decoded new video frames."""
    cond = vae.encode(condition_video).to(model.dtype)
    cfg = model.cfg
    pf = frame_actions(actions, new_frames, cfg.dit.actions_per_frame).to(model.device)
    sigmas = sigma_schedule(steps, shift)
    x = noise.float()
    ctx = torch.tensor([context_id], device=model.device)
    for k in range(steps):
        clip = torch.cat([cond.float(), x], dim=1)
        v = clip_velocity(model, clip, cond.shape[1], sigmas[k], pf, ctx)
        x = x + (sigmas[k + 1] - sigmas[k]) * v
    clip = torch.cat([cond.float(), x], dim=1)
    return vae.decode(clip)[:, -new_frames * cfg.vae.stride[0]:]
