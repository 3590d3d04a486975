"""A batch of no rows is refused at the sampling entry points by a ValueError naming the batch size, as
make_batch refuses N = 0. It failed deep inside instead: an IndexError choosing the SDE step (train/sde),
a reshape of 0 elements in the prefix (ode/sde_all), the fast path's bucket padding, a min() of nothing
in log_prob. CPU, the tiny policy."""

from __future__ import annotations

import pytest
import torch

from policies import PolicyConfig, build_policy
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.observation import ModelInputs
from tests.policies.conftest import raw_obs

EMPTY = r"needs a batch of at least one row, got batch size 0"
FAST = {"enabled": True, "dtype": "float32", "cuda_graphs": False, "attention": "sdpa", "batch_buckets": [4],
        "prompt_buckets": [16]}


def empty_inputs(cfg) -> ModelInputs:
    cams, res = len(cfg.cameras), cfg.vision.image_size
    return ModelInputs(torch.zeros(0, cams, 3, res, res), torch.ones(0, cams, dtype=torch.bool),
                       torch.zeros(0, 13, dtype=torch.long), torch.ones(0, 13, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["train", "sde", "sde_all", "ode"])
@pytest.mark.parametrize("path", ["plain", "reference", "observation"])
def test_sample_refuses_an_empty_batch_by_its_size(tiny_policy, mode, path):
    policy = tiny_policy
    batch = policy.make_batch(raw_obs(2)).select(slice(0, 0)) if path == "observation" else empty_inputs(policy.cfg)
    with pytest.raises(ValueError, match=r"Policy\.sample " + EMPTY):
        policy.sample(batch, mode=mode, reference_path=path == "reference")


@pytest.mark.parametrize("mode", ["sde", "ode"])
def test_the_fast_path_refuses_an_empty_batch_by_its_size(mode):
    fast = build_policy(PolicyConfig.preset("tiny", fast=FAST))
    with pytest.raises(ValueError, match=r"Policy\.sample " + EMPTY):
        fast.sample(empty_inputs(fast.cfg), mode=mode)
    cfg, k = fast.cfg, fast.cfg.sampling.num_steps
    sampler = FastSampler(fast.model, FastConfig(**{n: v for n, v in FAST.items() if n != "enabled"}))
    with pytest.raises(ValueError, match=r"FastSampler\.sample_chains " + EMPTY):
        sampler.sample_chains(empty_inputs(cfg), torch.zeros(0, cfg.chunk_size, cfg.max_action_dim), None,
                              torch.zeros(0, k, dtype=torch.bool))


def test_log_prob_refuses_an_empty_batch_by_its_size(tiny_policy):
    cfg, k = tiny_policy.cfg, tiny_policy.cfg.sampling.num_steps
    with pytest.raises(ValueError, match=r"Policy\.log_prob " + EMPTY):
        tiny_policy.log_prob(empty_inputs(cfg), torch.zeros(0, k + 1, cfg.chunk_size, cfg.max_action_dim),
                             torch.zeros(0, k, dtype=torch.long), mode="sde")


def test_make_batch_still_refuses_zero_rows_and_one_row_samples(tiny_policy):
    with pytest.raises(ValueError, match=r"N >= 1, got \(0, 8\)"):
        tiny_policy.make_batch(raw_obs(0))
    cfg = tiny_policy.cfg
    out = tiny_policy.sample(tiny_policy.make_batch(raw_obs(1)), mode="sde", generator=torch.Generator().manual_seed(0))
    assert out.chains.shape[0] == 1 and out.actions.shape == (1, cfg.chunk_size, cfg.action_dim)
