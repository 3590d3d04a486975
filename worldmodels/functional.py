"""Pure functions of the world model: timestep grid, embeddings, 3-axis RoPE, patching, noise.

Each follows Wan2.1 / Self-Forcing's definition (wan/modules/model.py, causal_model.py) and is
tested against a slow reference (complex-number RoPE in float64, conv3d patch embedding, a
hand-computed sinusoid).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


# ---------------------------------------------------------------------------- timesteps
def sigma_schedule(num_steps: int, shift: float) -> list[float]:
    """Flow-matching noise levels sigma_0 > ... > sigma_{K-1} > sigma_K = 0.

    The uniform grid s_k = 1 - k/K (Self-Forcing's 1000, 750, 500, 250 for K = 4) warped by
    sigma = shift s / (1 + (shift - 1) s), the flow-match scheduler's shift.
    """
    grid = [1.0 - k / num_steps for k in range(num_steps)]
    return [shift * s / (1.0 + (shift - 1.0) * s) for s in grid] + [0.0]


def sinusoidal_embedding(dim: int, timesteps: Tensor) -> Tensor:
    """Wan's sinusoidal_embedding_1d: [cos(t w_i), sin(t w_i)], w_i = 10000^(-i/half), float64."""
    half = dim // 2
    position = timesteps.to(torch.float64).reshape(-1)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=position.device) / half)
    angles = torch.outer(position, freqs)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


# ---------------------------------------------------------------------------- RoPE
def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Complex pairs per axis (frame, height, width): Wan splits head_dim/2 pairs as
    [c - 2 (c // 3), c // 3, c // 3] with c = head_dim / 2."""
    c = head_dim // 2
    return c - 2 * (c // 3), c // 3, c // 3


def rope_inverse_freqs(head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-axis inverse frequencies, as Wan's rope_params(1024, d - 4 (d // 6)) and
    rope_params(1024, 2 (d // 6)) twice: theta^(-2i / axis_dim)."""
    dims = (head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6))
    return tuple(
        1.0 / torch.pow(10000.0, torch.arange(0, d, 2, dtype=torch.float64) / d) for d in dims
    )  # type: ignore[return-value]


class RopeTables:
    """cos/sin angle tables for tokens of a (frames x h x w) grid at any frame offset.

    `cos_sin(frame0)` gives per item (n, L, head_dim/2): the frame axis is indexed by the absolute
    latent frame (frame0 + f), height and width by the token's grid position. The angles are
    float64 on the CPU; `on(device, dtype)` caches their cos/sin there, and the lookup is a
    gather on the device (no host work, capturable in a CUDA graph).
    """

    def __init__(self, head_dim: int, max_frames: int, grid: tuple[int, int, int]):
        inv_f, inv_h, inv_w = rope_inverse_freqs(head_dim)
        frames, h, w = grid
        self.max_frames = max_frames
        self.num_frames = frames
        frame_angles = torch.outer(torch.arange(max_frames, dtype=torch.float64), inv_f)
        ang_h = torch.outer(torch.arange(h, dtype=torch.float64), inv_h)[:, None, :].expand(h, w, -1)
        ang_w = torch.outer(torch.arange(w, dtype=torch.float64), inv_w)[None, :, :].expand(h, w, -1)
        hw_angles = torch.cat([ang_h, ang_w], dim=-1).reshape(h * w, -1).repeat(frames, 1)  # (L, nh + nw)
        self._angles = (frame_angles, hw_angles)
        self._token_frame = torch.arange(frames).repeat_interleave(h * w)  # (L,) token order (f, h, w)
        self._cache: dict[tuple, tuple[Tensor, ...]] = {}

    def on(self, device: torch.device | str, dtype: torch.dtype) -> tuple[Tensor, ...]:
        key = (str(device), dtype)
        if key not in self._cache:
            frame_angles, hw_angles = self._angles
            self._cache[key] = (
                frame_angles.cos().to(device, dtype), frame_angles.sin().to(device, dtype),
                hw_angles.cos().to(device, dtype), hw_angles.sin().to(device, dtype),
                self._token_frame.to(device),
            )
        return self._cache[key]

    def check(self, last_frame: int) -> None:
        if last_frame >= self.max_frames:
            raise ValueError(
                f"latent frame {last_frame} is past the RoPE table (worldmodel.dit.max_frames = {self.max_frames})"
            )

    def cos_sin(self, frame0: Tensor, dtype: torch.dtype, device: torch.device | str) -> tuple[Tensor, Tensor]:
        """(n, L, head_dim/2) cos and sin for items whose chunk starts at latent frame frame0 (n,).
        Frames past the table clamp silently here (the caller checks with `check`)."""
        fcos, fsin, hcos, hsin, token_frame = self.on(device, dtype)
        idx = (frame0.to(token_frame.device)[:, None] + token_frame[None, :]).clamp_(max=self.max_frames - 1)
        n = idx.shape[0]
        cos = torch.cat([fcos[idx], hcos[None].expand(n, -1, -1)], dim=-1)
        sin = torch.cat([fsin[idx], hsin[None].expand(n, -1, -1)], dim=-1)
        return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (x_2i, x_2i+1) of x (n, L, H, D) by the angles (n, L, D/2)."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------- patches
def patchify(latents: Tensor, patch: tuple[int, int]) -> Tensor:
    """(n, F, C, h, w) -> (n, F*(h/p)*(w/q), C*p*q), feature order (c, p, q) as conv3d's weight."""
    n, f, c, h, w = latents.shape
    p, q = patch
    x = latents.reshape(n, f, c, h // p, p, w // q, q)
    x = x.permute(0, 1, 3, 5, 2, 4, 6)  # n f hh ww c p q
    return x.reshape(n, f * (h // p) * (w // q), c * p * q)


def unpatchify(tokens: Tensor, frames: int, hw: tuple[int, int], patch: tuple[int, int], channels: int) -> Tensor:
    """(n, L, p*q*C) with feature order (p, q, c) (Wan's head) -> (n, F, C, h, w)."""
    n = tokens.shape[0]
    h, w = hw
    p, q = patch
    x = tokens.reshape(n, frames, h // p, w // q, p, q, channels)
    x = x.permute(0, 1, 6, 2, 4, 3, 5)  # n f c hh p ww q
    return x.reshape(n, frames, channels, h, w)


# ---------------------------------------------------------------------------- noise
def chunk_noise(seed: int, chunk_index: int, shape: tuple[int, ...]) -> Tensor:
    """The initial noise of one stream's chunk: a pure function of (seed, chunk index), so every
    schedule, batch composition and admission order draws the same numbers (float32, CPU)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(chunk_index) + 1]).generate_state(2)
    gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def frame_actions(actions: Tensor, frames: int, per_frame: int) -> Tensor:
    """Action chunk (n, H, A) -> per latent frame (n, frames, per_frame * (A + 1)).

    Action h drives video frame h, so latent frame f gets actions [f*per_frame, (f+1)*per_frame);
    each slot carries the action and a 1/0 flag saying whether it exists (H may be shorter
    than frames * per_frame: later slots are zero with flag 0).
    """
    n, horizon, dim = actions.shape
    slots = frames * per_frame
    if horizon > slots:
        raise ValueError(f"action chunk of {horizon} steps exceeds the world model's {slots} (frames x per frame)")
    padded = actions.new_zeros(n, slots, dim + 1)
    padded[:, :horizon, :dim] = actions
    padded[:, :horizon, dim] = 1.0
    return padded.reshape(n, frames, per_frame * (dim + 1))
