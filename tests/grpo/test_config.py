"""GRPOConfig / run / eval configs: bad values raise naming the full key and the value."""

from __future__ import annotations

import pytest

from grpo.config import GRPOConfig
from grpo.run_config import EvalConfig, RunConfig


@pytest.mark.parametrize("overrides,match", [
    ({"micro_batch": 0}, "grpo.micro_batch must be a positive integer, got 0"),
    ({"steps": 1.5}, "grpo.steps"),
    ({"clip_low": 1.0}, r"grpo.clip_low must be in \(0, 1\), got 1.0"),
    ({"clip_high": -0.1}, "grpo.clip_high"),
    ({"dual_clip": 0.5}, "grpo.dual_clip must be > 1"),
    ({"filter_low": 0.8, "filter_high": 0.2}, "grpo.filter_low"),
    ({"filter_high": 1.5}, "grpo.filter_high"),
    ({"loss_agg": "seq_mean"}, "grpo.loss_agg must be one of"),
    ({"kl_estimator": "k9"}, "grpo.kl_estimator"),
    ({"lr": 0}, "grpo.lr must be a positive number"),
    ({"betas": [0.9]}, "grpo.betas"),
    ({"global_batch": 100, "micro_batch": 64}, "grpo.global_batch"),
    ({"tis_cap": 0.5}, "grpo.tis_cap"),
    ({"autocast": "fp16"}, "grpo.autocast"),
    ({"tis": "yes"}, "grpo.tis must be true or false"),
])
def test_grpo_config_errors_name_key_and_value(overrides, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**overrides)


def test_grpo_from_mapping_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"grpo\.learning_rate"):
        GRPOConfig.from_mapping({"learning_rate": 1e-3})
    assert GRPOConfig.from_mapping({"lr": 1e-3}).lr == 1e-3


@pytest.mark.parametrize("cls,overrides,match", [
    (RunConfig, {"device": "tpu"}, "run.device"),
    (RunConfig, {"device": "cpu:1"}, "run.device"),
    (RunConfig, {"keep_checkpoints": 0}, "run.keep_checkpoints"),
    (RunConfig, {"dir": ""}, "run.dir"),
    (EvalConfig, {"init_states": 0}, "eval.init_states"),
    (EvalConfig, {"video_format": "avi"}, "eval.video_format"),
    (EvalConfig, {"tasks": [1, 1]}, "eval.tasks"),
])
def test_run_and_eval_config_errors(cls, overrides, match):
    with pytest.raises(ValueError, match=match):
        cls(**overrides)
