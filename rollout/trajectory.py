"""Trajectory storage of one rollout epoch: what the collector writes and the trainer reads.

`RolloutBatch` is preallocated once per (num_envs, max_chunks, shapes) and reused (memory is
bounded: `nbytes`; the collector logs it). Index [n, t] = env n, chunk t of the episode.
Arrays are numpy (CPU); the trainer turns the rows it trains on into tensors. H is the
policy's chunk (chains), Ha the sub-steps the env executes per chunk (env.chunk_size; the
collector requires the log-prob chunk Hc == Ha, so the ratio covers exactly what ran).

  images[cam]    (N, T, S, S, 3) uint8   observation the chunk was predicted from (camera keys
                                          as the env returns them, e.g. "agentview_image")
  states         (N, T, state_dim) float32
  tokens         (N, T, L) int32, token_mask (N, T, L) bool   the prompt the engine used
  chains         (N, T, K+1, H, D) float32
  denoise_inds   (N, T, K) int64
  actions        (N, T, Ha, action_dim) float32  what was sent to the env (after clipping)
  logprobs       (N, T, Hc, action_dim) float32  rollout (behaviour) log-probs, per element
  chunk_logprob  (N, T) float32
  versions       (N, T) int64    weight version of the prediction
  prefix_rows    (N, T) int64    the row's id in the engine's prefix store (-1: not kept there;
                                  PolicyEngine.keep_prefixes, grpo.prefix_cache=engine)
  rewards        (N, T, Ha) float32  per sub-step (0 on invalid sub-steps)
  substep_valid  (N, T, Ha) bool     sub-steps really executed
  dones          (N, T, Ha) bool     the sub-step ended the episode (success or truncation)
  chunk_valid    (N, T) bool        the chunk was predicted AND executed with the env not done
                                    before it and not lost: the only chunks a trainer may use
  num_chunks     (N,) int64         chunks executed per env (= first index with chunk_valid False)
  success        (N,) bool          episode succeeded
  done           (N,) bool          episode ended within the epoch (success or truncation);
                                    False when the collector's max_chunks cut it short
  lost           (N,) bool          env's worker crashed during the episode: NEVER train on it
                                    (its chunk_valid row is all False, num_chunks 0)
  init_state_ids (N,) int64, task_ids (N,) int64, group_ids (N,) int64 (= n // group_size)
  prompts        list[str] (N,)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _empty(dtype) -> np.ndarray:
    return np.zeros((0, 0, 0), dtype)


@dataclass
class RolloutBatch:
    images: dict[str, np.ndarray]
    states: np.ndarray
    tokens: np.ndarray
    token_mask: np.ndarray
    chains: np.ndarray
    denoise_inds: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    chunk_logprob: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    substep_valid: np.ndarray
    chunk_valid: np.ndarray
    num_chunks: np.ndarray
    success: np.ndarray
    lost: np.ndarray
    init_state_ids: np.ndarray
    task_ids: np.ndarray
    group_ids: np.ndarray
    prompts: list[str] = field(default_factory=list)
    # Added with the collector; defaults keep direct construction by older code working.
    dones: np.ndarray = field(default_factory=lambda: _empty(bool))
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    prefix_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    @property
    def num_envs(self) -> int:
        return int(self.states.shape[0])

    @property
    def max_chunks(self) -> int:
        return int(self.states.shape[1])

    @property
    def group_size(self) -> int:
        return int(np.sum(self.group_ids == self.group_ids[0])) if self.num_envs else 0

    @property
    def nbytes(self) -> int:
        arrays = [v for v in vars(self).values() if isinstance(v, np.ndarray)]
        arrays += list(self.images.values())
        return int(sum(a.nbytes for a in arrays))

    @property
    def num_valid_chunks(self) -> int:
        return int(self.chunk_valid.sum())

    @property
    def num_env_steps(self) -> int:
        """Sub-steps executed in envs that were not lost (what the epoch produced)."""
        return int(self.substep_valid[~self.lost].sum())

    @staticmethod
    def array_specs(
        num_envs: int,
        max_chunks: int,
        state_dim: int,
        token_len: int,
        num_steps: int,
        chunk: int,
        max_action_dim: int,
        action_dim: int,
        logprob_chunk: int,
        action_chunk: int | None = None,
    ) -> dict[str, tuple[tuple[int, ...], type]]:
        """name -> (shape, dtype) of every array `allocate` makes, images and group ids aside (what a
        caller's buffer is checked against). `chunk` is the policy's H (chains); `action_chunk` the
        sub-steps executed per chunk (default `chunk`)."""
        n, t = num_envs, max_chunks
        ha = chunk if action_chunk is None else action_chunk
        return {
            "states": ((n, t, state_dim), np.float32),
            "tokens": ((n, t, token_len), np.int32),
            "token_mask": ((n, t, token_len), bool),
            "chains": ((n, t, num_steps + 1, chunk, max_action_dim), np.float32),
            "denoise_inds": ((n, t, num_steps), np.int64),
            "actions": ((n, t, ha, action_dim), np.float32),
            "logprobs": ((n, t, logprob_chunk, action_dim), np.float32),
            "chunk_logprob": ((n, t), np.float32),
            "versions": ((n, t), np.int64),
            "prefix_rows": ((n, t), np.int64),
            "rewards": ((n, t, ha), np.float32),
            "substep_valid": ((n, t, ha), bool),
            "chunk_valid": ((n, t), bool),
            "num_chunks": ((n,), np.int64),
            "success": ((n,), bool),
            "lost": ((n,), bool),
            "init_state_ids": ((n,), np.int64),
            "task_ids": ((n,), np.int64),
            "dones": ((n, t, ha), bool),
            "done": ((n,), bool),
        }

    @classmethod
    def allocate(
        cls,
        num_envs: int,
        max_chunks: int,
        cameras: dict[str, tuple[int, int, int]],
        state_dim: int,
        token_len: int,
        num_steps: int,
        chunk: int,
        max_action_dim: int,
        action_dim: int,
        logprob_chunk: int,
        group_size: int = 1,
        action_chunk: int | None = None,
    ) -> RolloutBatch:
        """Zeroed buffers (`array_specs`); `cameras` maps observation key -> (S, S, 3)."""
        specs = cls.array_specs(num_envs, max_chunks, state_dim, token_len, num_steps, chunk, max_action_dim,
                                action_dim, logprob_chunk, action_chunk)
        batch = cls(
            images={key: np.zeros((num_envs, max_chunks, *shape), np.uint8) for key, shape in cameras.items()},
            group_ids=np.arange(num_envs, dtype=np.int64) // group_size,
            prompts=[""] * num_envs,
            **{name: np.zeros(shape, dtype) for name, (shape, dtype) in specs.items()},
        )
        batch.prefix_rows.fill(-1)
        return batch

    def clear(self) -> None:
        """Zero every per-step array in place (keeps the allocation)."""
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray) and name != "group_ids":
                value.fill(0)
        for value in self.images.values():
            value.fill(0)
        self.prefix_rows.fill(-1)  # 0 would name a store row
        self.prompts = [""] * self.num_envs

    def summary(self) -> dict[str, float | int]:
        """Counts a log line wants: envs, valid chunks and env steps, successes, losses, bytes."""
        trainable = ~self.lost
        return {
            "envs": self.num_envs,
            "valid_chunks": self.num_valid_chunks,
            "env_steps": self.num_env_steps,
            "success_rate": float(self.success[trainable].mean()) if trainable.any() else 0.0,
            "lost_envs": int(self.lost.sum()),
            "nbytes": self.nbytes,
        }
