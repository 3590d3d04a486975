"""Reward and state from a chunk's latents: a small head, or a user-supplied callable.

`SuccessHead` reads the chunk's last latent frame (pooled to 4 x 4) and gives a success
probability and an 8-dim robot state. The env turns the probability into LIBERO's reward
(1 on the sub-step that succeeded, `readout.success_threshold`). A callable
`reward_fn(latents, frames) -> probabilities (n,)` replaces the head's probability (e.g. a
trained image classifier on the decoded frames, as RLinf's ResNet reward model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldmodels.config import WorldModelConfig

RewardFn = Callable[[Tensor, Tensor | None], Tensor]
POOL = 4


@dataclass
class Readout:
    success_prob: Tensor  # (n,) float32
    state: Tensor  # (n, state_dim) float32


class SuccessHead(nn.Module):
    def __init__(self, latent_channels: int, hidden: int, state_dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latent_channels * POOL * POOL, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 1 + state_dim))
        with torch.no_grad():  # unit-scale logits around 0: with random weights both outcomes occur
            nn.init.xavier_normal_(self.net[0].weight)
            nn.init.normal_(self.net[2].weight, std=hidden**-0.5)
            self.net[0].bias.zero_()
            self.net[2].bias.zero_()

    def forward(self, latents: Tensor) -> Readout:
        last = latents[:, -1].to(self.net[0].weight.dtype)  # (n, C, h, w)
        pooled = F.adaptive_avg_pool2d(last, POOL).flatten(1)
        pooled = F.layer_norm(pooled, pooled.shape[-1:])  # unit scale: the logits spread whatever the latents' scale
        out = self.net(pooled).float()
        return Readout(torch.sigmoid(out[:, 0]), out[:, 1:])


def build_readout(cfg: WorldModelConfig, device: str | torch.device = "cpu") -> SuccessHead:
    state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed + 2)
    try:
        with torch.device(device):
            head = SuccessHead(cfg.dit.latent_channels, cfg.readout.hidden, cfg.readout.state_dim)
    finally:
        torch.random.set_rng_state(state)
    return head.eval().requires_grad_(False)


def read_chunk(head: SuccessHead, latents: Tensor, frames: Tensor | None = None,
               reward_fn: RewardFn | None = None) -> Readout:
    """The head's readout, with the success probability from `reward_fn` when given."""
    out = head(latents)
    if reward_fn is not None:
        prob = torch.as_tensor(reward_fn(latents, frames), dtype=torch.float32).reshape(-1).cpu()
        if prob.shape[0] != latents.shape[0]:
            raise ValueError(f"reward_fn returned {prob.shape[0]} values for {latents.shape[0]} chunks")
        out = Readout(prob, out.state)
    return out
