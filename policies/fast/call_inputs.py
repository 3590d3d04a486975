"""A fast-path call's inputs on the host side: the masks read back, the camera slots in use, the bucket
sizes and the token layout (policies/fast/runner.py's `_select`, `_fill_*` and `_upload_layout`).

Host time spent here before vision's graph is launched is GPU idle time (profile_overlap's
breakdown: 0.26-0.77 ms a call at batch 1-8 before round 15), hence numpy over torch CPU ops and
asynchronous copies into pinned buffers.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from common.devices import to_device
from policies.observation import HostMasks


def host_masks(inputs, staging: dict) -> tuple[Tensor, Tensor]:
    """(token mask, image masks) as host bools. From the GPU as asynchronous copies into pinned buffers
    (kept in `staging`, one pair per shape) and one wait: on the H200 box each blocking .cpu() took
    ~90 us, a cat of the two on the device ~120 (profile_overlap --host-profile). The buffers are
    reused by the next call of the same shapes, after this call has used them. Inputs that carry their masks'
    host copies (`ModelInputs.host_masks`, built from host tensors) are read without any copy or wait."""
    host = inputs.masks_on_host() if hasattr(inputs, "masks_on_host") else None
    if host is not None:
        return host[0].bool(), host[1].bool()
    masks = (inputs.token_mask, inputs.image_masks)
    if all(m.device.type == "cpu" for m in masks):
        return masks[0].bool(), masks[1].bool()
    key = tuple((tuple(m.shape), m.dtype) for m in masks)
    if key not in staging:
        staging[key] = tuple(torch.empty(m.shape, dtype=m.dtype, pin_memory=True) for m in masks)
    buffers = staging[key]
    for buf, m in zip(buffers, masks, strict=True):
        buf.copy_(m, non_blocking=True)
    for device in {m.device for m in masks if m.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    return buffers[0].bool(), buffers[1].bool()


def token_layout(image_masks: Tensor, token_mask: Tensor, rows: int, prompt_len: int, num_patches: int,
                 chunk: int) -> tuple[Tensor, Tensor]:
    """The prefix's token layout from host masks, padded to `rows` rows: (packed, n_valid), packed =
    [order (valid tokens first), RoPE positions in that order, the chunk's suffix slots] flattened
    (int64, the bucket's index_pack), n_valid (rows,) int32 = valid prefix tokens per row."""
    mask = F.pad(token_mask[:, :prompt_len], (0, prompt_len - min(token_mask.shape[1], prompt_len)))
    image_pad = image_masks[:, :, None].expand(-1, -1, num_patches).flatten(1)
    valid = pad_rows(torch.cat([image_pad, mask], dim=1), rows)  # (rows, P) host bool
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid tokens first
    positions = (torch.cumsum(valid.long(), dim=1) - 1).gather(1, order)
    n_valid = valid.sum(dim=1)
    suffix = n_valid[:, None] + torch.arange(chunk)
    return torch.cat([order.flatten(), positions.flatten(), suffix.flatten()]), n_valid.to(torch.int32)


def copy_rows(buf: Tensor, value: Tensor) -> None:
    """value's rows into buf's first rows; buf's padding rows repeat row 0 (finite numbers, outputs dropped)."""
    b = value.shape[0]
    buf[:b].copy_(value, non_blocking=True)
    if b < buf.shape[0]:
        buf[b:].copy_(buf[:1].expand_as(buf[b:]))


def drop_unused_cameras(inputs, image_masks: Tensor, cam_bits: int | None = None):
    """Drop the camera slots masked in EVERY row (e.g. pi0.5's third slot on LIBERO, which has two
    cameras): their tokens are never attended to (pad keys) and do not advance the RoPE positions,
    and their SigLIP outputs are never read, so leaving them out changes no output, while it saves
    a third of the vision tower and of the prefix tokens. `cam_bits` forces the kept set (the
    consistent recompute re-runs rows with the set their rollout call used).
    Returns (inputs, host image masks of the kept slots, bitmask of the kept slots)."""
    cams = image_masks.shape[1]
    per_slot = image_masks.numpy().any(axis=0)  # numpy, not torch ops: this host time delays vision's launch
    if cam_bits is None:
        active = per_slot if per_slot.any() else np.ones(cams, dtype=bool)
    else:
        active = np.array([bool(cam_bits >> i & 1) for i in range(cams)])
        if (per_slot & ~active).any():
            raise ValueError(f"camera bitmask {cam_bits} drops a camera slot that holds an image in some row "
                             f"(image masks per slot: {per_slot.tolist()})")
    bits = sum(1 << i for i in range(cams) if active[i])
    if active.all():
        return inputs, image_masks, bits
    keep = np.flatnonzero(active)
    first, last = int(keep[0]), int(keep[-1])
    if last - first + 1 == len(keep):  # a run of slots (LIBERO's first two): views, no copy and no upload
        images, masks = inputs.images[:, first:last + 1], inputs.image_masks[:, first:last + 1]
    else:
        images = inputs.images.index_select(1, torch.as_tensor(keep, device=inputs.images.device))
        masks = inputs.image_masks.index_select(1, torch.as_tensor(keep, device=inputs.image_masks.device))
    return type(inputs)(images, masks, inputs.tokens, inputs.token_mask), image_masks[:, keep], bits


def pick(buckets: list[int], value: int, what: str, key: str | None = None) -> int:
    """The smallest bucket that holds `value`; `key` names the config list of `buckets` in the error."""
    for size in buckets:
        if value <= size:
            return size
    where = f" ({key}={list(buckets)})" if key else ""
    raise ValueError(f"{what} {value} exceeds the largest fast-path bucket {buckets[-1]}{where}")


def pad_rows(values: Tensor, rows: int) -> Tensor:
    """values padded to `rows` rows by repeating row 0."""
    if len(values) >= rows:
        return values
    return torch.cat([values, values[:1].expand(rows - len(values), *values.shape[1:])])


def split_rows(inputs, start: int, stop: int):
    """Rows [start, stop) of a ModelInputs."""
    return take_rows(inputs, slice(start, stop))


def take_rows(inputs, rows: slice | Tensor):
    """Rows of a ModelInputs, a slice or a host index tensor, with the host copies of their masks where it has
    them (`ModelInputs.host_masks`)."""
    moved: dict[torch.device, Tensor] = {}

    def pick(t: Tensor) -> Tensor:
        if isinstance(rows, slice):
            return t[rows]
        if t.dim() and t.stride(0) == 0:  # every row the same (pixel-less images): a view, no gather
            return t[:1].expand(len(rows), *t.shape[1:])
        if t.device not in moved:
            moved[t.device] = to_device(rows, t.device)
        return t[moved[t.device]]

    out = type(inputs)(pick(inputs.images), pick(inputs.image_masks), pick(inputs.tokens), pick(inputs.token_mask))
    host = inputs.masks_on_host() if hasattr(inputs, "masks_on_host") else None
    if host is not None:
        out.host_masks = HostMasks(pick(host[0]), pick(host[1]), of=(out.token_mask, out.image_masks))
    return out
