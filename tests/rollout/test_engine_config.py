"""rollout config: the Hydra group conf/rollout/{inproc,local,ray}.yaml builds RolloutConfig;
errors name the full key."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from experiments.results import REPO_ROOT
from rollout.config import EngineConfig, RolloutConfig, WeightSyncConfig, engine_config


@pytest.mark.parametrize("name, backend, ranks", [("inproc", "inproc", 1), ("local", "local", 2), ("ray", "ray", 2)])
def test_hydra_group_builds(name, backend, ranks):
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base=None):
        cfg = compose(overrides=[f"+rollout={name}", "rollout.engine.seed=5", "rollout.weights.bucket_mb=64"])
    rollout = RolloutConfig.from_mapping(cfg.rollout)
    assert (rollout.engine.backend, rollout.engine.num_ranks, rollout.engine.seed) == (backend, ranks, 5)
    assert rollout.weights.bucket_bytes == 64 * 2**20
    engine, weights = engine_config(cfg.rollout)
    assert engine == rollout.engine and weights == rollout.weights


@pytest.mark.parametrize("data, message", [
    ({"engine": {"num_ranks": 0}}, r"rollout.engine.num_ranks must be a positive integer, got 0"),
    ({"engine": {"devices": "gpu0"}}, r"rollout.engine.devices entries must be 'cpu', 'cuda' or 'cuda:<index>'"),
    # spellings torch.device refuses: the rank failed on them (ray: no visibility check before it)
    ({"engine": {"devices": "cuda:"}}, r"rollout.engine.devices entries must be .* got 'cuda:'"),
    ({"engine": {"devices": "cuda:01"}}, r"rollout.engine.devices entries must be .* got 'cuda:01'"),
    ({"engine": {"num_ranks": 2, "devices": ["cuda:0", "cuda:\u0661"]}},
     r"rollout.engine.devices entries must be .* got 'cuda:\u0661'"),
    ({"engine": {"rank_timeout_s": -1}}, r"rollout.engine.rank_timeout_s must be a positive number"),
    ({"weights": {"format": "hf"}}, r"rollout.weights.format must be one of"),
    ({"weights": {"dist_backend": "mpi"}}, r"rollout.weights.dist_backend must be one of"),
    ({"engines": {}}, r"unknown config key\(s\) \['rollout.engines'\]"),
])
def test_errors_name_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig.from_mapping(data)


def test_engine_config_alone_and_devices():
    engine, weights = engine_config({"backend": "local", "num_ranks": 3})
    assert engine.backend == "local" and weights == WeightSyncConfig()
    assert EngineConfig(num_ranks=3).rank_devices(cuda_count=2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert EngineConfig(num_ranks=2).rank_devices(cuda_count=0) == ["cpu", "cpu"]
    assert EngineConfig(num_ranks=2, devices=["cuda:1", "cpu"]).rank_devices() == ["cuda:1", "cpu"]
