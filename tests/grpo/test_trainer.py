"""The GRPO loop on the countdown env (no MuJoCo) with the tiny policy: exact resume, weight
sync, artifacts. The same loop runs LIBERO in tests/experiments/test_grpo_smoke.py."""

from __future__ import annotations

import json

import pytest
import torch

from grpo import checkpoint
from grpo.run_config import ExperimentConfig
from grpo.trainer import Trainer


def countdown_config(run_dir, steps=3, **sections) -> ExperimentConfig:
    cfg = {
        "env": {"env_type": "countdown", "num_envs": 4, "group_size": 2, "num_workers": 2, "image_size": 16,
                "chunk_size": 4, "max_episode_steps": 8, "show_progress": False},
        "policy": {"preset": "tiny", "sampling": {"logprob_chunk": 4}},
        "rollout": {"engine": {"backend": "inproc", "devices": "cpu"}, "collector": {"stages": 2, "in_process": True}},
        "grpo": {"steps": steps, "filter_groups": False, "lr": 3e-3, "micro_batch": 4, "update_epochs": 2},
        "profiler": {"enabled": False},
        "logger": {"mode": "disabled"},
        "run": {"dir": str(run_dir), "show_progress": False, "checkpoint_every": 1, "keep_checkpoints": 5},
        "eval": {"every": 0},
    }
    for key, values in sections.items():
        cfg[key] = {**cfg.get(key, {}), **values}
    return ExperimentConfig.from_hydra(cfg)


def run(cfg: ExperimentConfig, run_dir):
    trainer = Trainer(cfg, run_dir)
    try:
        history = trainer.run()
    except BaseException:
        trainer.abort()
        raise
    trainer.finish()
    return history


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("step_time/")}


def test_resume_reproduces_the_next_step_bit_for_bit(tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = run(countdown_config(full_dir), full_dir)
    ckpt = full_dir / "checkpoints" / "step_000002.pt"
    resumed = run(countdown_config(resumed_dir, run={"resume": str(ckpt)}), resumed_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3]  # history carried over, then step 3 run again
    assert comparable(resumed[2]) == comparable(full[2])
    assert full[2]["train/rows"] > 0
    a = checkpoint.load(full_dir / "checkpoints" / "step_000003.pt")
    b = checkpoint.load(resumed_dir / "checkpoints" / "step_000003.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert torch.equal(a["rng"]["engine"], b["rng"]["engine"])
    assert a["data"] == b["data"]
    resumed_lines = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed_lines] == [1, 2, 3]


def test_weight_sync_every_step_versions_and_values(tmp_path):
    trainer = Trainer(countdown_config(tmp_path, steps=2), tmp_path)
    try:
        metrics = trainer.train_step(1)
        assert trainer.engine.version == 1 and metrics["rollout/stale_rows"] == 0
        trainer.state.step = 2
        trainer.train_step(2)
        assert trainer.engine.version == 2
        # after step 2's update the trainer is ahead of the engine until the next sync
        trainer.engine.update_weights({n: p.detach() for n, p in trainer.policy.model.named_parameters()}, version=3)
        engine_state = trainer.engine.state_dict()
        for name, p in trainer.policy.model.named_parameters():
            assert torch.equal(engine_state[name], p.detach()), name
    finally:
        trainer.close()


def test_bad_resume_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Trainer(countdown_config(tmp_path, run={"resume": str(tmp_path / "nowhere")}), tmp_path)


def test_checkpoints_are_checked_before_the_run_directory(tmp_path):
    """A missing checkpoint, or a resume with no step left, stops before anything is written."""
    from grpo.runs import check_checkpoints

    with pytest.raises(FileNotFoundError, match="nowhere"):
        check_checkpoints(countdown_config(tmp_path, run={"resume": str(tmp_path / "nowhere")}))
    evaluation = countdown_config(tmp_path, eval={"checkpoint": str(tmp_path / "nowhere")})
    evaluation.mode = "eval"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        check_checkpoints(evaluation)
    full_dir = tmp_path / "full"
    run(countdown_config(full_dir, steps=2), full_dir)
    with pytest.raises(ValueError, match=r"run.resume: .*step_000002.pt is step 2 and grpo.steps is 2: nothing"):
        check_checkpoints(countdown_config(tmp_path, steps=2, run={"resume": str(full_dir)}))
    check_checkpoints(countdown_config(tmp_path, steps=3, run={"resume": str(full_dir)}))  # a step left
    renamed = tmp_path / "last.pt"  # a name that does not say its step: the trainer refuses after loading
    renamed.write_bytes((full_dir / "checkpoints" / "step_000002.pt").read_bytes())
    with pytest.raises(ValueError, match="is step 2 and grpo.steps is 2: nothing is left to train"):
        Trainer(countdown_config(tmp_path / "again", steps=2, run={"resume": str(renamed)}), tmp_path / "again")
