"""Review round 39 (b): the policy package outside the fast path (checkpoint errors naming their
file, the FLOP counter's options)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from policies import PolicyConfig, build_policy
from policies.flops import stage_costs
from policies.loaders import export_state_dict


def _other_model_file(tmp_path) -> str:
    path = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(path))
    return str(path)


def test_checkpoint_of_unknown_format_names_the_file(tmp_path):
    # the refusal said only "cannot tell the checkpoint format from its keys, e.g. ['encoder.weight']"
    path = _other_model_file(tmp_path)
    with pytest.raises(ValueError, match=re.escape(path) + r": cannot tell the checkpoint format"):
        build_policy(PolicyConfig.preset("tiny", checkpoint=path))


def test_checkpoint_with_other_keys_names_the_file(tmp_path):
    # "checkpoint (lerobot) does not match the model: loaded 0, missing 91 ..." without the file
    path = _other_model_file(tmp_path)
    cfg = PolicyConfig.preset("tiny", checkpoint=path, checkpoint_format="lerobot")
    with pytest.raises(ValueError, match=r"checkpoint " + re.escape(path) + r" \(lerobot\) does not match"):
        build_policy(cfg)


def test_checkpoint_of_other_sizes_names_the_file(tmp_path):
    small = build_policy(PolicyConfig.preset("tiny", chunk_size=6, max_action_dim=8))
    path = str(tmp_path / "m.safetensors")
    save_file({k: v.contiguous() for k, v in export_state_dict(small.model, "lerobot").items()}, path)
    with pytest.raises(ValueError, match=re.escape(path) + r": checkpoint tensor .*action_in_proj\.weight"):
        build_policy(PolicyConfig.preset("tiny", checkpoint=path))


def test_stage_costs_refuses_a_misspelt_option():
    # **options read only the two names it knew: a typo counted the default silently
    cfg = PolicyConfig.preset("tiny")
    with pytest.raises(TypeError, match="modulation_precomputd"):
        stage_costs(cfg, 1, modulation_precomputd=True)
    precomputed = stage_costs(cfg, 1, modulation_precomputed=True)["expert_step"].flops
    assert precomputed < stage_costs(cfg, 1)["expert_step"].flops
