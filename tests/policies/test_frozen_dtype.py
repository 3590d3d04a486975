"""policy.frozen_dtype: the weights policy.train_expert_only freezes, in another dtype than the trained ones
(opt-in; GRPO's trainer keeps fp32 masters of what it trains and takes the key as set)."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy
from policies.models.gemma import RMSNorm
from tests.grpo.helpers import sampled_rows, tiny_policy


def test_bad_values_are_refused_by_key():
    with pytest.raises(ValueError, match="policy.frozen_dtype"):
        PolicyConfig.preset("tiny", frozen_dtype="float16")
    with pytest.raises(ValueError, match="policy.frozen_dtype='bfloat16' needs policy.train_expert_only=true"):
        PolicyConfig.preset("tiny", frozen_dtype="bfloat16", train_expert_only=False)


def test_the_frozen_weights_are_cast_and_the_trained_ones_stay_fp32():
    model = build_policy(PolicyConfig.preset("tiny", frozen_dtype="bfloat16")).model
    trained = {id(p) for p in model.trainable_parameters(True)}
    frozen = {id(p) for m in model.frozen_modules() for p in m.parameters()}
    assert not trained & frozen and trained | frozen == {id(p) for p in model.parameters()}
    norms = {id(p) for m in model.prefix.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    assert norms and norms <= frozen
    for p in model.parameters():
        expected = torch.float32 if id(p) in trained | norms else torch.bfloat16
        assert p.dtype == expected


def test_the_trainer_keeps_policy_frozen_dtype_and_fp32_masters():
    cfg = trainer_policy_config(PolicyConfig.preset("tiny", dtype="bfloat16", frozen_dtype="bfloat16"))
    assert (cfg.dtype, cfg.frozen_dtype) == ("float32", "bfloat16")
    assert trainer_policy_config(PolicyConfig.preset("tiny", dtype="bfloat16")).frozen_dtype is None  # opt-in


def test_log_probs_with_bf16_frozen_weights_train_the_expert():
    fp32 = tiny_policy()
    rows = sampled_rows(fp32, 4)
    policy = build_policy(fp32.cfg.replace(frozen_dtype="bfloat16"))
    policy.model.load_state_dict(fp32.model.state_dict())
    actor = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-2, global_batch=None))
    before = [p.detach().clone() for p in policy.model.parameters()]
    old = actor.recompute(rows)
    # the same transitions, the frozen weights rounded to bf16: close to the fp32 log-probs, not equal
    reference = Actor(fp32, GRPOConfig(micro_batch=4)).recompute(rows)
    assert not torch.equal(old, reference)
    torch.testing.assert_close(old, reference, rtol=0, atol=0.05 * float(reference.abs().max()))
    actor.train(rows)
    trained = {id(p) for p in policy.model.trainable_parameters(True)}
    moved = [(id(p) in trained, not torch.equal(p, was)) for p, was in zip(policy.model.parameters(), before,
                                                                          strict=True)]
    assert any(m for t, m in moved if t) and not any(m for t, m in moved if not t)
