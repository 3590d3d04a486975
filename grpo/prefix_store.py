"""The frozen prefix's K/V of one actor update's rows, kept from the old-log-prob pass for the update epochs.

With `policy.train_expert_only` the vision tower and the prefix stack do not train, so a row's prefix K/V
(per expert layer, RoPE applied; `policies.models.pi05.PrefixCache`) is the same in every forward of one
actor update: the old-log-prob pass computes it anyway, and each update epoch computes it again.
`grpo.prefix_cache` keeps it (opt-in: on the H100 `host` mode measured no gain and `device` mode did not fit
at micro-batch 32; README, GRPO):

    store = RowPrefixes("device")
    store.add(rows, cache)                 # the recompute pass: rows (R,) of the update, their cache
    cache = store.gather(micro, device)    # an update micro-batch's rows, in its order

"device" keeps the tensors where they were computed; "host" copies them to CPU memory (pinned where CUDA is
available) and brings each micro-batch's rows back. The caches of one update share their prefix length (the
rows' prompts are stored at one width, and `observation_from_rows` masks a camera slot in every row or in none,
so every micro-batch keeps the same slots), so the rows' K/V concatenate as they are.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from policies.models.pi05 import PrefixCache


def _to_host(tensor: Tensor) -> Tensor:
    if tensor.device.type == "cpu":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    out.copy_(tensor)
    return out


class RowPrefixes:
    def __init__(self, where: str):
        if where not in ("device", "host"):
            raise ValueError(f"grpo.prefix_cache must be 'device' or 'host' to keep caches, got {where!r}")
        self.where = where
        self._parts: list[PrefixCache] = []
        self._place: dict[int, tuple[int, int]] = {}  # row -> (part, position in the part)

    def __len__(self) -> int:
        return len(self._place)

    def add(self, rows: Tensor, cache: PrefixCache) -> None:
        """Keep `cache`, whose batch index i holds row rows[i] of the update."""
        rows = [int(r) for r in rows]
        if cache.offsets.shape[0] != len(rows):
            raise ValueError(f"a prefix cache of {cache.offsets.shape[0]} rows for {len(rows)} row ids")
        again = [r for r in rows if r in self._place]
        if again:
            raise ValueError(f"rows {again[:8]} already have a kept prefix cache")
        if self.where == "host":
            cache = PrefixCache([_to_host(k) for k in cache.keys], [_to_host(v) for v in cache.values],
                                _to_host(cache.pad_mask), _to_host(cache.offsets))
        part = len(self._parts)
        self._parts.append(cache)
        self._place.update({row: (part, i) for i, row in enumerate(rows)})

    def gather(self, rows: Tensor, device: torch.device) -> PrefixCache:
        """The kept caches of `rows`, in that order, on `device`."""
        missing = [int(r) for r in rows if int(r) not in self._place]
        if missing:
            raise KeyError(f"no kept prefix cache for rows {missing[:8]}")
        places = [self._place[int(r)] for r in rows]
        # the asked rows grouped by part (a stable sort), one index_select per part, then back in the asked order
        order = sorted(range(len(places)), key=lambda i: places[i][0])
        pieces = []
        for part, group in itertools.groupby(order, key=lambda i: places[i][0]):
            cache = self._parts[part]
            positions = [places[i][1] for i in group]
            pieces.append(cache.index_select(torch.tensor(positions, dtype=torch.long, device=cache.offsets.device)))
        joined = pieces[0] if len(pieces) == 1 else _concat(pieces)
        if order != sorted(order):
            back = torch.argsort(torch.tensor(order))
            joined = joined.index_select(back.to(joined.offsets.device))
        return _on(joined, device)


def _concat(pieces: list[PrefixCache]) -> PrefixCache:
    layers = len(pieces[0].keys)
    return PrefixCache(
        [torch.cat([p.keys[layer] for p in pieces]) for layer in range(layers)],
        [torch.cat([p.values[layer] for p in pieces]) for layer in range(layers)],
        torch.cat([p.pad_mask for p in pieces]),
        torch.cat([p.offsets for p in pieces]),
    )


def _on(cache: PrefixCache, device: torch.device) -> PrefixCache:
    """The cache on `device` (`Tensor.to` returns a tensor already there as it is)."""
    return PrefixCache([k.to(device) for k in cache.keys], [v.to(device) for v in cache.values],
                       cache.pad_mask.to(device), cache.offsets.to(device))
