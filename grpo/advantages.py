"""GRPO advantages as pure tensor functions (no model, no state).

Layout: N trajectories (envs x rollout epochs) of up to T chunks; group g holds the G
consecutive trajectories n with n // G == g (they started from one init state).

  score_n   = 1 if trajectory n succeeded else 0           (per-trajectory success score)
  A_n       = (score_n - mean_g) / (std_g + eps)           (mean/std over g's members that count)
  keep_g    = filter_low <= mean_g <= filter_high          (optional group filter)
  A[n, t]   = A_n on every chunk t the trainer may use, 0 elsewhere
  mask[n,t] = chunk_valid[n, t] and not lost[n] and keep_{g(n)}

Members that count: envs not lost (a crashed env's outcome is unknown, so it neither trains
nor shifts its group's baseline). std is torch.std's (Bessel-corrected, RLinf's
`compute_grpo_advantages`) unless `unbiased=False`; a group with one member has std 0.
Identical scores in a group give exactly zero advantage (score - mean = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def as_tensor(value, dtype: torch.dtype | None = None) -> Tensor:
    return torch.as_tensor(np.asarray(value) if not isinstance(value, Tensor) else value, dtype=dtype)


def trajectory_scores(success) -> Tensor:
    """(N,) bool success -> (N,) float32 score (1 success, 0 failure)."""
    return as_tensor(success).to(torch.float32)


def group_stats(scores: Tensor, counts_mask: Tensor, group_size: int, unbiased: bool = True
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group mean, std and member count over the members where `counts_mask` is True.

    scores (N,), counts_mask (N,) bool -> mean (N/G,), std (N/G,), count (N/G,) int64.
    Groups without a counting member get mean 0 and std 0.
    """
    n = scores.shape[0]
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size ({group_size}) must divide the number of trajectories ({n})")
    s = scores.to(torch.float64).reshape(-1, group_size)
    m = counts_mask.to(torch.bool).reshape(-1, group_size)
    count = m.sum(dim=1)
    safe = count.clamp(min=1).to(torch.float64)
    mean = torch.where(m, s, 0.0).sum(dim=1) / safe
    sq = torch.where(m, (s - mean[:, None]) ** 2, 0.0).sum(dim=1)
    dof = (count - 1 if unbiased else count).clamp(min=1).to(torch.float64)
    std = torch.where(count > 1, (sq / dof).sqrt(), torch.zeros_like(sq))
    return mean.to(torch.float32), std.to(torch.float32), count


def group_advantages(scores: Tensor, counts_mask: Tensor, group_size: int, eps: float = 1e-6,
                     unbiased: bool = True) -> Tensor:
    """(N,) normalised advantages; 0 for members that do not count."""
    mean, std, _ = group_stats(scores, counts_mask, group_size, unbiased)
    g = group_size
    adv = (scores.to(torch.float32) - mean.repeat_interleave(g)) / (std.repeat_interleave(g) + eps)
    return torch.where(counts_mask.to(torch.bool), adv, torch.zeros_like(adv))


def group_filter(mean: Tensor, count: Tensor, low: float, high: float) -> Tensor:
    """(N/G,) bool: groups that have a counting member and whose mean lies in [low, high]."""
    return (count > 0) & (mean >= low) & (mean <= high)


def chunk_mask(chunk_valid, lost) -> Tensor:
    """(N, T) bool: chunks the trainer may use (executed, env not done before, env not lost)."""
    valid = as_tensor(chunk_valid).to(torch.bool)
    lost = as_tensor(lost).to(torch.bool)
    if valid.dim() != 2 or lost.shape != valid.shape[:1]:
        raise ValueError(f"chunk_valid must be (N, T) and lost (N,), got {tuple(valid.shape)} and {tuple(lost.shape)}")
    return valid & ~lost[:, None]


def broadcast_to_chunks(advantages: Tensor, mask: Tensor) -> Tensor:
    """(N,) trajectory advantages -> (N, T), zero where `mask` is False."""
    return torch.where(mask, advantages[:, None].expand_as(mask), torch.zeros((), dtype=advantages.dtype))


@dataclass
class AdvantageResult:
    advantages: Tensor  # (N, T) float32, 0 outside mask
    mask: Tensor  # (N, T) bool: rows to train on
    scores: Tensor  # (N,) float32
    trajectory_advantages: Tensor  # (N,) float32 (before masking by chunk)
    group_mean: Tensor  # (N/G,)
    group_keep: Tensor  # (N/G,) bool

    def metrics(self) -> dict[str, float]:
        kept = self.group_keep
        return {
            "advantages/group_kept_frac": float(kept.float().mean()) if kept.numel() else 0.0,
            "advantages/train_chunks": int(self.mask.sum()),
            "advantages/abs_mean": float(self.advantages[self.mask].abs().mean()) if self.mask.any() else 0.0,
        }


def compute_advantages(success, chunk_valid, lost, group_size: int, eps: float = 1e-6,
                       unbiased: bool = True, filter_groups: bool = False, filter_low: float = 0.0,
                       filter_high: float = 1.0) -> AdvantageResult:
    """Everything above from a rollout's arrays: success (N,), chunk_valid (N, T), lost (N,)."""
    scores = trajectory_scores(success)
    lost_t = as_tensor(lost).to(torch.bool)
    counts = ~lost_t
    adv = group_advantages(scores, counts, group_size, eps, unbiased)
    mean, _, count = group_stats(scores, counts, group_size, unbiased)
    keep = group_filter(mean, count, filter_low, filter_high) if filter_groups else count > 0
    mask = chunk_mask(chunk_valid, lost_t) & keep.repeat_interleave(group_size)[:, None]
    return AdvantageResult(broadcast_to_chunks(adv, mask), mask, scores, adv, mean, keep)
