"""The policy contract the engine and the RLinf adapter call (narrow, openpi-style).

    policy = build_policy(PolicyConfig.preset("tiny"))
    batch = policy.make_batch(raw_env_obs)                 # frozen transforms -> Observation
    out = policy.sample(batch, mode="train")              # SampleOutput: actions, chains, ...
    lp = policy.log_prob(batch, out.chains, out.denoise_inds)   # recompute with gradients

`sample(..., noise=...)` takes the initial noise (B, H, max_action_dim) so two models can be
fed the same noise; `step_noise` (B, K, H, max_action_dim) fixes the SDE step noise too;
`generator` draws everything else. Padding dims of the noise are kept as LeRobot does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from common.devices import on_own_device, to_device
from policies import sampling
from policies.config import PolicyConfig
from policies.fast.call_inputs import drop_unused_cameras
from policies.models import reference
from policies.models.pi05 import PI05Model, PrefixCache
from policies.observation import ModelInputs, Observation, check_nonempty, model_inputs
from policies.sampling import LogProbOutput, SampleOutput
from policies.tokenizer import load_tokenizer
from policies.transforms import ObservationTransform


class Policy(nn.Module):
    def __init__(self, cfg: PolicyConfig, model: PI05Model | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = model if model is not None else PI05Model(cfg)
        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"tokenizer vocab ({self.tokenizer.vocab_size}) exceeds policy.vocab_size ({cfg.vocab_size})"
            )
        self.transform = ObservationTransform(cfg, self.tokenizer)
        self._fast = None

    @property
    def device(self) -> torch.device:
        return self.model.action_in_proj.weight.device

    # ----- inputs -----
    def make_batch(self, raw_obs: dict) -> Observation:
        """Raw env observation dict -> Observation, preprocessed batched on this policy's device.
        Bad input (missing keys, wrong shapes, non-uint8 images, non-finite states) is refused
        before any work (policies/transforms.py `check_raw`)."""
        return self.transform(raw_obs, self.device)

    def inputs(self, batch: Observation | ModelInputs) -> ModelInputs:
        return (
            batch if isinstance(batch, ModelInputs) else model_inputs(batch, self.cfg, self.device)
        )

    def prefix_cache(self, inputs: ModelInputs) -> PrefixCache:
        """The prefix K/V of `inputs`, without the camera slots masked in every row (the fast path's rule,
        `drop_unused_cameras`): pi0.5 on LIBERO leaves one of three slots empty, and its SigLIP pass and 256
        pad keys change no output. The cache holds the kept slots' tokens only."""
        host = inputs.masks_on_host()
        host = inputs.image_masks.cpu() if host is None else host[1]
        inputs, _, _ = drop_unused_cameras(inputs, host)
        return self.model.prefix_cache(
            inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask
        )

    def _noise(self, noise: Tensor | None, batch: int, generator: torch.Generator | None) -> Tensor:
        shape = (batch, self.cfg.chunk_size, self.cfg.max_action_dim)
        if noise is None:
            return torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32)
        if tuple(noise.shape) != shape:
            raise ValueError(
                f"noise must be (B, chunk_size, max_action_dim) = {shape}, got {tuple(noise.shape)}"
            )
        _check_finite("noise", noise)
        return noise.to(self.device, torch.float32)

    def _step_noise(self, step_noise: Tensor | None, batch: int) -> Tensor | None:
        if step_noise is None:
            return None
        shape = (batch, self.cfg.sampling.num_steps, self.cfg.chunk_size, self.cfg.max_action_dim)
        if tuple(step_noise.shape) != shape:
            raise ValueError(
                f"step_noise must be (B, K, chunk_size, max_action_dim) = {shape}, got {tuple(step_noise.shape)}"
            )
        _check_finite("step_noise", step_noise)
        return step_noise.to(self.device, torch.float32)

    # ----- sampling -----
    @torch.no_grad()
    @on_own_device
    def sample(
        self,
        batch: Observation | ModelInputs,
        mode: str = "train",
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        step_noise: Tensor | None = None,
        denoise_inds: Tensor | None = None,
        reference_path: bool = False,
    ) -> SampleOutput:
        """Sample action chunks. mode: "ode" | "sde" | "sde_all" | "train" (= sampling.train_mode)
        | "eval" (= "ode"). `denoise_inds` (B, K) overrides the random step choice (all rows must
        agree per step). `reference_path` runs the slow plain forward (tests, debugging)."""
        cfg, scfg = self.cfg, self.cfg.sampling
        mode = sampling.canonical_mode(mode, scfg.train_mode)
        inputs = self.inputs(batch)
        b, k = inputs.batch_size, scfg.num_steps
        check_nonempty(b, "Policy.sample")
        x = self._noise(noise, b, generator)
        if denoise_inds is None:
            denoise_inds = sampling.denoise_indices(
                mode, k, b, scfg.exclude_last_step, generator, self.device
            )
        stochastic = self._stochastic_steps(mode, denoise_inds, b)
        if reference_path or cfg.fast.enabled:
            eps = self._step_noise(step_noise, b)
            if eps is None and any(stochastic):
                eps = torch.randn(
                    (b, k, cfg.chunk_size, cfg.max_action_dim),
                    generator=generator,
                    device=self.device,
                )
        if cfg.fast.enabled and not reference_path:
            mask = torch.tensor(stochastic, device=self.device).expand(b, k)
            chains, step_lp = self.fast_sampler().sample_chains(inputs, x, eps, mask)
        elif reference_path:
            chains, step_lp = reference.sample_chain(
                self.model,
                inputs.images,
                inputs.image_masks,
                inputs.tokens,
                inputs.token_mask,
                x,
                stochastic,
                eps,
                scfg.noise_level,
            )
        else:
            cache = self.prefix_cache(inputs)
            chains, step_lp = sampling.run_chain(
                self.model,
                cache,
                x,
                stochastic,
                scfg.noise_level,
                self._step_noise(step_noise, b),
                generator,
            )
        logprobs = sampling.reduce_logprobs(
            mode, step_lp, chains, denoise_inds, cfg.logprob_chunk, cfg.action_dim
        )
        final = chains[:, -1]
        return SampleOutput(
            actions=final[..., : cfg.action_dim],
            model_actions=final,
            chains=chains,
            denoise_inds=denoise_inds,
            step_logprobs=step_lp,
            logprobs=logprobs,
            chunk_logprob=logprobs.flatten(1).sum(dim=1),
            mode=mode,
        )

    def fast_sampler(self):
        """The fast path (policies/fast), built on first use over this policy's weights."""
        if self._fast is None:
            from policies.fast.runner import FastSampler

            self._fast = FastSampler(self.model, self.cfg.fast)
        return self._fast

    def settle_checks(self) -> None:
        """Raise the error of any consistent log_prob call whose check of its given prefix is still pending on the
        GPU (policies/fast/recompute.py reads it back without a wait: at the next call, or here). Call it before
        acting on the results of the last such call, e.g. before an optimiser step."""
        if self._fast is not None:
            self._fast.layout_checks.settle()

    def reference_graph_counts(self) -> tuple[int, int]:
        """(captures, padded replays) of the consistent recompute's captured backward so far
        (policies/fast/reference_graph.py; (0, 0) where nothing was captured: no fast path yet, or no CUDA graphs)."""
        graphs = None if self._fast is None else self._fast.reference_graphs
        return (0, 0) if graphs is None else (graphs.captures, graphs.padded_replays)

    def fast_buckets(self) -> list[dict]:
        """The fast path's built buckets, each with its building call's seconds (FastSampler.bucket_report);
        [] before the fast path's first call."""
        return [] if self._fast is None else self._fast.bucket_report()

    def refresh_weights(self) -> None:
        """Call after updating the model's weights in place: refreshes the fast path's bf16
        shadows and weight-derived tables (its CUDA graphs stay valid)."""
        if self._fast is not None:
            self._fast.refresh_weights()

    def _stochastic_steps(self, mode: str, denoise_inds: Tensor, batch: int) -> list[bool]:
        k = self.cfg.sampling.num_steps
        # the whole shape: a (1, K) row would be returned as the output's denoise_inds and refused by
        # log_prob later; another batch size would fail inside the log-prob gather
        if tuple(denoise_inds.shape) != (batch, k):
            raise ValueError(
                f"denoise_inds must be (B, K) = {(batch, k)} (batch size, policy.sampling.num_steps), "
                f"got {tuple(denoise_inds.shape)}"
            )
        if mode == "ode":
            return [False] * k
        if mode == "sde_all":
            return [True] * k
        first = denoise_inds[:, 0]
        if not bool((first == first[0]).all()):
            raise ValueError(
                "sampling with mode 'sde' needs one denoise index for the whole batch (RLinf)"
            )
        index = int(first[0])
        if not 0 <= index < k:
            raise ValueError(f"denoise index must be in [0, {k}), got {index}")
        return [step == index for step in range(k)]

    # ----- trainer-side recompute -----
    @on_own_device
    def log_prob(
        self,
        batch: Observation | ModelInputs,
        chains: Tensor,
        denoise_inds: Tensor,
        mode: str = "train",
        consistent: bool | None = None,
        fast_buckets: Tensor | None = None,
        prefix: PrefixCache | None = None,
        return_prefix: bool = False,
    ) -> LogProbOutput:
        """Recompute log-probs of stored transitions with gradients. The prefix is recomputed
        (under no_grad when policy.train_expert_only); only the needed expert steps run: one per
        sample for "sde" (per-sample indices allowed), K for "sde_all".
        `consistent` (default policy.fast.consistent_recompute): recompute through the fast path's
        kernels at the rollout's bucket shapes, reproducing a fast-path rollout's log-probs bit for
        bit (policies/fast/recompute.py); `fast_buckets` (B, 2) = the rollout's
        `fast_sampler().last_buckets` rows, unless one-entry bucket lists pin them.
        `prefix`: these rows' prefix K/V, computed earlier from the same inputs and the same frozen weights
        (policy.train_expert_only; GRPO's grpo.prefix_cache), used instead of recomputing it: by `prefix_cache`, or
        the `prefix` of an earlier call's output; `return_prefix`: the output's `prefix` holds the rows' prefix K/V
        for such later calls. A consistent call copies a given prefix into the fast path's bucket instead of running
        vision and prefix there, so it takes a consistent call's own `prefix` (the bucket's layout: valid tokens
        first, its prompt bucket's length; checked), and returns the rollout's log-probs bit for bit with it."""
        cfg, scfg = self.cfg, self.cfg.sampling
        mode = sampling.canonical_mode(mode, scfg.train_mode)
        if mode == "ode":
            raise ValueError(
                "log_prob needs a stochastic mode ('sde' or 'sde_all'); ODE transitions have no density"
            )
        inputs = self.inputs(batch)
        b, k = inputs.batch_size, scfg.num_steps
        check_nonempty(b, "Policy.log_prob")
        shape = (b, k + 1, cfg.chunk_size, cfg.max_action_dim)
        if tuple(chains.shape) != shape:
            raise ValueError(
                f"chains must be (B, K+1, chunk_size, max_action_dim) = {shape}, got {tuple(chains.shape)}"
            )
        if tuple(denoise_inds.shape) != (b, k):
            raise ValueError(
                f"denoise_inds must be (B, K) = {(b, k)}, got {tuple(denoise_inds.shape)}"
            )
        # checked where the caller keeps them: indices given in host memory are read without waiting for the GPU
        if int(denoise_inds.min()) < 0 or int(denoise_inds.max()) >= k:
            raise ValueError(
                f"denoise_inds must be in [0, {k}) for mode {mode!r}, got {denoise_inds.min()}..{denoise_inds.max()}"
            )
        host_inds = denoise_inds.long() if denoise_inds.device.type == "cpu" else None
        chains, denoise_inds = (
            to_device(chains, self.device).float(),
            to_device(denoise_inds, self.device).long(),
        )
        if prefix is not None:
            check_given_prefix(prefix, b, cfg.train_expert_only)
        if cfg.fast.consistent_recompute if consistent is None else consistent:
            from policies.fast.recompute import consistent_log_prob

            return consistent_log_prob(self, inputs, chains, denoise_inds, mode, fast_buckets, prefix, return_prefix,
                                       host_denoise_inds=host_inds)
        if prefix is None:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not cfg.train_expert_only):
                cache = self.prefix_cache(inputs)
        else:
            cache = prefix
        columns = [0] if mode == "sde" else list(range(k))
        step_lp = torch.stack(
            [
                sampling.recompute_step_logprobs(
                    self.model, cache, chains, denoise_inds[:, c], k, scfg.noise_level
                )
                for c in columns
            ],
            dim=1,
        )
        if mode == "sde":
            logprobs = step_lp[:, 0, : cfg.logprob_chunk, : cfg.action_dim]
        else:
            logprobs = sampling.reduce_logprobs(
                mode, step_lp, chains, denoise_inds, cfg.logprob_chunk, cfg.action_dim
            )
        return LogProbOutput(logprobs, logprobs.flatten(1).sum(dim=1), step_lp, cache if return_prefix else None)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.model.trainable_parameters(self.cfg.train_expert_only)

    def save(self, path: str | Path) -> None:
        """Our own format: the model's state dict (fused layout) as safetensors."""
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()},
            str(path),
        )


def check_given_prefix(prefix: PrefixCache, batch: int, train_expert_only: bool) -> None:
    """A prefix cache handed to log_prob must be these rows' (one per row) and frozen: with the prefix trained, a
    cache computed earlier holds the weights of then and no graph back to them."""
    if not train_expert_only:
        raise ValueError("log_prob: a given prefix cache needs policy.train_expert_only=true (a trained prefix "
                         "must be recomputed with its current weights and gradients)")
    if prefix.offsets.shape[0] != batch:
        raise ValueError(f"log_prob: the given prefix cache holds {prefix.offsets.shape[0]} rows, the batch {batch}")


def _check_finite(name: str, values: Tensor) -> None:
    """Refuse NaN/inf noise (it would give NaN actions), naming the first bad element."""
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        index = tuple(int(i) for i in torch.nonzero(~finite)[0])
        raise ValueError(f"{name} has a non-finite value {float(values[index])} at index {index} (sample {index[0]})")


def build_policy(cfg: PolicyConfig, device: torch.device | str = "cpu") -> Policy:
    """Random init from cfg.seed (or cfg.checkpoint loaded strictly), precision applied, on device."""
    with torch.device(device):
        model = PI05Model(cfg)
    if cfg.checkpoint is None:
        model.init_weights(cfg.seed, cfg.init_scale)
    else:
        from policies.loaders import load_checkpoint

        load_checkpoint(model, cfg.checkpoint, cfg.checkpoint_format).raise_if_incomplete()
    model.apply_precision(cfg.dtype).to(device)
    if cfg.frozen_dtype is not None:
        model.apply_frozen_precision(cfg.frozen_dtype)
    return Policy(cfg, model)
