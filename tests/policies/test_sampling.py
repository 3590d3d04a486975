"""RL sampling modes, denoise indices, log-probs and the trainer-side recompute."""

from __future__ import annotations

import math

import pytest
import torch

from policies import PolicyConfig, build_policy, flow
from tests.policies.conftest import noise_for, raw_obs


def test_denoise_index_conventions(tiny_policy):
    k = tiny_policy.cfg.sampling.num_steps
    batch = tiny_policy.make_batch(raw_obs(2))
    ode = tiny_policy.sample(batch, mode="eval")
    assert ode.mode == "ode" and (ode.denoise_inds == -1).all()
    assert (ode.logprobs == 0).all() and (ode.step_logprobs == 0).all()
    joint = tiny_policy.sample(batch, mode="sde_all")
    assert joint.denoise_inds.tolist() == [list(range(k))] * 2
    seen = set()
    for seed in range(16):  # fixed seeds: deterministic
        out = tiny_policy.sample(batch, mode="train", generator=torch.Generator().manual_seed(seed))
        assert out.mode == "sde"
        assert (out.denoise_inds == out.denoise_inds[0, 0]).all()  # one index per call (RLinf)
        seen.add(int(out.denoise_inds[0, 0]))
        # only the chosen step is stochastic
        nonzero = [int(s) for s in range(k) if out.step_logprobs[:, s].abs().sum() > 0]
        assert nonzero == [int(out.denoise_inds[0, 0])]
    assert seen == set(range(k))


def test_exclude_last_step():
    policy = build_policy(PolicyConfig.preset("tiny", sampling={"exclude_last_step": True}))
    batch = policy.make_batch(raw_obs(1))
    picks = {
        int(policy.sample(batch, generator=torch.Generator().manual_seed(s)).denoise_inds[0, 0])
        for s in range(30)
    }
    assert picks == {0, 1, 2}


def test_generator_determinism(tiny_policy):
    batch = tiny_policy.make_batch(raw_obs(2))
    a = tiny_policy.sample(batch, mode="sde", generator=torch.Generator().manual_seed(3))
    b = tiny_policy.sample(batch, mode="sde", generator=torch.Generator().manual_seed(3))
    c = tiny_policy.sample(batch, mode="sde", generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.chains, b.chains) and torch.equal(a.denoise_inds, b.denoise_inds)
    assert not torch.equal(a.chains, c.chains)


def test_step_logprob_is_the_injected_gaussian(tiny_policy):
    """x_{k+1} = mean + std * eps  =>  log p = -log std - log(2 pi)/2 - eps^2/2 (element-wise)."""
    cfg = tiny_policy.cfg
    k = cfg.sampling.num_steps
    batch = tiny_policy.make_batch(raw_obs(2))
    noise, steps = noise_for(tiny_policy, 2)
    idx = 1
    out = tiny_policy.sample(
        batch, mode="sde", noise=noise, step_noise=steps, denoise_inds=torch.full((2, k), idx)
    )
    grid = flow.time_grid(k)
    std = float(flow.sde_sigmas(grid, cfg.sampling.noise_level)[idx]) * math.sqrt(
        float(flow.step_deltas(grid)[idx])
    )
    expected = -math.log(std) - 0.5 * math.log(2 * math.pi) - 0.5 * steps[:, idx] ** 2
    torch.testing.assert_close(out.step_logprobs[:, idx], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logprobs, expected[:, :, : cfg.action_dim])
    torch.testing.assert_close(out.chunk_logprob, expected[:, :, : cfg.action_dim].sum(dim=(1, 2)))


def test_joint_logprob_is_mean_over_initial_and_steps(tiny_policy):
    cfg = tiny_policy.cfg
    out = tiny_policy.sample(
        tiny_policy.make_batch(raw_obs(2)),
        mode="sde_all",
        generator=torch.Generator().manual_seed(1),
    )
    x0 = out.chains[:, 0, :, : cfg.action_dim]
    initial = -0.5 * math.log(2 * math.pi) - 0.5 * x0**2
    terms = torch.cat([initial[:, None], out.step_logprobs[..., : cfg.action_dim]], dim=1)
    torch.testing.assert_close(out.logprobs, terms.mean(dim=1))


@pytest.mark.parametrize("preset", ["tiny", "pi05_small"])
@pytest.mark.parametrize("mode", ["sde", "sde_all"])
def test_recompute_matches_rollout(preset, mode, request):
    policy = request.getfixturevalue("tiny_policy" if preset == "tiny" else "small_policy")
    batch = policy.make_batch(raw_obs(2, image_size=64 if preset == "tiny" else 256, seed=4))
    out = policy.sample(batch, mode=mode, generator=torch.Generator().manual_seed(9))
    lp = policy.log_prob(batch, out.chains, out.denoise_inds, mode=mode)
    assert lp.chunk_logprob.requires_grad
    assert float((lp.logprobs.detach() - out.logprobs).abs().max()) <= 1e-5
    assert float((lp.chunk_logprob.detach() - out.chunk_logprob).abs().max()) <= 1e-5 * max(
        1.0, float(out.chunk_logprob.abs().max())
    )


def test_recompute_with_per_sample_indices(tiny_policy):
    """A training batch mixes transitions from calls that picked different steps."""
    batch = tiny_policy.make_batch(raw_obs(2, seed=6))
    outs = [
        tiny_policy.sample(
            batch,
            mode="sde",
            denoise_inds=torch.full((2, 4), s),
            generator=torch.Generator().manual_seed(s),
        )
        for s in (0, 3)
    ]
    chains = torch.stack([outs[0].chains[0], outs[1].chains[1]])
    inds = torch.stack([outs[0].denoise_inds[0], outs[1].denoise_inds[1]])
    lp = tiny_policy.log_prob(batch, chains, inds).logprobs.detach()
    expected = torch.stack([outs[0].logprobs[0], outs[1].logprobs[1]])
    assert float((lp - expected).abs().max()) <= 1e-5


def test_logprob_excludes_padding_dims_and_unexecuted_actions():
    policy = build_policy(PolicyConfig.preset("tiny", sampling={"logprob_chunk": 5}))
    cfg = policy.cfg
    batch = policy.make_batch(raw_obs(2))
    inds = torch.full((2, cfg.sampling.num_steps), 2)
    out = policy.sample(
        batch, mode="sde", denoise_inds=inds, generator=torch.Generator().manual_seed(0)
    )
    assert out.logprobs.shape == (2, 5, cfg.action_dim)
    base = policy.log_prob(batch, out.chains, inds).logprobs
    chains = out.chains.clone()
    chains[:, 3, :, cfg.action_dim :] += 3.0  # padded action dims of the target
    chains[:, 3, 5:, :] += 3.0  # actions beyond logprob_chunk
    torch.testing.assert_close(policy.log_prob(batch, chains, inds).logprobs, base)
    chains[:, 3, :5, : cfg.action_dim] += 0.1
    assert (policy.log_prob(batch, chains, inds).logprobs - base).abs().max() > 1e-3


@pytest.mark.parametrize("expert_only", [True, False])
def test_gradients_reach_the_right_parameters(expert_only):
    policy = build_policy(PolicyConfig.preset("tiny", train_expert_only=expert_only))
    batch = policy.make_batch(raw_obs(2))
    out = policy.sample(batch, mode="sde", generator=torch.Generator().manual_seed(2))
    policy.log_prob(batch, out.chains, out.denoise_inds).chunk_logprob.sum().backward()
    m = policy.model
    for p in (
        m.expert.layers[0].qkv.weight,
        m.time_mlp_in.weight,
        m.action_in_proj.weight,
        m.expert.final_norm.dense.weight,
    ):
        assert p.grad is not None and p.grad.abs().sum() > 0
    vision_grad = m.vision.layers[0].qkv.weight.grad
    prefix_grad = m.prefix.layers[0].gate_up.weight.grad
    if expert_only:
        assert vision_grad is None and prefix_grad is None
    else:
        assert (
            vision_grad is not None and vision_grad.abs().sum() > 0 and prefix_grad.abs().sum() > 0
        )
    names = {id(p) for p in policy.trainable_parameters()}
    assert (id(m.vision.patch_embed.weight) in names) is (not expert_only)


def test_sampling_errors(tiny_policy):
    cfg = tiny_policy.cfg
    k = cfg.sampling.num_steps
    batch = tiny_policy.make_batch(raw_obs(2))
    out = tiny_policy.sample(batch, mode="sde", generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="stochastic mode"):
        tiny_policy.log_prob(batch, out.chains, out.denoise_inds, mode="ode")
    with pytest.raises(ValueError, match=r"chains must be \(B, K\+1"):
        tiny_policy.log_prob(batch, out.chains[:, :-1], out.denoise_inds)
    with pytest.raises(ValueError, match=r"denoise_inds must be in \[0, 4\)"):
        tiny_policy.log_prob(batch, out.chains, torch.full((2, k), k))
    with pytest.raises(ValueError, match="one denoise index for the whole batch"):
        tiny_policy.sample(batch, mode="sde", denoise_inds=torch.tensor([[0] * k, [1] * k]))
    with pytest.raises(ValueError, match="sampling mode must be"):
        tiny_policy.sample(batch, mode="sdx")
    with pytest.raises(ValueError, match=r"noise must be \(B, chunk_size, max_action_dim\)"):
        tiny_policy.sample(batch, noise=torch.zeros(2, cfg.chunk_size, 7))
