"""Cutting the blocks into pipeline stages from measured times (not equal block counts).

The first stage also embeds (patches, timestep, actions), the last also runs the head, the
Euler update and the readout, and a device may be slower or shared: `balanced_split` picks the
contiguous cut that minimises the slowest stage's time, given each block's measured time and
each stage's fixed extra time. Exact (dynamic programming over cut points).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache


def balanced_split(block_times: Sequence[float], num_stages: int,
                   stage_extra: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges, one per stage, minimising max(stage time) where
    stage time = extra[s] + sum of its blocks' times. Ties prefer earlier cuts."""
    times = [float(t) for t in block_times]
    n = len(times)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be in 1..{n} (one block at least per stage), got {num_stages}")
    extra = [0.0] * num_stages if stage_extra is None else [float(e) for e in stage_extra]
    if len(extra) != num_stages:
        raise ValueError(f"stage_extra has {len(extra)} entries for {num_stages} stages")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)

    @cache
    def best(stage: int, start: int) -> tuple[float, tuple[int, ...]]:
        """Best max-time for stages stage.. over blocks start..n-1, and the cut points."""
        remaining = num_stages - stage
        if remaining == 1:
            return extra[stage] + prefix[n] - prefix[start], ()
        choice = (float("inf"), ())
        for end in range(start + 1, n - remaining + 2):
            here = extra[stage] + prefix[end] - prefix[start]
            rest, cuts = best(stage + 1, end)
            cost = max(here, rest)
            if cost < choice[0] - 1e-12:
                choice = (cost, (end, *cuts))
        return choice

    _, cuts = best(0, 0)
    bounds = [0, *cuts, n]
    return [(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def stage_times(block_times: Sequence[float], split: Sequence[tuple[int, int]],
                stage_extra: Sequence[float] | None = None) -> list[float]:
    extra = [0.0] * len(split) if stage_extra is None else list(stage_extra)
    return [extra[i] + sum(block_times[a:b]) for i, (a, b) in enumerate(split)]


def equal_split(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Equal block counts (the first stages take the remainder)."""
    base, more = divmod(num_blocks, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < more else 0)
        out.append((start, end))
        start = end
    return out
