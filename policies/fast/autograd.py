"""Autograd for the recomputed denoise steps of one chunk: the fast path's kernels forward, the reference math backward.

`ConsistentChunk.apply(run, table, *weights)` returns the element-wise log-density of the stored
transitions chains[:, k] -> chains[:, k+1] of the chunk's rows, each row at its own step k:
- forward: `run.forward()`, the fast path's own expert velocity (`FastSampler._velocity`: the
  same kernels on the same weights: skinny GEMMs or F.linear, the norm, RoPE and action_io
  kernels, the bucket's attention backend) and flow_logprob.py's twin of the rollout's flow_step, at the
  rollout's bucket shapes: the rollout's numbers bit for bit;
- backward: `run.reference(table, weights)`, the plain model's `velocity` (policies/models/pi05.py)
  and policies.flow's log-density in fp32 under autograd at the same inputs (x_k, x_{k+1}, the
  prefix K/V the fast path computed, each row's modulation row, the weights upcast to fp32),
  differentiated by torch.autograd.grad. So the gradients are those of the reference math at the
  rollout's point, whatever the forward's precision.
`table` is the AdaRMS modulation table (K, 2L+1, 3W) computed with autograd from the time MLP and
the AdaRMS dense weights; the forward's kernels read its values from FastWeights' buffer (copied
there by recompute.py), the backward returns its gradient, which autograd carries on to those
weights. `weights` are the parameters the expert velocity reads (`velocity_parameters`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
class ChunkRun:
    """The needed steps of one chunk of a prepared bucket (vision + prefix already run): step `steps[i]` scores
    bucket rows `rows[i]`. Forward: one fast-path graph per step. Backward: one reference call over all the
    chunk's rows at once, each row at its own step (its modulation row and step constants gathered per row, as
    policies.sampling.recompute_step_logprobs does), so the plain model's kernels launch once per chunk, not once
    per step: the backward's Python launches, not its kernels, bound it on the GPU (round 49's profile)."""

    sampler: object  # FastSampler
    bucket: object  # runner.Bucket
    steps: list[int]  # distinct steps, in the order their rows are concatenated
    rows: list[Tensor]  # per step, (n_i,) positions in the bucket
    fill: Callable[[int], None]  # fill(step): the bucket's chains[:, step] and [:, step+1] for that step's rows
    x: Tensor  # (n, H, D) fp32 chains[:, k] of every row (rows of steps[0] first, then steps[1], ...)
    x_next: Tensor  # (n, H, D) fp32 chains[:, k+1]
    cache: PrefixCache | None  # the same rows' prefix K/V for the backward (None: no gradient needed)
    weight_names: tuple[str, ...] = ()

    def forward(self) -> Tensor:
        """(n, H, D) log-probs through the fast path's kernels (a CUDA graph per bucket and step)."""
        out = []
        for k, rows in zip(self.steps, self.rows, strict=True):
            self.fill(k)
            self.sampler.run_stage(self.bucket, f"recompute/{k}", functools.partial(stage_recompute, self.sampler, k))
            out.append(self.bucket.tensors["step_logprobs"][rows, k].clone())
        return torch.cat(out)

    def row_steps(self) -> list[int]:
        """Each row's step, in the rows' order."""
        return [k for k, rows in zip(self.steps, self.rows, strict=True) for _ in range(len(rows))]

    def reference(self, table: Tensor, weights: list[Tensor]) -> Tensor:
        """(n, H, D) the same log-probs by the plain model in fp32, differentiable."""
        sampler, dev = self.sampler, self.x.device
        per_row = self.row_steps()
        params = {f"model.{name}": w.float() for name, w in zip(self.weight_names, weights)}
        modulation = table.float()[torch.tensor(per_row, device=dev)]
        cache = PrefixCache([key.float() for key in self.cache.keys], [value.float() for value in self.cache.values],
                            self.cache.pad_mask, self.cache.offsets)
        v = functional_call(_VelocityCall(sampler.model), params, (cache, self.x, modulation))
        constants = torch.tensor([sampler.step_constants[k][:3] for k in per_row], dtype=torch.float32, device=dev)
        t, delta, sigma = (constants[:, i, None, None] for i in range(3))
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


class ConsistentChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: ChunkRun, table: Tensor, *weights: Tensor) -> Tensor:
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
