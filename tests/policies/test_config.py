"""Config presets, validation messages, YAML files, parameter counts (meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from policies import PolicyConfig
from policies.models.pi05 import PI05Model

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("name", ["pi05", "pi05_small", "tiny"])
def test_presets_and_yaml(name):
    cfg = PolicyConfig.preset(name)
    assert cfg.name == name
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):  # the group's defaults too
        from_yaml = PolicyConfig.from_mapping(compose(config_name=f"policy/{name}").policy)
    assert (
        from_yaml.vision == cfg.vision
        and from_yaml.prefix == cfg.prefix
        and from_yaml.expert == cfg.expert
    )


def test_pi05_sizes_match_lerobot():
    cfg = PolicyConfig.preset("pi05")
    assert (
        cfg.vision.width,
        cfg.vision.depth,
        cfg.vision.num_heads,
        cfg.vision.mlp_dim,
        cfg.vision.num_patches,
    ) == (1152, 27, 16, 4304, 256)
    assert (
        cfg.prefix.width,
        cfg.prefix.depth,
        cfg.prefix.mlp_dim,
        cfg.prefix.num_heads,
        cfg.prefix.num_kv_heads,
        cfg.prefix.head_dim,
    ) == (2048, 18, 16384, 8, 1, 256)
    assert (cfg.expert.width, cfg.expert.depth, cfg.expert.mlp_dim) == (1024, 18, 4096)
    assert (
        cfg.vocab_size,
        cfg.chunk_size,
        cfg.max_action_dim,
        cfg.max_token_len,
        cfg.sampling.num_steps,
    ) == (257152, 50, 32, 200, 10)
    assert cfg.prefix_len == 3 * 256 + 200


def parameter_count(name: str) -> int:
    with torch.device("meta"):
        model = PI05Model(PolicyConfig.preset(name))
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts():
    # LeRobot 0.6.1 PI05Pytorch has 4,143,404,816 elements incl. the unused PaliGemma lm_head
    # (257152 x 2048) and expert lm_head (257152 x 1024): the model in use is the rest.
    lerobot = json.loads((FIXTURES / "lerobot_pi05_full_keys.json").read_text())
    in_use = lerobot["num_elements"] - 257152 * 2048 - 257152 * 1024
    assert parameter_count("pi05") == in_use == 3_353_433_872
    assert parameter_count("pi05_small") < 20_000_000
    assert parameter_count("tiny") < 200_000


def test_overrides_and_replace():
    cfg = PolicyConfig.from_mapping(
        {"preset": "tiny", "dtype": "bfloat16", "sampling": {"noise_level": 0.3}}
    )
    assert (
        cfg.dtype == "bfloat16" and cfg.sampling.noise_level == 0.3 and cfg.sampling.num_steps == 4
    )
    assert cfg.replace(chunk_size=6).chunk_size == 6
    assert cfg.replace(inputs={"camera_map": {"main_images": "base_0_rgb"}}).inputs.camera_map == {
        "main_images": "base_0_rgb"
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"bogus": 1}, r"policy\.bogus"),
        ({"sampling": {"steps": 3}}, r"policy\.sampling\.steps"),
        ({"dtype": "float16"}, r"policy\.dtype must be one of"),
        (
            {"expert": {"num_heads": 4}},
            r"policy\.expert\.num_heads must equal policy\.prefix\.num_heads",
        ),
        ({"expert": {"depth": 3}}, r"policy\.expert\.depth must equal"),
        ({"vision": {"image_size": 50}}, r"policy\.vision\.image_size \(50\) must be a multiple"),
        ({"action_dim": 40}, r"policy\.action_dim \(40\) must not exceed policy\.max_action_dim"),
        ({"sampling": {"train_mode": "ode"}}, r"policy\.sampling\.train_mode"),
        ({"sampling": {"logprob_chunk": 99}}, r"policy\.sampling\.logprob_chunk \(99\)"),
        ({"chunk_size": 0}, r"policy\.chunk_size must be a positive integer"),
        (
            {"inputs": {"camera_map": {"agentview_image": "nope"}}},
            r"policy\.inputs\.camera_map\['agentview_image'\]",
        ),
        (
            {"inputs": {"state_q01": [0.0] * 8}},
            r"policy\.inputs\.state_q01 and policy\.inputs\.state_q99",
        ),
    ],
)
def test_validation_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig.preset("tiny", **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="policy.preset must be one of"):
        PolicyConfig.preset("pi0")


# One valid partial override per sub-config: (sub-config, {key: value given the preset's value}).
PARTIAL_OVERRIDES = {
    "vision": lambda cfg: {"layer_norm_eps": cfg.vision.layer_norm_eps * 10},
    "prefix": lambda cfg: {"mlp_dim": cfg.prefix.mlp_dim * 2},
    "expert": lambda cfg: {"width": cfg.expert.width + 2},
    "sampling": lambda cfg: {"noise_level": cfg.sampling.noise_level / 2},
    "inputs": lambda cfg: {"state_key": "proprio"},
    "fast": lambda cfg: {"cuda_graphs": not cfg.fast.cuda_graphs},
}


def _changed_keys(a: PolicyConfig, b: PolicyConfig) -> set[str]:
    """Dotted keys whose values differ between two configs."""
    def flat(tree, prefix=""):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict) and k != "camera_map":
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = flat(a.to_dict()), flat(b.to_dict())
    return {k for k in fa if fa[k] != fb[k]}


@pytest.mark.parametrize("name", ["pi05", "pi05_small", "tiny"])
@pytest.mark.parametrize("sub", sorted(PARTIAL_OVERRIDES))
def test_partial_override_changes_only_the_named_key(name, sub):
    base = PolicyConfig.preset(name)
    override = PARTIAL_OVERRIDES[sub](base)
    (key, value), = override.items()
    for cfg in (PolicyConfig.preset(name, **{sub: override}),
                PolicyConfig.from_mapping({"preset": name, sub: override}),
                base.replace(**{sub: override})):
        assert getattr(getattr(cfg, sub), key) == value
        assert _changed_keys(base, cfg) == {f"{sub}.{key}"}


def test_pi05_expert_depth_override_keeps_gemma_300m():
    # the example: the expert's depth must follow the prefix's, so both are named
    cfg = PolicyConfig.preset("pi05", prefix={"depth": 2}, expert={"depth": 2})
    assert (cfg.expert.width, cfg.expert.mlp_dim, cfg.expert.depth) == (1024, 4096, 2)
    assert (cfg.prefix.width, cfg.prefix.mlp_dim, cfg.prefix.depth) == (2048, 16384, 2)
    with pytest.raises(ValueError, match=r"policy\.expert\.depth must equal policy\.prefix\.depth \(18\)"):
        PolicyConfig.preset("pi05", expert={"depth": 2})


def test_hydra_overrides_are_partial():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("bench_predict", overrides=["+policy.prefix.depth=2", "+policy.expert.depth=2",
                                                  "policy.sampling.noise_level=0.25"])
    policy = PolicyConfig.from_mapping(cfg.policy)
    assert (policy.expert.width, policy.expert.mlp_dim, policy.expert.depth) == (1024, 4096, 2)
    assert (policy.sampling.noise_level, policy.sampling.num_steps) == (0.25, 10)


def test_policy_yaml_fast_block_lists_fast_config_defaults():
    """conf/policy/fast/default.yaml lists every FastConfig key with its default (so Hydra
    overrides like `policy.fast.precision=fp8` need no `+`), and every policy preset includes it."""
    import dataclasses
    from pathlib import Path

    import yaml

    from policies.fast.config import FastConfig

    conf = Path(__file__).resolve().parents[2] / "conf" / "policy"
    listed = yaml.safe_load((conf / "fast" / "default.yaml").read_text())
    defaults = dataclasses.asdict(FastConfig())
    assert listed == defaults
    for preset in conf.glob("*.yaml"):
        assert {"fast": "default"} in yaml.safe_load(preset.read_text())["defaults"], preset.name


def test_triton_cache_dir_follows_tritons_own_resolution(monkeypatch, tmp_path):
    """The directory the first-call log names is the one Triton compiles into: $TRITON_CACHE_DIR first, else
    under $TRITON_HOME."""
    pytest.importorskip("triton")
    from policies.fast.config import triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    assert triton_cache_dir() == tmp_path / "home" / ".triton" / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert triton_cache_dir() == tmp_path / "cache"
