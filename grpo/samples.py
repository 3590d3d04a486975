"""From the collector's `RolloutBatch` to the rows the actor trains on.

The collector reuses one preallocated `RolloutBatch` per rollout epoch, so each epoch is
copied out at once (`EpochRows.from_batch`), keeping only the chunks a trainer may ever use
(`chunk_valid` and not `lost`) plus the per-trajectory outcome. After all epochs,
`assemble` computes the group advantages over every trajectory (group ids are offset per
epoch: groups never mix epochs) and returns the `Samples` of the rows that survive the masks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from grpo.advantages import AdvantageResult, compute_advantages
from grpo.config import GRPOConfig
from rollout.trajectory import RolloutBatch


@dataclass
class Samples:
    """R stored chunk transitions (CPU tensors), in (epoch, env, chunk) order."""

    images: dict[str, Tensor]  # env camera key -> (R, S, S, 3) uint8
    states: Tensor  # (R, state_dim) float32
    tokens: Tensor  # (R, L) int64: the prompt ids the engine used (never re-tokenised)
    token_mask: Tensor  # (R, L) bool
    chains: Tensor  # (R, K+1, H, D) float32
    denoise_inds: Tensor  # (R, K) int64
    rollout_logprob: Tensor  # (R,) float32: the engine's chunk log-prob (behaviour policy)
    versions: Tensor  # (R,) int64: weight version each chunk was predicted with
    trajectory: Tensor  # (R,) int64: trajectory index (epoch * num_envs + env)
    chunk: Tensor  # (R,) int64: chunk index within the trajectory
    advantages: Tensor  # (R,) float32 (zeros until `assemble` sets them)
    trajectory_length: Tensor  # (R,) int64: trainable chunks of the row's trajectory
    # (R,) int64: the row's id in the engine's prefix store (grpo.prefix_cache=engine), -1: not kept there
    prefix_row: Tensor | None = None

    def __post_init__(self) -> None:
        if self.prefix_row is None:
            self.prefix_row = torch.full((len(self),), -1, dtype=torch.long)

    def __len__(self) -> int:
        return int(self.states.shape[0])

    def select(self, index: Tensor, pixels: bool = True) -> Samples:
        """The rows at `index`. pixels=False leaves their images out, for a forward that reads none (one given the
        rows' kept prefix K/V): each camera keeps a (0, S, S, 3) tensor, so its key and size stay known, and the
        ~0.3 MB a LIBERO row of images is neither gathered here nor sent to the GPU (`observation_from_rows`)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "images":
                values[f.name] = {k: v[index] if pixels else v[:0] for k, v in value.items()}
            else:
                values[f.name] = value[index]
        return Samples(**values)

    def without_prompt_padding(self) -> Samples:
        """These rows with the prompt columns past the last valid token of every row left out. Rows are stored at
        policy.max_token_len (the collector zero-pads; LIBERO's prompts use ~45 of 200 columns), and those columns
        are pad keys no token attends to that move no position, so the log-probs are the same at less work. One
        width for all the rows, so every micro-batch of an update runs the same shapes (and rounds the same)."""
        used = torch.nonzero(self.token_mask.any(dim=0))
        width = int(used[-1]) + 1 if len(used) else 1
        if width >= self.token_mask.shape[1]:
            return self
        return dataclasses.replace(self, tokens=self.tokens[:, :width], token_mask=self.token_mask[:, :width])

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        if not parts:
            raise ValueError("Samples.concat needs at least one part")
        values = {}
        for f in fields(Samples):
            first = getattr(parts[0], f.name)
            if isinstance(first, dict):
                values[f.name] = {k: torch.cat([getattr(p, f.name)[k] for p in parts]) for k in first}
            else:
                values[f.name] = torch.cat([getattr(p, f.name) for p in parts])
        return Samples(**values)


@dataclass
class EpochRows:
    """One rollout epoch: per-trajectory outcome arrays and the usable rows."""

    success: np.ndarray  # (N,) bool
    chunk_valid: np.ndarray  # (N, T) bool
    lost: np.ndarray  # (N,) bool
    num_chunks: np.ndarray  # (N,) int64
    task_ids: np.ndarray  # (N,) int64
    init_state_ids: np.ndarray  # (N,) int64
    rewards_sum: np.ndarray  # (N,) float32
    rows: Samples  # rows where chunk_valid and not lost (trajectory = env index here)

    @staticmethod
    def from_batch(batch: RolloutBatch) -> EpochRows:
        usable = batch.chunk_valid & ~batch.lost[:, None]
        env, chunk = np.nonzero(usable)

        def take(array: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(array[env, chunk]))

        n_rows = len(env)
        rows = Samples(
            images={k: take(v) for k, v in batch.images.items()},
            states=take(batch.states).float(),
            tokens=take(batch.tokens).long(),
            token_mask=take(batch.token_mask).bool(),
            chains=take(batch.chains).float(),
            denoise_inds=take(batch.denoise_inds).long(),
            rollout_logprob=take(batch.chunk_logprob).float(),
            versions=take(batch.versions).long(),
            prefix_row=take(batch.prefix_rows).long(),
            trajectory=torch.from_numpy(env.astype(np.int64)),
            chunk=torch.from_numpy(chunk.astype(np.int64)),
            advantages=torch.zeros(n_rows),
            trajectory_length=torch.zeros(n_rows, dtype=torch.int64),
        )
        return EpochRows(
            success=batch.success.copy(), chunk_valid=batch.chunk_valid.copy(), lost=batch.lost.copy(),
            num_chunks=batch.num_chunks.copy(), task_ids=batch.task_ids.copy(),
            init_state_ids=batch.init_state_ids.copy(), rewards_sum=batch.rewards.sum(axis=(1, 2)),
            rows=rows,
        )

    @property
    def num_envs(self) -> int:
        return int(self.success.shape[0])


@dataclass
class Assembled:
    samples: Samples  # rows with advantages, in trajectory order
    advantages: AdvantageResult  # over all trajectories of the step (epochs stacked)
    success: np.ndarray  # (E*N,) bool
    lost: np.ndarray
    task_ids: np.ndarray
    num_chunks: np.ndarray


def assemble(epochs: list[EpochRows], group_size: int, cfg: GRPOConfig) -> Assembled:
    """Stack the epochs' trajectories, compute advantages, keep the rows inside the mask."""
    if not epochs:
        raise ValueError("assemble needs at least one rollout epoch")
    horizons = {e.chunk_valid.shape[1] for e in epochs}
    if len(horizons) != 1:
        raise ValueError(f"rollout epochs have different max_chunks {sorted(horizons)}")
    cat = lambda name: np.concatenate([getattr(e, name) for e in epochs])
    success, chunk_valid, lost = cat("success"), cat("chunk_valid"), cat("lost")
    result = compute_advantages(success, chunk_valid, lost, group_size, eps=cfg.adv_eps, unbiased=cfg.std_unbiased,
                                filter_groups=cfg.filter_groups, filter_low=cfg.filter_low,
                                filter_high=cfg.filter_high)
    parts, offset = [], 0
    for e in epochs:
        parts.append(dataclasses.replace(e.rows, trajectory=e.rows.trajectory + offset))
        offset += e.num_envs
    samples = Samples.concat(parts)
    keep = result.mask[samples.trajectory, samples.chunk]
    samples = samples.select(torch.nonzero(keep).flatten())
    samples.advantages = result.advantages[samples.trajectory, samples.chunk].float()
    lengths = result.mask.sum(dim=1)
    samples.trajectory_length = lengths[samples.trajectory].long()
    return Assembled(samples, result, success, lost, cat("task_ids"), cat("num_chunks"))


def rollout_metrics(data: Assembled) -> dict[str, float]:
    """Success rate over the trajectories that finished (lost envs excluded), episode lengths."""
    counted = ~data.lost
    metrics = {
        "rollout/success_rate": float(data.success[counted].mean()) if counted.any() else 0.0,
        "rollout/episodes": int(counted.sum()),
        "rollout/lost_envs": int(data.lost.sum()),
        "rollout/chunks_per_episode": float(data.num_chunks[counted].mean()) if counted.any() else 0.0,
    }
    metrics.update(data.advantages.metrics())
    return metrics
