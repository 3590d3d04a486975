"""The Hydra tree of experiments.grpo: presets compose and validate; bad overrides stop at start
naming the key, before the run directory exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

import experiments.grpo  # noqa: F401  (registers the env and grpo schemas)
from grpo.run_config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
PRESETS = ["smoke", "libero10_pi05", "libero10_pi05_fast", "libero_spatial_pi05", "reach_tiny"]


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("grpo_main", overrides=list(overrides))


def test_default_is_the_smoke_run_on_a_real_libero_task():
    exp = ExperimentConfig.from_hydra(composed("run.dir=x"))
    smoke = ExperimentConfig.from_hydra(composed("+experiment=smoke", "run.dir=x"))
    assert exp.mode == "train" and exp.env.env_type == "libero" and exp.env.suite == "libero_10"
    assert exp.policy.name == "tiny" and exp.policy.logprob_chunk == exp.env.chunk_size
    assert exp.to_dict() == smoke.to_dict()


@pytest.mark.parametrize("group", ["reach", "countdown", "wm_tiny", "libero_spatial"])
def test_an_env_group_on_the_command_line_brings_its_own_values(group):
    # grpo_main.yaml's own env block (the smoke sizes) used to override the chosen group's file:
    # `env=reach` ran 4 envs in groups of 2 with chunks of 5 instead of reach.yaml's 16 / 8 / 8
    import yaml

    # the tiny policy's call: 8 actions; a GRPO group of 2 (EnvConfig's default is 1); prompts of up to 145
    # tokens (the longest LIBERO task texts, tests/grpo/test_prompt_length_check.py)
    fit = ["env.chunk_size=8", "env.group_size=2", "+policy.max_token_len=145"] if group.startswith("libero") else []
    exp = ExperimentConfig.from_hydra(composed(f"env={group}", *fit))
    own = {k: v for k, v in yaml.safe_load((ROOT / "conf" / "env" / f"{group}.yaml").read_text()).items()
           if k != "defaults"} | ({"chunk_size": 8, "group_size": 2} if fit else {})
    chosen = exp.env.to_dict()
    assert {k: chosen[k] for k in own} == own
    defaults = {k: v for k, v in type(exp.env)().to_dict().items() if k not in own and k != "env_type"}
    assert {k: chosen[k] for k in defaults} == defaults  # nothing from the smoke run's env


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    exp = ExperimentConfig.from_hydra(composed(f"+experiment={preset}"))
    assert exp.policy.logprob_chunk == exp.env.chunk_size


def test_libero10_preset_has_rlinf_recipe_values():
    exp = ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05"))
    g, e, p = exp.grpo, exp.env, exp.policy
    assert (e.num_envs, e.group_size, e.chunk_size, e.max_episode_steps, e.num_settle_steps) == (64, 8, 10, 480, 15)
    assert (p.name, p.chunk_size, p.sampling.num_steps, p.sampling.noise_level, p.train_expert_only) == \
        ("pi05", 10, 4, 0.5, True)
    assert (g.rollout_epochs, g.update_epochs, g.lr, g.global_batch, g.micro_batch) == (8, 4, 5e-6, 2048, 128)
    clips = (g.clip_low, g.clip_high, g.dual_clip, g.kl_coef, g.filter_low, g.filter_high)
    assert clips == (0.2, 0.2, 3.0, 0.0, 0.1, 0.9)
    assert tuple(g.betas) == (0.9, 0.95) and g.weight_decay == 0.01 and g.grad_clip == 1.0
    assert exp.collector.stages == 1


# What libero10_pi05_fast adds to the recipe (README "GRPO": the fastest step measured, log-prob gap 0)
FAST_OVERRIDES = ["policy.fast.consistent_recompute=true", "policy.fast.attention=triton",
                  "policy.fast.batch_buckets=[32]", "policy.fast.prompt_buckets=[128]", "grpo.prefix_cache=engine",
                  "rollout.collector.stages=2", "policy.frozen_dtype=bfloat16", "policy.fast.recompute_backward=bf16",
                  "policy.fast.recompute_graph=true", "grpo.prefix_cache_gib=16", "grpo.prefix_cache_spill_gib=40"]


def test_the_fast_preset_is_the_recipe_with_the_fast_settings_and_nothing_else():
    fast = ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05_fast", "run.dir=x")).to_dict()
    spelled = ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05", "run.dir=x", *FAST_OVERRIDES))
    recipe = ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05", "run.dir=x")).to_dict()
    assert fast == spelled.to_dict()
    assert fast != recipe and fast["grpo"]["lr"] == recipe["grpo"]["lr"] and fast["env"] == recipe["env"]
    # the command line still overrides the preset's own values
    fp32 = ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05_fast",
                                                "policy.fast.recompute_backward=fp32"))
    assert fp32.policy.fast.recompute_backward == "fp32" and fp32.policy.fast.recompute_graph


@pytest.mark.parametrize("override,match", [
    ("grpo.lrr=1", "grpo.lrr"),  # unknown key (Hydra, struct mode)
    ("grpo.lr=fast", "grpo.lr"),  # wrong type (the grpo schema)
    ("env.num_envs=many", "env.num_envs"),
])
def test_hydra_rejects_unknown_keys_and_wrong_types(override, match):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as info:
        composed(override)
    text = str(info.value) + str(info.value.__cause__)
    assert match in text


@pytest.mark.parametrize("override,match", [
    ("env.group_size=3", "env.num_envs must be a multiple of env.group_size"),
    ("grpo.micro_batch=0", "grpo.micro_batch"),
    ("grpo.clip_low=1.5", "grpo.clip_low"),
    ("rollout.collector.stages=3", "rollout.collector.stages"),
    ("grpo.global_batch=50", "grpo.global_batch"),
    ("+policy.foo=1", "policy.foo"),
    ("+run.nope=1", "run.nope"),
    ("mode=serve", "mode"),
    ("policy.sampling.logprob_chunk=3", "env.chunk_size"),
])
def test_impossible_values_name_the_key(override, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        ExperimentConfig.from_hydra(composed(override))


def test_bad_override_on_the_command_line_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "experiments.grpo", "env.group_size=3", f"run.dir={run_dir}",
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode != 0
    assert "env.group_size" in proc.stderr and "config error" in proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides,match", [
    (["grpo.prefix_cache=device", "policy.train_expert_only=false"], "needs policy.train_expert_only=true"),
    (["grpo.prefix_cache=host", "grpo.actor_parallel.mode=ddp"], "one-process actor only"),
    (["grpo.prefix_cache=gpu"], "grpo.prefix_cache must be one of"),
    (["grpo.prefix_cache=device", "grpo.prefix_cache_gib=-1"], r"grpo.prefix_cache_gib must be in \[0.0, "),
    (["grpo.prefix_cache_gib=4"], r"grpo.prefix_cache_gib=4.0 caps kept prefix caches, but grpo.prefix_cache is off"),
    (["grpo.prefix_cache=host", "grpo.prefix_cache_gib=4", "grpo.prefix_cache_spill_gib=8"],
     r"grpo.prefix_cache_spill_gib=8.0 keeps the rows past grpo.prefix_cache_gib in host memory: it needs "
     r"grpo.prefix_cache=device or engine \(got 'host'\)"),
    (["grpo.prefix_cache=device", "grpo.prefix_cache_spill_gib=8"], r"and grpo.prefix_cache_gib set \(got None\)"),
    (["grpo.prefix_cache=device", "grpo.prefix_cache_gib=4", "grpo.prefix_cache_spill_gib=-1"],
     r"grpo.prefix_cache_spill_gib must be in \[0.0, "),
])
def test_prefix_cache_is_refused_where_it_cannot_hold(overrides, match):
    with pytest.raises(ValueError, match=match):
        ExperimentConfig.from_hydra(composed(*overrides))


def test_turning_the_fast_presets_cache_off_names_every_size_to_drop():
    drop = r"or drop the sizes \(grpo.prefix_cache_gib=null grpo.prefix_cache_spill_gib=null\)"
    with pytest.raises(ValueError, match=drop):
        ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05_fast", "grpo.prefix_cache=off"))
    exp = ExperimentConfig.from_hydra(composed("+experiment=libero10_pi05_fast", "grpo.prefix_cache=off",
                                               "grpo.prefix_cache_gib=null", "grpo.prefix_cache_spill_gib=null"))
    assert exp.grpo.prefix_cache == "off" and exp.grpo.prefix_cache_gib is None


def test_prefix_cache_composes_on_the_default_run():
    grpo = ExperimentConfig.from_hydra(composed("grpo.prefix_cache=device", "grpo.prefix_cache_gib=2.5",
                                                "grpo.prefix_cache_spill_gib=4")).grpo
    assert (grpo.prefix_cache, grpo.prefix_cache_gib, grpo.prefix_cache_spill_bytes) == ("device", 2.5, 4 * 2**30)


def test_prefix_cache_composes_with_the_consistent_recompute():
    """It keeps the fast path's K/V there (policies/fast/recompute.py restores them into the buckets)."""
    exp = ExperimentConfig.from_hydra(composed(
        "grpo.prefix_cache=host", "policy.fast.enabled=true", "policy.fast.consistent_recompute=true",
        "policy.fast.attention=sdpa", "policy.fast.batch_buckets=[4]", "policy.fast.prompt_buckets=[200]"))
    assert exp.grpo.prefix_cache == "host" and exp.policy.fast.consistent_recompute
