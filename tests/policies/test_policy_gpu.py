"""GPU checks of the normal (non-graph) path; the lead runs them on the H200 box.

    python -m pytest tests/policies/test_policy_gpu.py -q -s        # -s prints the measured gaps

- bf16 normal path vs the plain reference forward (relative L2 of the chains).
- the trainer-side recompute vs the rollout log-probs in bf16 (the gap is printed).
- full-size pi05 against LeRobot 0.6.1 itself when `lerobot` imports (Python 3.12 there): LeRobot
  random weights (AdaRMS dense weights randomised, LeRobot zero-inits them) loaded into ours,
  same inputs and noise, bf16 on both sides: relative L2 of the actions <= 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from policies import PolicyConfig, build_policy
from policies.lerobot_bridge import relative_l2
from tests.policies.conftest import noise_for, raw_obs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_small():
    return build_policy(PolicyConfig.preset("pi05_small", dtype="bfloat16"), device="cuda")


def test_bf16_normal_path_vs_reference(gpu_small):
    batch = gpu_small.make_batch(raw_obs(4, image_size=256))
    noise, steps = noise_for(gpu_small, 4)
    k = gpu_small.cfg.sampling.num_steps
    kw = {
        "mode": "sde",
        "noise": noise.cuda(),
        "step_noise": steps.cuda(),
        "denoise_inds": torch.full((4, k), 3),
    }
    fast = gpu_small.sample(batch, **kw).chains
    slow = gpu_small.sample(batch, reference_path=True, **kw).chains
    rel = relative_l2(fast, slow)
    print(f"\npi05_small bf16 cuda: normal vs reference chains rel L2 {rel:.3e}")
    assert rel < 2e-2


@pytest.mark.parametrize("mode", ["sde", "sde_all"])
def test_bf16_recompute_gap(gpu_small, mode):
    batch = gpu_small.make_batch(raw_obs(8, image_size=256, seed=1))
    out = gpu_small.sample(
        batch, mode=mode, generator=torch.Generator(device="cuda").manual_seed(0)
    )
    lp = gpu_small.log_prob(batch, out.chains, out.denoise_inds, mode=mode)
    gap = (lp.chunk_logprob.detach() - out.chunk_logprob).abs()
    elem = (lp.logprobs.detach() - out.logprobs).abs().max()
    print(
        f"\npi05_small bf16 cuda {mode}: |chunk logprob| ~{float(out.chunk_logprob.abs().mean()):.1f}, "
        f"recompute gap max {float(gap.max()):.3e} (per element max {float(elem):.3e})"
    )
    assert torch.isfinite(lp.chunk_logprob).all()
    assert float(gap.max()) <= 1e-2 * max(1.0, float(out.chunk_logprob.abs().max()))


def test_full_pi05_matches_lerobot_bf16():
    try:
        from lerobot.policies.pi05 import modeling_pi05
        from lerobot.policies.pi05.configuration_pi05 import PI05Config
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"lerobot 0.6.1 not importable: {exc}")
    from policies.lerobot_bridge import build_lerobot_core, lerobot_inputs, load_lerobot_into_ours

    cfg = PolicyConfig.preset("pi05", dtype="bfloat16")
    with torch.device("cuda"):
        core = build_lerobot_core(
            modeling_pi05, cfg, config=PI05Config(dtype="bfloat16", device="cuda")
        ).eval()
    with torch.no_grad():
        for name, p in core.named_parameters():
            if "dense.weight" in name:
                p.normal_(0, 0.02)
    policy = build_policy(cfg.replace(seed=1), device="cuda")
    report = load_lerobot_into_ours(policy.model, core)
    assert report.complete, report.summary()
    batch = policy.make_batch(raw_obs(2, image_size=256))
    inputs = policy.inputs(batch)
    noise, _ = noise_for(policy, 2)
    noise = noise.cuda()
    ours = policy.sample(inputs, mode="ode", noise=noise).model_actions
    with torch.no_grad():
        theirs = core.sample_actions(*lerobot_inputs(inputs), noise=noise.clone())
    rel = relative_l2(ours, theirs)
    print(f"\nfull pi05 bf16: ours vs LeRobot 0.6.1 actions rel L2 {rel:.3e}")
    assert rel <= 2e-2
