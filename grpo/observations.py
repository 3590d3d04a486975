"""Rebuild the policy's `Observation` from stored rows, with the engine's own prompt ids.

The images go through the same steps as `policies.transforms.ObservationTransform` (uint8 ->
[0, 1] -> resize-with-pad to the vision size when needed -> [-1, 1]; camera slots the env does
not provide are -1 and masked), but the prompt is NOT re-tokenised: the tokens the engine built
(state discretised into them) are used as stored, so the recompute sees exactly the rollout's
inputs. tests/grpo/test_observations.py checks the images equal `policy.make_batch`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.devices import to_device
from policies.config import PolicyConfig
from policies.observation import Observation
from policies.transforms import resize_with_pad


def _image(raw: Tensor, size: int, resize: bool, key: str) -> Tensor:
    if raw.dim() != 4 or raw.shape[-1] != 3:
        raise ValueError(f"stored images {key!r} must be (R, S, S, 3), got {tuple(raw.shape)}")
    img = raw.float() / 255.0 if raw.dtype == torch.uint8 else raw.float()
    if tuple(img.shape[1:3]) != (size, size):
        if not resize:
            raise ValueError(f"stored images {key!r} are {tuple(img.shape[1:3])}, expected ({size}, {size}) "
                             "(policy.inputs.resize_images is off)")
        img = resize_with_pad(img, size, size)
    return img * 2.0 - 1.0


def observation_from_rows(cfg: PolicyConfig, images: dict[str, Tensor], states: Tensor, tokens: Tensor,
                          token_mask: Tensor, device: torch.device | str, pixels: bool = True) -> Observation:
    """images: env camera key -> (R, S, S, 3) uint8; states (R, state_dim); tokens/mask (R, L). The images go to
    `device` (converted there); the state, the prompt and the masks stay where they are: the policy checks them
    and moves them itself (`policies.observation.model_inputs`), and host copies of the masks let the fast path
    lay out the tokens without reading them back from the GPU. pixels=False: the images are not read (a forward
    given the rows' prefix K/V runs neither vision nor the prefix; `Samples.select(pixels=False)` leaves them out):
    each stored camera becomes a constant image on `device` with no memory of its own, its mask as usual."""
    n = int(states.shape[0])
    size = cfg.vision.image_size
    slot_to_key = {slot: key for key, slot in cfg.inputs.camera_map.items()}
    obs_images, masks = {}, {}
    for slot in cfg.cameras:
        key = slot_to_key.get(slot)
        if key is None:
            obs_images[slot] = torch.full((), -1.0, device=device).expand(n, size, size, 3)  # no memory of its own
            masks[slot] = torch.zeros(n, dtype=torch.bool, device=token_mask.device)
            continue
        if key not in images:
            raise ValueError(f"stored rows have no camera {key!r} (policy.inputs.camera_map maps it to {slot!r}); "
                             f"stored: {sorted(images)}")
        if pixels:
            obs_images[slot] = _image(to_device(images[key], device), size, cfg.inputs.resize_images, key)
        else:  # zero-stride: nothing gathered, copied or sent for pixels nobody reads
            obs_images[slot] = torch.zeros((), device=device).expand(n, size, size, 3)
        masks[slot] = torch.ones(n, dtype=torch.bool, device=token_mask.device)
    return Observation(images=obs_images, image_masks=masks, state=states, tokenized_prompt=tokens.long(),
                       tokenized_prompt_mask=token_mask.bool())
