"""Rollout videos: MP4 through imageio (with its ffmpeg plugin) when installed, else GIF via PIL."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

FORMATS = ("auto", "mp4", "gif")


def mp4_available() -> bool:
    return importlib.util.find_spec("imageio") is not None and importlib.util.find_spec("imageio_ffmpeg") is not None


def check_format(key: str, fmt: str) -> None:
    """Refuse a format this machine cannot write, naming the setting (`key`) that asked for it."""
    if fmt not in FORMATS:
        raise ValueError(f"{key} must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt == "mp4" and not mp4_available():
        raise ValueError(f"{key}=mp4 needs the imageio and imageio-ffmpeg packages (pip install 'imageio[ffmpeg]'), "
                         f"which are not installed here: use gif, or auto (mp4 when it can be written, else gif)")


def even_size(frames: np.ndarray) -> np.ndarray:
    """Frames with an odd height or width get their last row / column repeated: H.264 in yuv420p needs
    even sizes, and ffmpeg's refusal reached imageio only as a warning (an empty .mp4 file)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not pad_h and not pad_w:
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def write_video(frames: np.ndarray, path: Path, fps: int, fmt: str = "auto", key: str = "eval.video_format") -> Path:
    """frames (T, H, W, 3) uint8 -> path with the suffix of the format used (.mp4 or .gif). `key`
    names the setting that chose `fmt` in errors (the evaluation's, its only caller)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"video frames must be (T>0, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    if fmt == "auto":
        fmt = "mp4" if mp4_available() else "gif"
    check_format(key, fmt)
    path = Path(path).with_suffix(f".{fmt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "mp4":
        import imageio.v2 as imageio

        # macro_block_size 1: small frames (56-128 px) are written as they are, not resized
        imageio.mimwrite(path, list(even_size(frames)), fps=fps, macro_block_size=1)
    else:
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return path


def upright(frames: np.ndarray) -> np.ndarray:
    """LIBERO observations are rotated by 180 degrees (openpi's convention): undo it for viewing."""
    return np.ascontiguousarray(frames[:, ::-1, ::-1])
