"""Our model against LeRobot 0.6.1's own pi05 code.

The fixture (tests/policies/make_lerobot_fixture.py) holds LeRobot-format weights, inputs with a
masked camera and padded prompts, and LeRobot's `sample_actions` output in fp32 and bf16: this
test loads the weights with our LeRobot loader and must reproduce LeRobot's actions. The live
test builds LeRobot itself (where importable, or with LEROBOT_SITE; see lerobot_stub.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from policies.lerobot_bridge import relative_l2
from policies.loaders import load_state_dict
from policies.models.pi05 import PI05Model
from policies.observation import ModelInputs
from policies.sampling import run_chain
from tests.policies.make_lerobot_fixture import fixture_config, fixture_inputs

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "lerobot_pi05_parity.safetensors"


def load_fixture():
    with safe_open(str(FIXTURE), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        config = json.loads(f.metadata()["config"])
    return tensors, config


def our_actions(dtype: str, weights: dict, data: dict) -> torch.Tensor:
    cfg = fixture_config(dtype)
    model = PI05Model(cfg)
    report = load_state_dict(model, weights, "lerobot")
    assert report.complete, report.summary()
    model.apply_precision(dtype)
    inputs = ModelInputs(data["images"], data["image_masks"], data["tokens"], data["token_mask"])
    with torch.no_grad():
        cache = model.prefix_cache(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)
        chains, _ = run_chain(model, cache, data["noise"], [False] * cfg.sampling.num_steps, cfg.sampling.noise_level)
    return chains[:, -1]


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_matches_stored_lerobot_actions(dtype, tolerance):
    tensors, config = load_fixture()
    from tests.policies.make_lerobot_fixture import FIXTURE as SIZES

    assert config == json.loads(json.dumps(SIZES))
    weights = {k[len("weights."):]: v for k, v in tensors.items() if k.startswith("weights.")}
    data = {k[len("input."):]: v for k, v in tensors.items() if k.startswith("input.")}
    expected = tensors[f"lerobot.actions.{dtype}"]
    ours = our_actions(dtype, weights, data)
    assert relative_l2(ours, expected) <= tolerance
    # the fixture's inputs are the ones the generator script builds (so it can be regenerated)
    regenerated = fixture_inputs(fixture_config())
    for name, value in regenerated.items():
        assert torch.equal(value, data[name]), name


def test_live_lerobot_parity_tiny():
    from tests.policies.lerobot_stub import load_lerobot_pi05

    modeling = load_lerobot_pi05()
    if modeling is None:
        pytest.skip("LeRobot 0.6.1 pi05 not importable (set LEROBOT_SITE, see tests/policies/lerobot_stub.py)")
    from policies import PolicyConfig, build_policy
    from policies.lerobot_bridge import build_lerobot_core, lerobot_inputs, load_lerobot_into_ours
    from tests.policies.conftest import noise_for, raw_obs

    cfg = PolicyConfig.preset("tiny")
    core = build_lerobot_core(modeling, cfg).eval()
    with torch.no_grad():  # give LeRobot's zero-initialised AdaRMS dense weights some values
        for name, p in core.named_parameters():
            if "dense.weight" in name:
                p.normal_(0, 0.2)
    policy = build_policy(cfg)
    report = load_lerobot_into_ours(policy.model, core)
    assert report.complete and len(report.ignored) == 2
    batch = policy.make_batch(raw_obs(2, seed=1))
    batch.image_masks["left_wrist_0_rgb"][0] = False
    inputs = policy.inputs(batch)
    noise, _ = noise_for(policy, 2)
    ours = policy.sample(inputs, mode="ode", noise=noise).model_actions
    with torch.no_grad():
        theirs = core.sample_actions(*lerobot_inputs(inputs), noise=noise.clone(), num_steps=cfg.sampling.num_steps)
    assert relative_l2(ours, theirs) <= 1e-5
