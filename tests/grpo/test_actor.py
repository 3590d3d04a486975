"""The actor update on a real tiny policy: recompute, ratio 1 at the first update, micro-batching."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor, gap_metrics
from grpo.config import GRPOConfig
from grpo.observations import observation_from_rows
from tests.grpo.helpers import assert_same_update_to_rounding, raw_obs, sampled_rows, tiny_policy


def test_observation_from_rows_equals_the_policy_transform_and_keeps_tokens():
    policy = tiny_policy()
    raw = raw_obs(3, image_size=64)  # 64 px -> resized to the tiny policy's 56 px
    ref = policy.make_batch(raw)
    tokens = torch.randint(0, 300, ref.tokenized_prompt.shape)
    obs = observation_from_rows(policy.cfg, {k: torch.from_numpy(raw[k]) for k in ("agentview_image", "wrist_image")},
                                torch.from_numpy(raw["state"]), tokens, ref.tokenized_prompt_mask, "cpu")
    for slot in policy.cfg.cameras:
        assert torch.equal(obs.images[slot], ref.images[slot]), slot
        assert torch.equal(obs.image_masks[slot], ref.image_masks[slot])
    assert torch.equal(obs.tokenized_prompt, tokens)  # stored ids, never re-tokenised


def test_trainer_recompute_matches_rollout_and_ratio_is_one_at_first_update():
    policy = tiny_policy()
    rows = sampled_rows(policy, 6)
    actor = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-3))
    old = actor.recompute(rows)
    torch.testing.assert_close(old, rows.rollout_logprob, rtol=0, atol=1e-4)
    metrics = actor.train(rows)
    assert metrics["train/clip_frac_first_mb"] == 0.0
    assert metrics["rollout/logprob_gap"] < 1e-4
    assert metrics["train/optimizer_steps"] == 1


def test_gap_metrics_hand_computed():
    m = gap_metrics(torch.tensor([0.0, 1.0, -2.0, 0.1]), torch.tensor([0.0, 0.5, -2.0, 0.0]), 0.2, 0.2)
    assert m["rollout/logprob_gap"] == pytest.approx(0.15)
    assert m["rollout/logprob_gap_max"] == pytest.approx(0.5)
    assert m["rollout/logprob_gap_clip_frac"] == pytest.approx(0.25)  # exp(0.5) = 1.65 only


def test_only_trainable_parameters_change():
    policy = tiny_policy()
    rows = sampled_rows(policy, 4)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    Actor(policy, GRPOConfig(micro_batch=4, lr=1e-2)).train(rows)
    trainable = {id(p) for p in policy.trainable_parameters()}
    changed = {name for name, p in policy.model.named_parameters() if not torch.equal(p, before[name])}
    frozen = {name for name, p in policy.model.named_parameters() if id(p) not in trainable}
    assert changed and not (changed & frozen)
    assert any(name.startswith("expert") for name in changed)


@pytest.mark.parametrize("agg", ["token_mean", "trajectory_mean"])
def test_micro_batching_does_not_change_the_update(agg):
    lengths = torch.tensor([1, 3, 3, 3, 2, 2, 4, 4])
    results = []
    for micro in (8, 2, 3):
        policy = tiny_policy()
        rows = sampled_rows(policy, 8, lengths=lengths)
        Actor(policy, GRPOConfig(micro_batch=micro, lr=1e-2, loss_agg=agg)).train(rows)
        results.append([p.detach().clone() for p in policy.trainable_parameters()])
    for other in results[1:]:
        assert_same_update_to_rounding(other, results[0], lr=1e-2)


def test_update_raises_log_prob_of_positive_advantage_rows():
    policy = tiny_policy()
    adv = torch.tensor([1.0, -1.0] * 4)
    rows = sampled_rows(policy, 8, advantages=adv)
    actor = Actor(policy, GRPOConfig(micro_batch=8, lr=3e-3, update_epochs=2, global_batch=8))
    before = actor.recompute(rows)
    metrics = actor.train(rows)
    after = actor.recompute(rows)
    delta = after - before
    assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()
    assert metrics["train/optimizer_steps"] == 2 and metrics["train/approx_kl"] >= 0


def test_kl_to_reference_runs_and_entropy_is_reported():
    policy = tiny_policy()
    rows = sampled_rows(policy, 4)
    metrics = Actor(policy, GRPOConfig(micro_batch=2, lr=1e-3, kl_coef=0.1, update_epochs=2)).train(rows)
    assert metrics["train/kl_ref"] >= 0.0 and metrics["train/entropy"] != 0.0


def test_the_update_is_spanned_per_micro_batch_on_the_process_timeline(tmp_path):
    """actor_train/* spans: the old-log-prob pass once, per micro-batch its prefix gather, its forward/backward and,
    inside that, the host's issuing of it, per global batch the optimiser step."""
    from collections import Counter

    from profiler import Timeline, set_timeline

    policy = tiny_policy()
    rows = sampled_rows(policy, 6)
    actor = Actor(policy, GRPOConfig(micro_batch=2, update_epochs=2, global_batch=None, prefix_cache="device"),
                  show_progress=False)
    timeline = Timeline(tmp_path, keep_in_memory=True)
    previous = set_timeline(timeline)
    try:
        actor.train(rows)
    finally:
        set_timeline(previous)
    timeline.close()
    assert Counter(s[0] for s in timeline.spans) == {
        "actor_train/old_logprob": 1, "actor_train/prefix_gather": 6, "actor_train/micro_batch": 6,
        "actor_train/micro_batch_issue": 6, "actor_train/optimizer": 2}
    issues, micros = ([s for s in timeline.spans if s[0] == name]
                      for name in ("actor_train/micro_batch_issue", "actor_train/micro_batch"))
    for issue, micro in zip(issues, micros, strict=True):  # (name, start_ns, end_ns, ...): issuing lies inside
        assert micro[1] <= issue[1] <= issue[2] <= micro[2]
