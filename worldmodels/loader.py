"""Load causal-Wan checkpoints (Self-Forcing / CausVid layout) into `CausalWanDiT`.

Self-Forcing saves `torch.save({"generator": sd, "generator_ema": sd})` where `sd` is the state
dict of its WanDiffusionWrapper: CausalWanModel's keys under `model.` (e.g.
`model.blocks.0.self_attn.q.weight`); FSDP-wrapped saves insert `_fsdp_wrapped_module.` and
activation checkpointing `_checkpoint_wrapped_module.`. A bare Wan state dict (safetensors, no
prefix) loads too. Keys are matched by name after stripping those wrappers; a wrong shape
raises naming both keys; the report lists loaded / missing / unexpected / ignored keys.

Our own additions (`action_embedding.*`, `context_tokens`) are missing from such checkpoints:
they keep their init, and the action embedding's output layer is zeroed so the loaded model
generates exactly what the original does until it is fine-tuned with actions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from worldmodels.model import CausalWanDiT

WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
TOP_LEVEL_PREFIXES = ("module.", "model.")
# i2v-only and GAN/classifier branches of other Wan checkpoints: not part of this model
IGNORED_PREFIXES = ("img_emb.", "_cls_pred_branch.", "_gan_ca_blocks.", "_register_tokens.")
IGNORED_INFIXES = (".cross_attn.k_img.", ".cross_attn.v_img.", ".cross_attn.norm_k_img.")
OURS = ("action_embedding.", "context_tokens")
GENERATOR_KEYS = ("generator_ema", "generator", "model", "state_dict")


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # ours, kept at init
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    source_key: str | None = None  # which entry of the file held the weights

    def summary(self) -> str:
        return (f"loaded {len(self.loaded)}, missing {len(self.missing)} {self.missing[:4]}, "
                f"unexpected {len(self.unexpected)} {self.unexpected[:4]}, ignored {len(self.ignored)}")


def read_state_dict(path: str | os.PathLike, prefer_ema: bool = True) -> tuple[dict[str, Tensor], str | None]:
    """The generator's tensors from a .pt/.pth/.safetensors file, and the entry they came from."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"world-model checkpoint {path!r} does not exist")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path), None
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
    order = GENERATOR_KEYS if prefer_ema else ("generator", "generator_ema", "model", "state_dict")
    for key in order:
        if isinstance(data.get(key), dict):
            return data[key], key
    return data, None


def canonical_key(key: str) -> str:
    for token in WRAPPER_TOKENS:
        key = key.replace(token, "")
    for prefix in TOP_LEVEL_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


def load_state_dict_into(model: CausalWanDiT, state: dict[str, Tensor], strict: bool = False) -> LoadReport:
    """Copy matching tensors into the model (in place); raise on shape mismatch, or on
    unexpected keys when strict. Every check runs before the first copy: a refused checkpoint
    leaves the model as it was (not half-loaded, with caches of the old weights)."""
    report = LoadReport()
    params = model.state_dict()
    copies: list[tuple[Tensor, Tensor]] = []
    seen = set()
    for raw_key, tensor in state.items():
        key = canonical_key(raw_key)
        if key.startswith(IGNORED_PREFIXES) or any(s in key for s in IGNORED_INFIXES):
            report.ignored.append(raw_key)
            continue
        if key not in params:
            report.unexpected.append(raw_key)
            continue
        target = params[key]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint key {raw_key!r} has shape {tuple(tensor.shape)}, but model key {key!r} "
                f"has {tuple(target.shape)} (wrong preset? worldmodel.dit sizes must match the checkpoint)"
            )
        copies.append((target, tensor))
        report.loaded.append(key)
        seen.add(key)
    for key in params:
        if key in seen:
            continue
        if not key.startswith(OURS):
            raise ValueError(f"checkpoint lacks model key {key!r} (not a causal-Wan checkpoint of this size?)")
        report.missing.append(key)
    if strict and report.unexpected:
        raise ValueError(f"unexpected checkpoint keys: {report.unexpected[:8]}")
    with torch.no_grad():
        for target, tensor in copies:
            target.copy_(tensor.to(target.dtype))
    if any(k.startswith("action_embedding.") for k in report.missing):
        with torch.no_grad():
            model.action_embedding[2].weight.zero_()
            model.action_embedding[2].bias.zero_()
    model.refresh()
    return report


def load_checkpoint(model: CausalWanDiT, path: str | os.PathLike, prefer_ema: bool = True,
                    strict: bool = False) -> LoadReport:
    state, source = read_state_dict(path, prefer_ema)
    report = load_state_dict_into(model, state, strict)
    report.source_key = source
    return report


def export_self_forcing(model: CausalWanDiT, path: str | os.PathLike, include_ours: bool = True) -> None:
    """Write the model as Self-Forcing does: {"generator": {"model." + key: tensor}, "generator_ema": ...}."""
    sd = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()
          if include_ours or not k.startswith(OURS)}
    torch.save({"generator": sd, "generator_ema": sd}, os.fspath(path))
