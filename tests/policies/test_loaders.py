"""Checkpoint round trips in LeRobot / openpi / our formats, key reports, shape checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from policies import PolicyConfig, build_policy
from policies.loaders import (
    EXPERT_HEAD,
    PALIGEMMA_HEAD,
    detect_format,
    export_state_dict,
    key_rules,
    load_checkpoint,
    load_state_dict,
    save_lerobot_safetensors,
)
from policies.models.pi05 import PI05Model

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fresh(seed: int, **overrides) -> PI05Model:
    model = PI05Model(PolicyConfig.preset("tiny", **overrides))
    model.init_weights(seed)
    return model


def assert_same_weights(a: PI05Model, b: PI05Model) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_lerobot_safetensors_round_trip(tmp_path):
    src, dst = fresh(1), fresh(2)
    path = tmp_path / "model.safetensors"
    save_lerobot_safetensors(src, path)
    keys = set(load_file(str(path)))
    assert "model." + PALIGEMMA_HEAD in keys and "model." + EXPERT_HEAD in keys
    assert (
        "model.paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"
        in keys
    )
    assert (
        "model.paligemma_with_expert.gemma_expert.model.layers.1.input_layernorm.dense.bias" in keys
    )
    report = load_checkpoint(dst, tmp_path)  # a directory holding model.safetensors, format auto
    assert report.format == "lerobot" and report.complete
    assert sorted(report.ignored) == sorted([PALIGEMMA_HEAD, EXPERT_HEAD])
    assert len(report.loaded) == len(list(dst.parameters()))
    assert_same_weights(src, dst)


def test_export_names_and_shapes_match_lerobot_full_size():
    """Our export of the full pi05 (meta device) has exactly LeRobot 0.6.1's 813 keys and shapes."""
    lerobot = json.loads((FIXTURES / "lerobot_pi05_full_keys.json").read_text())
    with torch.device("meta"):
        model = PI05Model(PolicyConfig.preset("pi05"))
        state = export_state_dict(model, "lerobot")
    assert len(state) == lerobot["num_keys"] == 813
    patterns: dict[str, dict] = {}
    for name, tensor in state.items():
        entry = patterns.setdefault(
            re.sub(r"\.\d+\.", ".N.", name[len("model.") :]),
            {"shape": list(tensor.shape), "count": 0},
        )
        entry["count"] += 1
    assert patterns == lerobot["patterns"]


def test_fixture_keys_match_lerobot_at_small_sizes():
    meta = json.loads(
        __import__("safetensors")
        .safe_open(str(FIXTURES / "lerobot_pi05_parity.safetensors"), "pt")
        .metadata()["lerobot_keys"]
    )
    from tests.policies.make_lerobot_fixture import fixture_config

    model = PI05Model(fixture_config())
    ours = {
        k[len("model.") :]: list(v.shape) for k, v in export_state_dict(model, "lerobot").items()
    }
    meta[EXPERT_HEAD] = ours[EXPERT_HEAD]  # LeRobot sizes the unused expert head with vocab 257152
    assert ours == meta


def test_missing_and_unexpected_are_reported():
    src, dst = fresh(1), fresh(2)
    state = export_state_dict(src, "lerobot")
    dropped = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"
    del state[dropped]
    state["model.some_new_head.weight"] = torch.zeros(3)
    report = load_state_dict(dst, state)
    assert report.missing == [dropped[len("model.") :]]
    assert report.unexpected == ["some_new_head.weight"]
    assert not report.complete
    with pytest.raises(ValueError, match="up_proj"):
        report.raise_if_incomplete()
    # the fused gate_up of that layer was not touched; everything else was loaded
    assert "expert.layers.1.gate_up.weight" not in report.loaded
    assert torch.equal(dst.expert.layers[0].gate_up.weight, src.expert.layers[0].gate_up.weight)


def test_wrong_shape_is_rejected_naming_the_parameter():
    src, dst = fresh(1), fresh(2)
    state = export_state_dict(src, "lerobot")
    key = "model.paligemma_with_expert.paligemma.model.language_model.layers.1.self_attn.k_proj.weight"
    state[key] = torch.zeros(7, state[key].shape[1])
    with pytest.raises(
        ValueError, match=r"k_proj\.weight.*\(7, 48\).*prefix\.layers\.1\.qkv\.weight"
    ):
        load_state_dict(dst, state)


def test_openpi_format_with_tied_embedding_and_old_time_mlp_names():
    src, dst = fresh(3), fresh(4)
    state = export_state_dict(src, "openpi")
    del state[
        "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    ]  # tied to lm_head
    for name in list(state):
        if name.startswith("time_mlp_"):
            state["action_" + name] = state.pop(name)
    assert detect_format(list(state)) == "openpi"
    report = load_state_dict(dst, state)
    assert report.complete, report.summary()
    assert_same_weights(src, dst)


def test_ours_format_and_build_policy_from_checkpoint(tmp_path):
    policy = build_policy(PolicyConfig.preset("tiny", seed=5))
    policy.save(tmp_path / "ours.safetensors")
    loaded = build_policy(
        PolicyConfig.preset("tiny", seed=6, checkpoint=str(tmp_path / "ours.safetensors"))
    )
    assert_same_weights(policy.model, loaded.model)
    save_lerobot_safetensors(policy.model, tmp_path / "lerobot.safetensors")
    from_lerobot = build_policy(
        PolicyConfig.preset("tiny", seed=7, checkpoint=str(tmp_path / "lerobot.safetensors"))
    )
    assert_same_weights(policy.model, from_lerobot.model)


def test_checkpoint_for_other_sizes_fails_clearly(tmp_path):
    save_file(
        {
            k: v.contiguous()
            for k, v in export_state_dict(
                fresh(1, chunk_size=6, max_action_dim=8), "lerobot"
            ).items()
        },
        str(tmp_path / "m.safetensors"),
    )
    with pytest.raises(ValueError, match=r"action_in_proj\.weight.*expected \(32, 16\)"):
        build_policy(PolicyConfig.preset("tiny", checkpoint=str(tmp_path / "m.safetensors")))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(fresh(1), tmp_path / "missing")


def test_every_parameter_has_exactly_one_rule():
    model = fresh(0)
    rules = key_rules(model.cfg)
    assert sorted(r.ours for r in rules) == sorted(n for n, _ in model.named_parameters())
    sources = [s for r in rules for s in r.theirs]
    assert len(sources) == len(set(sources))
