"""Write tests/policies/fixtures/lerobot_pi05_parity.safetensors from LeRobot 0.6.1's own code.

    LEROBOT_SITE=/path/to/unpacked/site python tests/policies/make_lerobot_fixture.py

(or on a machine where lerobot 0.6.1 imports). Builds our model at FIXTURE sizes with a fixed
seed, exports it to LeRobot names, loads that into LeRobot's `PI05Pytorch` (strict), and stores
the LeRobot-format weights, the inputs (2 samples: a masked camera, prompts of different
lengths), the noise, and LeRobot's `sample_actions` output in fp32 and bf16, plus LeRobot's
state-dict key names and shapes for these sizes. tests/policies/test_lerobot_parity.py checks
our model against the stored outputs without needing LeRobot.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lerobot_stub import load_lerobot_pi05

from policies.config import PolicyConfig
from policies.lerobot_bridge import build_lerobot_core, lerobot_inputs, load_ours_into_lerobot
from policies.loaders import export_state_dict
from policies.models.pi05 import PI05Model

OUT = Path(__file__).resolve().parent / "fixtures" / "lerobot_pi05_parity.safetensors"
KEYS_OUT = Path(__file__).resolve().parent / "fixtures" / "lerobot_pi05_full_keys.json"
FIXTURE = {
    "vision": {
        "image_size": 28,
        "patch_size": 14,
        "width": 16,
        "depth": 2,
        "num_heads": 2,
        "mlp_dim": 32,
    },
    "prefix": {
        "width": 32,
        "depth": 2,
        "mlp_dim": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
    },
    "expert": {
        "width": 16,
        "depth": 2,
        "mlp_dim": 32,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
    },
    "vocab_size": 300,
    "chunk_size": 5,
    "max_action_dim": 8,
    "max_state_dim": 8,
    "max_token_len": 12,
    "sampling": {"num_steps": 3},
    "seed": 7,
}


def fixture_config(dtype: str = "float32") -> PolicyConfig:
    return PolicyConfig.preset("tiny", dtype=dtype, **FIXTURE)


def fixture_inputs(cfg: PolicyConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    b, c, r = 2, len(cfg.cameras), cfg.vision.image_size
    tokens = torch.randint(3, cfg.vocab_size, (b, cfg.max_token_len), generator=gen)
    token_mask = torch.zeros(b, cfg.max_token_len, dtype=torch.bool)
    token_mask[0, :9] = True
    token_mask[1, :5] = True
    tokens[~token_mask] = 0
    image_masks = torch.ones(b, c, dtype=torch.bool)
    image_masks[1, 1] = False
    return {
        "images": torch.rand(b, c, 3, r, r, generator=gen) * 2 - 1,
        "image_masks": image_masks,
        "tokens": tokens,
        "token_mask": token_mask,
        "noise": torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=gen),
    }


def main() -> None:
    from safetensors.torch import save_file

    from policies.observation import ModelInputs

    modeling = load_lerobot_pi05()
    if modeling is None:
        raise SystemExit(
            "LeRobot 0.6.1 pi05 is not importable: set LEROBOT_SITE (see tests/policies/lerobot_stub.py)"
        )
    cfg = fixture_config()
    model = PI05Model(cfg)
    model.init_weights(cfg.seed, cfg.init_scale)
    data = fixture_inputs(cfg)
    inputs = ModelInputs(data["images"], data["image_masks"], data["tokens"], data["token_mask"])
    tensors = {f"input.{k}": v for k, v in data.items()}
    for dtype in ("float32", "bfloat16"):
        core = build_lerobot_core(modeling, fixture_config(dtype)).eval()
        load_ours_into_lerobot(core, model)
        core.paligemma_with_expert.to_bfloat16_for_selected_params(dtype)
        with torch.no_grad():
            actions = core.sample_actions(
                *lerobot_inputs(inputs),
                noise=data["noise"].clone(),
                num_steps=cfg.sampling.num_steps,
            )
        tensors[f"lerobot.actions.{dtype}"] = actions.float()
    keys = {k: list(v.shape) for k, v in build_lerobot_core(modeling, cfg).state_dict().items()}
    # The expert lm_head (vocab 257152 x width, unused) is left out to keep the file small.
    weights = {
        f"weights.{k}": v
        for k, v in export_state_dict(model, "lerobot").items()
        if "gemma_expert.lm_head" not in k
    }
    save_file(
        {**tensors, **weights},
        str(OUT),
        metadata={"config": json.dumps(FIXTURE), "lerobot_keys": json.dumps(keys)},
    )
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB)")
    write_full_size_keys(modeling)


def write_full_size_keys(modeling) -> None:
    """LeRobot's state-dict names/shapes for the full pi05 (built on the meta device), with layer
    indices collapsed to "N" and counted."""
    import re

    with torch.device("meta"):
        core = build_lerobot_core(modeling, PolicyConfig.preset("pi05"))
    patterns: dict[str, dict] = {}
    for name, tensor in core.state_dict().items():
        entry = patterns.setdefault(
            re.sub(r"\.\d+\.", ".N.", name), {"shape": list(tensor.shape), "count": 0}
        )
        entry["count"] += 1
    total = sum(t.numel() for t in core.state_dict().values())
    KEYS_OUT.write_text(
        json.dumps(
            {"num_keys": len(core.state_dict()), "num_elements": total, "patterns": patterns},
            indent=1,
        )
    )
    print(f"wrote {KEYS_OUT}")


if __name__ == "__main__":
    main()
