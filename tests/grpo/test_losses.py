"""GRPO loss terms against hand-computed values and a slow Python reference loop."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.losses import (
    clipped_surrogate,
    gaussian_entropy,
    grpo_loss,
    kl_penalty,
    normalise,
    ratio_outside,
    row_weights,
    truncated_is_weight,
)

LOG = math.log


def test_clipping_at_both_ends_hand_computed():
    # rows: (A, ratio) -> expected loss, clipped branch active
    cases = [
        (1.0, 1.5, -1.2, True),  # upper clip binds for A > 0
        (1.0, 0.5, -0.5, False),  # ratio below the band, A > 0: unclipped is the max
        (-1.0, 0.5, 0.8, True),  # lower clip binds for A < 0
        (-1.0, 1.5, 1.5, False),  # above the band, A < 0: unclipped (dual bound 3 not reached)
        (-1.0, 5.0, 3.0, True),  # dual clip: min(5, 3)
        (2.0, 1.0, -2.0, False),
    ]
    adv = torch.tensor([c[0] for c in cases])
    log_ratio = torch.tensor([LOG(c[1]) for c in cases])
    loss, active = clipped_surrogate(log_ratio, adv, 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([c[2] for c in cases]))
    assert active.tolist() == [c[3] for c in cases]
    no_dual, _ = clipped_surrogate(log_ratio, adv, 0.2, 0.2, dual_clip=None)
    assert no_dual[4].item() == pytest.approx(5.0)


def test_separate_low_and_high_clip():
    adv = torch.tensor([1.0, -1.0])
    log_ratio = torch.tensor([LOG(1.5), LOG(0.5)])
    loss, _ = clipped_surrogate(log_ratio, adv, clip_low=0.1, clip_high=0.3)
    torch.testing.assert_close(loss, torch.tensor([-1.3, 0.9]))
    outside = ratio_outside(torch.tensor([LOG(0.85), LOG(0.95), LOG(1.25), LOG(1.35)]), 0.1, 0.3)
    assert outside.tolist() == [True, False, False, True]


def test_clipped_rows_have_no_gradient():
    logp = torch.tensor([LOG(1.5), LOG(1.1), LOG(0.5)], requires_grad=True)
    loss, _ = clipped_surrogate(logp, torch.tensor([1.0, 1.0, -1.0]), 0.2, 0.2)
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.1, 0.0]))


def test_truncated_is_weight_and_kl_estimators():
    w = truncated_is_weight(torch.tensor([0.0, 1.0, -1.0]), torch.tensor([0.0, 0.0, 0.0]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0, math.exp(-1.0)]))
    d = torch.tensor([0.5])
    assert kl_penalty(d, torch.zeros(1), "k1").item() == pytest.approx(0.5)
    assert kl_penalty(d, torch.zeros(1), "k2").item() == pytest.approx(0.125)
    assert kl_penalty(d, torch.zeros(1), "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(d, d, "k4")


def test_row_weights_token_and_trajectory_mean():
    lengths = torch.tensor([2, 2, 4, 4, 4, 4])
    torch.testing.assert_close(normalise(row_weights(lengths, "token_mean")), torch.full((6,), 1 / 6))
    # every trajectory counts once: 2 trajectories, each row 1 / (2 * its length)
    torch.testing.assert_close(normalise(row_weights(lengths, "trajectory_mean")),
                               torch.tensor([0.25, 0.25, 0.125, 0.125, 0.125, 0.125]))
    assert gaussian_entropy(torch.tensor([1.0]), 2).item() == pytest.approx(math.log(2 * math.pi * math.e))


def reference_loss(logp, old, adv, weights, lo, hi, dual, isw, ref, kl_coef):
    total = 0.0
    for i in range(len(logp)):
        r = math.exp(logp[i] - old[i])
        s = max(-adv[i] * r, -adv[i] * min(max(r, 1 - lo), 1 + hi))
        if dual is not None and adv[i] < 0:
            s = min(s, -adv[i] * dual)
        row = s * isw[i]
        d = logp[i] - ref[i]
        row += kl_coef * (math.exp(-d) + d - 1)
        total += weights[i] * row
    return total


@pytest.mark.parametrize("seed", range(6))
def test_grpo_loss_matches_slow_reference(seed):
    g = torch.Generator().manual_seed(seed)
    b = 17
    logp = torch.randn(b, generator=g, dtype=torch.float64) * 0.3
    old = logp + torch.randn(b, generator=g, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(b, generator=g, dtype=torch.float64) * 0.2
    ref = logp + torch.randn(b, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    ent = torch.randn(b, generator=g, dtype=torch.float64)
    weights = normalise(torch.rand(b, generator=g, dtype=torch.float64))
    isw = truncated_is_weight(old, rollout, 2.0)
    dual = 3.0 if seed % 2 else None
    terms = grpo_loss(logp, old, adv, weights, 0.2, 0.28, dual, is_weight=isw, ref_logprob=ref, kl_coef=0.1,
                      entropy=ent)
    expected = reference_loss(logp.tolist(), old.tolist(), adv.tolist(), weights.tolist(), 0.2, 0.28, dual,
                              isw.tolist(), ref.tolist(), 0.1)
    assert terms.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)  # the entropy is not in it
    assert terms.entropy.item() == pytest.approx(float((weights * ent).sum()), rel=1e-12)  # only reported


def test_ratio_is_one_at_the_first_update_whatever_the_rollout_gap():
    old = torch.tensor([-3.0, 2.0, 0.5])
    rollout = old + torch.tensor([0.4, -0.4, 0.0])  # large rollout/trainer gap
    terms = grpo_loss(old.clone().requires_grad_(), old, torch.tensor([1.0, -1.0, 1.0]), normalise(torch.ones(3)),
                      0.2, 0.2, 3.0, is_weight=truncated_is_weight(old, rollout, 2.0))
    assert not terms.clip_active.any() and not terms.ratio_outside.any()
    assert terms.approx_kl.item() == 0.0
