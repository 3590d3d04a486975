"""The log-density of a stored flow-SDE transition, computed as the rollout's `flow_step` computes it.

The rollout (kernels.flow_step) draws x_{k+1} = mean + std * eps and writes its log-density in the
same kernel. The trainer has x_{k+1} (stored in the chains), not eps, so the consistent recompute
needs the same arithmetic with x_{k+1} loaded instead of drawn. These are twins of kernels.py's
`flow_step_kernel` / `flow_step_reference` with exactly that change, statement for statement (same
expressions, so the Triton compiler makes the same FMA contractions; same PyTorch ops on the same
bucket-shaped tensors on CPU, so vectorised and scalar loops meet the same elements): given the
same x_k, v and x_{k+1} they produce the rollout's log-probs bit for bit. tests/policies/
test_consistent_recompute.py checks that against the rollout kernels (Triton under the interpreter
on CPU, compiled on CUDA in test_consistent_gpu.py).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from policies import flow
from policies.fast import kernels as K
from policies.fast.pdl import launch_kwargs

C = None  # policies.fast.triton_common once the kernel factory ran (triton is imported on first use only)


def flow_logprob_reference(chains: Tensor, v: Tensor, stochastic: Tensor, logp: Tensor,
                           k: int, t: float, delta: float, sigma: float) -> None:
    """logp[:, k] <- log N(chains[:, k+1]; mean(chains[:, k], v), std^2) where stochastic[:, k], else 0.
    chains (B, K+1, H, D), v (B, H, D), stochastic (B, K) bool, logp (B, K, H, D); fp32, in place."""
    x = chains[:, k]
    as_t = lambda value: torch.tensor(value, dtype=x.dtype, device=x.device)  # noqa: E731
    mean, std = flow.sde_step_mean_std(x, v, as_t(t), as_t(delta), as_t(sigma))
    chosen = stochastic[:, k, None, None]
    x_next = chains[:, k + 1].contiguous()  # the rollout's x_next is a fresh contiguous tensor too
    logp[:, k].copy_(torch.where(chosen, flow.gaussian_log_prob(x_next, mean, std), torch.zeros_like(x_next)))


@functools.cache
def _triton_kernel():
    global C  # the shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def flow_logprob_kernel(chains_ptr, v_ptr, stoch_ptr, logp_ptr, k, num_steps, width,
                            t, delta, sigma, BLOCK: tl.constexpr, PDL: tl.constexpr):
        C.pdl_enter(PDL)  # as flow_step_kernel
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < width
        src = chains_ptr + (b * (num_steps + 1) + k) * width + i
        x = tl.load(src, mask=m, other=0.0)
        v = tl.load(v_ptr + b * width + i, mask=m, other=0.0)
        chosen = tl.load(stoch_ptr + b * num_steps + k) != 0
        x0 = x - v * t
        x1 = x + v * (1 - t)
        mean = x0 * (1 - (t - delta)) + x1 * (t - delta - sigma * sigma * delta / (2 * t))
        std = tl.sqrt(delta) * sigma
        x_next = tl.load(src + width, mask=m, other=0.0)  # stored, where flow_step_kernel draws it
        safe = tl.where(chosen, std, 1.0)
        z = (x_next - mean) / safe
        logp = tl.where(chosen, -tl.log(safe) - 0.9189385332046727 - 0.5 * z * z, 0.0)
        tl.store(logp_ptr + (b * num_steps + k) * width + i, logp, mask=m)

    return flow_logprob_kernel


def flow_logprob_triton(chains: Tensor, v: Tensor, stochastic: Tensor, logp: Tensor,
                        k: int, t: float, delta: float, sigma: float, pdl: int = 0) -> None:
    kernel = _triton_kernel()
    batch, steps_plus_one = chains.shape[:2]
    width = chains[0, 0].numel()
    block = 1024  # as kernels.flow_step_triton
    kernel[(batch, math.ceil(width / block))](
        chains, v, stochastic, logp, k, steps_plus_one - 1, width, t, delta, sigma, BLOCK=block, PDL=pdl,
        num_warps=4, **launch_kwargs(pdl),
    )


def flow_logprob(chains: Tensor, v: Tensor, stochastic: Tensor, logp: Tensor,
                 k: int, t: float, delta: float, sigma: float, pdl: int = 0) -> None:
    """Dispatches exactly as kernels.flow_step does, so each device runs the rollout's twin."""
    if K.triton_usable(chains) and chains.is_contiguous() and v.is_contiguous():
        return flow_logprob_triton(chains, v, stochastic, logp, k, t, delta, sigma, pdl)
    return flow_logprob_reference(chains, v, stochastic, logp, k, t, delta, sigma)
