"""The plain sequential loop over one stream: the reference the server must reproduce, and the
Self-Forcing-style baseline of the benchmark.

Chunk n (3 latent frames) starts from noise (`chunk_noise(seed, n)`) and takes K Euler steps
from sigma_0 to 0. What it attends to depends on the KV schedule:

- "clean" (Self-Forcing / CausVid): every denoise step reads the clean K/V of the previous
  W chunk positions; after the last step the clean chunk is run once more at t = 0 and that
  pass writes the cache (the fifth pass per chunk).
- "noisy" (ours): denoise step k of chunk n reads step k's K/V of the previous W positions
  (still noisy) and writes its own; no extra pass, and chunk n+1's step k only waits for chunk
  n's step k, so consecutive chunks can overlap on a pipeline of devices.

Position 0 is the context chunk: the initial frames encoded to latents, run once at t = 0; its
K/V stand in every step's window until it rolls out.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from worldmodels.config import WorldModelConfig
from worldmodels.functional import chunk_noise, frame_actions, sigma_schedule
from worldmodels.model import CausalWanDiT


class SequentialStream:
    def __init__(self, model: CausalWanDiT, seed: int, context_id: int = 0, schedule: str | None = None):
        self.model = model
        self.cfg: WorldModelConfig = model.cfg
        self.schedule = schedule or self.cfg.kv_schedule
        self.seed = seed
        self.context_id = context_id
        self.sigmas = sigma_schedule(self.cfg.num_denoise_steps, self.cfg.timestep_shift)
        slots = self.cfg.num_denoise_steps if self.schedule == "noisy" else 1
        window = self.cfg.context_chunks
        # caches[slot][block]: the last W positions' (K, V), oldest first
        self.caches = [[deque(maxlen=window) for _ in model.blocks] for _ in range(slots)]
        self.position = 0  # next chunk position (0 = the context chunk)
        self.trace: list[tuple[int, int, Tensor]] | None = None  # set to [] to record (position, step, input)

    @property
    def chunk_index(self) -> int:
        return self.position - 1

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.cfg.latent_hw
        return (self.cfg.frames_per_chunk, self.cfg.dit.latent_channels, h, w)

    @torch.no_grad()
    def prefill(self, context_latents: Tensor) -> None:
        """Write the context chunk (F, C, h, w) (clean latents of the initial frames) at t = 0."""
        if self.position != 0:
            raise RuntimeError("prefill() starts a stream: it must come first")
        if tuple(context_latents.shape) != self.latent_shape():
            raise ValueError(
                f"context latents must have shape {self.latent_shape()}, got {tuple(context_latents.shape)}")
        no_actions = torch.zeros(1, 0, self.cfg.dit.action_dim)
        _, kv = self._forward(context_latents[None], 0.0, no_actions, past_slot=None)
        for slot in self.caches:
            self._push(slot, kv)
        self.position = 1

    @torch.no_grad()
    def step(self, actions: Tensor, noise: Tensor | None = None) -> Tensor:
        """Generate the next chunk for an action chunk (H, action_dim); returns latents (F, C, h, w)."""
        if self.position == 0:
            raise RuntimeError("step() before prefill(): give the stream its context first")
        x = (noise if noise is not None else chunk_noise(self.seed, self.chunk_index, self.latent_shape()))
        x = x.float()[None].to(self.model.device)
        actions = torch.as_tensor(actions, dtype=torch.float32)[None]
        steps = self.cfg.num_denoise_steps
        for k in range(steps):
            slot = k if self.schedule == "noisy" else 0
            if self.trace is not None:
                self.trace.append((self.position, k, x[0].clone()))
            velocity, kv = self._forward(x, self.sigmas[k], actions, past_slot=slot)
            if self.schedule == "noisy":
                self._push(self.caches[k], kv)
            x = x + (self.sigmas[k + 1] - self.sigmas[k]) * velocity
        if self.schedule == "clean":
            _, kv = self._forward(x, 0.0, actions, past_slot=0)  # the re-cache pass
            self._push(self.caches[0], kv)
        self.position += 1
        return x[0]

    def _forward(self, x: Tensor, sigma: float, actions: Tensor, past_slot: int | None):
        cfg = self.cfg
        past = None
        if past_slot is not None:
            past = [
                (torch.cat([kv[0] for kv in cache], dim=1), torch.cat([kv[1] for kv in cache], dim=1))
                for cache in self.caches[past_slot]
            ]
        pf = frame_actions(actions, cfg.frames_per_chunk, cfg.dit.actions_per_frame)
        device = self.model.device
        return self.model.forward_chunk(
            x.to(device),
            torch.tensor([sigma * 1000.0], device=device),
            pf.to(device),
            torch.tensor([self.position * cfg.frames_per_chunk]),
            torch.tensor([self.context_id], device=device),
            past,
        )

    @staticmethod
    def _push(cache_slot: list[deque], kv: list[tuple[Tensor, Tensor]]) -> None:
        for block_cache, block_kv in zip(cache_slot, kv, strict=True):
            block_cache.append(block_kv)
