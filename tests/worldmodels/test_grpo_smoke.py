"""One GRPO step on the world-model env (CPU, tiny policy, tiny world model): the real trainer,
collector, engine and env.

Until `EnvConfig` (envs/config.py) accepts env_type "worldmodel" and `make_vector_env` /
`env_slots` dispatch on it, the test routes those two entry points of the collector to the
world-model env itself (the objects the dispatch would return); once they do, it goes through
the real dispatch with an EnvConfig unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import envs.config
import rollout.collector
import rollout.collector_stages
from envs.worldmodel_env import WorldModelVectorEnv, worldmodel_slots
from grpo.run_config import ExperimentConfig
from grpo.trainer import Trainer
from worldmodels.env_config import WorldModelEnvConfig

# one chunk per episode: the tiny model's random success head makes each episode a coin flip,
# so groups of 2 disagree and GRPO has advantages to learn from
ENV = {"env_type": "worldmodel", "num_envs": 8, "group_size": 2, "image_size": 32, "chunk_size": 4,
       "max_episode_steps": 4, "worldmodel": {"model": {"preset": "tiny"}, "num_tasks": 2, "num_init_states": 4}}


def experiment(run_dir, env: dict) -> dict:
    return {
        "env": env,
        "policy": {"preset": "tiny", "sampling": {"logprob_chunk": 4}},
        "rollout": {"engine": {"backend": "inproc", "devices": "cpu"}, "collector": {"stages": 2, "in_process": True}},
        "grpo": {"steps": 1, "filter_groups": False, "lr": 3e-3, "micro_batch": 4, "update_epochs": 1},
        "profiler": {"enabled": False},
        "logger": {"mode": "disabled"},
        "run": {"dir": str(run_dir), "show_progress": False, "checkpoint_every": 0},
        "eval": {"every": 0},
    }


def build_config(run_dir, monkeypatch) -> ExperimentConfig:
    if "worldmodel" in envs.config.ENV_TYPES:  # the dispatch exists: EnvConfig all the way
        return ExperimentConfig.from_hydra(experiment(run_dir, ENV))
    countdown = {"env_type": "countdown", "num_envs": 8, "group_size": 2, "image_size": 32, "chunk_size": 4,
                 "max_episode_steps": 4, "show_progress": False}
    cfg = ExperimentConfig.from_hydra(experiment(run_dir, countdown))
    wm = WorldModelEnvConfig.from_mapping(ENV)
    monkeypatch.setattr(rollout.collector_stages, "make_vector_env", lambda c, in_process=False: WorldModelVectorEnv(c))
    monkeypatch.setattr(rollout.collector, "env_slots", worldmodel_slots)
    return dataclasses.replace(cfg, env=wm)


def test_one_grpo_step_on_the_world_model_env(tmp_path, monkeypatch):
    cfg = build_config(tmp_path, monkeypatch)
    trainer = Trainer(cfg, tmp_path)
    try:
        before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
        metrics = trainer.train_step(1)
        stage_envs = [stage.vec for stage in trainer.collector.stages]
        assert all(isinstance(vec, WorldModelVectorEnv) for vec in stage_envs)
        assert sum(len(vec.server.streams) for vec in stage_envs) == 8
        changed = [n for n, p in trainer.policy.model.named_parameters() if p.requires_grad
                   and not np.allclose(p.detach().numpy(), before[n].numpy())]
    finally:
        trainer.close()
    assert metrics["step"] == 1 and metrics["rollout/episodes"] == 8 and metrics["train/rows"] == 8
    assert 0.0 < metrics["rollout/success_rate"] < 1.0
    assert metrics["advantages/abs_mean"] > 0 and metrics["train/grad_norm"] > 0
    assert changed  # the actor's update reached the trained parameters
