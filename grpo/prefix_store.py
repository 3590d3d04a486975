"""The frozen prefix's K/V of one actor update's rows, kept from the old-log-prob pass for the update epochs.

With `policy.train_expert_only` the vision tower and the prefix stack do not train, so a row's prefix K/V
(per expert layer, RoPE applied; `policies.models.pi05.PrefixCache`) is the same in every forward of one
actor update: the old-log-prob pass computes it anyway, and each update epoch computes it again.
`grpo.prefix_cache` keeps it (opt-in: on the H100 `host` mode measured no gain and `device` mode did not fit
at micro-batch 32; README, GRPO):

    store = RowPrefixes("device", rows=R)
    store.add(rows, cache)                 # the recompute pass: rows (R,) of the update, their cache
    cache = store.gather(micro, device)    # an update micro-batch's rows, in its order

"device" keeps them on the device they were computed on; "host" in CPU memory (pinned where CUDA is available).
Both keep one buffer per tensor with a slot per row of the update, allocated at the first `add` (so the store
is told how many rows the update has), which `add` copies into and `gather` reads with one index_select: in
"host" mode into a pinned buffer that goes to the device without blocking, so a micro-batch's rows cost one
CPU copy and one transfer. The caches of one update share their prefix length (the rows' prompts are stored
at one width, and `observation_from_rows` masks a camera slot in every row or in none, so every micro-batch
keeps the same slots); a cache of another shape is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policies.models.pi05 import PrefixCache


class RowPrefixes:
    def __init__(self, where: str, rows: int):
        if where not in ("device", "host"):
            raise ValueError(f"grpo.prefix_cache must be 'device' or 'host' to keep caches, got {where!r}")
        if rows < 1:
            raise ValueError(f"a prefix store needs at least one row, got rows={rows}")
        self.where = where
        self.rows = rows
        self._kept = torch.zeros(rows, dtype=torch.bool)
        self._slots: PrefixCache | None = None  # one buffer per tensor, (rows, ...) each

    def __len__(self) -> int:
        return int(self._kept.sum())

    def add(self, rows: Tensor, cache: PrefixCache) -> None:
        """Keep `cache`, whose batch index i holds row rows[i] of the update."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        if cache.offsets.shape[0] != len(rows):
            raise ValueError(f"a prefix cache of {cache.offsets.shape[0]} rows for {len(rows)} row ids")
        outside = rows[(rows < 0) | (rows >= self.rows)]
        if len(outside):
            raise ValueError(f"rows {outside[:8].tolist()} are outside this update's {self.rows} rows")
        again = rows[self._kept[rows]]
        if len(again):
            raise ValueError(f"rows {again[:8].tolist()} already have a kept prefix cache")
        if len(rows.unique()) != len(rows):
            raise ValueError(f"row ids named twice in one cache: {rows[:8].tolist()}")
        if not len(rows):
            return
        if self._slots is None:
            self._slots = self._allocate(cache)
        for slot, part in zip(_tensors(self._slots), _tensors(cache), strict=True):
            if slot.shape[1:] != part.shape[1:] or slot.dtype != part.dtype:
                raise ValueError(f"a prefix cache tensor of shape {tuple(part.shape[1:])} / {part.dtype} per row, "
                                 f"the store keeps {tuple(slot.shape[1:])} / {slot.dtype} (one shape per update)")
            _copy_rows(slot, rows, part)
        self._kept[rows] = True

    def gather(self, rows: Tensor, device: torch.device) -> PrefixCache:
        """The kept caches of `rows`, in that order, on `device`."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        inside = (rows >= 0) & (rows < self.rows)
        known = torch.zeros_like(inside)
        known[inside] = self._kept[rows[inside]]
        if not bool(known.all()):
            raise KeyError(f"no kept prefix cache for rows {rows[~known][:8].tolist()}")
        return PrefixCache(*_regroup(self._slots, [_read_rows(t, rows, device) for t in _tensors(self._slots)]))

    def _allocate(self, like: PrefixCache) -> PrefixCache:
        pin = self.where == "host" and torch.cuda.is_available()
        device = torch.device("cpu") if self.where == "host" else like.offsets.device
        buffers = [torch.empty((self.rows, *t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin)
                   for t in _tensors(like)]
        return PrefixCache(*_regroup(like, buffers))


def _tensors(cache: PrefixCache) -> list[Tensor]:
    return [*cache.keys, *cache.values, cache.pad_mask, cache.offsets]


def _regroup(like: PrefixCache, flat: list[Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    """`flat` (in `_tensors` order) as PrefixCache's fields, with `like`'s layer count."""
    layers = len(like.keys)
    return flat[:layers], flat[layers:2 * layers], flat[2 * layers], flat[2 * layers + 1]


def _copy_rows(slot: Tensor, rows: Tensor, part: Tensor) -> None:
    """part's rows into slot's `rows`: a run of rows (the old-log-prob pass's micro-batches) as one slice copy,
    device to pinned host directly; other orders through index_copy_ on the slot's device."""
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + len(rows))):
        slot[first:first + len(rows)].copy_(part)
    else:
        slot.index_copy_(0, rows.to(slot.device), part.to(slot.device))


def _read_rows(slot: Tensor, rows: Tensor, device: torch.device) -> Tensor:
    """slot's `rows` on `device`; from the host through a pinned buffer, whose copy does not block."""
    if slot.device.type != "cpu":
        return slot.index_select(0, rows.to(slot.device)).to(device)
    staged = torch.empty((len(rows), *slot.shape[1:]), dtype=slot.dtype, pin_memory=slot.is_pinned())
    torch.index_select(slot, 0, rows, out=staged)
    return staged.to(device, non_blocking=slot.is_pinned())
