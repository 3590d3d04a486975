"""experiments.grpo / experiments.evaluate and their configs (review round 38): every option of every group
composes and validates; evaluate validates and records mode=eval; checkpoints that are not ours are refused
before the run directory exists; eval.tasks, run.device, paths and non-finite GRPO numbers name the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

import experiments.grpo  # noqa: F401  (registers the env and grpo schemas)
from grpo.config import GRPOConfig
from grpo.run_config import EvalConfig, ExperimentConfig, RunConfig

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ("env", "policy", "rollout", "grpo", "profiler", "logger")
# A run of a few seconds: the countdown env in this process, no wandb, no profiler
COUNTDOWN = ["env=countdown", "env.task_ids=[0]", "env.group_size=2", "env.image_size=16", "env.chunk_size=4",
             "env.max_episode_steps=8",
             "env.num_workers=1", "rollout.collector.stages=1", "rollout.collector.in_process=true", "eval.every=0",
             "run.show_progress=false", "logger=none", "profiler.enabled=false"]


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("grpo_main", overrides=list(overrides))


def group_options() -> list[str]:
    """Every file of every group (so a new one is covered), and every experiment preset."""
    options = [f"{group}={path.stem}" for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))
               if not path.stem.endswith("_schema")]
    return options + [f"+experiment={path.stem}" for path in sorted((CONF / "experiment").glob("*.yaml"))]


def test_every_group_is_listed():
    assert {p.name for p in CONF.iterdir() if p.is_dir()} == {*GROUPS, "experiment"}
    assert len(group_options()) >= 4 + 10 + 3  # experiments, envs, policies at least


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("option", group_options())
def test_every_group_option_composes_and_builds_the_typed_configs(option, mode):
    group, _, name = option.partition("=")
    if group == "env" and (yaml.safe_load((CONF / "env" / f"{name}.yaml").read_text()).get("chunk_size", 10) > 8):
        # LIBERO suites (EnvConfig's chunk of 10 actions) and the GPU world models: longer than a tiny policy call
        with pytest.raises(ValueError, match=r"policy\.chunk_size \(8\) is shorter than env\.chunk_size \(10\)"):
            ExperimentConfig.from_hydra(composed(option, f"mode={mode}"))
        # and a group to compare in (EnvConfig's is 1), and room for the longest LIBERO task texts' prompts
        option = f"{option} env.chunk_size=8 env.group_size=2 +policy.max_token_len=145"
    exp = ExperimentConfig.from_hydra(composed(*option.split(), f"mode={mode}"))
    assert exp.mode == mode and exp.policy.logprob_chunk in (None, exp.env.chunk_size)


def _evaluate(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "eval"
    experiments.grpo.run(composed(*COUNTDOWN, f"run.dir={run_dir}", "eval.videos=0", *overrides), force_mode="eval")
    return run_dir


def test_evaluate_accepts_what_mode_eval_accepts(tmp_path):
    # the training-only check (the recompute needs the images) refused experiments.evaluate, not mode=eval
    run_dir = _evaluate(tmp_path, "rollout.collector.record_images=false")
    assert (run_dir / "eval.json").is_file()


def test_evaluate_records_mode_eval_in_the_run_config(tmp_path):
    run_dir = _evaluate(tmp_path)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["mode"] == "eval"


def _not_a_checkpoint(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "ckpt" / "step_000001.pt"
    path.parent.mkdir()
    if kind == "text":
        path.write_text("mode: train\n")  # e.g. a run's config.yaml given by mistake
    else:
        torch.save({"weights": {}}, path)  # a state dict of someone else's
    return path


@pytest.mark.parametrize("kind", ["text", "other_dict"])
@pytest.mark.parametrize("key,extra", [("eval.checkpoint", ["mode=eval"]), ("run.resume", ["grpo.steps=3"])])
def test_a_file_that_is_not_a_checkpoint_is_refused_before_the_run_dir(tmp_path, capsys, kind, key, extra):
    path = _not_a_checkpoint(tmp_path, kind)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        experiments.grpo.run(composed(*COUNTDOWN, *extra, f"{key}={path}", f"run.dir={run_dir}"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error" in err and key in err and str(path) in err
    assert not run_dir.exists()


@pytest.mark.parametrize("tasks", ["abc", 3, [1.5], [True], [[1]]])
def test_eval_tasks_must_be_integer_ids(tasks):
    with pytest.raises(ValueError, match=r"eval\.tasks must be a non-empty list of distinct integers >= 0"):
        EvalConfig(tasks=tasks)
    assert EvalConfig(tasks=[2, 8]).tasks == [2, 8]


def test_run_device_with_no_index_is_refused():
    with pytest.raises(ValueError, match=r"run\.device .* got 'cuda:'"):
        RunConfig(device="cuda:")
    assert RunConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize("cls,key", [(RunConfig, "resume"), (EvalConfig, "checkpoint")])
def test_checkpoint_paths_must_be_strings(cls, key):
    # `run.resume=5` reaches the config as the int 5
    with pytest.raises(ValueError, match=rf"\b{'run' if cls is RunConfig else 'eval'}\.{key} must be a path"):
        cls(**{key: 5})


@pytest.mark.parametrize("key", ["lr", "adam_eps", "adv_eps", "weight_decay", "kl_coef"])
def test_grpo_numbers_must_be_finite(key):
    with pytest.raises(ValueError, match=rf"grpo\.{key} must be finite, got inf"):
        GRPOConfig(**{key: math.inf})


def test_grpo_inf_stays_allowed_where_it_means_no_limit():
    cfg = GRPOConfig(grad_clip=math.inf, tis_cap=math.inf, dual_clip=math.inf)
    assert cfg.grad_clip == cfg.tis_cap == math.inf


def test_per_env_tasks_that_mix_a_grpo_group_are_refused_before_the_run_dir(tmp_path, capsys):
    # env.task_ids per env: envs 0 and 1 (one group of env.group_size 2) would run tasks 0 and 1
    run_dir = tmp_path / "run"
    overrides = [o for o in COUNTDOWN if not o.startswith("env.task_ids")]
    with pytest.raises(SystemExit) as info:
        experiments.grpo.run(composed(*overrides, "env.task_ids=[0,1,0,1]", "grpo.steps=1", f"run.dir={run_dir}"))
    assert info.value.code == 2
    assert "env.group_size (2) puts envs 0..1, which run tasks [0, 1]" in capsys.readouterr().err
    assert not run_dir.exists()
    per_group = ExperimentConfig.from_hydra(composed(*overrides, "env.task_ids=[0,1]"))  # one task per group
    assert per_group.env.task_ids == [0, 1]
    assert ExperimentConfig.from_hydra(composed(*overrides, "env.task_ids=[0,1,0,1]", "mode=eval")).mode == "eval"


def test_a_resume_with_no_step_left_is_refused_before_the_run_dir_whatever_the_file_name(tmp_path, capsys):
    train_dir = tmp_path / "train"
    experiments.grpo.run(composed(*COUNTDOWN, "grpo.steps=1", f"run.dir={train_dir}"))
    best = tmp_path / "best.pt"  # a copy under another name: the step is read from inside
    best.write_bytes((train_dir / "checkpoints" / "step_000001.pt").read_bytes())
    run_dir = tmp_path / "resumed"
    with pytest.raises(SystemExit) as info:
        experiments.grpo.run(composed(*COUNTDOWN, "grpo.steps=1", f"run.resume={best}", f"run.dir={run_dir}"))
    assert info.value.code == 2
    assert "is step 1 and grpo.steps is 1" in capsys.readouterr().err
    assert not run_dir.exists()
