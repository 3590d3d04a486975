"""The GRPO actor update: recompute log-probs of stored flow-SDE transitions, clipped surrogate.

    actor = Actor(policy, grpo_cfg)
    metrics = actor.train(samples)          # one RL step's update (all update epochs)

Per step:
1. `old` = the trainer's own chunk log-probs of every row with the current weights (no grad,
   micro-batched): the ratio's denominator, so the ratio is exactly 1 at the first update.
   The rollout/trainer gap |old - rollout| (nats per chunk) and the fraction of rows whose
   exp(old - rollout) would already fall outside the clip band are logged.
2. The rollout's log-probs enter only through the truncated IS weight min(exp(old - rollout), cap).
3. update_epochs passes over the rows, shuffled by the actor's own generator; each pass split
   into global batches (one AdamW step each, gradient norm clipped) of micro-batches (one
   forward/backward each; gradients accumulate; row weights normalised per global batch).
Only `policy.trainable_parameters()` are optimised (the expert with policy.train_expert_only);
on CUDA the forward runs under bf16 autocast (grpo.autocast). With grpo.prefix_cache the frozen prefix's
K/V of every row come from the old-log-prob pass (1.) in every update epoch (grpo/prefix_store.py); with
policy.fast.consistent_recompute they are the fast path's, restored into its buckets (the same bits); with
grpo.prefix_cache=engine they come from the engine's rollout (`engine_prefixes`), so the pass skips them too.
Data-parallel over several GPUs (grpo.actor_parallel): grpo/actor_group.py, same interface.
Spans (the process's profiler timeline, inside the trainer's actor_train): actor_train/old_logprob (1.), and per
micro-batch actor_train/prefix_gather, actor_train/micro_batch and, inside it, actor_train/micro_batch_issue (until
backward() returned: the host's share), then actor_train/optimizer per global batch. Under profiler.gpu_timing=sync
the GPU-timed ones wait for the card at both ends, so micro_batch - micro_batch_issue is the GPU work left after the
host finished issuing: near 0, the host bounds the update (its speed, not the card's, sets the actor's time).
train/entropy reports the Gaussian entropy of the rows' stochastic SDE steps; it is not in the
loss (the std is not learned: see GRPOConfig.entropy_coef).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import Any

import torch
from torch import Tensor

from common.devices import to_device
from grpo import losses
from grpo.config import GRPOConfig
from grpo.distributed import full_parameters
from grpo.memory import actor_levers, micro_batch_oom
from grpo.observations import observation_from_rows
from grpo.prefix_store import RowPrefixes, StoreView
from grpo.samples import Samples
from policies import flow
from policies.models.pi05 import PrefixCache
from profiler import get_timeline

logger = logging.getLogger(__name__)

# AdamW's per-group settings and the grpo keys they come from
HYPERPARAMETER_KEYS = {"lr": "grpo.lr", "betas": "grpo.betas", "eps": "grpo.adam_eps",
                       "weight_decay": "grpo.weight_decay"}


def optimizer_hyperparameters(cfg: GRPOConfig) -> dict[str, Any]:
    """The configured AdamW settings, as torch stores them in every param group."""
    return {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay}


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: GRPOConfig) -> list[str]:
    """Set the configured settings on every param group and describe what changed ("grpo.lr 0.001 ->
    1e-05"). Loading an optimizer state dict restores the saved run's settings with its moments, so a
    resumed run with a changed grpo.lr would otherwise keep training with the old one."""
    changes: dict[str, None] = {}  # ordered and without repeats over param groups
    for group in optimizer.param_groups:
        for name, value in optimizer_hyperparameters(cfg).items():
            old = tuple(group[name]) if name == "betas" else group[name]
            if old != value:
                changes[f"{HYPERPARAMETER_KEYS[name]} {old!r} -> {value!r}"] = None
            group[name] = value
    return list(changes)


def make_optimizer(params: list[Tensor], cfg: GRPOConfig) -> torch.optim.AdamW:
    """AdamW with the configured settings, which it keeps through load_state_dict: a checkpoint
    brings back its moments and step counts, not its lr / betas / eps / weight decay (a warning
    names each one that differed)."""
    optimizer = torch.optim.AdamW(params, **optimizer_hyperparameters(cfg))

    def keep_configured(opt: torch.optim.Optimizer) -> None:
        changed = apply_hyperparameters(opt, cfg)
        if changed:
            logger.warning("the loaded optimizer state had other settings; the configured ones apply: %s",
                           ", ".join(changed))

    optimizer.register_load_state_dict_post_hook(keep_configured)
    return optimizer


class Actor:
    def __init__(self, policy, cfg: GRPOConfig, show_progress: bool = True):
        self.policy, self.cfg = policy, cfg
        self.device = policy.device
        self.params = list(policy.trainable_parameters())
        trainable = {id(p) for p in self.params}
        for p in policy.parameters():  # frozen parts get no .grad buffers
            p.requires_grad_(id(p) in trainable)
        self.optimizer = make_optimizer(self.params, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.reference = self._reference_policy() if cfg.kl_coef > 0 else None
        self.show_progress = show_progress
        self.updates = 0  # optimiser steps taken so far (checkpointed)
        # grpo.prefix_cache=engine: the store the rollout engine filled (the trainer attaches it; Samples.prefix_row
        # names each row's place there)
        self.engine_prefixes: RowPrefixes | None = None

    def _reference_policy(self):
        ref = copy.deepcopy(self.policy)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # ----- forward pieces -----
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16 where the forward runs under autocast (grpo.autocast; auto: on CUDA), else None."""
        mode = self.cfg.autocast
        if mode == "auto":
            mode = "bf16" if self.device.type == "cuda" else "none"
        return None if mode == "none" else torch.bfloat16

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.autocast_dtype()
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def chunk_logprob(self, policy, rows: Samples, prefix: PrefixCache | None = None,
                      keep: tuple[RowPrefixes, Tensor] | None = None) -> Tensor:
        """(R,) float32 chunk log-probs of the rows' stored transitions under `policy`. `prefix`: the rows'
        kept prefix K/V (grpo.prefix_cache); `keep` = (store, the rows' ids): compute it here and keep it."""
        # with the rows' prefix K/V given, vision and the prefix do not run: no pixels (the caller's
        # `Samples.select(pixels=False)` left them out)
        obs = observation_from_rows(policy.cfg, rows.images, rows.states, rows.tokens, rows.token_mask, self.device,
                                    pixels=prefix is None)
        # the denoise indices stay in host memory: log_prob checks them, and the consistent recompute plans its
        # chunks from them, without reading them back from the GPU
        chains, denoise_inds = to_device(rows.chains, self.device), rows.denoise_inds
        with self.autocast():
            if keep is not None:  # the prefix as this forward computes it (the plain model's or the fast path's)
                store, ids = keep
                out = policy.log_prob(obs, chains, denoise_inds, return_prefix=True)
                store.add(ids, out.prefix)
                return out.chunk_logprob.float()
            out = self._log_prob(policy, obs, chains, denoise_inds, prefix)
        return out.float()

    def _log_prob(self, policy, obs, chains: Tensor, denoise_inds: Tensor,
                  prefix: PrefixCache | None = None) -> Tensor:
        """The forward itself (the data-parallel actor routes the trained policy through its wrapper)."""
        return policy.log_prob(obs, chains, denoise_inds, prefix=prefix).chunk_logprob

    @torch.no_grad()
    def recompute(self, samples: Samples, policy=None, keep: RowPrefixes | StoreView | None = None) -> Tensor:
        """Chunk log-probs of every row without gradients, micro-batched (CPU tensor); with `keep`, every
        row's prefix K/V is kept there (by row index) for the update epochs, or, where `keep` is a view of a store
        the rollout engine filled, read from it for the rows it holds."""
        policy = policy or self.policy
        samples = samples.without_prompt_padding()
        index = torch.arange(len(samples))
        # gathered on the device and copied back once: a copy per micro-batch made the host wait for each
        if isinstance(keep, StoreView):
            out = torch.empty(len(samples), device=self.device)
            for idx in self._micro_batches(index, keep)[1]:  # the kept rows' micro-batches first
                prefix = keep.gather(idx, self.device) if bool(keep.kept(idx).all()) else None
                rows = samples.select(idx, pixels=prefix is None)
                out[to_device(idx, self.device)] = self.chunk_logprob(policy, rows, prefix)
            out = out.cpu()
            policy.settle_checks()  # the last call's restored prefixes were these rows' (read after the copy: no wait)
            return out
        parts = [self.chunk_logprob(policy, samples.select(idx), keep=None if keep is None else (keep, idx))
                 for idx in self._micro(index)]
        return torch.cat(parts).cpu() if parts else torch.zeros(0)

    def step_entropy(self, rows: Samples) -> Tensor | None:
        """Entropy of each row's stochastic SDE step, a function of the step index and the config only
        (reported, never optimised); None for train_mode sde_all (not computed there)."""
        scfg = self.policy.cfg.sampling
        if scfg.train_mode != "sde":
            return None
        grid = flow.time_grid(scfg.num_steps)
        std = flow.sde_sigmas(grid, scfg.noise_level) * torch.sqrt(flow.step_deltas(grid))
        numel = self.policy.cfg.logprob_chunk * self.policy.cfg.action_dim
        return to_device(losses.gaussian_entropy(std[rows.denoise_inds[:, 0]], numel), self.device)

    def _micro(self, index: Tensor) -> list[Tensor]:
        return list(torch.split(index, self.cfg.micro_batch))

    def _micro_batches(self, index: Tensor, prefixes: RowPrefixes | StoreView | None) -> tuple[Tensor, list[Tensor]]:
        """A global batch's rows (reordered) and its micro-batches. With a store that kept only some rows (its
        budget), the kept rows come first and no micro-batch mixes kept and recomputed rows: one optimiser step
        sums the same gradients in another order."""
        if prefixes is None or len(prefixes) == prefixes.rows:
            return index, self._micro(index)
        kept = prefixes.kept(index)
        parts = [index[kept], index[~kept]]
        return torch.cat(parts), [micro for part in parts if len(part) for micro in self._micro(part)]

    # ----- the update -----
    def train(self, samples: Samples) -> dict[str, float]:
        cfg = self.cfg
        if len(samples) == 0:
            return {"train/rows": 0, "train/optimizer_steps": 0}
        self.policy.train()
        graphs_before = self.policy.reference_graph_counts()
        samples = samples.without_prompt_padding()  # one width for the old-log-prob pass and every epoch
        # vision and prefix are frozen: with grpo.prefix_cache their K/V come from this pass in every epoch
        prefixes = None
        if cfg.prefix_cache == "engine":
            if self.engine_prefixes is None:
                raise ValueError("grpo.prefix_cache=engine: no store of the rollout engine is attached to the actor "
                                 "(the Trainer attaches it: Actor.engine_prefixes)")
            prefixes = self.engine_prefixes.view(samples.prefix_row)
        elif cfg.prefix_cache != "off":
            # under autocast the plain expert's attention reads the keys in bf16: kept so (RoPE left them fp32),
            # exact; the consistent recompute's (log_prob's default where the config sets it) come from the fast
            # path in its own dtype, kept as they are
            consistent = self.policy.cfg.fast.consistent_recompute  # the config refuses it without fast.enabled
            prefixes = RowPrefixes(cfg.prefix_cache, rows=len(samples), budget_bytes=cfg.prefix_cache_bytes,
                                   spill_bytes=cfg.prefix_cache_spill_bytes, spill_read=cfg.prefix_cache_spill_read,
                                   key_dtype=None if consistent else self.autocast_dtype())
        timeline = get_timeline()
        started = time.perf_counter()
        with timeline.span("actor_train/old_logprob", gpu=True):
            old = self.recompute(samples, keep=prefixes)
        metrics, is_weight = old_pass_metrics(old, samples.rollout_logprob, cfg, started)
        ref = self.recompute(samples, self.reference) if self.reference is not None else None
        raw_weights = losses.row_weights(samples.trajectory_length, cfg.loss_agg)
        acc = _Accumulator()
        first = True
        for _ in range(cfg.update_epochs):
            order = torch.randperm(len(samples), generator=self.generator)
            batch = cfg.global_batch or len(samples)
            for global_index in torch.split(order, batch):
                global_index, micros = self._micro_batches(global_index, prefixes)
                weights = losses.normalise(raw_weights[global_index])
                self.optimizer.zero_grad(set_to_none=True)
                offset = 0
                for micro in micros:
                    w = weights[offset: offset + len(micro)]
                    offset += len(micro)
                    prefix = None
                    if prefixes is not None and bool(prefixes.kept(micro).all()):
                        with timeline.span("actor_train/prefix_gather", gpu=True):
                            prefix = prefixes.gather(micro, self.device)
                    with self._out_of_memory_advice(len(micro)), timeline.span("actor_train/micro_batch", gpu=True):
                        with timeline.span("actor_train/micro_batch_issue"):
                            terms = self._micro_step(samples.select(micro, pixels=prefix is None), old[micro], w, micro,
                                                     is_weight, ref, prefix)
                    acc.add(terms, w)
                    if first:
                        acc.first_clip_frac = terms.ratio_outside.float().mean()
                        first = False
                with timeline.span("actor_train/optimizer", gpu=True):
                    # no step on log-probs of a wrong restored prefix: the checks of this batch's forwards (the host
                    # waits for the last forward only; its backward is still queued, so the GPU does not idle)
                    self.policy.settle_checks()
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
                    acc.grad_norms.append(grad_norm.detach())
                    self.optimizer.step()
                self.updates += 1
        metrics.update(acc.metrics(cfg.update_epochs))
        if prefixes is not None:
            metrics["train/prefix_cache_rows"] = len(prefixes)
            metrics["train/prefix_cache_gib"] = prefixes.kept_bytes / 2**30
            metrics["train/prefix_cache_spilled_rows"] = prefixes.spilled
            metrics["train/prefix_cache_spill_wait_s"] = prefixes.spill_wait_s  # the host slots made meanwhile
        metrics["train/rows"] = len(samples)
        if self.policy.cfg.fast.recompute_graph:
            # a capture costs ~0.6 s (128 rows, an H100): after the first update there should be none (round 68)
            after = self.policy.reference_graph_counts()
            metrics["train/reference_graph_captures"] = after[0] - graphs_before[0]
            metrics["train/reference_graph_padded_replays"] = after[1] - graphs_before[1]
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]  # what the steps used (not the config)
        return metrics

    # ----- what the trainer asks of any actor (the data-parallel ActorGroup answers the same) -----
    def weights_for_push(self, full: bool) -> dict[str, Tensor]:
        """Our parameter names -> tensors for the weight push: all of them, or only those trained.
        On a data-parallel rank with FSDP2 the sharded ones are all-gathered: a collective every
        rank runs (the result matters on rank 0 only)."""
        return full_parameters(self.policy.model, full)

    def sync_loaded_state(self) -> None:
        """After a checkpoint was loaded into this process's policy and optimizer: nothing to share."""

    def close(self) -> None:
        """Nothing to stop (the ActorGroup stops its worker ranks)."""

    @contextlib.contextmanager
    def _out_of_memory_advice(self, rows: int):
        """An out-of-memory error in a micro-batch names the micro-batch, the card's use and the settings that make
        room (grpo/memory.py); torch's own message stays in the chain."""
        try:
            yield
        except torch.OutOfMemoryError as error:
            pcfg = self.policy.cfg
            levers = actor_levers(self.cfg.micro_batch, pcfg.train_expert_only, pcfg.frozen_dtype,
                                  self.cfg.prefix_cache)
            raise torch.OutOfMemoryError(micro_batch_oom(rows, self.cfg.micro_batch, self.device, levers)) from error

    def _micro_step(self, rows: Samples, old: Tensor, weights: Tensor, index: Tensor,
                    is_weight: Tensor | None, ref: Tensor | None,
                    prefix: PrefixCache | None = None) -> losses.LossTerms:
        cfg, dev = self.cfg, self.device
        logprob = self.chunk_logprob(self.policy, rows, prefix)
        terms = losses.grpo_loss(
            logprob, to_device(old, dev), to_device(rows.advantages, dev), to_device(weights, dev), cfg.clip_low,
            cfg.clip_high, cfg.dual_clip, is_weight=None if is_weight is None else to_device(is_weight[index], dev),
            ref_logprob=None if ref is None else to_device(ref[index], dev), kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator, entropy=self.step_entropy(rows),
        )
        terms.loss.backward()
        return terms


def gap_metrics(trainer_logprob: Tensor, rollout_logprob: Tensor, clip_low: float, clip_high: float
                ) -> dict[str, float]:
    """Rollout vs trainer recompute of the same transitions, before any update (nats per chunk)."""
    gap = (trainer_logprob - rollout_logprob).abs()
    outside = losses.ratio_outside(trainer_logprob - rollout_logprob, clip_low, clip_high)
    return {
        "rollout/logprob_gap": float(gap.mean()),
        "rollout/logprob_gap_max": float(gap.max()),
        "rollout/logprob_gap_clip_frac": float(outside.float().mean()),
    }


def old_pass_metrics(old: Tensor, rollout_logprob: Tensor, cfg: GRPOConfig, started: float
                     ) -> tuple[dict[str, float], Tensor | None]:
    """After the old-log-prob pass: its gap to the rollout, the truncated IS weights (None without grpo.tis) with
    their metrics, and `step_time/actor_old_logprob`, the pass's wall time since `started` (the gap's floats are
    read from `old`, so the pass has finished on the device by then): with the step's `step_time/actor_train` it
    splits the actor's time into this pass and the update epochs."""
    metrics = gap_metrics(old, rollout_logprob, cfg.clip_low, cfg.clip_high)
    is_weight = losses.truncated_is_weight(old, rollout_logprob, cfg.tis_cap) if cfg.tis else None
    if is_weight is not None:
        metrics["train/is_weight_mean"] = float(is_weight.mean())
        metrics["train/is_weight_truncated_frac"] = float((is_weight >= cfg.tis_cap).float().mean())
    metrics["step_time/actor_old_logprob"] = time.perf_counter() - started
    return metrics, is_weight


class _Accumulator:
    """Weighted sums of the loss terms over an RL step's micro-batches, kept on the device until `host_sums` /
    `metrics` read them all at once: a read per micro-batch made the host wait for its backward before it could
    launch the next micro-batch."""

    KEYS = ("train/loss", "train/policy_loss", "train/kl_ref", "train/entropy", "train/approx_kl",
            "train/clip_active_frac", "train/clip_frac")  # what `add` sums (the DP actor reduces these)

    def __init__(self) -> None:
        self.sums: dict[str, Tensor | float] = {}
        self.rows = 0
        self.grad_norms: list[Tensor | float] = []
        self.first_clip_frac: Tensor | float | None = None  # the first micro-batch's ratios outside the clip band

    def add(self, terms: losses.LossTerms, weights: Tensor) -> None:
        w = to_device(weights, terms.clip_active.device)
        values = {
            "train/loss": terms.loss, "train/policy_loss": terms.policy, "train/kl_ref": terms.kl,
            "train/entropy": terms.entropy, "train/approx_kl": terms.approx_kl,
            "train/clip_active_frac": (w * terms.clip_active).sum(), "train/clip_frac": (w * terms.ratio_outside).sum(),
        }
        for key, value in values.items():
            value = torch.as_tensor(value).detach().double()  # fp64 as the Python floats summed before
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def host_sums(self) -> dict[str, float]:
        """The sums as floats (one copy from the device for all of them)."""
        keys = [k for k in self.KEYS if k in self.sums]
        values = _floats([self.sums[k] for k in keys])
        self.sums = dict(zip(keys, values, strict=True))
        return self.sums

    def metrics(self, epochs: int) -> dict[str, float]:
        sums, norms = self.host_sums(), _floats(self.grad_norms)
        steps = max(len(norms), 1)
        out = {k: v / steps for k, v in sums.items()}  # each global batch's weights sum to 1
        out["train/grad_norm"] = sum(norms) / steps
        out["train/optimizer_steps"] = len(norms)
        if self.first_clip_frac is not None:
            out["train/clip_frac_first_mb"] = _floats([self.first_clip_frac])[0]
        return out


def _floats(values: list[Tensor | float]) -> list[float]:
    """Scalars as floats; the tensors among them read back together (one wait for the device)."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.reshape(()).to(tensors[0].device, torch.float64) for t in tensors]).tolist())
    return [next(read) if isinstance(v, Tensor) else float(v) for v in values]
