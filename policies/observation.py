"""The policy's input batch (openpi-style `Observation`) and its checked conversion to model tensors.

Contract:
- images: camera slot -> (B, R, R, 3), uint8 in [0, 255] or float in [-1, 1]; R = vision.image_size
- image_masks: camera slot -> (B,) bool (missing entries mean "all valid")
- state: (B, state_dim) float, normalised (only written into the prompt by pi0.5)
- tokenized_prompt: (B, L) int ids, L <= max_token_len; tokenized_prompt_mask: (B, L) bool
Every violation raises a ValueError that names the field and says what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from common.devices import to_device
from policies.config import PolicyConfig


@dataclass
class Observation:
    images: dict[str, Tensor]
    state: Tensor
    tokenized_prompt: Tensor
    tokenized_prompt_mask: Tensor
    image_masks: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.tokenized_prompt.shape[0])

    def to(self, device: torch.device | str) -> Observation:
        return Observation(
            images={k: v.to(device) for k, v in self.images.items()},
            state=self.state.to(device),
            tokenized_prompt=self.tokenized_prompt.to(device),
            tokenized_prompt_mask=self.tokenized_prompt_mask.to(device),
            image_masks={k: v.to(device) for k, v in self.image_masks.items()},
        )

    def select(self, index: Tensor | slice) -> Observation:
        """Rows `index` of every tensor (a sub-batch)."""
        return Observation(
            images={k: v[index] for k, v in self.images.items()},
            state=self.state[index],
            tokenized_prompt=self.tokenized_prompt[index],
            tokenized_prompt_mask=self.tokenized_prompt_mask[index],
            image_masks={k: v[index] for k, v in self.image_masks.items()},
        )

    @classmethod
    def from_dict(cls, data: dict) -> Observation:
        """openpi's dict layout: image, image_mask, state, tokenized_prompt, tokenized_prompt_mask."""
        aliases = {"image": "images", "image_mask": "image_masks"}
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in data.items():
            name = aliases.get(key, key)
            if name not in known:
                raise ValueError(
                    f"unknown observation key {key!r}; expected {sorted(known | set(aliases))}"
                )
            kwargs[name] = value
        missing = sorted(known - set(kwargs) - {"image_masks"})
        if missing:
            raise ValueError(f"observation is missing {missing}")
        return cls(**kwargs)


@dataclass
class ModelInputs:
    images: Tensor  # (B, C, 3, R, R) float32 in [-1, 1], cameras in policy.cameras order
    image_masks: Tensor  # (B, C) bool
    tokens: Tensor  # (B, L) int64
    token_mask: Tensor  # (B, L) bool
    # host copies of the masks where they were built there (model_inputs): the fast path lays the tokens out from
    # host masks, and reading them back from the GPU waits for everything queued before. Read through
    # `masks_on_host`, which ignores copies of other tensors (after dataclasses.replace or an assignment) and of
    # tensors changed in place since
    host_masks: HostMasks | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    def masks_on_host(self) -> tuple[Tensor, Tensor] | None:
        """(token_mask, image_masks) in host memory, if `host_masks` holds copies of these very tensors, unchanged
        since (their version counters)."""
        host = self.host_masks
        if host is None or not host.mirrors(self.token_mask, self.image_masks):
            return None
        return host.token_mask, host.image_masks


@dataclass(frozen=True)
class HostMasks:
    """Host copies of a ModelInputs' masks, and the tensors (`of`: token_mask, image_masks) they copy, with those
    tensors' version counters when copied (an in-place change bumps them)."""

    token_mask: Tensor
    image_masks: Tensor
    of: tuple[Tensor, Tensor]
    versions: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", (self.of[0]._version, self.of[1]._version))

    def mirrors(self, token_mask: Tensor, image_masks: Tensor) -> bool:
        """Whether these are copies of `token_mask` and `image_masks` as they are now."""
        return (self.of[0] is token_mask and self.of[1] is image_masks
                and (token_mask._version, image_masks._version) == self.versions)


def check_nonempty(batch_size: int, entry: str) -> None:
    """Refuse a batch of no rows at a sampling entry point (Policy.sample, Policy.log_prob,
    FastSampler.sample_chains), as make_batch refuses N = 0: an empty batch failed deep inside, with
    an IndexError choosing the SDE step, a reshape of 0 elements in the prefix or the fast path's
    bucket padding, naming no batch size."""
    if batch_size < 1:
        raise ValueError(
            f"{entry} needs a batch of at least one row, got batch size {batch_size} "
            f"(inputs with leading dim {batch_size})"
        )


def model_inputs(
    obs: Observation, cfg: PolicyConfig, device: torch.device | str | None = None
) -> ModelInputs:
    """Validate `obs` against the config and build the model's tensors on `device`."""
    if not isinstance(obs, Observation):
        raise TypeError(f"expected a policies.observation.Observation, got {type(obs).__name__}")
    tokens, token_mask = _check_prompt(obs, cfg)
    b = tokens.shape[0]
    _check_state(obs.state, b, cfg)
    device = device if device is not None else tokens.device
    images, masks = [], []  # masks: each camera's (B,) bool, where the observation has it
    for cam in cfg.cameras:
        if cam not in obs.images:
            raise ValueError(
                f"observation.images is missing camera {cam!r}; expected cameras {cfg.cameras}, "
                f"got {sorted(obs.images)}"
            )
        images.append(_image_to_model(obs.images[cam], cam, b, cfg.vision.image_size).to(device))
        masks.append(_image_mask(obs.image_masks.get(cam), cam, b))
    for name, given in (("images", obs.images), ("image_masks", obs.image_masks)):
        # a mask under a misspelt slot would otherwise be dropped and its camera read as valid
        extra = sorted(set(given) - set(cfg.cameras))
        if extra:
            raise ValueError(
                f"observation.{name} has unknown camera(s) {extra}; expected {cfg.cameras}"
            )
    on_host = all(m.device.type == "cpu" for m in (token_mask, *masks))
    image_masks = torch.stack([m.to(token_mask.device if on_host else device) for m in masks], dim=1)
    inputs = ModelInputs(_stack_cameras(images), to_device(image_masks, device), to_device(tokens, device),
                         to_device(token_mask, device))
    if on_host:
        inputs.host_masks = HostMasks(token_mask, image_masks, of=(inputs.token_mask, inputs.image_masks))
    return inputs


def _stack_cameras(images: list[Tensor]) -> Tensor:
    """(B, N, 3, R, R): the cameras' images side by side. Where every camera is one constant with no memory of its own
    (zero strides: grpo.observations.observation_from_rows(pixels=False), for a forward that reads no pixel), the
    result holds one number per camera: the same values, without B x N images written on the device (a 128-row
    micro-batch's three pi0.5 slots: 231 MB in fp32)."""
    if all(not any(img.stride()) for img in images):
        constants = torch.stack([img[:1, :1, :1, :1] for img in images], dim=1)  # (1, N, 1, 1, 1)
        return constants.expand(images[0].shape[0], len(images), *images[0].shape[1:])
    return torch.stack(images, dim=1)


def _check_prompt(obs: Observation, cfg: PolicyConfig) -> tuple[Tensor, Tensor]:
    tokens, mask = obs.tokenized_prompt, obs.tokenized_prompt_mask
    if tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise ValueError(
            f"observation.tokenized_prompt must be (B, L) integer ids, got {tuple(tokens.shape)} {tokens.dtype}"
        )
    if tokens.shape[1] > cfg.max_token_len:
        raise ValueError(
            f"observation.tokenized_prompt has {tokens.shape[1]} tokens, "
            f"more than policy.max_token_len ({cfg.max_token_len})"
        )
    if tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(
            f"observation.tokenized_prompt_mask must have the prompt's shape {tuple(tokens.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        raise ValueError(
            f"observation.tokenized_prompt ids must be in [0, {cfg.vocab_size}) (policy.vocab_size), "
            f"got min {int(tokens.min())} max {int(tokens.max())}"
        )
    mask = mask.bool()
    if tokens.shape[1] and not bool(mask.any(dim=1).all()):
        raise ValueError(
            "observation.tokenized_prompt_mask has a row without any valid token (<bos> at least)"
        )
    return tokens.long(), mask


def _check_state(state: Tensor, b: int, cfg: PolicyConfig) -> None:
    if state.dim() != 2 or state.shape[0] != b or state.shape[1] != cfg.state_dim:
        raise ValueError(
            f"observation.state must be (B={b}, {cfg.state_dim}) (policy.state_dim), got {tuple(state.shape)}"
        )


def _image_to_model(img: Tensor, cam: str, b: int, size: int) -> Tensor:
    """(B, R, R, 3) uint8 or float in [-1, 1] -> (B, 3, R, R) float32 in [-1, 1]."""
    expected = (b, size, size, 3)
    if tuple(img.shape) != expected:
        raise ValueError(
            f"observation.images[{cam!r}] must be {expected} (B, H, W, 3; policy.vision.image_size={size}), "
            f"got {tuple(img.shape)}; resize with policies.transforms first"
        )
    if img.dtype == torch.uint8:
        img = img.float() / 255.0 * 2.0 - 1.0
    elif img.dtype.is_floating_point:
        img = img.float()
        if (
            img.device.type == "cpu"
            and img.numel()
            and (float(img.min()) < -1.001 or float(img.max()) > 1.001)
        ):
            raise ValueError(
                f"observation.images[{cam!r}] is float but outside [-1, 1] (min {float(img.min()):.3g}, "
                f"max {float(img.max()):.3g}); pass uint8 or float in [-1, 1]"
            )
    else:
        raise ValueError(f"observation.images[{cam!r}] must be uint8 or float, got {img.dtype}")
    return img.permute(0, 3, 1, 2)


def _image_mask(mask: Tensor | None, cam: str, b: int) -> Tensor:
    if mask is None:
        return torch.ones(b, dtype=torch.bool)
    mask = torch.as_tensor(mask)
    if mask.dim() == 0:
        return mask.bool().expand(b).clone()
    if tuple(mask.shape) != (b,):
        raise ValueError(
            f"observation.image_masks[{cam!r}] must be ({b},) bool, got {tuple(mask.shape)}"
        )
    return mask.bool()
