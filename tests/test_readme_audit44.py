"""Fixes found by auditing the README's CPU commands (round 44; each test fails on the code before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config_name", ["bench_worldmodel", "bench_predict"])
def test_bench_hydra_output_stays_out_of_the_working_directory(config_name, tmp_path, monkeypatch):
    """`python -m experiments.bench_worldmodel` (README "World-model simulation", on CPU with the tiny
    preset) left an empty `runs/bench_worldmodel/<time>/` (Hydra's `.hydra/` and an empty log) in the
    directory it was started from, beside the result JSONs experiments/results.py writes to the repository's
    `runs/bench_worldmodel/`, one per run; `bench_predict` (and `warm_lerobot_compile`, the same config) did
    the same. Every other entry point's config keeps Hydra's run directory under $TMPDIR and writes no
    `.hydra/`."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=config_name, return_hydra_config=True)
    hydra_cfg = cfg.hydra
    assert hydra_cfg.output_subdir is None
    assert hydra_cfg.job.chdir is False
    run_dir = str(hydra_cfg.run.dir)
    assert run_dir.startswith(str(tmp_path)), run_dir


# A run of a few seconds: the countdown env in this process, no wandb, no profiler (as tests/experiments/
# test_review38_entrypoints.py)
COUNTDOWN = ["env=countdown", "env.task_ids=[0]", "env.group_size=2", "env.image_size=16", "env.chunk_size=4",
             "env.max_episode_steps=8", "env.num_workers=1", "rollout.collector.stages=1",
             "rollout.collector.in_process=true", "eval.every=0", "run.show_progress=false", "logger=none",
             "profiler.enabled=false"]


def _composed(*overrides: str):
    import experiments.grpo  # noqa: F401  (registers the env and grpo schemas)

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("grpo_main", overrides=list(overrides))


@pytest.fixture()
def trained_run(tmp_path):
    import experiments.grpo

    train_dir = tmp_path / "train"
    experiments.grpo.run(_composed(*COUNTDOWN, "grpo.steps=1", f"run.dir={train_dir}"))
    assert (train_dir / "checkpoints" / "step_000001.pt").is_file()
    return train_dir


def test_a_resume_on_other_tasks_than_the_run_is_refused_before_the_run_dir(tmp_path, capsys, trained_run):
    """README: `python -m experiments.grpo run.resume=runs/grpo/RUN  # continue bit for bit from its newest
    checkpoint`. The command line composes the config again, so a `+experiment=reach_tiny` run resumed as the
    README writes it (`run.resume=RUN grpo.steps=16`) went on training the reach weights on the `smoke` env,
    libero_10 task 2, with nothing but a warning about grpo.lr (experiments/grpo.py:run checked only that the
    checkpoint is readable and has steps left)."""
    import experiments.grpo

    run_dir = tmp_path / "resumed"
    with pytest.raises(SystemExit) as info:
        experiments.grpo.run(_composed(*COUNTDOWN, "env.task_ids=[1]", "grpo.steps=2",
                                       f"run.resume={trained_run}", f"run.dir={run_dir}"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error: run.resume" in err and str(trained_run) in err
    assert "tasks ['countdown/0'] -> ['countdown/1']" in err and "+experiment=" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides, change", [
    # another model: the preset names it (`name` is filled in from it later)
    (["policy=pi05_small"], "policy.preset 'tiny' -> 'pi05_small'"),
    # task_ids null trains group g on task g mod N: more groups train more tasks, whatever task_ids says
    (["env.task_ids=null", "env.num_envs=4"], "tasks ['countdown/0'] -> ['countdown/0', 'countdown/1']"),
])
def test_a_resume_with_another_model_or_more_tasks_is_refused(tmp_path, capsys, trained_run, overrides, change):
    import experiments.grpo

    with pytest.raises(SystemExit):
        experiments.grpo.run(_composed(*COUNTDOWN, *overrides, "grpo.steps=2", f"run.resume={trained_run}",
                                       f"run.dir={tmp_path / 'resumed'}"))
    err = capsys.readouterr().err
    assert "config error: run.resume" in err and change in err


def test_a_resume_spelling_the_same_tasks_otherwise_goes_on(tmp_path, capsys, trained_run):
    """task_ids [0] (one for all) and [0, 0] (one per group) run the same task: not refused."""
    import experiments.grpo

    run_dir = tmp_path / "resumed"
    experiments.grpo.run(_composed(*COUNTDOWN, "env.task_ids=[0,0]", "grpo.steps=2", f"run.resume={trained_run}",
                                   f"run.dir={run_dir}"))
    assert "env.task_ids [0] -> [0, 0]" in capsys.readouterr().err  # named in the warning
    assert (run_dir / "checkpoints" / "step_000002.pt").is_file()


def test_a_resume_with_another_setting_warns_and_goes_on(tmp_path, capsys, trained_run):
    """Settings other than the run's tasks and model may change deliberately on a resume (as grpo.lr may):
    named in a warning, not refused."""
    import experiments.grpo

    run_dir = tmp_path / "resumed"
    experiments.grpo.run(_composed(*COUNTDOWN, "env.max_episode_steps=12", "grpo.steps=2",
                                   f"run.resume={trained_run}", f"run.dir={run_dir}"))
    err = capsys.readouterr().err
    assert "warning: run.resume" in err and "env.max_episode_steps 8 -> 12" in err
    assert (run_dir / "checkpoints" / "step_000002.pt").is_file()


def test_a_resume_with_the_run_settings_goes_on(tmp_path, capsys, trained_run):
    import experiments.grpo

    run_dir = tmp_path / "resumed"
    # env.num_workers says where the envs run, not what they compute: it may change on resume, unmentioned
    experiments.grpo.run(_composed(*COUNTDOWN, "env.num_workers=2", "grpo.steps=2", f"run.resume={trained_run}",
                                   f"run.dir={run_dir}"))
    assert "warning: run.resume" not in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "step_000002.pt").is_file()


def test_an_evaluation_with_another_env_than_the_run_warns_and_runs(tmp_path, capsys, trained_run):
    import experiments.grpo

    run_dir = tmp_path / "eval"
    experiments.grpo.run(_composed(*COUNTDOWN, "env.max_episode_steps=12", "eval.videos=0",
                                   f"eval.checkpoint={trained_run}", f"run.dir={run_dir}"), force_mode="eval")
    err = capsys.readouterr().err
    assert "warning: eval.checkpoint" in err and "env.max_episode_steps 8 -> 12" in err
    assert (run_dir / "eval.json").is_file()
