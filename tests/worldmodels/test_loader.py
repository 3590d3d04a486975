"""Loading causal-Wan checkpoints in Self-Forcing's layout (files the tests write)."""

from __future__ import annotations

import pytest
import torch

from worldmodels.config import WorldModelConfig
from worldmodels.functional import frame_actions
from worldmodels.loader import export_self_forcing, load_checkpoint
from worldmodels.model import build_model

CFG = WorldModelConfig.preset("tiny")

# CausalWanModel's parameter names (wan/modules/causal_model.py, t2v, qk_norm, cross_attn_norm):
TOP_LEVEL = ["patch_embedding.weight", "patch_embedding.bias", "text_embedding.0.weight", "text_embedding.0.bias",
             "text_embedding.2.weight", "text_embedding.2.bias", "time_embedding.0.weight", "time_embedding.0.bias",
             "time_embedding.2.weight", "time_embedding.2.bias", "time_projection.1.weight", "time_projection.1.bias",
             "head.head.weight", "head.head.bias", "head.modulation"]
PER_BLOCK = [f"{attn}.{p}.{w}" for attn in ("self_attn", "cross_attn") for p in ("q", "k", "v", "o")
             for w in ("weight", "bias")]
PER_BLOCK += [f"{attn}.{n}.weight" for attn in ("self_attn", "cross_attn") for n in ("norm_q", "norm_k")]
PER_BLOCK += ["norm3.weight", "norm3.bias", "ffn.0.weight", "ffn.0.bias", "ffn.2.weight", "ffn.2.bias", "modulation"]


def self_forcing_keys(num_blocks: int) -> set[str]:
    return set(TOP_LEVEL) | {f"blocks.{i}.{k}" for i in range(num_blocks) for k in PER_BLOCK}


def test_parameter_names_are_causal_wans():
    model = build_model(CFG)
    ours = {k for k in model.state_dict() if not k.startswith(("action_embedding.", "context_tokens"))}
    assert ours == self_forcing_keys(CFG.dit.num_blocks)
    sd = model.state_dict()
    d = CFG.dit
    assert sd["patch_embedding.weight"].shape == (d.width, d.latent_channels, 1, 2, 2)
    assert sd["blocks.0.modulation"].shape == (1, 6, d.width)
    assert sd["head.head.weight"].shape == (4 * d.latent_channels, d.width)
    assert sd["time_projection.1.weight"].shape == (6 * d.width, d.width)


def _fsdp_style(sd: dict) -> dict:
    """As an FSDP + activation-checkpointing save names them, plus i2v-only keys."""
    out = {}
    for key, value in sd.items():
        if key.startswith("blocks."):
            index, rest = key[len("blocks."):].split(".", 1)
            key = f"blocks.{index}._fsdp_wrapped_module._checkpoint_wrapped_module.{rest}"
        out[f"model.{key}"] = value
    out["model.img_emb.proj.0.weight"] = torch.zeros(3)
    out["model.blocks.0.cross_attn.k_img.weight"] = torch.zeros(3)
    return out


def _velocity(model, actions):
    lat = torch.randn(1, 3, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    return model.forward_chunk(lat, torch.tensor([800.0]), frame_actions(actions, 3, 4), torch.tensor([3]),
                               torch.tensor([0]))[0]


def test_loads_a_self_forcing_checkpoint(tmp_path):
    source = build_model(CFG.replace(seed=11))
    sd = {k: v for k, v in source.state_dict().items() if not k.startswith(("action_embedding.", "context_tokens"))}
    ema = {k: v + 0.5 if k == "head.head.bias" else v for k, v in sd.items()}
    path = tmp_path / "self_forcing.pt"
    torch.save({"generator": _fsdp_style(sd), "generator_ema": _fsdp_style(ema)}, path)
    target = build_model(CFG.replace(seed=12))
    report = load_checkpoint(target, path)
    assert report.source_key == "generator_ema"
    assert set(report.loaded) == self_forcing_keys(CFG.dit.num_blocks)
    assert sorted(report.missing) == ["action_embedding.0.bias", "action_embedding.0.weight",
                                      "action_embedding.2.bias", "action_embedding.2.weight", "context_tokens"]
    assert len(report.ignored) == 2 and not report.unexpected
    torch.testing.assert_close(target.head.head.bias, source.head.head.bias + 0.5)
    # the action embedding's output layer is zeroed: actions have no effect until fine-tuned
    torch.testing.assert_close(_velocity(target, torch.ones(1, 12, 7)), _velocity(target, -torch.ones(1, 12, 7)))
    report = load_checkpoint(target, path, prefer_ema=False)
    assert report.source_key == "generator"
    torch.testing.assert_close(target.head.head.bias, source.head.head.bias)


def test_export_roundtrip_and_build_from_config(tmp_path):
    source = build_model(CFG.replace(seed=3))
    path = tmp_path / "ours.pt"
    export_self_forcing(source, path)
    loaded = build_model(CFG.replace(seed=4, checkpoint=str(path)))
    actions = torch.randn(1, 12, 7, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_velocity(loaded, actions), _velocity(source, actions))


def test_bad_checkpoints_name_the_key(tmp_path):
    model = build_model(CFG)
    sd = {f"model.{k}": v for k, v in model.state_dict().items()}
    sd["model.blocks.1.ffn.0.weight"] = torch.zeros(3, 3)
    torch.save({"generator": sd}, tmp_path / "bad_shape.pt")
    with pytest.raises(ValueError, match=r"'model.blocks.1.ffn.0.weight' has shape \(3, 3\).*\(64, 32\)"):
        load_checkpoint(model, tmp_path / "bad_shape.pt")
    del sd["model.blocks.1.ffn.0.weight"]
    torch.save({"generator": sd}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="lacks model key 'blocks.1.ffn.0.weight'"):
        load_checkpoint(model, tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        load_checkpoint(model, tmp_path / "nowhere.pt")
