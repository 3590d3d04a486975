"""Small frozen transforms: raw env observations -> `Observation`, and model actions -> env actions.

Raw env observation (envs/ vector env, or RLinf's env_obs with a different `camera_map`):
  "<camera>_image" (N, H, W, 3) uint8 per camera, "state" (N, state_dim), "prompt" list[str].
Steps (LeRobot 0.6.1 pi05 pre-processor order): images -> float [0, 1] -> resize-with-pad to
R x R if needed (`common.vla_utils.resize_with_pad_torch`: keep aspect, bilinear,
align_corners=False, clamp, centred zero padding) -> [-1, 1]; camera slots without an env camera
get -1 images and mask False (LeRobot `_preprocess_images` for missing cameras, openpi's masked
right-wrist slot); state -> QUANTILES normalisation (if stats are configured) -> 256-bin prompt
-> tokens. Action unnormalisation is the inverse QUANTILES map on the real action dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from policies.config import PolicyConfig
from policies.observation import Observation
from policies.tokenizer import PromptTokenizer, discretize_state, format_prompt, tokenize_prompts

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


@dataclass(frozen=True)
class ObservationTransform:
    cfg: PolicyConfig
    tokenizer: PromptTokenizer

    def __call__(self, raw: Mapping[str, Any]) -> Observation:
        inputs = self.cfg.inputs
        state = self._state(raw)
        n = state.shape[0]
        images, masks = {}, {}
        mapped = {slot: key for key, slot in inputs.camera_map.items()}
        for slot in self.cfg.cameras:
            if slot in mapped:
                images[slot] = self._image(raw, mapped[slot], n)
                masks[slot] = torch.ones(n, dtype=torch.bool)
            else:
                size = self.cfg.vision.image_size
                images[slot] = torch.full((n, size, size, 3), -1.0)
                masks[slot] = torch.zeros(n, dtype=torch.bool)
        prompts = self._prompts(raw, n)
        bins = discretize_state(self.normalize_state(state).numpy())
        text = [format_prompt(task, b) for task, b in zip(prompts, bins)]
        tokens, token_mask = tokenize_prompts(self.tokenizer, text, self.cfg.max_token_len)
        return Observation(
            images=images,
            image_masks=masks,
            state=state,
            tokenized_prompt=tokens,
            tokenized_prompt_mask=token_mask,
        )

    def normalize_state(self, state: Tensor) -> Tensor:
        q01, q99 = self.cfg.inputs.state_q01, self.cfg.inputs.state_q99
        if q01 is None:
            return state
        return quantile_normalize(
            state, torch.tensor(q01, dtype=state.dtype), torch.tensor(q99, dtype=state.dtype)
        )

    def unnormalize_actions(self, actions: Tensor) -> Tensor:
        """Model actions (..., >= action_dim) -> env actions (..., action_dim)."""
        actions = actions[..., : self.cfg.action_dim]
        q01, q99 = self.cfg.inputs.action_q01, self.cfg.inputs.action_q99
        if q01 is None:
            return actions
        low = torch.tensor(q01, dtype=actions.dtype, device=actions.device)
        high = torch.tensor(q99, dtype=actions.dtype, device=actions.device)
        return quantile_unnormalize(actions, low, high)

    def _state(self, raw: Mapping[str, Any]) -> Tensor:
        key = self.cfg.inputs.state_key
        if key not in raw:
            raise ValueError(
                f"raw observation is missing the state key {key!r} (policy.inputs.state_key); keys: {sorted(raw)}"
            )
        state = torch.as_tensor(np.asarray(raw[key]), dtype=torch.float32)
        if state.dim() != 2 or state.shape[1] != self.cfg.state_dim:
            raise ValueError(
                f"raw observation {key!r} must be (N, {self.cfg.state_dim}) (policy.state_dim), got {tuple(state.shape)}"
            )
        return state

    def _image(self, raw: Mapping[str, Any], key: str, n: int) -> Tensor:
        if key not in raw:
            raise ValueError(
                f"raw observation is missing camera {key!r} (policy.inputs.camera_map maps it to "
                f"{self.cfg.inputs.camera_map[key]!r}); keys: {sorted(raw)}"
            )
        img = torch.as_tensor(np.asarray(raw[key]))
        size = self.cfg.vision.image_size
        if img.dim() != 4 or img.shape[0] != n or img.shape[3] != 3:
            raise ValueError(
                f"raw observation {key!r} must be (N={n}, H, W, 3) images, got {tuple(img.shape)}"
            )
        img = img.float() / 255.0 if img.dtype == torch.uint8 else img.float()
        if tuple(img.shape[1:3]) != (size, size):
            if not self.cfg.inputs.resize_images:
                raise ValueError(
                    f"raw observation {key!r} images are {tuple(img.shape[1:3])}, expected ({size}, {size}) "
                    f"(policy.vision.image_size; policy.inputs.resize_images is off)"
                )
            img = resize_with_pad(img, size, size)
        return img * 2.0 - 1.0

    def _prompts(self, raw: Mapping[str, Any], n: int) -> Sequence[str]:
        key = self.cfg.inputs.prompt_key
        if key not in raw:
            raise ValueError(
                f"raw observation is missing the prompt key {key!r} (policy.inputs.prompt_key); keys: {sorted(raw)}"
            )
        prompts = raw[key]
        prompts = [prompts] * n if isinstance(prompts, str) else list(prompts)
        if len(prompts) != n:
            raise ValueError(
                f"raw observation {key!r} has {len(prompts)} prompts for {n} observations"
            )
        return prompts
