"""Model shapes and the normal (fused, cached-prefix) path against the plain reference forward."""

from __future__ import annotations

import pytest
import torch

from policies.models import reference
from tests.policies.conftest import noise_for, raw_obs


def test_prefix_cache_and_velocity_shapes(tiny_policy):
    cfg = tiny_policy.cfg
    inputs = tiny_policy.inputs(tiny_policy.make_batch(raw_obs(3)))
    assert inputs.images.shape == (3, 2, 3, 56, 56)
    cache = tiny_policy.prefix_cache(inputs)
    p = cfg.prefix_len
    assert len(cache.keys) == cfg.prefix.depth
    assert cache.keys[0].shape == (3, cfg.prefix.num_kv_heads, p, cfg.prefix.head_dim)
    assert (
        cache.pad_mask.shape == (3, p) and cache.offsets.tolist() == cache.pad_mask.sum(1).tolist()
    )
    table = tiny_policy.model.modulation_table(torch.tensor([1.0, 0.5]))
    assert table.shape == (2, 2 * cfg.expert.depth + 1, 3 * cfg.expert.width)
    v = tiny_policy.model.velocity(
        cache, torch.zeros(3, cfg.chunk_size, cfg.max_action_dim), table[:1]
    )
    assert v.shape == (3, cfg.chunk_size, cfg.max_action_dim) and v.dtype == torch.float32


@pytest.mark.parametrize("mode", ["ode", "sde", "sde_all"])
def test_sample_output_shapes(tiny_policy, mode):
    cfg = tiny_policy.cfg
    k, h, d = cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim
    out = tiny_policy.sample(
        tiny_policy.make_batch(raw_obs(2)), mode=mode, generator=torch.Generator().manual_seed(0)
    )
    assert out.chains.shape == (2, k + 1, h, d)
    assert out.actions.shape == (2, h, cfg.action_dim) and out.model_actions.shape == (2, h, d)
    assert out.denoise_inds.shape == (2, k) and out.step_logprobs.shape == (2, k, h, d)
    assert out.logprobs.shape == (
        2,
        cfg.logprob_chunk,
        cfg.action_dim,
    ) and out.chunk_logprob.shape == (2,)
    torch.testing.assert_close(out.model_actions, out.chains[:, -1])
    assert torch.isfinite(out.chains).all()


@pytest.mark.parametrize("mode", ["ode", "sde", "sde_all"])
def test_normal_path_matches_reference_tiny(tiny_policy, mode):
    batch = tiny_policy.make_batch(raw_obs(3, seed=5))
    batch.image_masks["left_wrist_0_rgb"][1] = False  # a masked camera in one row
    noise, steps = noise_for(tiny_policy, 3, seed=11)
    inds = torch.full((3, tiny_policy.cfg.sampling.num_steps), 2)
    if mode == "sde_all":
        inds = torch.arange(tiny_policy.cfg.sampling.num_steps).repeat(3, 1)
    kw = {"mode": mode, "noise": noise, "step_noise": steps, "denoise_inds": inds}
    fast = tiny_policy.sample(batch, **kw)
    slow = tiny_policy.sample(batch, reference_path=True, **kw)
    torch.testing.assert_close(fast.chains, slow.chains, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.step_logprobs, slow.step_logprobs, rtol=1e-5, atol=1e-4)
    assert fast.chains.abs().max() > 0.5  # a non-degenerate chain


def test_normal_path_matches_reference_pi05_small(small_policy):
    """Real pi0.5 sequence lengths: 3 x 256 image tokens (one slot masked), 200 prompt tokens."""
    batch = small_policy.make_batch(raw_obs(2, image_size=256, seed=3))
    noise, steps = noise_for(small_policy, 2, seed=4)
    inds = torch.full((2, small_policy.cfg.sampling.num_steps), 6)
    fast = small_policy.sample(batch, mode="sde", noise=noise, step_noise=steps, denoise_inds=inds)
    slow = small_policy.sample(
        batch, mode="sde", noise=noise, step_noise=steps, denoise_inds=inds, reference_path=True
    )
    torch.testing.assert_close(fast.chains, slow.chains, rtol=1e-5, atol=1e-5)


def test_masked_inputs_do_not_matter(tiny_policy):
    """Pixels of a masked camera and ids of padded prompt positions never reach the actions."""
    batch = tiny_policy.make_batch(raw_obs(2, seed=8))
    noise, _ = noise_for(tiny_policy, 2)
    base = tiny_policy.sample(batch, mode="ode", noise=noise).chains
    batch.image_masks["left_wrist_0_rgb"][:] = False
    masked = tiny_policy.sample(batch, mode="ode", noise=noise).chains
    batch.images["left_wrist_0_rgb"] = torch.rand_like(batch.images["left_wrist_0_rgb"]) * 2 - 1
    batch.tokenized_prompt[~batch.tokenized_prompt_mask] = 77
    changed = tiny_policy.sample(batch, mode="ode", noise=noise).chains
    torch.testing.assert_close(masked, changed, rtol=0, atol=1e-6)
    assert (masked - base).abs().max() > 1e-3  # masking itself does change the output


def test_rows_are_independent(tiny_policy):
    batch = tiny_policy.make_batch(raw_obs(3, seed=9))
    noise, _ = noise_for(tiny_policy, 3)
    full = tiny_policy.sample(batch, mode="ode", noise=noise).chains
    one = tiny_policy.sample(batch.select(slice(1, 2)), mode="ode", noise=noise[1:2]).chains
    torch.testing.assert_close(full[1:2], one, rtol=1e-5, atol=1e-5)


def test_velocity_depends_on_time_and_prompt(tiny_policy):
    model = tiny_policy.model
    inputs = tiny_policy.inputs(tiny_policy.make_batch(raw_obs(2, seed=2)))
    cache = tiny_policy.prefix_cache(inputs)
    x = torch.randn(2, tiny_policy.cfg.chunk_size, tiny_policy.cfg.max_action_dim)
    table = model.modulation_table(torch.tensor([1.0, 0.25]))
    v1, v2 = model.velocity(cache, x, table[:1]), model.velocity(cache, x, table[1:])
    assert (v1 - v2).abs().max() > 1e-3
    assert (v1[0] - v1[1]).abs().max() > 1e-4  # different observations, different velocity
    # the reference computes the same velocity from scratch
    embs, pad = reference.embed_prefix(
        model, inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask
    )
    torch.testing.assert_close(
        reference.velocity(model, embs, pad, x, torch.full((2,), 0.25)), v2, rtol=1e-5, atol=1e-5
    )


def test_keys_joined_in_the_autocast_dtype_give_the_promoting_joins_bits(tiny_policy, monkeypatch):
    """Under bf16 autocast the velocity joins each layer's cached and new K/V in bf16 (gemma.join_keys); the plain
    join promoted the bf16 prefix to fp32 and the attention cast it back. Outputs and every gradient (weights, x,
    the cache) must be the promoting join's, bit for bit."""
    from policies.models import gemma, pi05

    model = tiny_policy.model
    inputs = tiny_policy.inputs(tiny_policy.make_batch(raw_obs(3, seed=4)))
    with torch.no_grad():
        cache = tiny_policy.prefix_cache(inputs)
    cache = type(cache)([k.bfloat16() for k in cache.keys], [v.bfloat16() for v in cache.values], cache.pad_mask,
                        cache.offsets)
    x = torch.randn(3, tiny_policy.cfg.chunk_size, tiny_policy.cfg.max_action_dim)
    table = model.modulation_table(torch.tensor([0.75])).detach()

    def run():
        keys = [k.clone().requires_grad_() for k in cache.keys]
        values = [v.clone().requires_grad_() for v in cache.values]
        xs = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = model.velocity(type(cache)(keys, values, cache.pad_mask, cache.offsets), xs, table)
        (v * torch.linspace(-1, 1, v.numel()).reshape(v.shape)).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return v.detach(), xs.grad, [k.grad for k in keys + values], grads

    joined = run()
    assert gemma.join_keys(cache.keys[0], x[:, None, :, :1].expand(-1, 1, -1, cache.keys[0].shape[-1])).dtype \
        == torch.float32  # outside autocast the join promotes, as before
    monkeypatch.setattr(pi05, "join_keys", lambda cached, new: torch.cat([cached, new], dim=2))
    promoted = run()
    assert torch.equal(joined[0], promoted[0]) and torch.equal(joined[1], promoted[1])
    for a, b in zip(joined[2], promoted[2], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    assert joined[3].keys() == promoted[3].keys() and len(joined[3]) > 10
    for name in joined[3]:
        assert torch.equal(joined[3][name], promoted[3][name]), name


def test_bfloat16_precision_policy():
    from policies import PolicyConfig, build_policy

    policy = build_policy(PolicyConfig.preset("tiny", dtype="bfloat16"))
    m = policy.model
    assert (
        m.prefix.layers[0].qkv.weight.dtype == torch.bfloat16
        and m.embed_tokens.weight.dtype == torch.bfloat16
    )
    assert (
        m.vision.layers[0].qkv.weight.dtype == torch.float32
        and m.vision.projector.weight.dtype == torch.float32
    )
    assert m.prefix.layers[0].input_norm.weight.dtype == torch.float32
    assert m.expert.layers[0].input_norm.dense.weight.dtype == torch.float32
    assert (
        m.time_mlp_in.weight.dtype == torch.float32
        and m.action_out_proj.weight.dtype == torch.float32
    )
    batch = policy.make_batch(raw_obs(2))
    noise, _ = noise_for(policy, 2)
    fast = policy.sample(batch, mode="ode", noise=noise).chains
    slow = policy.sample(batch, mode="ode", noise=noise, reference_path=True).chains
    rel = float((fast - slow).norm() / slow.norm())
    assert torch.isfinite(fast).all() and rel < 2e-2


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_grouped_attention_equals_attention_over_repeated_heads(kv_heads):
    """The folded GQA attention against the textbook one: K/V repeated per query head, softmax over unmasked keys,
    in float64 on fresh random inputs with padded keys (a whole row of one sample masked but one key)."""
    from policies.models.gemma import grouped_attention

    g = torch.Generator().manual_seed(kv_heads)
    b, heads, s, t, hd = 3, 8, 5, 11, 16
    q = torch.randn(b, heads, s, hd, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, t, hd, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(b, t, generator=g) > 0.3
    keep[:, 0] = True
    keep[1] = False
    keep[1, 4] = True
    rep = heads // kv_heads
    scores = q @ k.repeat_interleave(rep, dim=1).transpose(-1, -2) / hd**0.5
    weights = scores.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(dim=-1)
    want = weights @ v.repeat_interleave(rep, dim=1)
    got = grouped_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, keep[:, None, None, :])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="without a query dimension"):
        grouped_attention(q, k, v, keep[:, None, None, :].expand(b, 1, s, t))
