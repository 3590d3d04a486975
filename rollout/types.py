"""What the policy engine returns, shared by every backend, the collector and the trainers.

`PolicyOutput` is one `PolicyEngine.predict` call's result for a whole (gathered) batch, rows
in the caller's order, every tensor on the CPU:

  actions        (B, H, action_dim) float32  env actions (unnormalised, not clipped)
  model_actions  (B, H, max_action_dim) float32  the final chain state (model space)
  chains         (B, K+1, H, max_action_dim) float32  chains[:, 0] = initial noise
  denoise_inds   (B, K) int64  RLinf convention (-1 everywhere in ODE/eval mode)
  logprobs       (B, logprob_chunk, action_dim) float32  RLinf `prev_logprobs`
  chunk_logprob  (B,) float32  sum of `logprobs` over (chunk, dims): the GRPO ratio's log-prob
  tokens         (B, L) int64, token_mask (B, L) bool: the prompt the ranks built (state
                 discretised into it); the trainer's recompute must use these exact ids
  version        int  the weight version every row was computed with (all ranks agree)
  mode           "ode" | "sde" | "sde_all"
  timings        one `RankTiming` per rank that got rows
  prefix_rows    (B,) int64 or None  with predict(keep_prefix=True): each row's id in the engine's prefix
                 store (-1: not kept; PolicyEngine.keep_prefixes)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RankTiming:
    rank: int
    rows: int  # how many rows of the batch this rank computed
    preprocess_s: float  # raw obs -> model inputs on the rank's device (resize, normalise, tokenise)
    predict_s: float  # the policy's sampling (device-synchronised)
    total_s: float  # from the rank receiving the request to its reply being ready


@dataclass
class PolicyOutput:
    actions: Tensor
    model_actions: Tensor
    chains: Tensor
    denoise_inds: Tensor
    logprobs: Tensor
    chunk_logprob: Tensor
    tokens: Tensor
    token_mask: Tensor
    version: int
    mode: str
    timings: list[RankTiming] = field(default_factory=list)
    prefix_rows: Tensor | None = None

    TENSOR_FIELDS = (
        "actions",
        "model_actions",
        "chains",
        "denoise_inds",
        "logprobs",
        "chunk_logprob",
        "tokens",
        "token_mask",
    )

    @property
    def batch_size(self) -> int:
        return int(self.actions.shape[0])

    @property
    def max_rank_predict_s(self) -> float:
        """The slowest rank's predict time: what a synchronous step waits for."""
        return max((t.predict_s for t in self.timings), default=0.0)

    @staticmethod
    def concat(parts: list[PolicyOutput]) -> PolicyOutput:
        """Rows of `parts` in order (one part per rank); versions and modes must agree."""
        if not parts:
            raise ValueError("PolicyOutput.concat needs at least one part")
        versions = {p.version for p in parts}
        if len(versions) != 1:
            raise RuntimeError(f"ranks answered with different weight versions {sorted(versions)}")
        modes = {p.mode for p in parts}
        if len(modes) != 1:
            raise RuntimeError(f"ranks answered with different sampling modes {sorted(modes)}")
        tensors = {
            name: torch.cat([getattr(p, name) for p in parts], dim=0)
            for name in PolicyOutput.TENSOR_FIELDS
        }
        timings = [t for p in parts for t in p.timings]
        kept = [p.prefix_rows for p in parts]
        prefix_rows = None if all(k is None for k in kept) else torch.cat(
            [torch.full((p.batch_size,), -1, dtype=torch.long) if k is None else k for p, k in zip(parts, kept)])
        return PolicyOutput(**tensors, version=parts[0].version, mode=parts[0].mode, timings=timings,
                            prefix_rows=prefix_rows)
