"""Checkpoint loading (LeRobot, openpi, ours) into the fused layout, and export to LeRobot names.

LeRobot 0.6.1 (`PI05Policy.state_dict()`, its model.safetensors) key names, with P =
"model.paligemma_with_expert.", V = P + "paligemma.model.vision_tower.vision_model.",
G = P + "paligemma.model.language_model.", E = P + "gemma_expert.model.":
  ours                                   <- LeRobot
  vision.patch_embed.{weight,bias}       <- V embeddings.patch_embedding.*           (W, 3, 14, 14)
  vision.position_embedding              <- V embeddings.position_embedding.weight   (256, W)
  vision.layers.i.ln1/ln2.*              <- V encoder.layers.i.layer_norm1/2.*
  vision.layers.i.qkv.{weight,bias}      <- cat(V ...self_attn.{q,k,v}_proj.*)         fused rows
  vision.layers.i.out_proj/fc1/fc2.*     <- V ...self_attn.out_proj.*, mlp.fc1.*, mlp.fc2.*
  vision.post_ln.*                       <- V post_layernorm.*
  vision.projector.*                     <- P paligemma.model.multi_modal_projector.linear.*
  embed_tokens.weight                    <- G embed_tokens.weight (or P paligemma.lm_head.weight)
  prefix.layers.i.input_norm/post_norm   <- G layers.i.input_layernorm/post_attention_layernorm.weight
  prefix.layers.i.qkv.weight             <- cat(G layers.i.self_attn.{q,k,v}_proj.weight)
  prefix.layers.i.o_proj.weight          <- G layers.i.self_attn.o_proj.weight
  prefix.layers.i.gate_up.weight         <- cat(G layers.i.mlp.{gate,up}_proj.weight)
  prefix.layers.i.down.weight            <- G layers.i.mlp.down_proj.weight
  prefix.final_norm.weight               <- G norm.weight
  expert.* (same as prefix)              <- E ..., norms: input_layernorm.dense.*, norm.dense.*
  action_in_proj / action_out_proj / time_mlp_in / time_mlp_out  <- model.<same name>
Unused by pi0.5 sampling and ignored on load: P paligemma.lm_head.weight (vocab x 2048) and
P gemma_expert.lm_head.weight (vocab x 1024). openpi's PyTorch port (`PI0Pytorch` +
gemma_pytorch) uses the same names without the leading "model." (its PaliGemma embedding is
tied to lm_head, so either may be present) and older checkpoints may call the time MLP
`action_time_mlp_*` (LeRobot `_fix_pytorch_state_dict_keys` renames them; so do we).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from policies.config import PolicyConfig
from policies.models.pi05 import PI05Model

PWE = "paligemma_with_expert."
VISION = PWE + "paligemma.model.vision_tower.vision_model."
LLM = PWE + "paligemma.model.language_model."
EXPERT = PWE + "gemma_expert.model."
PALIGEMMA_HEAD = PWE + "paligemma.lm_head.weight"
EXPERT_HEAD = PWE + "gemma_expert.lm_head.weight"
UNUSED_HEADS = (PALIGEMMA_HEAD, EXPERT_HEAD)
ALIASES = {"action_time_mlp_in.": "time_mlp_in.", "action_time_mlp_out.": "time_mlp_out."}


@dataclass(frozen=True)
class KeyRule:
    ours: str
    theirs: tuple[str, ...]  # source names (no "model." prefix); several = concatenated along dim 0


def key_rules(cfg: PolicyConfig) -> list[KeyRule]:
    rules = [
        KeyRule("vision.patch_embed.weight", (VISION + "embeddings.patch_embedding.weight",)),
        KeyRule("vision.patch_embed.bias", (VISION + "embeddings.patch_embedding.bias",)),
        KeyRule("vision.position_embedding", (VISION + "embeddings.position_embedding.weight",)),
    ]
    for i in range(cfg.vision.depth):
        src, dst = f"{VISION}encoder.layers.{i}.", f"vision.layers.{i}."
        for p in ("weight", "bias"):
            rules += [
                KeyRule(dst + f"ln1.{p}", (src + f"layer_norm1.{p}",)),
                KeyRule(dst + f"qkv.{p}", tuple(src + f"self_attn.{n}_proj.{p}" for n in "qkv")),
                KeyRule(dst + f"out_proj.{p}", (src + f"self_attn.out_proj.{p}",)),
                KeyRule(dst + f"ln2.{p}", (src + f"layer_norm2.{p}",)),
                KeyRule(dst + f"fc1.{p}", (src + f"mlp.fc1.{p}",)),
                KeyRule(dst + f"fc2.{p}", (src + f"mlp.fc2.{p}",)),
            ]
    for p in ("weight", "bias"):
        rules += [
            KeyRule(f"vision.post_ln.{p}", (VISION + f"post_layernorm.{p}",)),
            KeyRule(
                f"vision.projector.{p}",
                (PWE + f"paligemma.model.multi_modal_projector.linear.{p}",),
            ),
        ]
    rules.append(KeyRule("embed_tokens.weight", (LLM + "embed_tokens.weight",)))
    rules += _gemma_rules("prefix", LLM, cfg.prefix.depth, adaptive=False)
    rules += _gemma_rules("expert", EXPERT, cfg.expert.depth, adaptive=True)
    for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        rules += [KeyRule(f"{name}.{p}", (f"{name}.{p}",)) for p in ("weight", "bias")]
    return rules


def _gemma_rules(ours: str, theirs: str, depth: int, adaptive: bool) -> list[KeyRule]:
    def norm(dst: str, src: str) -> list[KeyRule]:
        if adaptive:
            return [KeyRule(f"{dst}.dense.{p}", (f"{src}.dense.{p}",)) for p in ("weight", "bias")]
        return [KeyRule(f"{dst}.weight", (f"{src}.weight",))]

    rules = []
    for i in range(depth):
        src, dst = f"{theirs}layers.{i}.", f"{ours}.layers.{i}."
        rules += norm(dst + "input_norm", src + "input_layernorm")
        rules += norm(dst + "post_norm", src + "post_attention_layernorm")
        rules += [
            KeyRule(dst + "qkv.weight", tuple(src + f"self_attn.{n}_proj.weight" for n in "qkv")),
            KeyRule(dst + "o_proj.weight", (src + "self_attn.o_proj.weight",)),
            KeyRule(
                dst + "gate_up.weight", (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight")
            ),
            KeyRule(dst + "down.weight", (src + "mlp.down_proj.weight",)),
        ]
    return rules + norm(f"{ours}.final_norm", f"{theirs}norm")


def part_sizes(model: PI05Model, rule: KeyRule) -> list[int]:
    """Rows of each source tensor inside our (fused) parameter."""
    if len(rule.theirs) == 1:
        return [model.get_parameter(rule.ours).shape[0]]
    module = model.get_submodule(rule.ours.rsplit(".", 2)[0])
    if rule.ours.endswith("gate_up.weight"):
        return [module.cfg.mlp_dim] * 2
    if hasattr(module, "qkv_sizes"):  # Gemma block (GQA sizes)
        return list(module.qkv_sizes)
    return [module.qkv.weight.shape[1]] * 3  # SigLIP: q, k, v all width x width


@dataclass
class LoadReport:
    format: str
    loaded: list[str] = field(default_factory=list)  # our parameter names
    missing: list[str] = field(default_factory=list)  # source names we needed and did not find
    unexpected: list[str] = field(default_factory=list)  # source names we do not know
    ignored: list[str] = field(default_factory=list)  # known but unused (the LM heads)
    source: str | None = None  # the file it came from (load_checkpoint), named in the refusal

    @property
    def complete(self) -> bool:
        return not self.missing and not self.unexpected

    def raise_if_incomplete(self) -> LoadReport:
        if not self.complete:
            where = f" {self.source}" if self.source else ""
            raise ValueError(
                f"checkpoint{where} ({self.format}) does not match the model: {self.summary()}"
            )
        return self

    def summary(self) -> str:
        def head(names: list[str]) -> str:
            return f"{len(names)}" + (
                f" {names[:5]}{' ...' if len(names) > 5 else ''}" if names else ""
            )

        return (
            f"loaded {len(self.loaded)}, missing {head(self.missing)}, "
            f"unexpected {head(self.unexpected)}, ignored {head(self.ignored)}"
        )


def detect_format(keys: list[str]) -> str:
    if any(k.startswith("model." + PWE) for k in keys):
        return "lerobot"
    if any(k.startswith(PWE) for k in keys):
        return "openpi"
    if any(k.startswith(("vision.", "prefix.", "expert.")) for k in keys):
        return "ours"
    raise ValueError(f"cannot tell the checkpoint format from its keys, e.g. {sorted(keys)[:5]}")


def _canonical_source(state: Mapping[str, Tensor], fmt: str) -> dict[str, Tensor]:
    """Strip LeRobot's "model." prefix and apply openpi/LeRobot renames."""
    out = {}
    for key, value in state.items():
        name = key[len("model.") :] if fmt == "lerobot" and key.startswith("model.") else key
        for old, new in ALIASES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
        out[name] = value
    return out


@torch.no_grad()
def load_state_dict(model: PI05Model, state: Mapping[str, Tensor], fmt: str = "auto") -> LoadReport:
    """Copy a LeRobot / openpi / ours state dict into `model` (cast to its dtypes). Shapes are
    checked strictly (ValueError naming the source key and our parameter); the report lists
    missing, unexpected and ignored keys instead of failing on them."""
    fmt = detect_format(list(state)) if fmt == "auto" else fmt
    if fmt == "ours":
        return _load_ours(model, state)
    if fmt not in ("lerobot", "openpi"):
        raise ValueError(f"checkpoint format must be 'lerobot', 'openpi' or 'ours', got {fmt!r}")
    source = _canonical_source(state, fmt)
    if LLM + "embed_tokens.weight" not in source and PALIGEMMA_HEAD in source:
        source[LLM + "embed_tokens.weight"] = source[PALIGEMMA_HEAD]  # tied PaliGemma embedding
    report = LoadReport(format=fmt)
    used: set[str] = set()
    for rule in key_rules(model.cfg):
        absent = [name for name in rule.theirs if name not in source]
        if absent:  # the parameter stays as it was; its other parts are known, not unexpected
            report.missing += absent
            used.update(name for name in rule.theirs if name in source)
            continue
        param = model.get_parameter(rule.ours)
        sizes = part_sizes(model, rule)
        parts = []
        for name, rows in zip(rule.theirs, sizes):
            expected = (rows, *param.shape[1:])
            if tuple(source[name].shape) != expected:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(source[name].shape)}, expected {expected} "
                    f"(for our parameter {rule.ours!r} {tuple(param.shape)})"
                )
            parts.append(source[name])
            used.add(name)
        param.copy_(torch.cat(parts, dim=0) if len(parts) > 1 else parts[0])
        report.loaded.append(rule.ours)
    for name in source:
        if name in used:
            continue
        (report.ignored if name in UNUSED_HEADS else report.unexpected).append(name)
    return report


def _load_ours(model: PI05Model, state: Mapping[str, Tensor]) -> LoadReport:
    report = LoadReport(format="ours")
    params = dict(model.named_parameters())
    for name, value in state.items():
        if name not in params:
            report.unexpected.append(name)
            continue
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(params[name].shape)}"
            )
        params[name].copy_(value)
        report.loaded.append(name)
    report.missing = sorted(set(params) - set(state))
    return report


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """A .safetensors file, or a directory holding model.safetensors (LeRobot / openpi layout)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    try:
        return load_file(str(path))
    except SafetensorError as exc:  # its message ("header too large") does not say which file
        raise ValueError(f"checkpoint {path} is not a readable safetensors file: {exc}") from exc


def load_checkpoint(model: PI05Model, path: str | Path, fmt: str = "auto") -> LoadReport:
    """`load_state_dict` of a file; its refusals (format, shape, key mismatch) name the file, which
    the key lists alone do not (a rank building policy.checkpoint said only "cannot tell the format")."""
    state = read_safetensors(path)
    try:
        report = load_state_dict(model, state, fmt)
    except ValueError as exc:
        raise ValueError(f"checkpoint {path}: {exc}") from exc
    report.source = str(path)
    return report


@torch.no_grad()
def export_state_dict(
    model: PI05Model, fmt: str = "lerobot", include_unused_heads: bool = True
) -> dict[str, Tensor]:
    """Ours -> LeRobot ("model." prefix) or openpi names, fused weights split back. The unused
    heads are written as LeRobot has them: the PaliGemma lm_head tied to (a copy of) the token
    embedding, the expert lm_head as zeros (LeRobot never reads either)."""
    if fmt not in ("lerobot", "openpi"):
        raise ValueError(f"export format must be 'lerobot' or 'openpi', got {fmt!r}")
    out: dict[str, Tensor] = {}
    for rule in key_rules(model.cfg):
        param = model.get_parameter(rule.ours).detach()
        for name, part in zip(rule.theirs, param.split(part_sizes(model, rule), dim=0)):
            out[name] = part.clone().contiguous()
    if include_unused_heads:
        embed = model.embed_tokens.weight.detach()
        out[PALIGEMMA_HEAD] = embed.clone()
        out[EXPERT_HEAD] = torch.zeros(
            embed.shape[0], model.cfg.expert.width, dtype=embed.dtype, device=embed.device
        )
    prefix = "model." if fmt == "lerobot" else ""
    return {prefix + k: v for k, v in out.items()}


def save_lerobot_safetensors(model: PI05Model, path: str | Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.cpu() for k, v in export_state_dict(model, "lerobot").items()}, str(path))
