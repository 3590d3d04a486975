"""Typed policy configuration (Hydra group `policy`, conf/policy/*.yaml) with named presets.

`PolicyConfig.preset("tiny" | "pi05_small" | "pi05")` gives a validated config; YAML files
name a preset and override keys: `PolicyConfig.from_mapping({"preset": "tiny", "dtype": ...})`.
Unknown keys (at any nesting level) and bad values raise errors naming the full key, e.g.
"policy.expert.num_heads must equal policy.prefix.num_heads (8) ...".

Sizes of the full model are LeRobot 0.6.1's `get_gemma_config` ("gemma_2b" prefix,
"gemma_300m" expert) and the PaliGemma SigLIP So400m/14 vision config LeRobot builds
(`PaliGemmaWithExpertModel.__init__`: intermediate 4304, projection 2048).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    check_bool,
    check_choice,
    check_list,
    check_nonnegative_int,
    check_positive_finite,
    check_positive_int,
    is_list,
    is_number,
    reject_unknown_keys,
    to_container,
)
from policies.fast.config import FastConfig

DTYPES = ("float32", "bfloat16")
TRAIN_MODES = ("sde", "sde_all")
SAMPLE_MODES = ("ode", "sde", "sde_all")
CHECKPOINT_FORMATS = ("auto", "lerobot", "openpi", "ours")
PALIGEMMA_VOCAB = 257152


@dataclass
class VisionConfig:
    """SigLIP vision tower (+ linear projector to the prefix width)."""

    image_size: int = 224
    patch_size: int = 14
    width: int = 1152
    depth: int = 27
    num_heads: int = 16
    mlp_dim: int = 4304
    layer_norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def validate(self, key: str) -> None:
        for name in ("image_size", "patch_size", "width", "depth", "num_heads", "mlp_dim"):
            check_positive_int(f"{key}.{name}", getattr(self, name))
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{key}.image_size ({self.image_size}) must be a multiple of {key}.patch_size "
                f"({self.patch_size})"
            )
        if self.width % self.num_heads:
            raise ValueError(
                f"{key}.width ({self.width}) must be divisible by {key}.num_heads ({self.num_heads})"
            )
        check_positive_finite(f"{key}.layer_norm_eps", self.layer_norm_eps)


@dataclass
class GemmaConfig:
    """One Gemma decoder stack (the prefix LLM or the action expert)."""

    width: int = 2048
    depth: int = 18
    mlp_dim: int = 16384
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def validate(self, key: str) -> None:
        for name in ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
            check_positive_int(f"{key}.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{key}.num_heads ({self.num_heads}) must be a multiple of {key}.num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"{key}.head_dim must be even (RoPE rotates halves), got {self.head_dim}"
            )
        check_positive_finite(f"{key}.rms_norm_eps", self.rms_norm_eps)
        check_positive_finite(f"{key}.rope_theta", self.rope_theta)


@dataclass
class SamplingConfig:
    """Flow sampling and RL log-prob settings (RLinf's flow-SDE conventions)."""

    num_steps: int = 10  # K Euler steps, t from 1 to 0
    train_mode: str = "sde"  # "sde": one random stochastic step per call; "sde_all": every step
    noise_level: float = 0.5  # a in sigma_t = a * sqrt(t / (1 - t))
    exclude_last_step: bool = False  # RLinf `ignore_last`: never pick step K-1 in "sde" mode
    logprob_chunk: int | None = None  # actions counted in the log-prob (None: chunk_size)

    def validate(self, key: str, chunk_size: int) -> None:
        check_positive_int(f"{key}.num_steps", self.num_steps)
        check_choice(f"{key}.train_mode", self.train_mode, TRAIN_MODES)
        check_positive_finite(f"{key}.noise_level", self.noise_level)
        check_bool(f"{key}.exclude_last_step", self.exclude_last_step)  # a quoted "false" excluded the step
        if self.exclude_last_step and self.num_steps < 2:
            raise ValueError(
                f"{key}.exclude_last_step needs {key}.num_steps >= 2, got {self.num_steps}"
            )
        if self.logprob_chunk is not None:
            check_positive_int(f"{key}.logprob_chunk", self.logprob_chunk)
            if self.logprob_chunk > chunk_size:
                raise ValueError(
                    f"{key}.logprob_chunk ({self.logprob_chunk}) must not exceed policy.chunk_size "
                    f"({chunk_size})"
                )


@dataclass
class InputConfig:
    """How raw env observations map onto the model's inputs (policies/transforms.py)."""

    # env observation key -> model camera slot; slots not mapped are filled with black and masked
    camera_map: dict[str, str] = field(
        default_factory=lambda: {"agentview_image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"}
    )
    state_key: str = "state"
    prompt_key: str = "prompt"
    resize_images: bool = (
        True  # resize-with-pad to vision.image_size (openpi/LeRobot); else exact size required
    )
    # LeRobot QUANTILES normalisation, x -> 2 (x - q01) / (q99 - q01) - 1; None: state already in [-1, 1]
    state_q01: list[float] | None = None
    state_q99: list[float] | None = None
    action_q01: list[float] | None = None
    action_q99: list[float] | None = None

    def validate(self, key: str, cameras: list[str], state_dim: int, action_dim: int) -> None:
        check_bool(f"{key}.resize_images", self.resize_images)  # a quoted "false" resized
        slots = list(self.camera_map.values())
        if not slots:
            raise ValueError(f"{key}.camera_map must map at least one env camera to a slot")
        for env_key, slot in self.camera_map.items():
            if slot not in cameras:
                raise ValueError(
                    f"{key}.camera_map[{env_key!r}] = {slot!r} is not one of policy.cameras {cameras}"
                )
        if len(set(slots)) != len(slots):
            raise ValueError(
                f"{key}.camera_map maps two env cameras to one slot: {self.camera_map}"
            )
        for name, dim in (("state", state_dim), ("action", action_dim)):
            low, high = getattr(self, f"{name}_q01"), getattr(self, f"{name}_q99")
            if (low is None) != (high is None):
                raise ValueError(f"{key}.{name}_q01 and {key}.{name}_q99 must be given together")
            for stat, values in ((f"{name}_q01", low), (f"{name}_q99", high)):
                if values is None:
                    continue
                # NaN, inf or text came back only as non-finite actions from the engine, naming no key
                if not is_list(values) or not all(is_number(v) and math.isfinite(v) for v in values):
                    raise ValueError(f"{key}.{stat} must be a list of finite numbers, got {values!r}")
                if len(values) != dim:
                    raise ValueError(
                        f"{key}.{stat} must have {dim} entries ({name}_dim), got {len(values)}"
                    )
            flipped = [i for i in range(dim) if low is not None and low[i] > high[i]]
            if flipped:
                i = flipped[0]
                raise ValueError(f"{key}.{name}_q01 exceeds {key}.{name}_q99 at dim {i} ({low[i]} > {high[i]}): "
                                 "the normalisation would flip its sign")


@dataclass
class PolicyConfig:
    """A pi0.5-class policy: sizes, I/O contract, precision, sampling, weights."""

    name: str = "pi05"
    vision: VisionConfig = field(default_factory=VisionConfig)
    prefix: GemmaConfig = field(default_factory=GemmaConfig)
    expert: GemmaConfig = field(
        default_factory=lambda: GemmaConfig(
            width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256
        )
    )
    vocab_size: int = PALIGEMMA_VOCAB
    chunk_size: int = 50  # H actions per call
    max_action_dim: int = 32
    max_state_dim: int = 32
    action_dim: int = 7  # real (env) action dims; the rest of max_action_dim is padding
    state_dim: int = 8  # real state dims written into the prompt
    cameras: list[str] = field(
        default_factory=lambda: ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
    )
    max_token_len: int = 200
    min_period: float = 4e-3  # sincos time embedding periods
    max_period: float = 4.0
    dtype: str = "float32"  # "bfloat16" keeps vision, projector, norms, time/action projections in fp32 (LeRobot)
    train_expert_only: bool = True  # log_prob grads reach only the expert + action/time projections
    # with train_expert_only: the frozen vision, token embedding and prefix stack in this dtype (their RMSNorm
    # weights stay fp32); null: as policy.dtype says. Opt-in for GRPO's trainer, which keeps fp32 masters of every
    # weight otherwise: weights it never updates need no master copy. Every policy built from the config gets it,
    # the engine's too (its plain path's vision then runs in this dtype)
    frozen_dtype: str | None = None
    tokenizer_path: str | None = (
        None  # PaliGemma SentencePiece model; None: built-in byte tokenizer
    )
    checkpoint: str | None = None  # None: random init from `seed`
    checkpoint_format: str = "auto"
    seed: int = 0
    init_scale: float = 1.0  # random init std = init_scale / sqrt(fan_in)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    inputs: InputConfig = field(default_factory=InputConfig)
    fast: FastConfig = field(default_factory=FastConfig)  # the GPU fast path (policies/fast)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.vision.validate("policy.vision")
        self.prefix.validate("policy.prefix")
        self.expert.validate("policy.expert")
        for name in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self.expert, name), getattr(self.prefix, name)
            if mine != theirs:
                raise ValueError(
                    f"policy.expert.{name} must equal policy.prefix.{name} ({theirs}) because the expert "
                    f"attends to the prefix K/V layer by layer, got {mine}"
                )
        for name in (
            "vocab_size",
            "chunk_size",
            "max_action_dim",
            "max_state_dim",
            "action_dim",
            "state_dim",
            "max_token_len",
        ):
            check_positive_int(f"policy.{name}", getattr(self, name))
        if self.action_dim > self.max_action_dim:
            raise ValueError(
                f"policy.action_dim ({self.action_dim}) must not exceed policy.max_action_dim ({self.max_action_dim})"
            )
        if self.state_dim > self.max_state_dim:
            raise ValueError(
                f"policy.state_dim ({self.state_dim}) must not exceed policy.max_state_dim ({self.max_state_dim})"
            )
        if self.expert.width % 2:
            raise ValueError(
                f"policy.expert.width must be even (sincos time embedding), got {self.expert.width}"
            )
        # a bare string became one camera per character (["b", "a", ...]) and then failed naming the slots
        self.cameras = check_list("policy.cameras", self.cameras)
        if (not self.cameras or not all(isinstance(c, str) and c for c in self.cameras)
                or len(set(self.cameras)) != len(self.cameras)):
            raise ValueError(
                f"policy.cameras must be non-empty camera slot names without duplicates, got {self.cameras}"
            )
        check_positive_finite("policy.min_period", self.min_period)
        check_positive_finite("policy.max_period", self.max_period)
        check_choice("policy.dtype", self.dtype, DTYPES)
        check_choice("policy.checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        check_positive_finite("policy.init_scale", self.init_scale)
        check_bool("policy.train_expert_only", self.train_expert_only)  # a quoted "false" trained only the expert
        if self.frozen_dtype is not None:
            check_choice("policy.frozen_dtype", self.frozen_dtype, DTYPES)
            if not self.train_expert_only:
                raise ValueError(f"policy.frozen_dtype={self.frozen_dtype!r} needs policy.train_expert_only=true "
                                 "(with the whole model trained nothing is frozen)")
        for name in ("checkpoint", "tokenizer_path"):  # a number would reach open() as a file descriptor
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (str, os.PathLike)) and str(value)):
                raise ValueError(f"policy.{name} must be a path (a non-empty string) or null, got {value!r}")
        check_nonnegative_int("policy.seed", self.seed)
        self.sampling.validate("policy.sampling", self.chunk_size)
        self.inputs.validate("policy.inputs", self.cameras, self.state_dim, self.action_dim)

    def check_consistent_training(self) -> None:
        """What a trainer's recompute with gradients (GRPO's actor) needs of policy.fast.consistent_recompute.
        Checked with the experiment's config, before the run directory exists, because the recompute itself
        (policies/fast/recompute.py) only finds out after the first rollout. The actor passes no per-row
        buckets, so one-entry bucket lists must pin them; vision and prefix run without autograd."""
        fast = self.fast
        if not fast.consistent_recompute:
            return
        if not fast.pins_one_bucket:
            raise ValueError(
                "policy.fast.consistent_recompute=true in training needs one-entry policy.fast.batch_buckets and "
                "policy.fast.prompt_buckets (they pin the bucket every rollout row ran in, which the trainer's "
                f"recompute must reuse), got policy.fast.batch_buckets={fast.batch_buckets} and "
                f"policy.fast.prompt_buckets={fast.prompt_buckets}")
        if not self.train_expert_only:
            raise ValueError(
                "policy.fast.consistent_recompute=true in training needs policy.train_expert_only=true (vision "
                "and prefix run through the fast path without autograd), got policy.train_expert_only=false")
        if fast.dtype == "float32" and self.dtype != "float32":
            # the engine's float32 copies hold its policy.dtype-rounded weights, the trainer's its fp32 masters
            raise ValueError(
                f"policy.fast.consistent_recompute=true in training with policy.fast.dtype=float32 needs "
                f"policy.dtype=float32 (the engine's weights are rounded to it, the trainer's fp32 masters are "
                f"not), got policy.dtype={self.dtype!r}")

    @property
    def logprob_chunk(self) -> int:
        return self.sampling.logprob_chunk or self.chunk_size

    @property
    def prefix_len(self) -> int:
        return len(self.cameras) * self.vision.num_patches + self.max_token_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **overrides: Any) -> PolicyConfig:
        """A copy with top-level or nested (dict) overrides, validated."""
        return _build(type(self), _merge(self.to_dict(), overrides), "policy")

    @staticmethod
    def preset(name: str, /, **overrides: Any) -> PolicyConfig:
        """The preset's config with `overrides` applied key by key: a partial sub-config such as
        `expert={"mlp_dim": 2048}` changes only the keys it names. `name` is positional-only so that
        the config's own `name` key can be overridden too (and `from_mapping(cfg.to_dict())` works)."""
        if name not in PRESETS:
            raise ValueError(f"policy.preset must be one of {sorted(PRESETS)}, got {name!r}")
        return _build(PolicyConfig, _merge(preset_tree(name), overrides), "policy")

    @staticmethod
    def from_mapping(mapping: Mapping[str, Any] | None = None, **overrides: Any) -> PolicyConfig:
        """Build from a dict / OmegaConf node: `preset` (default "pi05") plus overrides."""
        data = _merge(to_container(mapping) if mapping is not None else {}, overrides)
        # a `name` that is a preset picks it (a to_dict() round trip); any other name is just a label
        name = data.get("name")
        preset = data.pop("preset", None) or (name if name in PRESETS else "pi05")
        return PolicyConfig.preset(preset, **data)


_SMALL_INPUTS = {"camera_map": {"agentview_image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"}}

PRESETS: dict[str, dict[str, Any]] = {
    # LeRobot 0.6.1 PI05Config defaults: SigLIP So400m/14 + gemma_2b + gemma_300m, ~3.3B in use.
    "pi05": {"name": "pi05"},
    # Real sequence lengths (3 cams x 256 patches, 200 tokens, chunk 50, 10 steps, PaliGemma vocab)
    # with small widths: runs on a CPU, same code path and token counts as pi05.
    "pi05_small": {
        "name": "pi05_small",
        "vision": {"width": 64, "depth": 2, "num_heads": 4, "mlp_dim": 128},
        "prefix": {
            "width": 64,
            "depth": 2,
            "mlp_dim": 128,
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 16,
        },
        "expert": {
            "width": 32,
            "depth": 2,
            "mlp_dim": 64,
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 16,
        },
    },
    # Unit-test size: 56 px images (16 patches), 2 cameras, byte-token prompts, chunk 8, 4 steps.
    "tiny": {
        "name": "tiny",
        "vision": {
            "image_size": 56,
            "patch_size": 14,
            "width": 32,
            "depth": 2,
            "num_heads": 2,
            "mlp_dim": 64,
        },
        "prefix": {
            "width": 48,
            "depth": 2,
            "mlp_dim": 96,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 16,
        },
        "expert": {
            "width": 32,
            "depth": 2,
            "mlp_dim": 64,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 16,
        },
        "vocab_size": 512,
        "chunk_size": 8,
        "max_action_dim": 16,
        "max_state_dim": 16,
        "cameras": ["base_0_rgb", "left_wrist_0_rgb"],
        "max_token_len": 128,
        "sampling": {"num_steps": 4},
        "inputs": _SMALL_INPUTS,
    },
}


def preset_tree(name: str) -> dict[str, Any]:
    """Every key of preset `name` (PolicyConfig's field defaults + the preset's entries) as nested
    dicts. Overrides merge onto this full tree, so a partial override of a sub-config the preset
    leaves at its default (pi05's 1024-wide expert, not GemmaConfig's 2048) keeps the rest."""
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(PolicyConfig)}
    return _merge(defaults, PRESETS[name])


def _build(cls: type, data: Mapping[str, Any], key: str) -> Any:
    """Instantiate a (nested) config dataclass, rejecting unknown keys by their full name."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{key} must be a mapping, got {type(data).__name__}")
    kwargs = {}
    for name, value in reject_unknown_keys(cls, data, key).items():
        sub = _NESTED.get((cls.__name__, name))
        kwargs[name] = _build(sub, value, f"{key}.{name}") if sub is not None else value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # e.g. a wrong argument type caught by the dataclass itself
        raise ValueError(f"{key}: {exc}") from exc


def _nested_table() -> dict[tuple[str, str], type]:
    return {
        ("PolicyConfig", "vision"): VisionConfig,
        ("PolicyConfig", "prefix"): GemmaConfig,
        ("PolicyConfig", "expert"): GemmaConfig,
        ("PolicyConfig", "sampling"): SamplingConfig,
        ("PolicyConfig", "inputs"): InputConfig,
        ("PolicyConfig", "fast"): FastConfig,
    }


_NESTED = _nested_table()


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; dataclass values are turned into dicts first."""
    out = {
        k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in base.items()
    }
    for k, v in overrides.items():
        if dataclasses.is_dataclass(v):
            v = dataclasses.asdict(v)
        if (
            k in out
            and isinstance(out[k], Mapping)
            and isinstance(v, Mapping)
            and k != "camera_map"
        ):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
