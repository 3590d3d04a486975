"""The GRPO loss as pure tensor functions, per row (one row = one stored chunk transition).

  log r     = log pi_theta(chunk) - log pi_old(chunk)        chunk-level (sum over chunk x dims)
  surrogate = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
  dual clip : for A < 0, min(surrogate, -dual_clip A)        (bounds the loss of huge ratios)
  w_IS      = min(pi_old / pi_rollout, tis_cap), detached    (truncated importance sampling)
  loss_row  = w_IS surrogate + kl_coef KL(pi_theta, pi_ref)
  loss      = sum_rows weight_row loss_row                   (weights sum to 1 over a global batch)

No entropy bonus: the flow-SDE step's std (noise level and time grid) is not learned, so the
entropy H of its Gaussian is a constant of the config with zero gradient; it is only reported
(LossTerms.entropy), and GRPOConfig refuses entropy_coef != 0.

pi_old is the trainer's own recompute before the update (so r = 1 at the first micro-batch);
pi_rollout is what the engine reported. Row weights implement the aggregation: "token_mean"
gives every row the same weight (RLinf's token-mean at chunk level), "trajectory_mean" weighs
a row by 1 / (its trajectory's trainable chunks), i.e. every trajectory counts once
(per-trajectory length normalisation). Normalising the weights over the whole global batch
before splitting it into micro-batches makes the accumulated gradient independent of the
micro-batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# exp() overflows float32 past 88.7 nats, and a chunk log-prob (a sum over chunk x action dims of a
# narrow Gaussian) can move that far within one RL step. Such a row's clipped branch (or its zero
# advantage) has no gradient, but exp's backward multiplied that 0 by inf: NaN, which
# clip_grad_norm_ spreads to every weight. Exponents are capped here; nothing below the cap changes.
MAX_EXPONENT = 80.0


def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                      dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-row PPO clipped surrogate (to minimise) and where the clipped branch is active."""
    ratio = torch.exp(log_ratio.clamp(max=MAX_EXPONENT))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
        active = active | dual_active
    return loss, active


def ratio_outside(log_ratio: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """(B,) bool: the ratio lies outside [1 - clip_low, 1 + clip_high] (whatever A's sign)."""
    ratio = torch.exp(log_ratio)
    return (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)


def truncated_is_weight(old_logprob: Tensor, rollout_logprob: Tensor, cap: float) -> Tensor:
    """min(exp(old - rollout), cap), without gradient: corrects for the rollout's numerics."""
    return torch.exp(old_logprob.detach() - rollout_logprob.detach()).clamp(max=cap)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, estimator: str = "k3") -> Tensor:
    """Per-row estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman's k1/k2/k3)."""
    diff = logprob - ref_logprob
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    if estimator == "k3":
        diff = diff.clamp(min=-MAX_EXPONENT)  # exp(-diff) (see MAX_EXPONENT)
        return torch.exp(-diff) + diff - 1.0
    raise ValueError(f"kl estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def gaussian_entropy(std: Tensor, numel: int) -> Tensor:
    """Entropy of a chunk of `numel` independent Gaussian elements with std `std` (per row)."""
    return numel * (0.5 * math.log(2 * math.pi * math.e) + torch.log(std))


def row_weights(trajectory_lengths: Tensor, aggregation: str) -> Tensor:
    """Unnormalised weight per row: 1 (token_mean) or 1 / trajectory length (trajectory_mean)."""
    lengths = trajectory_lengths.to(torch.float32)
    if aggregation == "token_mean":
        return torch.ones_like(lengths)
    if aggregation == "trajectory_mean":
        if bool((lengths < 1).any()):
            raise ValueError("trajectory_mean needs every row's trajectory length >= 1")
        return 1.0 / lengths
    raise ValueError(f"aggregation must be 'token_mean' or 'trajectory_mean', got {aggregation!r}")


def normalise(weights: Tensor) -> Tensor:
    total = weights.sum()
    if not total > 0:
        raise ValueError("row weights must have a positive sum")
    return weights / total


@dataclass
class LossTerms:
    loss: Tensor  # scalar: sum of weight * per-row loss (what backward() is called on)
    policy: Tensor  # scalar weighted surrogate (with IS weights)
    kl: Tensor  # scalar weighted KL to the reference (0 without one)
    entropy: Tensor  # scalar weighted entropy, reported only (0 without one)
    clip_active: Tensor  # (B,) bool
    ratio_outside: Tensor  # (B,) bool
    approx_kl: Tensor  # scalar weighted k3 estimate of KL(pi_old || pi_theta)


def grpo_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, weights: Tensor,
              clip_low: float, clip_high: float, dual_clip: float | None = None,
              is_weight: Tensor | None = None, ref_logprob: Tensor | None = None, kl_coef: float = 0.0,
              kl_estimator: str = "k3", entropy: Tensor | None = None) -> LossTerms:
    """All rows' terms; `weights` already normalised over the global batch (sum to 1 there). `entropy`
    (per row, constant in the parameters) is averaged for the report and stays out of the loss."""
    log_ratio = logprob - old_logprob.detach()
    surrogate, active = clipped_surrogate(log_ratio, advantages, clip_low, clip_high, dual_clip)
    if is_weight is not None:
        surrogate = surrogate * is_weight.detach()
    policy = (weights * surrogate).sum()
    zero = logprob.new_zeros(())
    kl = (weights * kl_penalty(logprob, ref_logprob.detach(), kl_estimator)).sum() if ref_logprob is not None else zero
    loss = policy + kl_coef * kl
    with torch.no_grad():
        ent = (weights * entropy).sum() if entropy is not None else zero
        approx_kl = (weights * (torch.exp(log_ratio) - 1.0 - log_ratio)).sum()
    return LossTerms(loss, policy, kl, ent, active, ratio_outside(log_ratio.detach(), clip_low, clip_high), approx_kl)
