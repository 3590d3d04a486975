"""Resume and evaluation: three defects found in review round 69, each failing before its fix. Countdown env + tiny
policy, CPU.

1. The evaluator's env reset counter (episode seeds derive from it) was not part of the data position: the evaluation
   after step s of a resumed run ran other episode seeds than the uninterrupted run's (countdown puts seed % 1000 in
   the observed state; the world-model env draws its generation noise from it). Now every evaluation runs the same
   episodes.
2. The evaluation drew its noise from the engine's training generator, so resuming a finished run past its last
   step (README: `run.resume=RUN grpo.steps=N`), whose final evaluation had consumed draws a longer run never made,
   did not continue bit for bit. Now the evaluation has its own noise and leaves the training stream untouched.
3. A resume with another run.seed (which seeds every later step's init-state draws and episode seeds) was accepted
   without a word, while an env / policy change is named in a warning.
"""

from __future__ import annotations

import torch

import experiments.grpo
from grpo import checkpoint
from grpo.evaluate import Evaluator
from grpo.run_config import ExperimentConfig
from grpo.trainer import Trainer
from tests.experiments.test_review38_entrypoints import COUNTDOWN, composed
from tests.grpo.test_trainer import comparable, countdown_config, run

REAL_EVALUATOR_RUN = Evaluator.run
SDE_EVAL = {"init_states": 2, "videos": 0, "sampling": "sde"}


def eval_episode_seeds(cfg, run_dir, monkeypatch) -> list:
    """The episode seeds of every evaluation's (last) reset."""
    seen = []

    def record(evaluator, video_dir=None):
        result = REAL_EVALUATOR_RUN(evaluator, video_dir)
        seen.append([int(s) for stage in evaluator.collector.stages for s in stage.vec.episode_seeds])
        return result

    monkeypatch.setattr(Evaluator, "run", record)
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.run()
    finally:
        trainer.close()
    return seen


def test_evaluation_after_a_resume_runs_the_uninterrupted_runs_episodes(tmp_path, monkeypatch):
    full = eval_episode_seeds(countdown_config(tmp_path / "full", eval={"every": 1, **SDE_EVAL}), tmp_path / "full",
                              monkeypatch)
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002.pt"
    resumed = eval_episode_seeds(countdown_config(tmp_path / "res", eval={"every": 1, **SDE_EVAL},
                                                  run={"resume": str(ckpt)}), tmp_path / "res", monkeypatch)
    assert len(full) == 3 and len(resumed) == 1
    assert resumed[-1] == full[-1]  # the evaluation after step 3, in both runs


def test_resuming_a_finished_run_past_its_last_step_is_bit_for_bit(tmp_path):
    ev = {"every": 5, **SDE_EVAL}  # evaluates after the last step only
    full = run(countdown_config(tmp_path / "full", steps=3, eval=ev), tmp_path / "full")
    run(countdown_config(tmp_path / "short", steps=2, eval=ev), tmp_path / "short")
    resumed = run(countdown_config(tmp_path / "res", steps=3, eval=ev, run={"resume": str(tmp_path / "short")}),
                  tmp_path / "res")
    step3 = [[comparable(r) for r in h if r["kind"] == "train" and r["step"] == 3] for h in (full, resumed)]
    assert step3[0] == step3[1]
    a = checkpoint.load(tmp_path / "full" / "checkpoints" / "step_000003.pt")["model"]
    b = checkpoint.load(tmp_path / "res" / "checkpoints" / "step_000003.pt")["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_resume_with_another_run_seed_is_named(tmp_path, capsys):
    experiments.grpo.run(composed(*COUNTDOWN, "grpo.steps=1", "grpo.micro_batch=4", "run.seed=3",
                                  f"run.dir={tmp_path / 'a'}"))
    capsys.readouterr()
    exp = ExperimentConfig.from_hydra(composed(*COUNTDOWN, "grpo.steps=2", f"run.resume={tmp_path / 'a'}",
                                               f"run.dir={tmp_path / 'b'}"))  # run.seed=3 forgotten
    experiments.grpo.check_checkpoint_run_config(exp)
    assert "run.seed 3 -> 0" in capsys.readouterr().err
