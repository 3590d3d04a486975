"""What the RLinf adapter reads from RLinf's model config, typed and validated.

RLinf builds every embodied model from one config node: `actor.model` (the rollout worker deep-copies
it and overrides `precision` and `model_path` from `rollout.model`; with `runner.only_eval` it uses
`rollout.model`). Errors name the key as `model.<key>`. Keys read (RLinf's own names, rlinf 0.3.0
examples/embodiment/config/model/pi0_5.yaml):

  model_path            checkpoint: a LeRobot / openpi / ours safetensors file or a directory holding
                        model.safetensors (policies/loaders.py); null or "" = random init (policy seed)
  precision             handed to the builder as `torch_dtype` by `get_model`: bf16 -> "bfloat16",
                        fp32 -> "float32", null -> vla_rollout.policy.dtype; fp16 is refused
  num_action_chunks     C, actions the env executes per call = RLinf `openpi.action_chunk`; the
                        log-prob counts these C actions (policy.sampling.logprob_chunk)
  action_dim            env action dims (7 for LIBERO) = RLinf `openpi.action_env_dim`
  num_steps             denoise steps K
  add_value_head, is_lora               must be false: no value head (GRPO), no LoRA
  openpi.noise_method                   must be "flow_sde" (the only method we sample)
  openpi.noise_level                    a in sigma_t = a sqrt(t / (1 - t)) (default 0.5)
  openpi.noise_anneal                   must be false (a fixed noise level)
  openpi.joint_logprob                  train mode "sde_all": every step stochastic, log-prob the
                                        mean over the K+1 terms (RLinf `joint_logprob`)
  openpi.ignore_last                    never pick the last step as the stochastic one
  openpi.train_expert_only              log-prob gradients reach only the expert and its projections
  openpi.action_chunk / action_env_dim / num_steps    when given, must equal the top-level keys
Every other RLinf key (openpi.config_name, lora_rank, dsrl_*, ...) is RLinf's and ignored here.

Our own section, `vla_rollout` (unknown keys refused):
  policy                PolicyConfig mapping (`preset` + overrides: chunk_size, tokenizer_path,
                        inputs.state_q01 ..., fast.enabled ...); the keys above override its sampling,
                        action_dim, train_expert_only, dtype and checkpoint
  cameras               env_obs image key -> policy camera slot (default main_images -> base_0_rgb,
                        wrist_images -> left_wrist_0_rgb; slots left out are masked, as openpi does)
  actor                 "openpi" (default): inside an RLinf worker that is not a rollout worker (the
                        actor) the builder returns RLinf's own OpenPi0ForRLActionPrediction, so RLinf's
                        FSDP actor trains its own model and sends openpi names, and our state_dict /
                        load_state_dict speak those names (row-slice views of our fused weights);
                        "self": ours everywhere, and the weights keep our own parameter names (RLinf's
                        FSDP actor sends the names of the module it wraps)
  expose_expert_lm_head true (default): state_dict also has openpi's unused expert lm_head (vocab x
                        expert width, zeros; 527 MB in bf16 for pi05) because RLinf's patch syncer
                        requires the sender's and receiver's key sets to be equal
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from common.config import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)
from policies.config import PolicyConfig

ACTORS = ("openpi", "self")
DEFAULT_CAMERAS = {"main_images": "base_0_rgb", "wrist_images": "left_wrist_0_rgb"}
RLINF_CAMERA_KEYS = ("main_images", "wrist_images", "extra_view_images")
STATE_KEY, PROMPT_KEY = "states", "task_descriptions"  # RLinf env_obs keys


@dataclass
class VLARolloutSection:
    """The `vla_rollout` section of the RLinf model config."""

    policy: dict = field(default_factory=lambda: {"preset": "pi05"})
    cameras: dict = field(default_factory=lambda: dict(DEFAULT_CAMERAS))
    actor: str = "openpi"
    expose_expert_lm_head: bool = True

    @property
    def weight_names(self) -> str:
        """The names our weights speak: the actor's ("openpi", or our own, "native")."""
        return "openpi" if self.actor == "openpi" else "native"

    def validate(self, key: str) -> None:
        check_choice(f"{key}.actor", self.actor, ACTORS)
        check_bool(f"{key}.expose_expert_lm_head", self.expose_expert_lm_head)
        for name in ("policy", "cameras"):  # a list or a string here failed later as "dictionary update sequence"
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"{key}.{name} must be a mapping, got {getattr(self, name)!r}")
        if not self.cameras:
            raise ValueError(f"{key}.cameras must map at least one env_obs image key to a camera slot")
        for env_key in self.cameras:
            check_choice(f"{key}.cameras key", env_key, RLINF_CAMERA_KEYS)


@dataclass
class RLinfAdapterConfig:
    """The RLinf model keys the adapter uses (module docstring), validated at construction."""

    model_path: str | None = None
    num_action_chunks: int = 10
    action_dim: int = 7
    num_steps: int = 10
    noise_level: float = 0.5
    joint_logprob: bool = False
    ignore_last: bool = False
    train_expert_only: bool | None = None  # None: the policy config's own value
    dtype: str | None = None  # from get_model's torch_dtype; None: the policy config's own dtype
    vla_rollout: VLARolloutSection = field(default_factory=VLARolloutSection)

    def __post_init__(self) -> None:
        for name in ("num_action_chunks", "action_dim", "num_steps"):
            check_positive_int(f"model.{name}", getattr(self, name))
        check_positive_float("model.openpi.noise_level", self.noise_level)
        for name in ("joint_logprob", "ignore_last"):
            check_bool(f"model.openpi.{name}", getattr(self, name))
        if self.train_expert_only is not None:  # a quoted "false" is truthy: it froze all but the expert
            check_bool("model.openpi.train_expert_only", self.train_expert_only)
        if self.ignore_last and self.num_steps < 2:
            raise ValueError(f"model.openpi.ignore_last needs model.num_steps >= 2, got {self.num_steps}")
        self.vla_rollout.validate("model.vla_rollout")

    @classmethod
    def from_rlinf(cls, cfg: Any, torch_dtype: torch.dtype | None = None) -> RLinfAdapterConfig:
        """From RLinf's model config node (DictConfig or mapping) and `get_model`'s torch_dtype."""
        data = to_container(cfg)
        openpi = to_container(data.get("openpi") or {})
        _refuse_unsupported(data, openpi)
        section = reject_unknown_keys(VLARolloutSection, data.get("vla_rollout") or {}, "model.vla_rollout")
        return cls(
            model_path=data.get("model_path") or None,
            num_action_chunks=_agreeing(data, openpi, "num_action_chunks", "action_chunk", 10),
            action_dim=_agreeing(data, openpi, "action_dim", "action_env_dim", 7),
            num_steps=_agreeing(data, openpi, "num_steps", "num_steps", 10),
            noise_level=openpi.get("noise_level", 0.5),
            joint_logprob=openpi.get("joint_logprob", False),
            ignore_last=openpi.get("ignore_last", False),
            train_expert_only=openpi.get("train_expert_only"),
            dtype=dtype_name(torch_dtype),
            vla_rollout=VLARolloutSection(**section),
        )

    def policy_config(self) -> PolicyConfig:
        """Our PolicyConfig: vla_rollout.policy with the RLinf keys and RLinf's env_obs keys applied."""
        base = to_container(self.vla_rollout.policy)
        sampling = {
            "num_steps": self.num_steps,
            "noise_level": float(self.noise_level),
            "exclude_last_step": self.ignore_last,
            "train_mode": "sde_all" if self.joint_logprob else "sde",
            "logprob_chunk": self.num_action_chunks,
        }
        inputs = {"camera_map": dict(self.vla_rollout.cameras), "state_key": STATE_KEY, "prompt_key": PROMPT_KEY}
        overrides: dict[str, Any] = {"sampling": sampling, "inputs": inputs, "action_dim": self.action_dim}
        if self.train_expert_only is not None:
            overrides["train_expert_only"] = bool(self.train_expert_only)
        if self.dtype is not None:
            overrides["dtype"] = self.dtype
        if self.model_path is not None:
            overrides["checkpoint"] = str(self.model_path)
        cfg = PolicyConfig.from_mapping(base, **overrides)
        if self.num_action_chunks > cfg.chunk_size:
            raise ValueError(
                f"model.num_action_chunks ({self.num_action_chunks}) must not exceed the policy's chunk "
                f"(model.vla_rollout.policy.chunk_size = {cfg.chunk_size})"
            )
        return cfg


def dtype_name(torch_dtype: torch.dtype | None) -> str | None:
    """get_model's torch_dtype (from model.precision) -> our policy dtype name."""
    names = {None: None, torch.bfloat16: "bfloat16", torch.float32: "float32"}
    if torch_dtype not in names:
        raise ValueError(f"model.precision gives torch dtype {torch_dtype}; the adapter supports bf16, fp32 or null")
    return names[torch_dtype]


def _refuse_unsupported(data: Mapping[str, Any], openpi: Mapping[str, Any]) -> None:
    """Settings RLinf's openpi model has and ours does not: refuse them by name, never ignore them."""
    refused = {
        "model.add_value_head": (data.get("add_value_head", False), False),
        "model.is_lora": (data.get("is_lora", False), False),
        "model.openpi.add_value_head": (openpi.get("add_value_head", False), False),
        "model.openpi.noise_method": (openpi.get("noise_method", "flow_sde"), "flow_sde"),
        "model.openpi.noise_anneal": (openpi.get("noise_anneal", False), False),
        "model.openpi.use_dsrl": (openpi.get("use_dsrl", False), False),
        "model.openpi.is_nft": (openpi.get("is_nft", False), False),
        # RLinf's -(x - mu)^2 "log-prob" and its double-layer expert: its actor would recompute other numbers
        # than the Gaussian log-probs this adapter rolls out with (a wrong PPO ratio from the first step)
        "model.openpi.safe_get_logprob": (openpi.get("safe_get_logprob", False), False),
        "model.openpi.double_layer": (openpi.get("double_layer", False), False),
    }
    for key, (value, supported) in refused.items():
        if value != supported and value is not None:
            raise ValueError(f"{key} = {value!r} is not supported by the vla_rollout adapter (only {supported!r})")


def _agreeing(data: Mapping[str, Any], openpi: Mapping[str, Any], top: str, sub: str, default: Any) -> Any:
    """A top-level RLinf key and its openpi twin must agree when both are given."""
    value, twin = data.get(top), openpi.get(sub)
    if value is not None and twin is not None and value != twin:
        raise ValueError(f"model.{top} ({value!r}) and model.openpi.{sub} ({twin!r}) disagree")
    return value if value is not None else (twin if twin is not None else default)
