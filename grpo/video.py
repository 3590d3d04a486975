"""Rollout videos: MP4 through imageio (with its ffmpeg plugin) when installed, else GIF via PIL."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def mp4_available() -> bool:
    return importlib.util.find_spec("imageio") is not None and importlib.util.find_spec("imageio_ffmpeg") is not None


def write_video(frames: np.ndarray, path: Path, fps: int, fmt: str = "auto") -> Path:
    """frames (T, H, W, 3) uint8 -> path with the suffix of the format used (.mp4 or .gif)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"video frames must be (T>0, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    if fmt == "auto":
        fmt = "mp4" if mp4_available() else "gif"
    path = Path(path).with_suffix(f".{fmt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "mp4":
        import imageio.v2 as imageio

        # macro_block_size 1: small frames (56-128 px) are written as they are, not resized
        imageio.mimwrite(path, list(frames), fps=fps, macro_block_size=1)
    elif fmt == "gif":
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    else:
        raise ValueError(f"video format must be 'auto', 'mp4' or 'gif', got {fmt!r}")
    return path


def upright(frames: np.ndarray) -> np.ndarray:
    """LIBERO observations are rotated by 180 degrees (openpi's convention): undo it for viewing."""
    return np.ascontiguousarray(frames[:, ::-1, ::-1])
