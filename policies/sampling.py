"""Sampling loops (ODE / flow-SDE) over a prefix cache, and the trainer-side log-prob recompute.

Conventions follow RLinf's `OpenPi0ForRLActionPrediction` (rlinf 0.3.0,
rlinf/models/embodiment/openpi/openpi_action_model.py, `sample_actions`, `get_log_prob_value`,
`default_forward`):
- modes: "ode" (eval; denoise_inds all -1), "sde" (train, one stochastic step per call: index
  uniform in [0, K-1] (or [0, K-2] with exclude_last_step), the same for the whole batch;
  denoise_inds = that index repeated K times), "sde_all" (every step stochastic, RLinf
  `joint_logprob`; denoise_inds = arange(K)).
- chains (B, K+1, H, D): chains[:, 0] is the initial noise, chains[:, k+1] the state after step k;
  the actions are chains[:, K].
- log-probs: element-wise Gaussian log-density of chains[:, k+1] given chains[:, k]; only the
  first `logprob_chunk` actions and the `action_dim` real dims count (padding excluded).
  "sde": the selected step's (B, Hc, A); "sde_all": the mean over [log N(chains[:, 0]; 0, I),
  step 0, ..., step K-1] (RLinf averages the K+1 terms); "ode": zeros. `chunk_logprob` sums
  the (Hc, A) elements: the chunk-level log-prob used by the GRPO ratio.
Deterministic steps are LeRobot's Euler step x + dt v with dt = -1/K; stochastic steps use
`flow.sde_step_mean_std`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from policies import flow
from policies.models.pi05 import PI05Model, PrefixCache

MODE_ALIASES = {"eval": "ode", "flow_ode": "ode", "flow_sde": "sde", "joint": "sde_all"}


@dataclass
class SampleOutput:
    actions: (
        Tensor  # (B, H, action_dim) real dims of the final chain state, model (normalised) space
    )
    model_actions: Tensor  # (B, H, max_action_dim)
    chains: Tensor  # (B, K+1, H, max_action_dim)
    denoise_inds: Tensor  # (B, K) int64, RLinf convention
    step_logprobs: Tensor  # (B, K, H, max_action_dim) element-wise; 0 on deterministic steps
    logprobs: Tensor  # (B, logprob_chunk, action_dim): RLinf `prev_logprobs`
    chunk_logprob: Tensor  # (B,)
    mode: str


@dataclass
class LogProbOutput:
    logprobs: Tensor  # (B, logprob_chunk, action_dim), same convention as SampleOutput.logprobs
    chunk_logprob: Tensor  # (B,)
    step_logprobs: Tensor  # (B, n, H, max_action_dim) for the n recomputed steps
    prefix: PrefixCache | None = None  # the rows' prefix K/V, when log_prob was asked for it (return_prefix)


def canonical_mode(mode: str, train_mode: str) -> str:
    mode = "train" if mode is None else mode
    mode = train_mode if mode == "train" else MODE_ALIASES.get(mode, mode)
    if mode not in ("ode", "sde", "sde_all"):
        raise ValueError(
            f"sampling mode must be 'ode', 'sde', 'sde_all', 'train' or 'eval', got {mode!r}"
        )
    return mode


def denoise_indices(
    mode: str,
    num_steps: int,
    batch: int,
    exclude_last: bool,
    generator: torch.Generator | None,
    device,
) -> Tensor:
    if mode == "ode":
        row = torch.full((num_steps,), -1, dtype=torch.long)
    elif mode == "sde_all":
        row = torch.arange(num_steps)
    else:
        high = num_steps - 1 if exclude_last else num_steps
        gen_device = generator.device if generator is not None else "cpu"
        row = (
            torch.randint(0, high, (1,), generator=generator, device=gen_device)
            .cpu()
            .expand(num_steps)
        )
    return row[None].repeat(batch, 1).to(device)


def run_chain(
    model: PI05Model,
    cache: PrefixCache,
    noise: Tensor,
    stochastic: list[bool],
    noise_level: float,
    step_noise: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """-> chains (B, K+1, H, D), step_logprobs (B, K, H, D). The AdaRMS modulation of the K grid
    times is computed once (`modulation_table`) and indexed per step."""
    num_steps = len(stochastic)
    grid = flow.time_grid(num_steps, noise.device)
    deltas, sigmas = flow.step_deltas(grid), flow.sde_sigmas(grid, noise_level)
    table = model.modulation_table(grid[:-1])
    x = noise
    chain, logps = [x], []
    for k in range(num_steps):
        v = model.velocity(cache, x, table[k : k + 1])
        if stochastic[k]:
            mean, std = flow.sde_step_mean_std(x, v, grid[k], deltas[k], sigmas[k])
            eps = (
                step_noise[:, k]
                if step_noise is not None
                else torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            )
            x = mean + std * eps
            logps.append(flow.gaussian_log_prob(x, mean, std))
        else:
            x = flow.euler_step(x, v, -1.0 / num_steps)
            logps.append(torch.zeros_like(x))
        chain.append(x)
    return torch.stack(chain, dim=1), torch.stack(logps, dim=1)


def reduce_logprobs(
    mode: str,
    step_logprobs: Tensor,
    chains: Tensor,
    denoise_inds: Tensor,
    chunk: int,
    action_dim: int,
) -> Tensor:
    """RLinf's post-processing of the per-step element log-probs -> (B, chunk, action_dim)."""
    lp = step_logprobs[:, :, :chunk, :action_dim]
    if mode == "ode":
        return torch.zeros_like(lp[:, 0])
    if mode == "sde":
        return lp[torch.arange(lp.shape[0], device=lp.device), denoise_inds[:, 0].to(lp.device)]
    x0 = chains[:, 0, :chunk, :action_dim]
    initial = flow.gaussian_log_prob(x0, torch.zeros_like(x0), torch.ones_like(x0))
    return torch.cat([initial[:, None], lp], dim=1).mean(dim=1)


def recompute_step_logprobs(
    model: PI05Model,
    cache: PrefixCache,
    chains: Tensor,
    steps: Tensor,
    num_steps: int,
    noise_level: float,
) -> Tensor:
    """Log-prob of chains[b, steps[b]+1] given chains[b, steps[b]] under the flow-SDE step (B, H, D).
    Per-sample steps: t, d, sigma and the modulation rows are gathered per sample."""
    grid = flow.time_grid(num_steps, chains.device)
    deltas, sigmas = flow.step_deltas(grid), flow.sde_sigmas(grid, noise_level)
    rows = torch.arange(chains.shape[0], device=chains.device)
    x, x_next = chains[rows, steps], chains[rows, steps + 1]
    table = model.modulation_table(grid[:-1])
    v = model.velocity(cache, x, table[steps])
    per_sample = lambda values: values[steps][:, None, None]
    mean, std = flow.sde_step_mean_std(
        x, v, per_sample(grid[:-1]), per_sample(deltas), per_sample(sigmas)
    )
    return flow.gaussian_log_prob(x_next, mean, std)
