"""`VLARolloutPolicy`: our pi0.5 policy behind RLinf's `BasePolicy` interface (rlinf 0.3.0).

What RLinf calls, and what it gets (read in rlinf/workers/rollout/hf/huggingface_worker.py,
rlinf/workers/actor/fsdp_actor_worker.py and the reference `OpenPi0ForRLActionPrediction`):

- rollout worker: `predict_action_batch(env_obs=obs, **kw)` under no_grad. env_obs (LIBERO):
  main_images / wrist_images uint8 (B, H, W, 3), extra_view_images None, states float32 (B, 8),
  task_descriptions list[str]. Returns (actions, result) exactly as RLinf's openpi model does:
    actions        (B, C, action_dim) float32, CPU, env space (unnormalised)
    prev_logprobs  (B, C, action_dim) float32: Gaussian log-density of the ONE stochastic
                   transition (train), of all K (+ the initial noise) averaged with joint_logprob,
                   zeros in eval
    prev_values    (B, 1) float32 zeros: there is no value head (GRPO needs none)
    forward_inputs chains (B, K+1, H, max_action_dim), denoise_inds (B, K) int64 (one index for
                   the whole batch in train, -1 in eval; CPU as in RLinf), tokenized_prompt (B, L)
                   int64 and tokenized_prompt_mask (B, L) bool (the prompt with the state in it),
                   action (B, C*action_dim) CPU, model_action (B, H*max_action_dim), and RLinf's raw
                   copies observation/image, observation/wrist_image, observation/extra_view_image
                   (when given) and observation/state.
  `mode` is passed by RLinf only for its own model types; for ours it passes the
  rollout.sampling_params instead (do_sample: true in training; false in eval when
  temperature_eval <= 0), so without mode, do_sample decides, and a call with neither is refused.
  Preprocessing is `Policy.make_batch` (batched on the policy's device) where RLinf transforms
  each sample on the CPU in a pool of 8 threads.
- actor: `model(forward_inputs=..., compute_logprobs=True, compute_entropy=..., compute_values=...,
  use_cache=False)` -> forward -> `default_forward`, which recomputes the log-probs of the stored
  transitions with gradients: {"logprobs" (B, C, action_dim), "values" (B,) zeros, "entropy"
  (B, 1) zeros (flow-SDE has none in RLinf either)}.
- weight sync: `state_dict()` / `load_state_dict()` speak RLinf's openpi names as views of our
  fused weights (rollout/rlinf/weights.py); after the syncer's `apply` the rollout worker calls
  `set_global_step(version)`, where the fast path's weight-derived tables are refreshed. Any
  `state_dict()` or `load_state_dict()` call also marks them stale, and the next predict
  refreshes them first, so a write through those tensors is never served with old tables.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from rlinf.models.embodiment.base_policy import BasePolicy, ForwardType
from torch import Tensor, nn

from policies.observation import Observation
from policies.policy import Policy, build_policy
from rollout.rlinf.config import PROMPT_KEY, STATE_KEY, RLinfAdapterConfig
from rollout.rlinf.weights import expert_head_shape, load_openpi_state, openpi_views

# RLinf keeps these raw env_obs copies in forward_inputs (openpi_action_model.obs_processor names)
RAW_COPY_KEYS = {
    "main_images": "observation/image",
    "wrist_images": "observation/wrist_image",
    "extra_view_images": "observation/extra_view_image",
    STATE_KEY: "observation/state",
}
# what RLinf's rollout worker passes instead of `mode` for model types it does not know
SAMPLING_KWARGS = frozenset({"do_sample", "temperature", "top_k", "top_p", "max_new_tokens"})
ACTOR_KWARGS = frozenset({"compute_logprobs", "compute_entropy", "use_cache"})
RECOMPUTE_KEYS = ("chains", "denoise_inds", "tokenized_prompt", "tokenized_prompt_mask")


class LoadResult(NamedTuple):
    """What `nn.Module.load_state_dict` returns (same field names)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class VLARolloutPolicy(nn.Module, BasePolicy):
    def __init__(self, policy: Policy, cfg: RLinfAdapterConfig):
        super().__init__()
        self.policy = policy
        self.rlinf_cfg = cfg
        self.weight_version = 0
        self._weights_stale = False
        head = None
        if cfg.vla_rollout.weight_names == "openpi" and cfg.vla_rollout.expose_expert_lm_head:
            weight = policy.model.expert.layers[0].qkv.weight
            head = torch.zeros(expert_head_shape(policy.model), dtype=weight.dtype, device=weight.device)
        self.register_buffer("expert_lm_head", head, persistent=False)
        if policy.cfg.train_expert_only:
            self._freeze_all_but_trainable()

    @classmethod
    def from_config(cls, cfg: RLinfAdapterConfig, device: torch.device | str = "cpu") -> VLARolloutPolicy:
        return cls(build_policy(cfg.policy_config(), device), cfg)

    def _freeze_all_but_trainable(self) -> None:
        """As RLinf's freeze_vlm: only what log_prob trains requires grad, so RLinf's optimizer and
        its `param_names_need_sync` (trainable parameters) cover the expert and its projections."""
        trainable = {id(p) for p in self.policy.trainable_parameters()}
        for param in self.policy.parameters():
            param.requires_grad_(id(param) in trainable)

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def predict_action_batch(
        self, env_obs: Mapping[str, Any], mode: str | None = None, compute_values: bool = True, **kwargs: Any
    ) -> tuple[Tensor, dict[str, Any]]:
        """RLinf env_obs -> (actions, {prev_logprobs, prev_values, forward_inputs}) (module
        docstring). `compute_values` is accepted for RLinf's signature: values are zeros."""
        del compute_values  # no value head: prev_values are zeros either way (RLinf does the same)
        mode = resolve_mode(mode, kwargs)
        self._refresh_if_stale()
        raw, copies = self._env_inputs(env_obs)
        batch = self.policy.make_batch(raw)
        out = self.policy.sample(batch, mode=mode)
        chunk, b = self.rlinf_cfg.num_action_chunks, out.chains.shape[0]
        actions = self.policy.transform.unnormalize_actions(out.model_actions[:, :chunk])
        actions = actions.float().cpu().contiguous()
        forward_inputs = {
            "chains": out.chains,
            "denoise_inds": out.denoise_inds.cpu(),
            "tokenized_prompt": batch.tokenized_prompt,
            "tokenized_prompt_mask": batch.tokenized_prompt_mask,
            "action": actions.reshape(b, -1).contiguous(),
            "model_action": out.model_actions.reshape(b, -1).contiguous(),
            **copies,
        }
        result = {
            "prev_logprobs": out.logprobs,
            "prev_values": torch.zeros(b, 1, dtype=torch.float32, device=out.logprobs.device),
            "forward_inputs": forward_inputs,
        }
        return actions, result

    def _env_inputs(self, env_obs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """-> (the raw observation `Policy.make_batch` reads, RLinf's raw copies for forward_inputs)."""
        raw: dict[str, Any] = {}
        for key in (*self.rlinf_cfg.vla_rollout.cameras, STATE_KEY, PROMPT_KEY):
            if env_obs.get(key) is None:
                raise ValueError(
                    f"env_obs[{key!r}] is missing or None; the vla_rollout policy needs {key!r} "
                    f"(model.vla_rollout.cameras = {self.rlinf_cfg.vla_rollout.cameras}); got keys {sorted(env_obs)}"
                )
            raw[key] = env_obs[key]
        copies = {
            copy_key: _cloned_tensor(env_obs[key])
            for key, copy_key in RAW_COPY_KEYS.items()
            if env_obs.get(key) is not None
        }
        return raw, copies

    # ------------------------------------------------------------------ actor
    def forward(self, forward_type: ForwardType = ForwardType.DEFAULT, **kwargs: Any) -> dict[str, Tensor]:
        if forward_type == ForwardType.DEFAULT:
            return self.default_forward(**kwargs)
        raise NotImplementedError(f"the vla_rollout policy supports only ForwardType.DEFAULT, got {forward_type}")

    def default_forward(
        self, forward_inputs: Mapping[str, Tensor], compute_values: bool = False, **kwargs: Any
    ) -> dict[str, Tensor]:
        """Recompute the stored transitions' log-probs (with gradients) from forward_inputs as
        predict_action_batch wrote them (possibly several batches concatenated along dim 0)."""
        unknown = sorted(set(kwargs) - ACTOR_KWARGS)
        if unknown:
            raise TypeError(f"default_forward got unexpected arguments {unknown}; known: {sorted(ACTOR_KWARGS)}")
        if compute_values:
            raise ValueError(
                "compute_values=True: the vla_rollout policy has no value head; use algorithm.adv_type=grpo"
            )
        batch = self._recompute_batch(forward_inputs)
        out = self.policy.log_prob(batch, forward_inputs["chains"], forward_inputs["denoise_inds"], mode="train")
        b, device = out.logprobs.shape[0], out.logprobs.device
        return {
            "logprobs": out.logprobs,
            "values": torch.zeros(b, dtype=torch.float32, device=device),
            "entropy": torch.zeros(b, 1, dtype=torch.float32, device=device),
        }

    def _recompute_batch(self, forward_inputs: Mapping[str, Tensor]) -> Observation:
        """The policy's batch from RLinf's raw copies, with the stored prompt tokens (the prompt
        carries the state as it was at rollout time; the placeholder task is never used)."""
        needed = [*RECOMPUTE_KEYS, RAW_COPY_KEYS[STATE_KEY]]
        needed += [RAW_COPY_KEYS[key] for key in self.rlinf_cfg.vla_rollout.cameras]
        missing = [key for key in needed if key not in forward_inputs]
        if missing:
            raise ValueError(f"forward_inputs is missing {missing}; got keys {sorted(forward_inputs)}")
        raw: dict[str, Any] = {key: forward_inputs[RAW_COPY_KEYS[key]] for key in self.rlinf_cfg.vla_rollout.cameras}
        raw[STATE_KEY] = forward_inputs[RAW_COPY_KEYS[STATE_KEY]]
        raw[PROMPT_KEY] = [""] * int(forward_inputs["chains"].shape[0])
        batch = self.policy.make_batch(raw)
        device = batch.tokenized_prompt.device
        return dataclasses.replace(
            batch,
            tokenized_prompt=forward_inputs["tokenized_prompt"].to(device).long(),
            tokenized_prompt_mask=forward_inputs["tokenized_prompt_mask"].to(device).bool(),
        )

    # ------------------------------------------------------------------ weights
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """openpi names -> views of our weights (writes through them land in place), or our own
        names with vla_rollout.actor "self". Marks the fast path's tables stale: callers write
        through these tensors (RLinf's patch syncer does)."""
        self._weights_stale = True
        if self.rlinf_cfg.vla_rollout.weight_names == "native":
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if args:
            raise TypeError("state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        destination = OrderedDict() if destination is None else destination
        for name, view in openpi_views(self.policy.model, self.expert_lm_head).items():
            destination[prefix + name] = view
        return destination

    def load_state_dict(
        self, state_dict: Mapping[str, Tensor], strict: bool = True, assign: bool = False
    ) -> LoadResult:
        """Copy in place (RLinf's BucketWeightSyncer calls this per bucket with strict=False)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace our weights' storage; only in-place copies")
        self._weights_stale = True
        if self.rlinf_cfg.vla_rollout.weight_names == "native":
            result = super().load_state_dict(state_dict, strict=strict)
            return LoadResult(list(result.missing_keys), list(result.unexpected_keys))
        missing, unexpected = load_openpi_state(self.policy.model, state_dict, strict, self.expert_lm_head)
        return LoadResult(missing, unexpected)

    def set_global_step(self, global_step: int) -> None:
        """RLinf calls this after every weight sync with the applied version (and the actor with
        its step): the hook where the fast path's weight-derived tables are refreshed."""
        self.weight_version = int(global_step)
        self.refresh_weights()

    def refresh_weights(self) -> None:
        self.policy.refresh_weights()
        self._weights_stale = False

    def _refresh_if_stale(self) -> None:
        if self._weights_stale:
            self.refresh_weights()

    def _apply(self, fn, recurse: bool = True):
        """.to() / offload replace our parameters' storage: the fast path's references and graphs
        would be stale, so the Policy wrapper (and its fast sampler) is rebuilt around the moved model."""
        super()._apply(fn, recurse)
        self.policy = Policy(self.policy.cfg, self.policy.model)
        return self


def resolve_mode(mode: str | None, kwargs: Mapping[str, Any]) -> str:
    """RLinf's mode, or (for model types RLinf does not list) its sampling params: do_sample
    False -> eval. Neither is refused: eval would silently sample like training."""
    unknown = sorted(set(kwargs) - SAMPLING_KWARGS)
    if unknown:
        raise TypeError(
            f"predict_action_batch got unexpected arguments {unknown}; known: mode, compute_values, "
            f"{sorted(SAMPLING_KWARGS)}"
        )
    if mode is None:
        if "do_sample" not in kwargs:
            raise ValueError(
                "predict_action_batch got neither mode nor do_sample: RLinf passes rollout.sampling_params "
                "for model types it does not list, so set rollout.sampling_params (do_sample: true, "
                "temperature_train: 1.0, temperature_eval: 0, top_k: 0, top_p: 1.0, max_new_tokens: 1) to "
                "tell training (flow-SDE) from evaluation (ODE), or pass mode='train' / 'eval'"
            )
        mode = "train" if kwargs["do_sample"] else "eval"
    if mode not in ("train", "eval"):
        raise ValueError(f"predict_action_batch mode must be 'train' or 'eval', got {mode!r}")
    return mode


def _cloned_tensor(value: Any) -> Tensor:
    """RLinf clones the raw observations it keeps (copy_dict_tensor); numpy arrays become tensors."""
    if isinstance(value, Tensor):
        return value.clone()
    return torch.from_numpy(np.array(value, copy=True))
