"""Review round 39 (c): policy config keys that were taken as given (a quoted boolean, a bare camera
string, a number for a path) are refused by key."""

from __future__ import annotations

import pytest

from policies import PolicyConfig


@pytest.mark.parametrize(("overrides", "key"), [
    ({"train_expert_only": "false"}, "policy.train_expert_only"),  # truthy: trained only the expert
    ({"sampling": {"exclude_last_step": "false"}}, "policy.sampling.exclude_last_step"),
    ({"inputs": {"resize_images": "false"}}, "policy.inputs.resize_images"),
    ({"checkpoint": 3}, "policy.checkpoint"),  # open(3) reads file descriptor 3
    ({"checkpoint": ""}, "policy.checkpoint"),
    ({"tokenizer_path": 0}, "policy.tokenizer_path"),
    ({"cameras": "base_0_rgb"}, "policy.cameras must be a list"),  # was ['b', 'a', 's', ...]
    ({"cameras": ["base_0_rgb", 1]}, "policy.cameras must be non-empty camera slot names"),
])
def test_a_mistyped_policy_key_is_refused_by_name(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        PolicyConfig.preset("tiny", **overrides)


def test_real_values_still_build(tmp_path):
    cfg = PolicyConfig.preset("tiny", train_expert_only=False, sampling={"exclude_last_step": True},
                              inputs={"resize_images": False}, tokenizer_path=None)
    assert cfg.train_expert_only is False and cfg.sampling.exclude_last_step and not cfg.inputs.resize_images
    assert PolicyConfig.preset("tiny", checkpoint=tmp_path / "m.safetensors").checkpoint == tmp_path / "m.safetensors"


@pytest.mark.parametrize(("overrides", "key"), [
    ({"sampling": {"noise_level": float("inf")}}, "policy.sampling.noise_level"),
    ({"init_scale": float("inf")}, "policy.init_scale"),
    ({"max_period": float("inf")}, "policy.max_period"),
])
def test_an_infinite_policy_scale_is_refused_by_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + " must be a positive finite number"):
        PolicyConfig.preset("tiny", **overrides)
