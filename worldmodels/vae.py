"""Pixels <-> latents: the VAE interface and a small causal conv VAE of Wan's strides.

Any object with `stride`, `latent_channels`, `encode` and `decode` as in `VideoVAE` works (a
real Wan2.1 VAE wrapped to these two calls, e.g. Self-Forcing's WanVAEWrapper.encode_to_latent /
decode_to_pixel with the frame axis moved). `SmallCausalVAE` is the random-weight stand-in:
causal in time like Wan's (the first frame is its own latent frame, then every `stride[0]`
frames make one), `stride[1]` x `stride[2]` space-to-depth, a temporal kernel of 2 that only
looks back. Frames are float in [-1, 1], (n, T, 3, H, W); latents (n, F, C, h, w).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldmodels.config import WorldModelConfig


class VideoVAE(Protocol):
    stride: tuple[int, int, int]
    latent_channels: int

    def encode(self, video: Tensor) -> Tensor:
        """(n, 1 + stride_t (F - 1), 3, H, W) in [-1, 1] -> (n, F, C, H/s, W/s)."""

    def decode(self, latents: Tensor, previous: Tensor | None = None) -> Tensor:
        """(n, F, C, h, w) -> (n, F * stride_t, 3, H, W): the video frames those latent frames
        cover; `previous` (n, C, h, w) is the latent frame before (the causal context)."""


class SmallCausalVAE(nn.Module):
    def __init__(self, latent_channels: int, stride: tuple[int, int, int], hidden: int, scale: float = 1.0):
        super().__init__()
        self.stride = tuple(stride)
        self.latent_channels = latent_channels
        self.scale = scale
        st, ss = self.stride[0], self.stride[1]
        packed = st * 3 * ss * ss  # one group of st frames, space-to-depth by ss
        self.enc_in = nn.Conv2d(2 * packed, hidden, 1)  # this group + the previous one (causal)
        self.enc_mid = nn.Conv2d(hidden, hidden, 3, padding=1)
        self.enc_out = nn.Conv2d(hidden, latent_channels, 1)
        self.dec_in = nn.Conv2d(2 * latent_channels, hidden, 3, padding=1)  # this frame + the previous
        self.dec_mid = nn.Conv2d(hidden, hidden, 3, padding=1)
        self.dec_out = nn.Conv2d(hidden, packed, 1)

    def _groups(self, video: Tensor) -> Tensor:
        """(n, T, 3, H, W) -> (n, F, st*3*ss*ss, h, w); the first frame is repeated into a group
        (causal padding), as the first latent frame covers one frame."""
        n, frames, c, h, w = video.shape
        st, ss = self.stride[0], self.stride[1]
        if (frames - 1) % st:
            raise ValueError(f"VAE encode needs 1 + {st} k frames, got {frames}")
        first = video[:, :1].expand(n, st, c, h, w)
        groups = torch.cat([first, video[:, 1:]], dim=1).reshape(n, -1, st * c, h, w)
        packed = F.pixel_unshuffle(groups.flatten(0, 1), ss)
        return packed.unflatten(0, (n, -1))

    def encode(self, video: Tensor) -> Tensor:
        g = self._groups(video.to(self.enc_in.weight.dtype))
        prev = torch.cat([g[:, :1], g[:, :-1]], dim=1)
        x = torch.cat([g, prev], dim=2).flatten(0, 1)
        x = F.silu(self.enc_in(x))
        x = F.silu(self.enc_mid(x))
        z = self.enc_out(x).unflatten(0, g.shape[:2])
        return z * self.scale

    def decode(self, latents: Tensor, previous: Tensor | None = None) -> Tensor:
        z = latents.to(self.dec_in.weight.dtype) / self.scale
        n, frames = z.shape[:2]
        first_prev = z[:, :1] if previous is None else (previous.to(z.dtype) / self.scale)[:, None]
        prev = torch.cat([first_prev, z[:, :-1]], dim=1)
        x = torch.cat([z, prev], dim=2).flatten(0, 1)
        x = F.silu(self.dec_in(x))
        x = F.silu(self.dec_mid(x))
        x = F.pixel_shuffle(self.dec_out(x), self.stride[1])  # (n F, st*3, H, W)
        x = torch.tanh(x).unflatten(1, (self.stride[0], 3))
        return x.reshape(n, frames * self.stride[0], 3, *x.shape[-2:])


def build_vae(cfg: WorldModelConfig, device: str | torch.device = "cpu") -> SmallCausalVAE:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed + 1)
    try:
        with torch.device(device):
            vae = SmallCausalVAE(cfg.dit.latent_channels, tuple(cfg.vae.stride), cfg.vae.hidden, cfg.vae.scale)
    finally:
        torch.random.set_rng_state(gen_state)
    return vae.eval().requires_grad_(False)


# ---------------------------------------------------------------------------- images
def images_to_frame(images: list[np.ndarray] | np.ndarray) -> Tensor:
    """Camera images (each (n, S, S, 3) uint8) tiled side by side -> (n, 3, S, S * cams) in [-1, 1]."""
    views = [images] if isinstance(images, np.ndarray) else list(images)
    tiled = np.concatenate(views, axis=2)
    return torch.from_numpy(tiled).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def frame_to_images(frame: Tensor, num_cameras: int) -> list[np.ndarray]:
    """(n, 3, S, S * cams) in [-1, 1] -> per camera (n, S, S, 3) uint8."""
    pixels = ((frame.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()
    return list(np.split(pixels, num_cameras, axis=2))


def still_clip(frame: Tensor, latent_frames: int, time_stride: int) -> Tensor:
    """A still image as the clip of 1 + stride (F - 1) frames that encodes to F latent frames
    (the initial context chunk)."""
    count = 1 + time_stride * (latent_frames - 1)
    return frame[:, None].expand(-1, count, -1, -1, -1)
