"""Review 38, the fast path's CPU-checkable logic: config values that were accepted and then misbehaved, and
bucket errors that did not name the config key to change."""

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast import call_inputs
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.policy import build_policy
from tests.policies.test_fast_sampler import random_inputs


@pytest.mark.parametrize("name", ["enabled", "cuda_graphs", "consistent_recompute"])
@pytest.mark.parametrize("value", ["false", "no", 0, 1, None])
def test_flags_must_be_booleans(name, value):
    """A quoted "false" is truthy: policy.fast.enabled="false" used to turn the fast path on."""
    with pytest.raises(ValueError, match=f"policy.fast.{name} must be true or false, got {value!r}"):
        PolicyConfig.preset("tiny", fast={name: value})


def test_a_quoted_false_keeps_the_fast_path_off():
    with pytest.raises(ValueError, match="policy.fast.enabled"):
        build_policy(PolicyConfig.preset("tiny", fast={"enabled": "false"}))


@pytest.mark.parametrize("name,value", [("batch_buckets", 4), ("prompt_buckets", None), ("fp8_gemms", None),
                                        ("fp8_gemms", "prefix_down"), ("batch_buckets", "1,2")])
def test_list_settings_given_a_bare_value_name_the_key(name, value):
    """They failed unnamed ("policy.fast: 'int' object is not iterable") or were iterated character by character."""
    with pytest.raises(ValueError, match=f"policy.fast.{name} must be a list, got {value!r}"):
        PolicyConfig.preset("tiny", fast={name: value})


@pytest.mark.parametrize("fast", [{"batch_buckets": [True]}, {"prompt_buckets": [False, 32]},
                                  {"compile_workers": True}])
def test_booleans_are_not_counts(fast):
    (name,) = fast
    with pytest.raises(ValueError, match=f"policy.fast.{name}"):
        FastConfig(**fast)


def test_lists_and_tuples_still_pass():
    cfg = FastConfig(batch_buckets=(1, 2), prompt_buckets=[8], fp8_gemms=("prefix_down",), compile_workers=0)
    assert cfg.pins_one_bucket is False and list(cfg.fp8_gemms) == ["prefix_down"]


def test_a_prompt_longer_than_every_bucket_names_the_setting():
    cfg = PolicyConfig.preset("tiny")
    fast = FastSampler(build_policy(cfg).model, FastConfig(dtype="float32", batch_buckets=[2], prompt_buckets=[16],
                                                           attention="sdpa"))
    inputs, noise, step_noise = random_inputs(cfg, 2, 20, seed=3)
    inputs.token_mask[:] = True
    stochastic = torch.zeros(2, cfg.sampling.num_steps, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"prompt length 20 exceeds .* \(policy.fast.prompt_buckets=\[16\]\)"):
        fast.sample_chains(inputs, noise, step_noise, stochastic)


def test_pick_names_the_key_it_is_given():
    with pytest.raises(ValueError, match=r"bucket 4 \(policy.fast.batch_buckets=\[1, 2, 4\]\)"):
        call_inputs.pick([1, 2, 4], 5, "batch size", "policy.fast.batch_buckets")
