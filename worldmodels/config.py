"""Typed configuration of the world model (Hydra key `worldmodel`) with named presets.

`WorldModelConfig.preset("wan1_3b" | "small" | "tiny", **overrides)` gives a validated config;
YAML names a preset and overrides keys: `WorldModelConfig.from_mapping({"preset": "tiny", ...})`.
Unknown keys at any level and bad values raise errors naming the full key
("worldmodel.dit.num_heads must divide worldmodel.dit.width (1536), got 7").

The `wan1_3b` sizes are Wan2.1-T2V-1.3B's (wan/configs/wan_t2v_1_3B.py in the Wan / Self-Forcing
repositories): patch (1, 2, 2), width 1536, FFN 8960, 12 heads, 30 blocks, 16 latent channels,
sinusoidal time embedding of 256, text width 4096; VAE stride (4, 8, 8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    check_choice,
    check_int_list,
    check_nonnegative_int,
    check_positive_finite,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)

DTYPES = ("float32", "bfloat16")
KV_SCHEDULES = ("noisy", "clean")  # per-step noisy KV (ours) | Self-Forcing's clean re-cache pass
ACTION_INITS = ("random", "zero")


@dataclass
class DiTConfig:
    """The causal video DiT (CausalWanModel's layout)."""

    width: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_blocks: int = 30
    latent_channels: int = 16
    patch_size: list[int] = field(default_factory=lambda: [1, 2, 2])
    freq_dim: int = 256  # sinusoidal timestep embedding width
    text_dim: int = 4096  # width of the context tokens fed to text_embedding (T5 width in Wan)
    # The fixed learned context replacing the T5 prompt: num_contexts tables of context_len
    # tokens (one per task/prompt id); cross-attention K/V of each are computed once per weights.
    context_len: int = 16
    num_contexts: int = 1
    action_dim: int = 7
    actions_per_frame: int = 4  # = VAE temporal stride: one action per video frame
    action_init: str = "random"  # "zero": actions start with no effect (fine-tuning a loaded model)
    max_frames: int = 1024  # RoPE table length in latent frames (Wan: 1024)
    eps: float = 1e-6

    def validate(self, key: str) -> None:
        for name in ("width", "ffn_dim", "num_heads", "num_blocks", "latent_channels", "freq_dim",
                     "text_dim", "context_len", "num_contexts", "action_dim", "actions_per_frame", "max_frames"):
            check_positive_int(f"{key}.{name}", getattr(self, name))
        if self.width % self.num_heads:
            raise ValueError(f"{key}.num_heads must divide {key}.width ({self.width}), got {self.num_heads}")
        head_dim = self.width // self.num_heads
        if head_dim % 2 or head_dim // 6 < 1:
            raise ValueError(f"{key}: head dim width/num_heads = {head_dim} must be even and >= 6 (3-axis RoPE)")
        if self.freq_dim % 2:
            raise ValueError(f"{key}.freq_dim must be even, got {self.freq_dim}")
        # as given, not through int(): 2.5 became 2 and True 1, silently; a bare 2 failed unnamed ("not iterable")
        self.patch_size = check_int_list(f"{key}.patch_size", self.patch_size, 1)
        if len(self.patch_size) != 3:
            raise ValueError(f"{key}.patch_size must be 3 positive ints (t, h, w), got {self.patch_size}")
        if self.patch_size[0] != 1:
            raise ValueError(f"{key}.patch_size[0] must be 1 (frames are the causal unit), got {self.patch_size}")
        check_choice(f"{key}.action_init", self.action_init, ACTION_INITS)
        check_positive_finite(f"{key}.eps", self.eps)

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads


@dataclass
class VAEConfig:
    """The small causal conv VAE (random weights unless loaded); stride (t, h, w)."""

    stride: list[int] = field(default_factory=lambda: [4, 8, 8])
    hidden: int = 32
    scale: float = 1.0  # latents are (z - 0) * scale; a real VAE brings its own mean/std

    def validate(self, key: str, latent_channels: int) -> None:
        self.stride = check_int_list(f"{key}.stride", self.stride, 1)  # as patch_size: no int() truncation
        if len(self.stride) != 3:
            raise ValueError(f"{key}.stride must be 3 positive ints (t, h, w), got {self.stride}")
        if self.stride[1] != self.stride[2] or self.stride[1] not in (1, 2, 4, 8, 16):
            raise ValueError(f"{key}.stride spatial factors must be equal powers of 2 <= 16, got {self.stride}")
        check_positive_int(f"{key}.hidden", self.hidden)
        check_positive_finite(f"{key}.scale", self.scale)


@dataclass
class ReadoutConfig:
    """Heads on the chunk's latents: success probability (the reward) and an 8-dim robot state."""

    hidden: int = 64
    state_dim: int = 8
    success_threshold: float = 0.5  # success when the head's probability exceeds this

    def validate(self, key: str) -> None:
        check_positive_int(f"{key}.hidden", self.hidden)
        check_positive_int(f"{key}.state_dim", self.state_dim)
        if not 0.0 < self.success_threshold < 1.0:
            raise ValueError(f"{key}.success_threshold must be in (0, 1), got {self.success_threshold}")


@dataclass
class WorldModelConfig:
    """An action-conditioned autoregressive-denoising video model: chunk by chunk, few steps."""

    name: str = "wan1_3b"
    dit: DiTConfig = field(default_factory=DiTConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    readout: ReadoutConfig = field(default_factory=ReadoutConfig)
    height: int = 256  # frame size in pixels (the env tiles its cameras side by side into one frame)
    width: int = 256
    frames_per_chunk: int = 3  # latent frames per chunk (Self-Forcing / CausVid: 3)
    num_denoise_steps: int = 4
    timestep_shift: float = 5.0  # sigma = shift s / (1 + (shift - 1) s) on the uniform grid s
    kv_schedule: str = "noisy"
    context_chunks: int = 2  # rolling KV window W in chunks (the initial context counts as one)
    dtype: str = "float32"
    checkpoint: str | None = None  # Self-Forcing / CausVid checkpoint (.pt / .safetensors)
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.dit.validate("worldmodel.dit")
        self.vae.validate("worldmodel.vae", self.dit.latent_channels)
        self.readout.validate("worldmodel.readout")
        for name in ("height", "width", "frames_per_chunk", "num_denoise_steps", "context_chunks"):
            check_positive_int(f"worldmodel.{name}", getattr(self, name))
        check_positive_finite("worldmodel.timestep_shift", self.timestep_shift)
        check_choice("worldmodel.kv_schedule", self.kv_schedule, KV_SCHEDULES)
        check_choice("worldmodel.dtype", self.dtype, DTYPES)
        check_nonnegative_int("worldmodel.seed", self.seed)
        for axis, name in ((1, "height"), (2, "width")):  # each axis by its own patch size (patch_size[1] vs [2])
            factor = self.vae.stride[axis] * self.dit.patch_size[axis]
            if getattr(self, name) % factor:
                raise ValueError(
                    f"worldmodel.{name} ({getattr(self, name)}) must be a multiple of VAE stride x patch "
                    f"(vae.stride[{axis}] x dit.patch_size[{axis}] = {factor})"
                )
        if self.max_chunks < 1:  # the context chunk and one chunk after it must fit the RoPE table
            raise ValueError(
                f"worldmodel.dit.max_frames ({self.dit.max_frames}) must hold at least 2 x frames_per_chunk "
                f"({2 * self.frames_per_chunk}) latent frames (the context chunk and one generated chunk)"
            )

    # ------------------------------------------------------------------ derived sizes
    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // self.vae.stride[1], self.width // self.vae.stride[2]

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.latent_hw
        return (h // self.dit.patch_size[1]) * (w // self.dit.patch_size[2])

    @property
    def chunk_tokens(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def chunk_actions(self) -> int:
        """Largest action chunk one world-model chunk covers (one action per video frame)."""
        return self.frames_per_chunk * self.dit.actions_per_frame

    @property
    def max_chunks(self) -> int:
        """Action chunks one stream can take: the context chunk and every chunk after it fit in the RoPE table
        (chunk c covers latent frames (c + 1) F .. (c + 2) F - 1, which must stay below dit.max_frames)."""
        return self.dit.max_frames // self.frames_per_chunk - 1

    @property
    def video_frames_per_chunk(self) -> int:
        return self.frames_per_chunk * self.vae.stride[0]

    @property
    def passes_per_chunk(self) -> int:
        """Model passes per chunk: K denoise steps, plus the clean re-cache pass (clean schedule)."""
        return self.num_denoise_steps + (1 if self.kv_schedule == "clean" else 0)

    @property
    def kv_step_slots(self) -> int:
        """KV copies a stream keeps per chunk position: one per denoise step (noisy) or one (clean)."""
        return self.num_denoise_steps if self.kv_schedule == "noisy" else 1

    def kv_bytes_per_page(self, num_blocks: int | None = None) -> int:
        """One chunk's K and V for `num_blocks` blocks (all by default)."""
        blocks = self.dit.num_blocks if num_blocks is None else num_blocks
        itemsize = 2 if self.dtype == "bfloat16" else 4
        return 2 * blocks * self.chunk_tokens * self.dit.width * itemsize

    def kv_pages_per_stream(self) -> int:
        return self.kv_step_slots * self.context_chunks

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **overrides: Any) -> WorldModelConfig:
        return build_config(merge(self.to_dict(), overrides))

    @staticmethod
    def preset(name: str, **overrides: Any) -> WorldModelConfig:
        if name not in PRESETS:
            raise ValueError(f"worldmodel.preset must be one of {sorted(PRESETS)}, got {name!r}")
        base = merge(_defaults(), PRESETS[name])
        return build_config(merge(base, overrides))

    @staticmethod
    def from_mapping(mapping: Mapping[str, Any] | None = None, **overrides: Any) -> WorldModelConfig:
        """From a dict / OmegaConf node: `preset` (default "wan1_3b") plus overrides."""
        data = merge(to_container(mapping) if mapping is not None else {}, overrides)
        preset = data.pop("preset", None) or data.get("name") or "wan1_3b"
        return WorldModelConfig.preset(preset, **data)


PRESETS: dict[str, dict[str, Any]] = {
    "wan1_3b": {"name": "wan1_3b", "dtype": "bfloat16", "vae": {"hidden": 64}},
    # Real geometry ratios at a width a CPU runs in seconds.
    "small": {
        "name": "small",
        "height": 64,
        "width": 64,
        "dit": {"width": 256, "ffn_dim": 1024, "num_heads": 4, "num_blocks": 4, "text_dim": 256},
        "vae": {"hidden": 16},
        "readout": {"hidden": 32},
    },
    # Unit-test size: 32x32 frames (4 tokens per latent frame), 2 blocks.
    "tiny": {
        "name": "tiny",
        "height": 32,
        "width": 32,
        "dit": {"width": 32, "ffn_dim": 64, "num_heads": 2, "num_blocks": 2, "latent_channels": 4,
                "freq_dim": 32, "text_dim": 16, "context_len": 4, "max_frames": 256},
        "vae": {"hidden": 8},
        "readout": {"hidden": 16},
    },
}

_NESTED = {"dit": DiTConfig, "vae": VAEConfig, "readout": ReadoutConfig}


def _defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(WorldModelConfig):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def build_config(data: Mapping[str, Any]) -> WorldModelConfig:
    """WorldModelConfig from a full nested dict; unknown keys raise with their full name."""
    data = reject_unknown_keys(WorldModelConfig, data, "worldmodel", "world model config")
    kwargs = {}
    for name, value in data.items():
        sub = _NESTED.get(name)
        if sub is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"worldmodel.{name} must be a mapping, got {type(value).__name__}")
            value = sub(**reject_unknown_keys(sub, value, f"worldmodel.{name}", "world model config"))
        kwargs[name] = value
    return WorldModelConfig(**kwargs)


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge (dataclass values become dicts)."""
    out = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in base.items()}
    for key, value in overrides.items():
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
