"""Typed GRPO configuration (Hydra group `grpo`, conf/grpo/*.yaml), validated on construction.

Errors name the full key and the bad value ("grpo.clip_low must be in (0, 1), got 1.5").
`GRPOConfig.from_mapping(cfg.grpo)` rejects unknown keys by name; `register_hydra_schema()`
stores the dataclass as `grpo/grpo_schema` so Hydra also type-checks overrides while composing.

Defaults are RLinf's pi0.5 GRPO recipe (DESIGN.md section 5; RLinf
examples/embodiment/config/libero_10_grpo_openpi_pi05.yaml) where it has one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    check_bool,
    check_choice,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)
from grpo.distributed import ActorParallelConfig

LOSS_AGGREGATIONS = ("token_mean", "trajectory_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
AUTOCAST_MODES = ("auto", "bf16", "none")
PREFIX_CACHES = ("off", "device", "host", "engine")
# grpo.prefix_cache_spill_read: how spilled rows are read (grpo/prefix_store.py; auto: mapped on CUDA, copy elsewhere)
SPILL_READS = ("auto", "copy", "mapped")


@dataclass
class GRPOConfig:
    """Advantages, loss, optimiser and loop of GRPO; the group size is env.group_size."""

    # ----- loop -----
    steps: int = 3  # RL steps (weight_sync -> rollout epochs -> advantages -> actor_train)
    rollout_epochs: int = 1  # collector epochs per RL step (each resets every env once)
    # ----- advantages -----
    adv_eps: float = 1e-6  # (score - mean) / (std + eps), RLinf's eps
    std_unbiased: bool = True  # torch.std's Bessel correction, as RLinf's compute_grpo_advantages
    filter_groups: bool = True  # drop groups whose mean success is outside [filter_low, filter_high]
    filter_low: float = 0.1
    filter_high: float = 0.9
    # ----- loss -----
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    dual_clip: float | None = 3.0  # lower bound -dual_clip * A for negative advantages; null: off
    loss_agg: str = "token_mean"  # token_mean (RLinf) | trajectory_mean (per-trajectory length norm.)
    kl_coef: float = 0.0  # KL to the initial (reference) policy; 0: no reference copy is kept
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # must be 0: the flow-SDE std is not learned (no entropy bonus possible)
    # Truncated importance sampling: the rollout's log-probs enter only as the weight
    # min(pi_old_trainer / pi_rollout, tis_cap) (detached); the ratio uses the trainer's own old
    # log-probs, so it is exactly 1 at the first update whatever the rollout's numerics.
    tis: bool = True
    tis_cap: float = 2.0
    # ----- optimiser (RLinf: AdamW betas (0.9, 0.95), eps 1e-5, weight decay 0.01, clip 1.0) -----
    lr: float = 5e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # ----- batching -----
    update_epochs: int = 1  # passes over the step's data
    global_batch: int | None = None  # rows per optimiser step; null: all rows in one step
    micro_batch: int = 128  # rows per forward/backward (gradients accumulate over a global batch)
    autocast: str = "auto"  # auto: bf16 autocast on CUDA, none on CPU
    # The frozen prefix's K/V of every row, computed once per actor update (the old-log-prob pass) and reused by
    # every update epoch instead of re-running vision and prefix: "device" keeps it on the actor's device,
    # "host" in CPU memory (~11 MiB a row for the full pi0.5 at LIBERO's shapes, keys in bf16 under autocast);
    # needs policy.train_expert_only. "engine": the rollout engine keeps them as it predicts (on its device; the
    # in-process engine with one rank, policy.fast.consistent_recompute), so the old-log-prob pass skips them too
    prefix_cache: str = "off"
    # The most memory (GiB) the kept caches of one update take; the rows past it recompute their prefix in every
    # epoch (null: every row is kept)
    prefix_cache_gib: float | None = None
    # With grpo.prefix_cache=device or engine and a cap: the rows past prefix_cache_gib are kept in pinned host
    # memory, up to this many GiB, instead of recomputing their prefix in every epoch (null: none)
    prefix_cache_spill_gib: float | None = None
    # How the actor reads spilled rows: "copy" (a CPU gather into a pinned buffer, then one transfer), "mapped"
    # (the GPU gathers them from the page-locked memory across PCIe: no host copy; round 62: the 8-epoch step's actor
    # 25.4 s against 29.2 / 33.3 with copy) or "auto" (mapped where the store is on CUDA); grpo/prefix_store.py
    prefix_cache_spill_read: str = "auto"
    seed: int = 0  # shuffling of the rows (its RNG state is checkpointed)
    # ----- data-parallel actor (grpo/distributed.py): mode none | ddp | fsdp2, world_size, devices -----
    actor_parallel: ActorParallelConfig = field(default_factory=ActorParallelConfig)

    @property
    def prefix_cache_bytes(self) -> int | None:
        """grpo.prefix_cache_gib in bytes (None: no cap)."""
        return None if self.prefix_cache_gib is None else int(self.prefix_cache_gib * 2**30)

    @property
    def prefix_cache_spill_bytes(self) -> int:
        """grpo.prefix_cache_spill_gib in bytes (0: no spill)."""
        return 0 if self.prefix_cache_spill_gib is None else int(self.prefix_cache_spill_gib * 2**30)

    def __post_init__(self) -> None:
        for key in ("steps", "rollout_epochs", "update_epochs", "micro_batch"):
            check_positive_int(f"grpo.{key}", getattr(self, key))
        check_nonnegative_int("grpo.seed", self.seed)
        if self.global_batch is not None:
            check_positive_int("grpo.global_batch", self.global_batch)
            if self.global_batch % self.micro_batch:
                raise ValueError(
                    f"grpo.global_batch ({self.global_batch}) must be a multiple of grpo.micro_batch "
                    f"({self.micro_batch})"
                )
        check_positive_float("grpo.adv_eps", self.adv_eps)
        for key in ("std_unbiased", "filter_groups", "tis"):
            check_bool(f"grpo.{key}", getattr(self, key))
        for key in ("filter_low", "filter_high"):
            _check_range(f"grpo.{key}", getattr(self, key), 0.0, 1.0)
        if self.filter_low > self.filter_high:
            raise ValueError(
                f"grpo.filter_low ({self.filter_low}) must not exceed grpo.filter_high ({self.filter_high})"
            )
        for key in ("clip_low", "clip_high"):
            value = getattr(self, key)
            _check_number(f"grpo.{key}", value)
            if not 0 < value < 1:
                raise ValueError(f"grpo.{key} must be in (0, 1), got {value!r}")
        if self.dual_clip is not None:
            _check_number("grpo.dual_clip", self.dual_clip)
            if not self.dual_clip > 1:
                raise ValueError(f"grpo.dual_clip must be > 1 or null, got {self.dual_clip!r}")
        check_choice("grpo.loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        check_choice("grpo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("grpo.autocast", self.autocast, AUTOCAST_MODES)
        check_choice("grpo.prefix_cache", self.prefix_cache, PREFIX_CACHES)
        if self.prefix_cache_gib is not None:
            _check_range("grpo.prefix_cache_gib", self.prefix_cache_gib, 0.0, 2.0**20)  # finite: bytes are ints
            if self.prefix_cache == "off":
                # a preset's cap and spill (libero10_pi05_fast) stay when the cache is turned off on the command
                # line: every size to drop is named at once
                spill = "" if self.prefix_cache_spill_gib is None else " grpo.prefix_cache_spill_gib=null"
                drop = f"grpo.prefix_cache_gib=null{spill}"
                raise ValueError(f"grpo.prefix_cache_gib={self.prefix_cache_gib} caps kept prefix caches, but "
                                 f"grpo.prefix_cache is off: set grpo.prefix_cache=device (or host, engine), or drop "
                                 f"the sizes ({drop})")
        if self.prefix_cache_spill_gib is not None:
            _check_range("grpo.prefix_cache_spill_gib", self.prefix_cache_spill_gib, 0.0, 2.0**20)
            if self.prefix_cache not in ("device", "engine") or self.prefix_cache_gib is None:
                raise ValueError(
                    f"grpo.prefix_cache_spill_gib={self.prefix_cache_spill_gib} keeps the rows past "
                    f"grpo.prefix_cache_gib in host memory: it needs grpo.prefix_cache=device or engine (got "
                    f"{self.prefix_cache!r}) and grpo.prefix_cache_gib set (got {self.prefix_cache_gib}); "
                    "grpo.prefix_cache_spill_gib=null drops it")
        check_choice("grpo.prefix_cache_spill_read", self.prefix_cache_spill_read, SPILL_READS)
        for key in ("kl_coef", "weight_decay"):
            _check_range(f"grpo.{key}", getattr(self, key), 0.0, math.inf)
        _check_number("grpo.entropy_coef", self.entropy_coef)
        if self.entropy_coef != 0:
            # The SDE step's std (policy.sampling.noise_level, the time grid) has no parameter behind
            # it, so a bonus on its entropy would have zero gradient: it would only shift the loss.
            raise ValueError(
                f"grpo.entropy_coef must be 0, got {self.entropy_coef!r}: the flow-SDE policy's std is not "
                "learned (it comes from policy.sampling.noise_level and the time grid), so its Gaussian "
                "entropy is a constant and a bonus on it would not change the update; raise "
                "policy.sampling.noise_level for more exploration")
        for key in ("tis_cap", "lr", "adam_eps", "grad_clip"):
            check_positive_float(f"grpo.{key}", getattr(self, key))
        for key in ("adv_eps", "lr", "adam_eps", "weight_decay", "kl_coef"):
            # inf passed the range checks: lr / weight_decay / kl_coef inf gave NaN weights (refused a step later
            # as non-finite engine actions), adv_eps / adam_eps inf silently zero updates
            if math.isinf(getattr(self, key)):
                raise ValueError(f"grpo.{key} must be finite, got {getattr(self, key)!r}")
        if self.tis and self.tis_cap < 1:
            raise ValueError(f"grpo.tis_cap must be >= 1 (1 would ignore the gap), got {self.tis_cap!r}")
        self.actor_parallel = ActorParallelConfig.coerce(self.actor_parallel)
        self.betas = list(self.betas)
        if len(self.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"grpo.betas must be two numbers in [0, 1), got {self.betas!r}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, **overrides: Any) -> GRPOConfig:
        data = dict(to_container(mapping) if mapping is not None else {})
        data.update(overrides)
        data = reject_unknown_keys(cls, data, "grpo", "grpo config")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"grpo: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _check_number(key: str, value: Any) -> None:
    if not _is_number(value) or math.isnan(value):
        raise ValueError(f"{key} must be a number, got {value!r}")


def _check_range(key: str, value: Any, low: float, high: float) -> None:
    _check_number(key, value)
    if not low <= value <= high:
        raise ValueError(f"{key} must be in [{low}, {high}], got {value!r}")


HYDRA_SCHEMA_NAME = "grpo_schema"


def register_hydra_schema() -> None:
    """Store GRPOConfig as `grpo/grpo_schema` (conf/grpo/*.yaml extend it): Hydra rejects unknown
    keys and wrongly typed values under `grpo.` while composing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="grpo", name=HYDRA_SCHEMA_NAME, node=GRPOConfig)
