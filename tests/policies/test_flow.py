"""Flow math against hand-computed values and slow Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from policies import flow


def test_time_grid_and_deltas():
    grid = flow.time_grid(4)
    assert grid.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert flow.step_deltas(grid).tolist() == [0.25, 0.25, 0.25, 0.25]
    assert flow.time_grid(10).dtype == torch.float32
    with pytest.raises(ValueError, match="num_steps"):
        flow.time_grid(0)


def test_sde_sigmas_hand_values():
    # a = 0.5, K = 4: t = 1 uses t_1 = 0.75 in the denominator (RLinf)
    sig = flow.sde_sigmas(flow.time_grid(4), 0.5)
    expected = [
        0.5 * math.sqrt(1 / 0.25),
        0.5 * math.sqrt(0.75 / 0.25),
        0.5 * math.sqrt(0.5 / 0.5),
        0.5 * math.sqrt(0.25 / 0.75),
    ]
    assert sig.tolist() == pytest.approx(expected, rel=1e-6)
    assert expected[0] == pytest.approx(1.0) and expected[2] == pytest.approx(0.5)
    # K = 1: sigma_0 = a * sqrt(1 / (1 - 0))
    assert flow.sde_sigmas(flow.time_grid(1), 0.3).tolist() == pytest.approx([0.3])


def test_sde_step_mean_std_hand_value():
    x, v, t, d, s = (
        torch.tensor(2.0),
        torch.tensor(0.5),
        torch.tensor(0.75),
        torch.tensor(0.25),
        torch.tensor(0.8),
    )
    mean, std = flow.sde_step_mean_std(x, v, t, d, s)
    x0, x1 = 2.0 - 0.5 * 0.75, 2.0 + 0.5 * 0.25  # 1.625, 2.125
    hand = x0 * (1 - 0.5) + x1 * (0.5 - 0.64 * 0.25 / 1.5)  # 0.8125 + 2.125 * 0.393333...
    assert float(mean) == pytest.approx(hand, rel=1e-6)
    assert float(mean) == pytest.approx(1.6483333, rel=1e-6)
    assert float(std) == pytest.approx(0.8 * 0.5)


def test_sde_step_reduces_to_euler_when_sigma_is_zero():
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    t, d = torch.tensor(0.6), torch.tensor(0.2)
    mean, std = flow.sde_step_mean_std(x, v, t, d, torch.tensor(0.0))
    torch.testing.assert_close(mean, x - d * v)
    torch.testing.assert_close(flow.ode_step_mean(x, v, t, d), x - d * v)
    torch.testing.assert_close(flow.euler_step(x, v, -0.2), x - 0.2 * v)
    assert float(std) == 0.0


def test_sde_mean_matches_slow_loop():
    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)
    t, d, s = (
        torch.tensor([[0.9], [0.4]]),
        torch.tensor([[0.1], [0.1]]),
        torch.tensor([[1.2], [0.3]]),
    )
    mean, std = flow.sde_step_mean_std(x, v, t, d, s)
    for i in range(2):
        ti, di, si = float(t[i]), float(d[i]), float(s[i])
        for j in range(3):
            xi, vi = float(x[i, j]), float(v[i, j])
            slow = (xi - vi * ti) * (1 - (ti - di)) + (xi + vi * (1 - ti)) * (
                ti - di - si * si * di / (2 * ti)
            )
            assert float(mean[i, j]) == pytest.approx(slow, rel=1e-5, abs=1e-6)
        assert float(std[i, 0]) == pytest.approx(si * math.sqrt(di), rel=1e-6)


def test_gaussian_log_prob_matches_loop_and_zero_std():
    gen = torch.Generator().manual_seed(2)
    x, mu = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    std = torch.rand(4, 3, generator=gen) + 0.1
    std[0, 0] = 0.0
    lp = flow.gaussian_log_prob(x, mu, std)
    for i in range(4):
        for j in range(3):
            s = float(std[i, j])
            slow = (
                0.0
                if s == 0
                else -math.log(s)
                - 0.5 * math.log(2 * math.pi)
                - 0.5 * ((float(x[i, j]) - float(mu[i, j])) / s) ** 2
            )
            assert float(lp[i, j]) == pytest.approx(slow, rel=1e-5, abs=1e-6)
    assert float(
        flow.gaussian_log_prob(torch.tensor(0.0), torch.tensor(0.0), torch.tensor(1.0))
    ) == pytest.approx(-0.9189385)


def test_interpolate_convention():
    noise, actions, t = torch.ones(2, 1, 1), torch.zeros(2, 1, 1), torch.tensor([1.0, 0.25])
    x_t, u = flow.interpolate(noise, actions, t)
    assert x_t.flatten().tolist() == [1.0, 0.25]
    assert u.flatten().tolist() == [1.0, 1.0]


def test_sincos_time_embedding_matches_loop():
    t = torch.tensor([1.0, 0.3], dtype=torch.float32)
    dim, lo, hi = 8, 4e-3, 4.0
    emb = flow.sincos_time_embedding(t, dim, lo, hi)
    assert emb.shape == (2, 8) and emb.dtype == torch.float32
    for b in range(2):
        for i in range(dim // 2):
            period = lo * (hi / lo) ** (i / (dim // 2 - 1))
            angle = float(t[b]) * 2 * math.pi / period
            assert float(emb[b, i]) == pytest.approx(math.sin(angle), abs=1e-6)
            assert float(emb[b, dim // 2 + i]) == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="even"):
        flow.sincos_time_embedding(t, 7, lo, hi)
