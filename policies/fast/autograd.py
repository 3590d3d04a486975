"""Autograd for one recomputed denoise step: the fast path's kernels forward, the reference math backward.

`ConsistentStep.apply(run, table, *weights)` returns the element-wise log-density of the stored
transitions chains[:, k] -> chains[:, k+1] of some rows of a bucket:
- forward: `run.forward()`, the fast path's own expert velocity (`FastSampler._velocity`: the
  same kernels on the same weights: skinny GEMMs or F.linear, the norm, RoPE and action_io
  kernels, the bucket's attention backend) and flow_logprob.py's twin of the rollout's flow_step, at the
  rollout's bucket shapes: the rollout's numbers bit for bit;
- backward: `run.reference(table, weights)`, the plain model's `velocity` (policies/models/pi05.py)
  and policies.flow's log-density in fp32 under autograd at the same inputs (x_k, x_{k+1}, the
  prefix K/V the fast path computed, the modulation rows of step k, the weights upcast to fp32),
  differentiated by torch.autograd.grad. So the gradients are those of the reference math at the
  rollout's point, whatever the forward's precision.
`table` is the AdaRMS modulation table (K, 2L+1, 3W) computed with autograd from the time MLP and
the AdaRMS dense weights; the forward's kernels read its values from FastWeights' buffer (copied
there by recompute.py), the backward returns its gradient, which autograd carries on to those
weights. `weights` are the parameters the expert velocity reads (`velocity_parameters`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from policies import flow
from policies.fast.flow_logprob import flow_logprob
from policies.models.gemma import rope_cos_sin
from policies.models.pi05 import PrefixCache

VELOCITY_LAYERS = ("qkv", "o_proj", "gate_up", "down")


def velocity_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything `PI05Model.velocity` reads besides the modulation: the
    expert layers' projections and action_in/out_proj (the AdaRMS dense layers and the time MLP
    enter through the modulation table)."""
    def used(name: str) -> bool:
        if name.startswith(("action_in_proj.", "action_out_proj.")):
            return True
        parts = name.split(".")
        return name.startswith("expert.layers.") and parts[3] in VELOCITY_LAYERS

    return [(name, p) for name, p in model.named_parameters() if used(name)]


class _VelocityCall(nn.Module):
    """`functional_call` calls forward(); this routes it to PI05Model.velocity."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, cache: PrefixCache, x: Tensor, modulation: Tensor) -> Tensor:
        return self.model.velocity(cache, x, modulation)


@dataclass
class StepRun:
    """One recomputed step k over rows `rows` of a prepared bucket (vision + prefix already run,
    chains[:, k] and chains[:, k+1] of every bucket row filled in)."""

    sampler: object  # FastSampler
    bucket: object  # runner.Bucket
    step: int
    rows: Tensor  # (n,) positions in the bucket
    x: Tensor  # (n, H, D) fp32 chains[:, k] of those rows
    x_next: Tensor  # (n, H, D) fp32 chains[:, k+1]
    cache: PrefixCache | None  # the rows' prefix K/V for the backward (None: no gradient needed)
    weight_names: tuple[str, ...] = ()

    def forward(self) -> Tensor:
        """(n, H, D) log-probs through the fast path's kernels (a CUDA graph per bucket and step)."""
        k = self.step
        self.sampler.run_stage(self.bucket, f"recompute/{k}", functools.partial(stage_recompute, self.sampler, k))
        return self.bucket.tensors["step_logprobs"][self.rows, k].clone()

    def reference(self, table: Tensor, weights: list[Tensor]) -> Tensor:
        """(n, H, D) the same log-probs by the plain model in fp32, differentiable."""
        k, sampler = self.step, self.sampler
        params = {f"model.{name}": w.float() for name, w in zip(self.weight_names, weights)}
        modulation = table[k: k + 1].float()
        cache = PrefixCache([key.float() for key in self.cache.keys], [value.float() for value in self.cache.values],
                            self.cache.pad_mask, self.cache.offsets)
        v = functional_call(_VelocityCall(sampler.model), params, (cache, self.x, modulation))
        t, delta, sigma, _ = (torch.tensor(c, dtype=torch.float32, device=v.device) for c in sampler.step_constants[k])
        mean, std = flow.sde_step_mean_std(self.x, v, t, delta, sigma)
        return flow.gaussian_log_prob(self.x_next, mean, std)


def stage_recompute(sampler, k: int, bucket) -> None:
    """Denoise step k of the rollout's denoise stage (runner._stage_denoise), with the stored
    chains[:, k+1] scored instead of drawn: the expert velocity then flow_logprob."""
    t, ecfg = bucket.tensors, sampler.cfg.expert
    cos, sin = rope_cos_sin(t["suffix_positions"], ecfg.head_dim, ecfg.rope_theta, sampler.dtype)
    if bucket.mlp_sync is not None:  # fused_mlp's counters of step k start at zero in every call
        bucket.mlp_sync[k].zero_()
    v = sampler._velocity(bucket, t["chains"][:, k], k, cos, sin)
    grid_t, delta, sigma, _ = sampler.step_constants[k]
    flow_logprob(t["chains"], v, t["stochastic"], t["step_logprobs"], k, grid_t, delta, sigma, sampler._pdl_for(bucket))


class ConsistentStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: StepRun, table: Tensor, *weights: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(table, *weights)
        return run.forward()

    @staticmethod
    def backward(ctx, grad: Tensor):
        table, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad(), torch.autocast(grad.device.type, enabled=False):
            leaves = [w.detach().requires_grad_(need) for w, need in zip([table, *weights], needs)]
            logp = ctx.run.reference(leaves[0], leaves[1:])
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(logp, wanted, grad, allow_unused=True))
        return (None, *[next(grads) if need else None for need in needs])
