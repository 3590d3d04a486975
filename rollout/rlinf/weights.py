"""RLinf's openpi weight names over our fused parameters, as views: writes land in place.

RLinf's pi0.5 model (`OpenPi0ForRLActionPrediction`, openpi's `PI0Pytorch`) names its weights the
openpi PyTorch way, e.g. `paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.
q_proj.weight` (= LeRobot's names without the leading "model."; policies/loaders.py `key_rules`).
Our model fuses q/k/v and gate/up into one parameter each, so every openpi name is a row slice of
one of our parameters: `tensor.split(part_sizes, dim=0)` of a contiguous parameter gives
contiguous views that share its storage. RLinf's weight syncers write through exactly such
tensors:
- `BucketWeightSyncer.apply` calls `model.load_state_dict(bucket, strict=False)` per bucket:
  `load_openpi_state` copies each tensor into its view (no new storage);
- `PatchWeightSyncer.apply` takes `model.state_dict()` and writes the sparse COO values into the
  2-D views of its tensors (`as_coo_2d_view`): the writes reach our parameters directly.
The data pointers of our parameters never change, so captured CUDA graphs stay valid; what the
fast path derives from the weights (bf16 shadows, AdaRMS tables) must be refreshed afterwards
(`Policy.refresh_weights`; rollout/rlinf/policy.py decides when).

openpi's state dict also has two heads pi0.5 never uses: the PaliGemma `lm_head` (tied to the
token embedding in openpi: we expose the embedding itself under that name, tied the same way) and
the expert's `lm_head` (vocab x expert width): RLinf's patch syncer requires equal key sets on
both sides, so a zero tensor of that shape is exposed when the caller provides one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from policies.loaders import EXPERT_HEAD, PALIGEMMA_HEAD, key_rules, part_sizes
from policies.models.pi05 import PI05Model


def openpi_views(model: PI05Model, expert_head: Tensor | None = None) -> dict[str, Tensor]:
    """openpi name -> detached view of our parameter storage, in openpi's module order."""
    views: dict[str, Tensor] = {}
    for rule in key_rules(model.cfg):
        param = model.get_parameter(rule.ours).detach()
        parts = param.split(part_sizes(model, rule), dim=0) if len(rule.theirs) > 1 else (param,)
        views.update(zip(rule.theirs, parts))
    views[PALIGEMMA_HEAD] = model.embed_tokens.weight.detach()  # tied to the embedding, as in openpi
    if expert_head is not None:
        views[EXPERT_HEAD] = expert_head
    return views


def expert_head_shape(model: PI05Model) -> tuple[int, int]:
    """openpi sizes the unused expert lm_head like the PaliGemma vocabulary."""
    return (model.cfg.vocab_size, model.cfg.expert.width)


@torch.no_grad()
def load_openpi_state(
    model: PI05Model, state: Mapping[str, Tensor], strict: bool, expert_head: Tensor | None = None
) -> tuple[list[str], list[str]]:
    """Copy openpi-named tensors into our parameters in place (cast to their dtype and device).
    Everything is checked before anything is written: a wrong shape raises naming the key (as
    torch does, strict or not), and with `strict` so do missing or unexpected keys.
    -> (missing keys, unexpected keys)."""
    targets = openpi_views(model, expert_head)
    unexpected = [name for name in state if name not in targets]
    missing = [name for name in targets if name not in state]
    bad = [
        f"{name}: got {tuple(value.shape)}, expected {tuple(targets[name].shape)}"
        for name, value in state.items()
        if name in targets and tuple(value.shape) != tuple(targets[name].shape)
    ]
    if bad:
        raise RuntimeError(f"size mismatch loading openpi weights into the vla_rollout policy: {bad[:5]}")
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"openpi state dict does not match the vla_rollout policy: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    for name, value in state.items():
        if name in targets:
            targets[name].copy_(value)
    return missing, unexpected
