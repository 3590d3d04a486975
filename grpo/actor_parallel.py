"""One rank of the data-parallel actor update (SPMD: every rank runs `DistributedActor.train`).

    batches = split_batch(samples, owner, world, orders)   # rank 0: every rank's share of the step
    metrics = DistributedActor(policy, grpo_cfg, spec).train(batches[rank])   # on every rank at once

The update equals the single-process `Actor.train` over all rows (up to fp32 summation order):
- rank 0 draws each update epoch's permutation of ALL rows from the actor's generator (the same
  draws as the single-process actor, so its generator state stays checkpoint-compatible) and
  sends it with each rank's rows, their global ids and the per-row globals (rollout log-probs,
  trajectory lengths, the owner of every row);
- the old log-probs (and the reference's) are recomputed by each rank for its own rows and
  summed into one global vector, so the gap metrics and the truncated IS weights are the
  single-process ones;
- each global batch is the single-process slice of the permutation; its row weights are
  normalised over the whole global batch before each rank takes its own rows, and the gradients
  are summed over ranks (grpo/distributed.py), so the summed gradient is the single-process one;
- every rank runs the same number of micro-batches per global batch (the largest share): a rank
  with fewer real rows runs "filler" micro-batches of one row with weight 0, which keeps DDP's
  single synced backward and FSDP2's per-forward all-gathers in step across ranks (also for a
  rank that owns no rows at all: it holds one borrowed row for this);
- loss metrics are weighted sums (weights sum to 1 over a global batch) summed over ranks;
  `train/clip_frac_first_mb` is over every rank's first micro-batch; the gradient norm is the
  global one (identical on every rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo import losses
from grpo.actor import Actor, _Accumulator, make_optimizer, old_pass_metrics
from grpo.config import GRPOConfig
from grpo.distributed import (
    RankSpec,
    all_reduce_sum,
    broadcast_module,
    full_value,
    gather_rows,
    gradient_sync,
    wrap,
)
from grpo.samples import Samples


@dataclass
class RankBatch:
    """One rank's share of an RL step's rows, plus what every rank needs about all R rows."""

    rows: Samples  # this rank's rows in global order (one borrowed row when it owns none)
    ids: Tensor  # (R_r,) int64 global row ids of `rows` (empty when it owns none)
    owner: Tensor  # (R,) int64 rank of every row
    rollout_logprob: Tensor  # (R,) float32
    trajectory_length: Tensor  # (R,) int64
    orders: list[Tensor]  # one permutation of range(R) per update epoch


def split_batch(samples: Samples, owner: Tensor, world: int, orders: list[Tensor]) -> list[RankBatch]:
    """Every rank's RankBatch (rank 0 builds them; the rows travel to the workers)."""
    out, samples = [], samples.without_prompt_padding()  # one prompt width on every rank (Actor.train's)
    for rank in range(world):
        ids = torch.nonzero(owner == rank).flatten()
        rows = samples.select(ids if len(ids) else torch.zeros(1, dtype=torch.int64))
        out.append(RankBatch(rows, ids, owner, samples.rollout_logprob, samples.trajectory_length, orders))
    return out


class DistributedActor(Actor):
    """`Actor` on one rank of an initialised actor group (grpo/distributed.py `init_group`)."""

    def __init__(self, policy, cfg: GRPOConfig, spec: RankSpec, show_progress: bool = False):
        broadcast_module(policy.model, spec)  # rank 0's weights everywhere, before the reference copy
        super().__init__(policy, cfg, show_progress)
        self.spec = spec
        self.module = wrap(policy, spec)
        self.params = list(policy.trainable_parameters())  # FSDP2: the sharded parameters now
        self.optimizer = make_optimizer(self.params, cfg)

    # ----- forward through the wrapper -----
    def _log_prob(self, policy, obs, chains: Tensor, denoise_inds: Tensor, prefix=None) -> Tensor:
        if prefix is not None:  # refused with the config (grpo.prefix_cache needs actor_parallel.mode none)
            raise ValueError("the data-parallel actor takes no kept prefix cache (grpo.prefix_cache)")
        if policy is not self.policy:  # the frozen reference: a plain local forward
            return super()._log_prob(policy, obs, chains, denoise_inds)
        return self.module(obs, chains, denoise_inds)

    def _micro_chunks(self, count: int, steps: int) -> list[Tensor | None]:
        """Local positions of each of `steps` micro-batches; None = a filler (no rows left here)."""
        parts = self._micro(torch.arange(count)) if count else []  # torch.split of nothing gives one empty part
        return parts + [None] * (steps - len(parts))

    def _steps(self, owners: Tensor) -> int:
        """Micro-batches every rank runs for these rows: the largest share's."""
        largest = int(torch.bincount(owners, minlength=self.spec.world_size).max())
        return max(-(-largest // self.cfg.micro_batch), 1)

    @torch.no_grad()
    def _recompute_local(self, batch: RankBatch, policy) -> Tensor:
        """This rank's rows' chunk log-probs (CPU), with filler forwards up to the largest share."""
        parts, filler = [], torch.zeros(1, dtype=torch.int64)
        for chunk in self._micro_chunks(len(batch.ids), self._steps(batch.owner)):
            if chunk is None:
                if policy is self.policy:  # only the wrapped module communicates in forward
                    self.chunk_logprob(policy, batch.rows.select(filler))
                continue
            parts.append(self.chunk_logprob(policy, batch.rows.select(chunk)).cpu())
        return torch.cat(parts) if parts else torch.zeros(0)

    def _filler_step(self, rows: Samples) -> None:
        """Forward/backward of one row with weight 0: zero gradients, the same collectives."""
        logprob = self.chunk_logprob(self.policy, rows.select(torch.zeros(1, dtype=torch.int64)))
        (logprob * 0.0).sum().backward()

    # ----- the update -----
    def train(self, batch: RankBatch) -> dict[str, float]:
        cfg, spec = self.cfg, self.spec
        total = int(batch.owner.shape[0])
        self.policy.train()
        started = time.perf_counter()
        old = gather_rows(self._recompute_local(batch, self.policy), batch.ids, total, spec)
        metrics, is_weight = old_pass_metrics(old, batch.rollout_logprob, cfg, started)  # the time: this rank's
        ref = None
        if self.reference is not None:
            ref = gather_rows(self._recompute_local(batch, self.reference), batch.ids, total, spec)
        raw_weights = losses.row_weights(batch.trajectory_length, cfg.loss_agg)
        local_pos = torch.full((total,), -1, dtype=torch.int64)
        local_pos[batch.ids] = torch.arange(len(batch.ids))
        acc, first = _Accumulator(), [0.0, 0.0]  # ratios outside the clip band, rows: first micro-batch
        for order in batch.orders:
            for global_index in torch.split(order, cfg.global_batch or total):
                weights = losses.normalise(raw_weights[global_index])
                mine = batch.owner[global_index] == spec.rank
                self._global_step(batch, global_index[mine], weights[mine], self._steps(batch.owner[global_index]),
                                  local_pos, old, is_weight, ref, acc, first)
        return self._reduce_metrics(metrics, acc, first, total)

    def _global_step(self, batch: RankBatch, index: Tensor, weights: Tensor, steps: int, local_pos: Tensor,
                     old: Tensor, is_weight: Tensor | None, ref: Tensor | None, acc: _Accumulator,
                     first: list[float]) -> None:
        """One optimiser step: this rank's rows of one global batch, `steps` micro-batches."""
        self.optimizer.zero_grad(set_to_none=True)
        micro, micro_weights = (self._micro(index), self._micro(weights)) if len(index) else ([], [])
        for j in range(steps):
            with gradient_sync(self.module, self.spec.mode, enabled=j == steps - 1):
                if j >= len(micro):
                    self._filler_step(batch.rows)
                    continue
                idx, w = micro[j], micro_weights[j]
                terms = self._micro_step(batch.rows.select(local_pos[idx]), old[idx], w, idx, is_weight, ref)
                acc.add(terms, w)
                if first[1] == 0:
                    first[:] = [float(terms.ratio_outside.float().sum()), float(len(idx))]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        acc.grad_norms.append(float(full_value(grad_norm)))
        self.optimizer.step()
        self.updates += 1

    def _reduce_metrics(self, metrics: dict, acc: _Accumulator, first: list[float], total: int) -> dict[str, float]:
        keys = list(_Accumulator.KEYS)  # fixed: a rank without real rows has no sums of its own
        sums = acc.host_sums()
        summed = all_reduce_sum([sums.get(k, 0.0) for k in keys] + first, self.spec)
        acc.sums = dict(zip(keys, summed[: len(keys)]))
        outside, rows = summed[len(keys):]
        metrics["train/clip_frac_first_mb"] = outside / rows if rows else 0.0
        metrics.update(acc.metrics(self.cfg.update_epochs))
        metrics["train/rows"] = total
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]  # what the steps used (not the config)
        metrics["train/actor_ranks"] = self.spec.world_size
        return metrics

    # ----- weights (weights_for_push: Actor's, which all-gathers FSDP2's shards) -----
    def receive_state(self, optimizer_state: dict | None) -> None:
        """After rank 0 loaded a checkpoint: its weights (a broadcast) and optimiser state here."""
        broadcast_module(self.policy.model, self.spec)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
