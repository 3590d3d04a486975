"""GRPO advantages against hand-computed values and a slow Python reference loop."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from grpo.advantages import chunk_mask, compute_advantages, group_advantages, group_stats

SQRT3 = math.sqrt(3.0)


def reference(success, chunk_valid, lost, g, eps, unbiased, filter_groups, low, high):
    """Slow loop: one group at a time, statistics module, Python floats."""
    n, t = len(success), len(chunk_valid[0])
    adv = [[0.0] * t for _ in range(n)]
    mask = [[False] * t for _ in range(n)]
    for start in range(0, n, g):
        members = [i for i in range(start, start + g) if not lost[i]]
        if not members:
            continue
        scores = [1.0 if success[i] else 0.0 for i in members]
        mean = sum(scores) / len(scores)
        if len(scores) > 1:
            std = statistics.stdev(scores) if unbiased else statistics.pstdev(scores)
        else:
            std = 0.0
        if filter_groups and not low <= mean <= high:
            continue
        for i, s in zip(members, scores):
            for c in range(t):
                if chunk_valid[i][c]:
                    mask[i][c] = True
                    adv[i][c] = (s - mean) / (std + eps)
    return np.array(adv, dtype=np.float64), np.array(mask)


def test_hand_computed_group_of_four():
    success = [True, False, False, True]
    adv = group_advantages(torch.tensor(success).float(), torch.ones(4, dtype=torch.bool), 4, eps=0.0)
    # mean 0.5, Bessel std sqrt(1/3): +-0.5 * sqrt(3)
    expected = torch.tensor([1, -1, -1, 1]) * 0.5 * SQRT3
    torch.testing.assert_close(adv, expected.float())
    biased = group_advantages(torch.tensor(success).float(), torch.ones(4, dtype=torch.bool), 4, eps=0.0,
                              unbiased=False)
    torch.testing.assert_close(biased, torch.tensor([1.0, -1, -1, 1]))  # population std 0.5


@pytest.mark.parametrize("value", [True, False])
def test_identical_rewards_give_zero_advantage(value):
    res = compute_advantages([value] * 4, np.ones((4, 3), bool), np.zeros(4, bool), 4)
    assert torch.equal(res.advantages, torch.zeros(4, 3))
    assert torch.equal(res.trajectory_advantages, torch.zeros(4))


def test_lost_env_neither_trains_nor_shifts_the_baseline():
    success = [True, False, True, False]
    lost = np.array([False, False, True, False])
    res = compute_advantages(success, np.ones((4, 2), bool), lost, 4, eps=0.0)
    # counting members [1, 0, 0]: mean 1/3, Bessel std sqrt(1/3)
    torch.testing.assert_close(res.trajectory_advantages,
                               torch.tensor([(2 / 3) * SQRT3, -(1 / 3) * SQRT3, 0.0, -(1 / 3) * SQRT3]))
    assert not res.mask[2].any() and res.mask[[0, 1, 3]].all()
    assert res.advantages[2].abs().sum() == 0


def test_group_filter_drops_groups_outside_bounds():
    success = [1, 1, 0, 0, 1, 0]  # group means 1.0, 0.0, 0.5 (G = 2)
    res = compute_advantages(np.array(success, bool), np.ones((6, 1), bool), np.zeros(6, bool), 2,
                             filter_groups=True, filter_low=0.1, filter_high=0.9)
    assert res.group_keep.tolist() == [False, False, True]
    assert res.mask[:, 0].tolist() == [False, False, False, False, True, True]
    unfiltered = compute_advantages(np.array(success, bool), np.ones((6, 1), bool), np.zeros(6, bool), 2)
    assert unfiltered.mask.all()


def test_masks_after_done_broadcast_to_chunks():
    valid = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
    res = compute_advantages([True, False], valid, np.zeros(2, bool), 2, eps=0.0)
    a = 1 / math.sqrt(0.5)  # mean 0.5, Bessel std sqrt(0.5)
    expected = torch.tensor([[0.5 * a, 0.5 * a, 0, 0], [-0.5 * a] * 4])
    torch.testing.assert_close(res.advantages, expected)
    assert torch.equal(res.mask, torch.from_numpy(valid))


def test_group_of_one_member_has_zero_std_and_zero_advantage():
    mean, std, count = group_stats(torch.tensor([1.0, 0.0]), torch.tensor([True, False]), 2)
    assert mean.item() == 1.0 and std.item() == 0.0 and count.item() == 1
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([True, False]), 2)
    assert torch.equal(adv, torch.zeros(2))


def test_bad_group_size_names_it():
    with pytest.raises(ValueError, match="group_size \\(3\\) must divide"):
        group_stats(torch.zeros(4), torch.ones(4, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="chunk_valid must be"):
        chunk_mask(np.ones(3, bool), np.zeros(3, bool))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("unbiased,filter_groups", [(True, False), (False, True), (True, True)])
def test_matches_slow_reference_on_random_rollouts(seed, unbiased, filter_groups):
    rng = np.random.default_rng(seed)
    g, groups, t = int(rng.integers(1, 6)), int(rng.integers(1, 7)), int(rng.integers(1, 9))
    n = g * groups
    success = rng.random(n) < rng.random()
    lengths = rng.integers(0, t + 1, n)
    valid = np.arange(t)[None] < lengths[:, None]
    lost = rng.random(n) < 0.15
    res = compute_advantages(success, valid, lost, g, eps=1e-6, unbiased=unbiased,
                             filter_groups=filter_groups, filter_low=0.1, filter_high=0.9)
    adv, mask = reference(success, valid, lost, g, 1e-6, unbiased, filter_groups, 0.1, 0.9)
    assert np.array_equal(res.mask.numpy(), mask)
    np.testing.assert_allclose(res.advantages.numpy(), adv, rtol=1e-5, atol=1e-6)
