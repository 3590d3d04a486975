"""Fixes found by walking through the README's CPU commands (each test fails on the code before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from envs.config import EnvConfig
from experiments.bench_env import BenchConfig, check_episode_covers_bench

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_bench_env_default_config_passes_the_episode_check():
    """`python -m experiments.bench_env` (README "Benchmark: python -m experiments.bench_env") crashed
    before timing anything: conf/bench_env.yaml leaves env.max_episode_steps null (the suite's default
    horizon), and the check compared an int with None (TypeError)."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base=None):
        cfg = compose(config_name="bench_env")
    env_cfg = EnvConfig.from_mapping(cfg.env)
    bench = BenchConfig.from_mapping(OmegaConf.to_container(cfg.bench, resolve=True))
    assert env_cfg.max_episode_steps is None  # the case the check missed
    check_episode_covers_bench(env_cfg, bench)  # 7 chunks of 5 steps: well inside libero_10's 520


def test_bench_env_episode_check_uses_the_suite_horizon_when_unset():
    env_cfg = EnvConfig(suite="libero_10", num_envs=4, chunk_size=5)  # max_episode_steps None -> 520
    with pytest.raises(ValueError, match=r"are 1005 steps, past env.max_episode_steps \(520\)"):
        check_episode_covers_bench(env_cfg, BenchConfig(num_chunks=200, warmup_chunks=1))
    check_episode_covers_bench(env_cfg, BenchConfig(num_chunks=103, warmup_chunks=1))  # 520 steps: fits
    reach = EnvConfig(env_type="reach", num_envs=2, chunk_size=8)  # reach's default horizon: 40
    with pytest.raises(ValueError, match=r"past env.max_episode_steps \(40\)"):
        check_episode_covers_bench(reach, BenchConfig(num_chunks=5, warmup_chunks=1))
