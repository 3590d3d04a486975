"""Small frozen transforms: raw env observations -> `Observation`, and model actions -> env actions.

Raw env observation (envs/ vector env, or RLinf's env_obs with a different `camera_map`):
  "<camera>_image" (N, H, W, 3) uint8 per camera, "state" (N, state_dim), "prompt" list[str].
Steps (LeRobot 0.6.1 pi05 pre-processor order): images uint8 -> float [0, 1] -> resize-with-pad to
R x R if needed (`common.vla_utils.resize_with_pad_torch`: keep aspect, bilinear,
align_corners=False, clamp, centred zero padding) -> [-1, 1]; camera slots without an env camera
get -1 images and mask False (LeRobot `_preprocess_images` for missing cameras, openpi's masked
right-wrist slot); state -> QUANTILES normalisation (if stats are configured) -> 256-bin prompt
-> tokens. Action unnormalisation is the inverse QUANTILES map on the real action dims.

`ObservationTransform(raw, device)` runs batched on `device` (the engine's rank device): the
uint8 images are copied there and converted, all cameras of one size resized in one
`F.interpolate`, the state binned with `torch.bucketize` and the prompt ids composed by
`PromptBuilder` (policies/prompt_builder.py), with no per-sample Python loop.
`ObservationTransform.reference(raw)` is the per-sample CPU path it replaced (numerically
identical on CPU: tests/policies/test_inputs.py). Bad input is refused by `check_raw` before any
work, naming the key, expected and received shape/dtype, or the env index and value of a
non-finite state.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from policies.config import PolicyConfig
from policies.observation import Observation
from policies.prompt_builder import PromptBuilder
from policies.tokenizer import (
    NUM_STATE_BINS,
    PromptTokenizer,
    discretize_state,
    format_prompt,
    tokenize_prompts,
)

QUANTILE_EPS = 1e-8  # LeRobot NormalizerProcessorStep eps for q99 == q01


def resize_with_pad(images: Tensor, height: int, width: int) -> Tensor:
    """(N, H, W, C) float in [0, 1] -> (N, height, width, C): openpi/LeRobot `resize_with_pad_torch`."""
    x = images.permute(0, 3, 1, 2)
    cur_h, cur_w = x.shape[2:]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    pad_h0, rem_h = divmod(height - new_h, 2)
    pad_w0, rem_w = divmod(width - new_w, 2)
    x = F.pad(x, (pad_w0, pad_w0 + rem_w, pad_h0, pad_h0 + rem_h), mode="constant", value=0.0)
    return x.permute(0, 2, 3, 1)


def quantile_normalize(x: Tensor, q01: Tensor, q99: Tensor) -> Tensor:
    denom = torch.where(q99 - q01 == 0, torch.full_like(q01, QUANTILE_EPS), q99 - q01)
    return 2.0 * (x - q01) / denom - 1.0


def quantile_unnormalize(x: Tensor, q01: Tensor, q99: Tensor) -> Tensor:
    denom = torch.where(q99 - q01 == 0, torch.full_like(q01, QUANTILE_EPS), q99 - q01)
    return (x + 1.0) * denom / 2.0 + q01


class ObservationTransform:
    def __init__(self, cfg: PolicyConfig, tokenizer: PromptTokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.prompts = PromptBuilder(tokenizer, cfg.max_token_len)
        self._bin_edges: dict[str, Tensor] = {}

    def __call__(self, raw: Mapping[str, Any], device: torch.device | str | None = None) -> Observation:
        """Raw env observation -> Observation on `device` (default cpu), batched there."""
        n = check_raw(raw, self.cfg)
        device = torch.device(device if device is not None else "cpu")
        images, masks = self._images(raw, n, device)
        state = _as_tensor(raw[self.cfg.inputs.state_key]).to(device, torch.float32, non_blocking=True)
        bins = torch.bucketize(self.normalize_state(state).double(), self._edges(device), right=True) - 1
        tokens, token_mask = self.prompts.build(self._prompts(raw, n), bins)
        return Observation(images, state, tokens, token_mask, masks)

    def reference(self, raw: Mapping[str, Any]) -> Observation:
        """The per-sample CPU path (np.digitize, one prompt string per sample): the reference
        the batched path is tested against."""
        n = check_raw(raw, self.cfg)
        state = _as_tensor(raw[self.cfg.inputs.state_key]).cpu().float()
        images, masks = {}, {}
        mapped = {slot: key for key, slot in self.cfg.inputs.camera_map.items()}
        for slot in self.cfg.cameras:
            if slot in mapped:
                img = _as_tensor(raw[mapped[slot]]).cpu().float() / 255.0
                if tuple(img.shape[1:3]) != (self.cfg.vision.image_size,) * 2:
                    img = resize_with_pad(img, self.cfg.vision.image_size, self.cfg.vision.image_size)
                images[slot], masks[slot] = img * 2.0 - 1.0, torch.ones(n, dtype=torch.bool)
            else:
                size = self.cfg.vision.image_size
                images[slot], masks[slot] = torch.full((n, size, size, 3), -1.0), torch.zeros(n, dtype=torch.bool)
        bins = discretize_state(self.normalize_state(state).numpy())
        text = [format_prompt(task, b) for task, b in zip(self._prompts(raw, n), bins)]
        tokens, token_mask = tokenize_prompts(self.tokenizer, text, self.cfg.max_token_len)
        return Observation(images, state, tokens, token_mask, masks)

    def normalize_state(self, state: Tensor) -> Tensor:
        q01, q99 = self.cfg.inputs.state_q01, self.cfg.inputs.state_q99
        if q01 is None:
            return state
        low = torch.tensor(q01, dtype=state.dtype, device=state.device)
        high = torch.tensor(q99, dtype=state.dtype, device=state.device)
        return quantile_normalize(state, low, high)

    def unnormalize_actions(self, actions: Tensor) -> Tensor:
        """Model actions (..., >= action_dim) -> env actions (..., action_dim)."""
        actions = actions[..., : self.cfg.action_dim]
        q01, q99 = self.cfg.inputs.action_q01, self.cfg.inputs.action_q99
        if q01 is None:
            return actions
        low = torch.tensor(q01, dtype=actions.dtype, device=actions.device)
        high = torch.tensor(q99, dtype=actions.dtype, device=actions.device)
        return quantile_unnormalize(actions, low, high)

    # ------------------------------------------------------------------ batched steps
    def _images(self, raw, n: int, device: torch.device) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Every mapped camera to [-1, 1] on device; cameras of one size resized in one call."""
        size = self.cfg.vision.image_size
        mapped = {slot: key for key, slot in self.cfg.inputs.camera_map.items()}
        by_size: dict[tuple[int, int], list[str]] = {}
        for slot in self.cfg.cameras:
            if slot in mapped:
                by_size.setdefault(tuple(raw[mapped[slot]].shape[1:3]), []).append(slot)
        images, masks = {}, {}
        for hw, slots in by_size.items():
            stacked = torch.cat([_as_tensor(raw[mapped[s]]).to(device, non_blocking=True) for s in slots])
            x = stacked.float() / 255.0
            if hw != (size, size):
                x = resize_with_pad(x, size, size)
            for slot, part in zip(slots, (x * 2.0 - 1.0).split(n)):
                images[slot], masks[slot] = part, torch.ones(n, dtype=torch.bool, device=device)
        for slot in self.cfg.cameras:
            if slot not in images:
                images[slot] = torch.full((n, size, size, 3), -1.0, device=device)
                masks[slot] = torch.zeros(n, dtype=torch.bool, device=device)
        return {s: images[s] for s in self.cfg.cameras}, {s: masks[s] for s in self.cfg.cameras}

    def _edges(self, device: torch.device) -> Tensor:
        """np.digitize(x, linspace(-1, 1, 257)[:-1]) == bucketize(x, edges, right=True) (float64)."""
        key = str(device)
        if key not in self._bin_edges:
            edges = np.linspace(-1, 1, NUM_STATE_BINS + 1)[:-1]
            self._bin_edges[key] = torch.from_numpy(edges).to(device)
        return self._bin_edges[key]

    def _prompts(self, raw: Mapping[str, Any], n: int) -> list[str]:
        prompts = raw[self.cfg.inputs.prompt_key]
        return [prompts] * n if isinstance(prompts, str) else list(prompts)


def _as_tensor(value: Any) -> Tensor:
    """A tensor view of an array (no copy), except for negative strides (a flipped image,
    img[:, ::-1]), which torch cannot view: those are copied, as the local backend's shared
    memory does, so every backend takes them. Read-only arrays (Ray's object store, shared
    observations) are only read here, so torch's warning about them does not apply."""
    if isinstance(value, Tensor):
        return value
    array = np.asarray(value)
    if any(stride < 0 for stride in array.strides):
        array = np.ascontiguousarray(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(array)


# ---------------------------------------------------------------------- input boundary
def check_raw(raw: Mapping[str, Any], cfg: PolicyConfig) -> int:
    """Refuse a bad raw observation before any work; returns the batch size N. Errors name the
    key, what was expected and what was received."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"raw observation must be a mapping of arrays, got {type(raw).__name__}")
    n = _check_state(raw, cfg)
    for key, slot in cfg.inputs.camera_map.items():
        _check_image(raw, key, slot, n, cfg)
    _check_prompts(raw, n, cfg)
    return n


def _missing(raw: Mapping[str, Any], key: str, what: str) -> ValueError:
    return ValueError(f"raw observation is missing {what}; keys: {sorted(raw)}")


def _check_state(raw: Mapping[str, Any], cfg: PolicyConfig) -> int:
    key, dim = cfg.inputs.state_key, cfg.state_dim
    if key not in raw:
        raise _missing(raw, key, f"the state key {key!r} (policy.inputs.state_key)")
    state = raw[key]
    shape, dtype = tuple(state.shape) if hasattr(state, "shape") else None, getattr(state, "dtype", None)
    if shape is None or len(shape) != 2 or shape[1] != dim or shape[0] < 1:
        raise ValueError(f"raw observation {key!r} must be (N, {dim}) (policy.state_dim), N >= 1, got {shape}")
    if not _is_real(dtype):
        raise ValueError(f"raw observation {key!r} must be a float array (N, {dim}), got dtype {dtype}")
    finite = torch.isfinite(_as_tensor(state))
    if not bool(finite.all()):
        env, dim_index = (int(i) for i in torch.nonzero(~finite)[0])
        value = float(_as_tensor(state)[env, dim_index])
        raise ValueError(
            f"raw observation {key!r} has a non-finite value {value} at env {env}, dim {dim_index}: "
            "a NaN/inf state would be discretised into the prompt as a wrong bin"
        )
    return int(shape[0])


def _check_image(raw: Mapping[str, Any], key: str, slot: str, n: int, cfg: PolicyConfig) -> None:
    if key not in raw:
        raise _missing(raw, key, f"camera {key!r} (policy.inputs.camera_map maps it to {slot!r})")
    img = raw[key]
    shape, dtype = tuple(getattr(img, "shape", ())), getattr(img, "dtype", None)
    if len(shape) != 4 or shape[0] != n or shape[3] != 3 or 0 in shape:
        raise ValueError(f"raw observation {key!r} must be (N={n}, H, W, 3) images, got {shape}")
    if not _is_uint8(dtype):
        raise ValueError(
            f"raw observation {key!r} must be uint8 images (N={n}, H, W, 3) in [0, 255], got dtype {dtype}: "
            "raw images must be uint8 (float images would be misread as [0, 1] or clamped)"
        )
    size = cfg.vision.image_size
    if shape[1:3] != (size, size) and not cfg.inputs.resize_images:
        raise ValueError(
            f"raw observation {key!r} images are {shape[1:3]}, expected ({size}, {size}) "
            f"(policy.vision.image_size; policy.inputs.resize_images is off)"
        )


def _check_prompts(raw: Mapping[str, Any], n: int, cfg: PolicyConfig) -> None:
    key = cfg.inputs.prompt_key
    if key not in raw:
        raise _missing(raw, key, f"the prompt key {key!r} (policy.inputs.prompt_key)")
    prompts = raw[key]
    if isinstance(prompts, str):
        return
    prompts = list(prompts)
    if len(prompts) != n:
        raise ValueError(f"raw observation {key!r} has {len(prompts)} prompts for {n} observations")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise ValueError(
            f"raw observation {key!r} must be strings, got {type(prompts[bad[0]]).__name__} at env {bad[0]}"
        )


def _is_uint8(dtype: Any) -> bool:
    return dtype == torch.uint8 or (isinstance(dtype, np.dtype) and dtype == np.uint8)


def _is_real(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point or (dtype != torch.bool and not dtype.is_complex)
    return isinstance(dtype, np.dtype) and dtype.kind in "fiu"
