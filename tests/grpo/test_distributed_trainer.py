"""The GRPO loop (countdown env, tiny policy) with grpo.actor_parallel: 2 gloo DDP ranks give the
single-process run's steps, and a DDP run resumes bit for bit (rank 0's checkpoint reaches rank 1)."""

from __future__ import annotations

import pytest
import torch

from grpo import checkpoint
from tests.grpo.test_trainer import comparable, countdown_config, run

DDP2 = {"actor_parallel": {"mode": "ddp", "world_size": 2, "torch_threads": 1, "dist_timeout_s": 120,
                           "start_timeout_s": 120}}


def close_metrics(a: dict, b: dict) -> None:
    assert set(a) == set(b) - {"train/actor_ranks"}
    for key, value in comparable(a).items():
        expected = value if isinstance(value, str) else pytest.approx(value, rel=1e-5, abs=1e-6)
        assert b[key] == expected, key


@pytest.mark.slow
def test_ddp_actor_steps_match_the_single_process_run(tmp_path):
    single = run(countdown_config(tmp_path / "one", steps=2, run={"checkpoint_every": 0}), tmp_path / "one")
    ddp = run(countdown_config(tmp_path / "ddp", steps=2, run={"checkpoint_every": 0}, grpo=DDP2), tmp_path / "ddp")
    assert [r["train/actor_ranks"] for r in ddp] == [2, 2]
    assert all(r["train/rows"] > 0 for r in single)
    for a, b in zip(single, ddp):
        close_metrics(a, b)


@pytest.mark.slow
def test_ddp_actor_resumes_bit_for_bit(tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = run(countdown_config(full_dir, grpo=DDP2), full_dir)
    ckpt = full_dir / "checkpoints" / "step_000002.pt"
    resumed = run(countdown_config(resumed_dir, run={"resume": str(ckpt)}, grpo=DDP2), resumed_dir)
    assert comparable(resumed[2]) == comparable(full[2])
    a = checkpoint.load(full_dir / "checkpoints" / "step_000003.pt")
    b = checkpoint.load(resumed_dir / "checkpoints" / "step_000003.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert torch.equal(a["rng"]["actor"], b["rng"]["actor"])
