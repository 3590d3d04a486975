"""Flow-matching math as pure tensor functions (no model, no state).

Conventions (LeRobot 0.6.1 `PI05Pytorch.forward` / `common.flow_matching.euler_integrate`,
openpi `PI0Pytorch`): time runs from t=1 (pure noise) to t=0 (actions);
x_t = t * noise + (1 - t) * actions and the model predicts v = noise - actions, so an Euler
step with dt = -1/K moves x_t towards the actions.

The stochastic step is RLinf's flow-SDE (rlinf/models/embodiment/openpi/openpi_action_model.py,
`sample_mean_var_val`, method "flow_sde"): from t to t - d, with x0 = x - v t and
x1 = x + v (1 - t),
    mean = x0 (1 - (t - d)) + x1 (t - d - sigma^2 d / (2 t)),   std = sigma sqrt(d),
    sigma_t = a sqrt(t / (1 - t)),
where at t = 1 (sigma infinite) RLinf puts the next grid time t_1 in the denominator:
sigma_0 = a sqrt(1 / (1 - t_1)). Log-probs are per-element Gaussian densities, defined as 0
where std == 0 (deterministic steps), as RLinf's `get_logprob_norm` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_2PI = math.log(2.0 * math.pi)


def time_grid(num_steps: int, device: torch.device | str | None = None) -> Tensor:
    """The K+1 times t_k = 1 - k/K (float32, computed in float64 as LeRobot's `1.0 + k * dt`)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    dt = -1.0 / num_steps
    values = [1.0 + k * dt for k in range(num_steps)] + [0.0]
    return torch.tensor(values, dtype=torch.float32, device=device)


def step_deltas(grid: Tensor) -> Tensor:
    """d_k = t_k - t_{k+1} (K,), the positive step sizes of the grid."""
    return grid[:-1] - grid[1:]


def sde_sigmas(grid: Tensor, noise_level: float) -> Tensor:
    """sigma_k = a sqrt(t_k / (1 - t_k)) for k < K; at t = 1 the denominator uses t_1 (RLinf)."""
    denom_t = torch.where(grid == 1, grid[1], grid)
    return noise_level * torch.sqrt(grid / (1 - denom_t))[:-1]


def interpolate(noise: Tensor, actions: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """Training pair: x_t = t noise + (1 - t) actions and the target velocity noise - actions."""
    t = t.reshape(-1, *([1] * (noise.dim() - 1)))
    return t * noise + (1 - t) * actions, noise - actions


def euler_step(x: Tensor, v: Tensor, dt: float | Tensor) -> Tensor:
    """Deterministic (ODE) step x + dt v, dt < 0 going from noise to actions."""
    return x + dt * v


def sde_step_mean_std(
    x: Tensor, v: Tensor, t: Tensor, delta: Tensor, sigma: Tensor
) -> tuple[Tensor, Tensor]:
    """Mean and std of RLinf's flow-SDE transition from t to t - delta (all broadcastable)."""
    x0 = x - v * t
    x1 = x + v * (1 - t)
    x0_weight = 1 - (t - delta)
    x1_weight = t - delta - sigma**2 * delta / (2 * t)
    return x0 * x0_weight + x1 * x1_weight, torch.sqrt(delta) * sigma


def ode_step_mean(x: Tensor, v: Tensor, t: Tensor, delta: Tensor) -> Tensor:
    """RLinf's "flow_ode" mean, x0 (1 - (t - d)) + x1 (t - d); equals x - d v mathematically."""
    x0 = x - v * t
    x1 = x + v * (1 - t)
    return x0 * (1 - (t - delta)) + x1 * (t - delta)


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Element-wise log N(sample; mean, std^2); 0 where std == 0 (a deterministic step)."""
    std = torch.as_tensor(std, dtype=sample.dtype, device=sample.device).expand_as(sample)
    zero = std == 0
    safe = torch.where(zero, torch.ones_like(std), std)
    log_prob = -torch.log(safe) - 0.5 * LOG_2PI - 0.5 * ((sample - mean) / safe) ** 2
    return torch.where(zero, torch.zeros_like(log_prob), log_prob)


def sincos_time_embedding(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """LeRobot/openpi `create_sinusoidal_pos_embedding`: [sin, cos] of t * 2 pi / period (float64 math).

    Periods are log-spaced from min_period to max_period over dim / 2 frequencies; the result is
    cast to t's dtype. t has shape (B,).
    """
    if dim % 2:
        raise ValueError(f"time embedding dim must be even, got {dim}")
    if t.dim() != 1:
        raise ValueError(f"time must have shape (batch,), got {tuple(t.shape)}")
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None].to(torch.float64)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(t.dtype)
