"""Side-by-side helpers for LeRobot 0.6.1's pi05 (the GPU bench and the parity tests use them).

Nothing here imports LeRobot at module import; callers pass the imported
`lerobot.policies.pi05.modeling_pi05` module (the real package on the GPU machine, Python 3.12,
or tests/policies/lerobot_stub.py's loader on this CPU box).

- `build_lerobot_core(modeling, cfg)` builds LeRobot's `PI05Pytorch` with our config's sizes.
  The full "pi05" preset maps onto LeRobot's own variants untouched ("gemma_2b" /
  "gemma_300m", So400m); smaller presets patch `get_gemma_config` and the PaliGemma vision /
  vocab sizes LeRobot hard-codes, only for the duration of the constructor.
- `lerobot_inputs(inputs)` turns our `ModelInputs` into `sample_actions` arguments: a list of
  per-camera (B, 3, R, R) images in [-1, 1] (camera order = policy.cameras), a list of (B,)
  masks, tokens, token mask.
- `load_ours_into_lerobot` / `load_lerobot_into_ours` move the same weights across.
"""

from __future__ import annotations

import contextlib
from types import ModuleType, SimpleNamespace

import torch
from torch import Tensor

from policies.config import PolicyConfig
from policies.loaders import LoadReport, export_state_dict, load_state_dict
from policies.models.pi05 import PI05Model
from policies.observation import ModelInputs

PI05_VISION = {
    "image_size": 224,
    "patch_size": 14,
    "width": 1152,
    "depth": 27,
    "num_heads": 16,
    "mlp_dim": 4304,
}


def lerobot_config(cfg: PolicyConfig) -> SimpleNamespace:
    """The PI05Config fields `PI05Pytorch` reads (use the real PI05Config(**vars(...)) when available)."""
    return SimpleNamespace(
        paligemma_variant="gemma_2b",
        action_expert_variant="gemma_300m",
        dtype=cfg.dtype,
        chunk_size=cfg.chunk_size,
        n_action_steps=cfg.chunk_size,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
        num_inference_steps=cfg.sampling.num_steps,
        min_period=cfg.min_period,
        max_period=cfg.max_period,
        image_resolution=(cfg.vision.image_size, cfg.vision.image_size),
        tokenizer_max_length=cfg.max_token_len,
        freeze_vision_encoder=False,
        train_expert_only=False,
        compile_model=False,
        rtc_config=None,
    )


def _is_full_size(cfg: PolicyConfig) -> bool:
    ref = PolicyConfig()
    vision_same = all(getattr(cfg.vision, k) == v for k, v in PI05_VISION.items())
    return (
        vision_same
        and cfg.prefix == ref.prefix
        and cfg.expert == ref.expert
        and cfg.vocab_size == ref.vocab_size
    )


@contextlib.contextmanager
def _patched_sizes(modeling: ModuleType, cfg: PolicyConfig):
    """Make LeRobot build our (small) sizes: its variants, vision config and vocab are hard-coded."""
    if _is_full_size(cfg):
        yield
        return
    gemma_cfg_cls = modeling.GemmaConfig
    sizes = {"gemma_2b": cfg.prefix, "gemma_300m": cfg.expert}

    def get_gemma_config(variant: str):
        g = sizes[variant]
        return gemma_cfg_cls(g.width, g.depth, g.mlp_dim, g.num_heads, g.num_kv_heads, g.head_dim)

    base = modeling.PaliGemmaForConditionalGenerationWithPiGemma

    class SmallPaliGemma(base):  # type: ignore[misc, valid-type]
        def __init__(self, config):
            v = config.vision_config
            v.hidden_size, v.num_hidden_layers = cfg.vision.width, cfg.vision.depth
            v.num_attention_heads, v.intermediate_size = cfg.vision.num_heads, cfg.vision.mlp_dim
            v.patch_size, v.image_size, v.projection_dim = (
                cfg.vision.patch_size,
                cfg.vision.image_size,
                cfg.prefix.width,
            )
            config.text_config.vocab_size = cfg.vocab_size
            super().__init__(config)

    saved = modeling.get_gemma_config, modeling.PaliGemmaForConditionalGenerationWithPiGemma
    modeling.get_gemma_config, modeling.PaliGemmaForConditionalGenerationWithPiGemma = (
        get_gemma_config,
        SmallPaliGemma,
    )
    try:
        yield
    finally:
        modeling.get_gemma_config, modeling.PaliGemmaForConditionalGenerationWithPiGemma = saved


def build_lerobot_core(modeling: ModuleType, cfg: PolicyConfig, config=None) -> torch.nn.Module:
    """LeRobot `PI05Pytorch` with cfg's sizes (random LeRobot init; load weights next)."""
    with _patched_sizes(modeling, cfg):
        return modeling.PI05Pytorch(config if config is not None else lerobot_config(cfg))


def load_ours_into_lerobot(core: torch.nn.Module, model: PI05Model) -> None:
    """Our weights -> LeRobot `PI05Pytorch` (strict; the expert lm_head is resized if the vocab differs)."""
    state = {k[len("model.") :]: v for k, v in export_state_dict(model, "lerobot").items()}
    head = "paligemma_with_expert.gemma_expert.lm_head.weight"
    theirs = core.state_dict()[head]
    if tuple(state[head].shape) != tuple(
        theirs.shape
    ):  # unused; LeRobot sizes it with the 257152 vocab
        state[head] = torch.zeros_like(theirs)
    result = core.load_state_dict(state, strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"LeRobot load mismatch: {result}")


def load_lerobot_into_ours(model: PI05Model, core: torch.nn.Module) -> LoadReport:
    """LeRobot `PI05Pytorch` (or PI05Policy.model) weights -> ours; returns the key report."""
    state = {"model." + k: v for k, v in core.state_dict().items()}
    return load_state_dict(model, state, "lerobot")


def lerobot_inputs(inputs: ModelInputs) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    cams = inputs.images.shape[1]
    return (
        [inputs.images[:, c] for c in range(cams)],
        [inputs.image_masks[:, c] for c in range(cams)],
        inputs.tokens,
        inputs.token_mask,
    )


def relative_l2(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
