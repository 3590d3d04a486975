import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from profiler.config import ProfilerConfig, WandbConfig

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_defaults_are_valid_and_offline():
    cfg = ProfilerConfig()
    assert cfg.enabled and cfg.gpu_timing == "none"
    assert cfg.wandb.mode == "offline"
    assert cfg.speedups[-1] == math.inf


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu_timing": "cuda"}, "profiler.gpu_timing must be one of ['none', 'sync', 'cuda_event'], got 'cuda'"),
    ({"exports": ["png", "tensorboard"]}, "profiler.exports[] must be one of"),
    ({"flush_every": 0}, "profiler.flush_every must be an integer >= 1, got 0"),
    ({"speedups": [2.0, 0.5]}, "profiler.speedups entries must be >= 1"),
    ({"predict_speedup": -1.0}, "profiler.predict_speedup must be > 0"),
    ({"enabled": "yes"}, "profiler.enabled must be true or false"),
])
def test_bad_values_name_the_key(kwargs, message):
    with pytest.raises(ValueError) as err:
        ProfilerConfig(**kwargs)
    assert message in str(err.value)


def test_wandb_mode_validated():
    with pytest.raises(ValueError,
                       match=r"logger.mode must be one of \['offline', 'online', 'disabled'\], got 'cloud'"):
        WandbConfig(mode="cloud")


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ValueError, match="profiler: unknown key 'gpu_timming'"):
        ProfilerConfig.from_dict({"gpu_timming": "sync"})
    with pytest.raises(ValueError, match="profiler.wandb: unknown key 'projct'"):
        ProfilerConfig.from_dict({"wandb": {"projct": "x"}})


def test_hydra_yaml_files_load_into_the_dataclasses():
    profiler_group = OmegaConf.load(CONF / "profiler" / "default.yaml")
    logger_group = OmegaConf.load(CONF / "logger" / "wandb_offline.yaml")
    cfg = ProfilerConfig.from_dict(profiler_group, logger=logger_group)
    assert cfg.speedups == [1.5, 2.0, 2.55, 4.0, math.inf]
    assert cfg.exports == ["json", "console", "perfetto", "png", "wandb"]
    assert isinstance(cfg.wandb, WandbConfig) and cfg.wandb.mode == "offline"
    # the yaml mirrors the dataclass defaults, key for key
    assert cfg == ProfilerConfig()
