"""Regression tests for reviewed defects: evaluation sees the trained weights, a resumed run trains
with the configured optimiser settings, no entropy bonus that cannot act, and eval / actor
settings refused before the run directory exists. Countdown env + tiny policy, CPU, seconds."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo import checkpoint
from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.evaluate import Evaluator
from grpo.losses import gaussian_entropy
from grpo.trainer import Trainer
from policies import flow
from tests.grpo.helpers import sampled_rows, tiny_policy
from tests.grpo.test_trainer import comparable, countdown_config, run

NO_VIDEOS = {"init_states": 2, "videos": 0}


def trainer_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


# ----- evaluation after step s scores the weights after s updates -----
@pytest.mark.parametrize("steps,every,at_start,pushes", [
    # (version, full) of every push: eval after s pushes s + 1, which step s + 1 then does not push again
    (2, 1, True, [(1, True), (2, False), (3, False)]),
    (3, 2, False, [(1, True), (2, False), (3, False), (4, False)]),
])
def test_evaluation_after_step_s_sees_the_weights_after_s_updates(tmp_path, monkeypatch, steps, every, at_start,
                                                                  pushes):
    cfg = countdown_config(tmp_path, steps=steps, eval={"every": every, "at_start": at_start, **NO_VIDEOS})
    trainer = Trainer(cfg, tmp_path)
    seen, pushed = {}, []
    real_run, real_push = Evaluator.run, trainer.pusher.push

    def evaluate_and_record(evaluator, video_dir=None):
        engine = trainer.engine.state_dict()
        seen[len(seen)] = ({n: engine[n].clone() for n in trainer_weights(trainer)}, trainer_weights(trainer),
                           trainer.actor.updates)
        return real_run(evaluator, video_dir)

    def push_and_record(named, version, partial=False):
        pushed.append((version, not partial))
        return real_push(named, version, partial=partial)

    monkeypatch.setattr(Evaluator, "run", evaluate_and_record)
    monkeypatch.setattr(trainer.pusher, "push", push_and_record)
    try:
        history = trainer.run()
    finally:
        trainer.close()
    assert pushed == pushes
    assert all(r["rollout/stale_rows"] == 0 for r in history if r["kind"] == "train")
    evaluated_steps = [r["step"] for r in history if r["kind"] == "eval"]
    updates_per_step = trainer.actor.updates // steps
    for (engine, trained, updates), step in zip(seen.values(), evaluated_steps, strict=True):
        assert updates == step * updates_per_step
        for name, tensor in trained.items():
            assert torch.equal(engine[name], tensor), (step, name)
    final = checkpoint.load(tmp_path / "checkpoints" / f"step_{steps:06d}.pt")["model"]
    last_engine = seen[len(seen) - 1][0]
    assert all(torch.equal(final[name], last_engine[name]) for name in last_engine)
    first, second = seen[0][0], seen[1][0]
    assert any(not torch.equal(first[n], second[n]) for n in first)  # the evaluations saw different weights


def test_resume_with_evaluations_reproduces_train_and_eval_records(tmp_path):
    ev = {"every": 1, "sampling": "sde", **NO_VIDEOS}
    full = run(countdown_config(tmp_path / "full", eval=ev), tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002.pt"
    resumed = run(countdown_config(tmp_path / "res", eval=ev, run={"resume": str(ckpt)}), tmp_path / "res")
    assert [(r["kind"], r["step"]) for r in resumed] == [(r["kind"], r["step"]) for r in full]
    assert [comparable(r) for r in resumed] == [comparable(r) for r in full]
    a = checkpoint.load(tmp_path / "full" / "checkpoints" / "step_000003.pt")["model"]
    b = checkpoint.load(tmp_path / "res" / "checkpoints" / "step_000003.pt")["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)


# ----- a resumed run trains with the configured optimiser settings -----
def test_loaded_optimizer_state_keeps_the_configured_settings(caplog):
    trained = tiny_policy()
    before = Actor(trained, GRPOConfig(lr=1e-3, micro_batch=4), show_progress=False)
    before.train(sampled_rows(trained, 4))
    saved = before.optimizer.state_dict()
    policy = tiny_policy()
    policy.model.load_state_dict(trained.model.state_dict())
    cfg = GRPOConfig(lr=1e-5, betas=[0.8, 0.9], adam_eps=1e-6, weight_decay=0.0, micro_batch=4)
    actor = Actor(policy, cfg, show_progress=False)
    with caplog.at_level(logging.WARNING, logger="grpo.actor"):
        actor.optimizer.load_state_dict(saved)
    for key in ("grpo.lr 0.001 -> 1e-05", "grpo.betas (0.9, 0.95) -> (0.8, 0.9)", "grpo.adam_eps 1e-05 -> 1e-06",
                "grpo.weight_decay 0.01 -> 0.0"):
        assert key in caplog.text
    group = actor.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-5, (0.8, 0.9), 1e-6, 0.0)
    moments = next(iter(saved["state"].values()))["exp_avg"]
    assert torch.equal(next(iter(actor.optimizer.state_dict()["state"].values()))["exp_avg"], moments)
    assert actor.train(sampled_rows(policy, 4, seed=1))["train/lr"] == 1e-5


def test_resume_with_a_changed_lr_trains_and_logs_it(tmp_path, caplog):
    run(countdown_config(tmp_path / "a", steps=1), tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "step_000001.pt"
    cfg = countdown_config(tmp_path / "b", steps=2, grpo={"lr": 1e-3}, run={"resume": str(ckpt)})
    with caplog.at_level(logging.WARNING, logger="grpo.actor"):
        history = run(cfg, tmp_path / "b")
    assert "grpo.lr 0.003 -> 0.001" in caplog.text
    assert [r["train/lr"] for r in history] == [3e-3, 1e-3]


def test_resume_with_the_same_settings_warns_nothing(tmp_path, caplog):
    run(countdown_config(tmp_path / "a", steps=1), tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "step_000001.pt"
    with caplog.at_level(logging.WARNING, logger="grpo.actor"):
        run(countdown_config(tmp_path / "b", steps=2, run={"resume": str(ckpt)}), tmp_path / "b")
    assert "configured ones apply" not in caplog.text


# ----- no entropy bonus: the flow-SDE std is not learned -----
@pytest.mark.parametrize("coef", [0.01, 10.0])
def test_entropy_coef_is_refused_saying_why(coef):
    with pytest.raises(ValueError, match=r"grpo.entropy_coef must be 0, got .*std is not learned"):
        GRPOConfig(entropy_coef=coef)


def test_entropy_coef_override_stops_the_experiment_config(tmp_path):
    with pytest.raises(ValueError, match="grpo.entropy_coef"):
        countdown_config(tmp_path, grpo={"entropy_coef": 0.01})


def test_reported_entropy_is_the_sde_steps_gaussian_entropy():
    policy = tiny_policy()
    rows = sampled_rows(policy, 6)
    metrics = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-3), show_progress=False).train(rows)
    s = policy.cfg.sampling
    grid = flow.time_grid(s.num_steps)
    std = flow.sde_sigmas(grid, s.noise_level) * torch.sqrt(flow.step_deltas(grid))
    expected = gaussian_entropy(std[rows.denoise_inds[:, 0]], policy.cfg.logprob_chunk * policy.cfg.action_dim)
    assert metrics["train/entropy"] == pytest.approx(float(expected.mean()), rel=1e-5)


# ----- settings refused before the run directory exists -----
@pytest.mark.parametrize("eval_over,match", [
    ({"every": 2, "init_states": 10_000}, r"eval.init_states \(10000\) exceeds the 6 init states of countdown/0"),
    ({"every": 2, "tasks": [1, 999]}, r"eval.tasks has task 999, but countdown has 4 tasks \(0..3\)"),
    ({"at_start": True, "tasks": [7]}, r"eval.tasks has task 7"),
])
def test_eval_settings_are_checked_with_the_config(tmp_path, eval_over, match):
    with pytest.raises(ValueError, match=match):
        countdown_config(tmp_path, eval=eval_over)


def test_eval_settings_are_checked_in_eval_mode(tmp_path):
    from grpo.run_config import ExperimentConfig

    exp = countdown_config(tmp_path, eval={"every": 0, "init_states": 10_000})  # no evaluation: unused
    exp.mode = "eval"
    with pytest.raises(ValueError, match="eval.init_states"):
        ExperimentConfig.check_cross_group(exp)


@pytest.mark.parametrize("sections,match", [
    ({"run": {"checkpoint_every": 1}}, r"mode=fsdp2 .*run.checkpoint_every=1"),
    ({"run": {"checkpoint_every": 0, "resume": "somewhere"}}, r"mode=fsdp2 .*run.resume='somewhere'"),
])
def test_fsdp2_without_checkpoints_is_checked_with_the_config(tmp_path, sections, match):
    fsdp2 = {"actor_parallel": {"mode": "fsdp2", "world_size": 2}}
    with pytest.raises(ValueError, match=match):
        countdown_config(tmp_path, grpo=fsdp2, **sections)
    countdown_config(tmp_path, grpo=fsdp2, run={"checkpoint_every": 0})  # what it can run
    assert not any(tmp_path.iterdir())


def test_actor_group_with_an_explicit_broadcast_is_checked_with_the_config(tmp_path):
    with pytest.raises(ValueError, match="rollout.weights.transport=broadcast with grpo.actor_parallel.mode=ddp"):
        countdown_config(tmp_path, grpo={"actor_parallel": {"mode": "ddp", "world_size": 2}},
                         rollout={"engine": {"backend": "local", "devices": "cpu"},
                                  "weights": {"transport": "broadcast"},
                                  "collector": {"stages": 2, "in_process": True}})


# ----- policy.fast.consistent_recompute settings that cannot train: refused with the config -----
CONSISTENT = {"enabled": True, "consistent_recompute": True, "attention": "sdpa"}
PINNED = {**CONSISTENT, "batch_buckets": [2], "prompt_buckets": [200]}


@pytest.mark.parametrize("policy,match", [
    ({"fast": CONSISTENT}, r"one-entry policy.fast.batch_buckets and policy.fast.prompt_buckets .*"
                           r"got policy.fast.batch_buckets=\[1, 2, 4, 8, 16, 32, 64\] and policy.fast.prompt_buckets="),
    ({"fast": {**CONSISTENT, "batch_buckets": [2]}}, r"policy.fast.prompt_buckets=\[32, 48, 64, 128, 200\]"),
    ({"fast": PINNED, "train_expert_only": False}, r"needs policy.train_expert_only=true .*got "
                                                   r"policy.train_expert_only=false"),
    ({"fast": {**PINNED, "dtype": "float32"}, "dtype": "bfloat16"},
     r"policy.fast.dtype=float32 needs policy.dtype=float32 .*got policy.dtype='bfloat16'"),
])
def test_consistent_recompute_needs_are_checked_with_the_config(tmp_path, policy, match):
    with pytest.raises(ValueError, match=match):
        countdown_config(tmp_path, policy=policy)
    assert not any(tmp_path.iterdir())


def test_consistent_recompute_with_pinned_buckets_trains_without_a_gap(tmp_path):
    """What the check lets through trains: the trainer (fp32 masters) re-scores the engine's rollout exactly."""
    history = run(countdown_config(tmp_path, steps=1, policy={"fast": PINNED}, run={"checkpoint_every": 0}), tmp_path)
    assert history[0]["rollout/logprob_gap"] == 0.0


def test_consistent_recompute_needs_do_not_apply_to_evaluation(tmp_path):
    exp = countdown_config(tmp_path, policy={"fast": PINNED})
    exp.mode = "eval"
    exp.policy = exp.policy.replace(train_expert_only=False,
                                    fast={"batch_buckets": [1, 2], "prompt_buckets": [32, 200]})
    exp.check_cross_group()  # an evaluation never recomputes log-probs


@pytest.mark.slow
def test_actor_ranks_shard_by_the_collectors_group_size(tmp_path):
    """rollout.collector.group_size overrides env.group_size: the actor ranks must keep the
    collector's GRPO groups whole, not groups of env.group_size."""
    ddp = {"actor_parallel": {"mode": "ddp", "world_size": 2, "torch_threads": 1, "dist_timeout_s": 120,
                              "start_timeout_s": 120}}
    cfg = countdown_config(tmp_path, steps=1, env={"group_size": 1, "task_ids": [0, 0, 1, 1]},
                           rollout={"engine": {"backend": "inproc", "devices": "cpu"},
                                    "collector": {"stages": 2, "in_process": True, "group_size": 2}},
                           grpo=ddp)
    trainer = Trainer(cfg, tmp_path)
    try:
        assert trainer.collector.group_size == 2
        assert trainer.actor.group_size == 2
        assert "groups of 2" in trainer.describe()
    finally:
        trainer.abort()
