"""EnvConfig validation, task/worker layout, and the Hydra config files."""

from __future__ import annotations

import pytest

from envs.config import EnvConfig, register_hydra_schema, robosuite_camera


def test_defaults_are_the_cpu_acceptance_setup():
    cfg = EnvConfig()
    assert (cfg.suite, cfg.num_envs, cfg.num_workers, cfg.image_size) == ("libero_10", 4, 2, 128)
    assert cfg.cameras == ["agentview", "wrist"] and cfg.num_settle_steps == 10
    assert cfg.episode_steps == 520 and cfg.step_mode == "lean"
    assert EnvConfig(suite="libero_spatial").episode_steps == 220
    assert EnvConfig(suite="libero_90", max_episode_steps=7).episode_steps == 7


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_envs=12, group_size=8), r"env.num_envs must be a multiple of env.group_size \(8\), got 12"),
        (dict(suite="libero_11"), r"env.suite must be one of .* got 'libero_11'"),
        (dict(num_envs=0), r"env.num_envs must be a positive integer, got 0"),
        (dict(num_workers=5), r"env.num_workers \(5\) must not exceed env.num_envs \(4\)"),
        (dict(render_every="always"), r"env.render_every must be one of \['chunk_end', 'substep'\]"),
        (dict(start_method="fork"), r"env.start_method must be one of \['spawn', 'forkserver'\], got 'fork'"),
        (dict(step_mode="fast"), r"env.step_mode must be one of \['robosuite', 'lean'\]"),
        (dict(task_ids=[0, 1, 2]), r"env.task_ids must have 1, num_groups \(4\) or num_envs \(4\) entries, got 3"),
        (dict(task_ids=[-1]), r"env.task_ids entries must be >= 0, got -1"),
        (dict(num_settle_steps=-1), r"env.num_settle_steps must be a non-negative integer"),
        (dict(worker_timeout_s=0), r"env.worker_timeout_s must be a positive number"),
        (dict(cameras=["wrist", "wrist"]), r"env.cameras has duplicates"),
        (dict(max_episode_steps=0), r"env.max_episode_steps must be a positive integer"),
    ],
)
def test_validation_names_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        EnvConfig(**overrides)


def test_task_ids_per_group_per_env_or_shared():
    cfg = EnvConfig(num_envs=6, group_size=2, num_workers=2, task_ids=[4, 1, 9])
    assert cfg.env_task_ids(10) == [4, 4, 1, 1, 9, 9]
    assert EnvConfig(num_envs=4, group_size=2, task_ids=[3]).env_task_ids(10) == [3, 3, 3, 3]
    per_env = EnvConfig(num_envs=4, group_size=2, task_ids=[0, 1, 2, 3])
    assert per_env.env_task_ids(10) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"env 4 has task 9, but libero_10 has 5 tasks"):
        cfg.env_task_ids(5)


def test_worker_split_is_contiguous_and_balanced():
    assert EnvConfig(num_envs=7, num_workers=3).worker_env_ids() == [[0, 1, 2], [3, 4], [5, 6]]
    assert EnvConfig(num_envs=64, num_workers=16).worker_env_ids()[15] == [60, 61, 62, 63]


def test_from_mapping_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown env config key\(s\) \['env.num_env'\]"):
        EnvConfig.from_mapping({"num_env": 4})
    assert EnvConfig.from_mapping({"num_envs": 8}, num_workers=4).num_workers == 4


def test_camera_aliases():
    assert robosuite_camera("wrist") == "robot0_eye_in_hand"
    assert robosuite_camera("agentview") == "agentview"
    assert EnvConfig(cameras=["wrist"]).robosuite_cameras == ("robot0_eye_in_hand",)


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from experiments.results import REPO_ROOT

    register_hydra_schema()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "conf")):
        return compose(config_name=config_name, overrides=overrides)


@pytest.mark.parametrize("suite", ["libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"])
def test_env_yaml_per_suite(suite):
    cfg = _compose("bench_env", [f"env={suite}"])
    env = EnvConfig.from_mapping(cfg.env)
    assert env.suite == suite and env.num_envs == 4 and env.chunk_size == 5


def test_bench_config_overrides_and_typing():
    cfg = _compose("bench_env", ["env.suite=libero_10", "env.num_envs=8", "env.num_workers=2",
                                 "env.image_size=64", "env.task_ids=[0,1]", "env.group_size=4"])
    env = EnvConfig.from_mapping(cfg.env)
    assert (env.num_envs, env.image_size, env.task_ids, env.group_size) == (8, 64, [0, 1], 4)
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose("bench_env", ["env.num_envs=many"])  # typed by the EnvConfig schema
    with pytest.raises(ConfigCompositionException):
        _compose("bench_env", ["env.num_env=4"])  # unknown key


def test_countdown_yaml():
    env = EnvConfig.from_mapping(_compose("bench_env", ["env=countdown"]).env)
    assert env.env_type == "countdown" and env.episode_steps == 8
