"""The consistent log-prob recompute (policies/fast/recompute.py) against the fast-path rollout.

CPU (the fused kernels' PyTorch twins; the flow kernels on Triton, interpreted, at the end):
rows of several rollout calls (different batch and prompt buckets, different stochastic steps)
are shuffled together and re-scored in micro-batches of several sizes; the log-probs must equal
the rollout's bit for bit (torch.equal), and the gradients must match the plain recompute's.
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

from policies.config import PolicyConfig
from policies.fast import kernels as K
from policies.fast.config import FastConfig
from policies.observation import ModelInputs
from policies.policy import build_policy
from tests.policies.test_fast_sampler import random_inputs

# (batch, prompt length, stochastic step) of each rollout call: batches split over the largest
# bucket (5 -> 4 + 1) and padded into a bucket (3 -> 4); prompts landing in different buckets:
# (4, 16), (4, 8), (1, 8), (1, 16), (2, 8).
CALLS = [(3, 13, 1), (5, 7, 2), (1, 16, 0), (2, 5, 3)]


def fast_policy(preset="tiny", dtype="float32", **fast):
    options = {"enabled": True, "dtype": dtype, "batch_buckets": [1, 2, 4], "prompt_buckets": [8, 16], **fast}
    return build_policy(PolicyConfig.preset(preset, fast=options))


def rollout(policy, calls, mode="sde", seed=0):
    """Sample every call through the fast path; returns the rows of all calls concatenated:
    inputs (prompts padded to one length), chains, denoise_inds, log-probs, step log-probs, buckets."""
    cfg, steps = policy.cfg, policy.cfg.sampling.num_steps
    parts = []
    for i, (batch, prompt_len, step) in enumerate(calls):
        inputs, noise, step_noise = random_inputs(cfg, batch, prompt_len, seed=seed + 17 * i)
        inputs.token_mask[0] = True  # the call's prompt bucket is the one that holds prompt_len
        inds = torch.full((batch, steps), step) if mode == "sde" else torch.arange(steps).repeat(batch, 1)
        out = policy.sample(inputs, mode=mode, noise=noise, step_noise=step_noise, denoise_inds=inds)
        parts.append((inputs, out, policy.fast_sampler().last_buckets.clone()))
    width = max(p[0].tokens.shape[1] for p in parts)
    pad = lambda t: F.pad(t, (0, width - t.shape[1]))  # noqa: E731
    inputs = ModelInputs(torch.cat([p[0].images for p in parts]), torch.cat([p[0].image_masks for p in parts]),
                         torch.cat([pad(p[0].tokens) for p in parts]), torch.cat([pad(p[0].token_mask) for p in parts]))
    cat = lambda name: torch.cat([getattr(p[1], name) for p in parts])  # noqa: E731
    return inputs, cat("chains"), cat("denoise_inds"), cat("logprobs"), cat("step_logprobs"), \
        torch.cat([p[2] for p in parts])


def select(inputs, index):
    return ModelInputs(inputs.images[index], inputs.image_masks[index], inputs.tokens[index], inputs.token_mask[index])


def recompute_in_micro_batches(policy, rows, micro, seed=0, kept=None, **kwargs):
    """Shuffled rows re-scored micro-batch by micro-batch -> (log-probs, step log-probs, order); `kept`: every
    row's prefix K/V (a consistent call's returned `prefix`), given to each micro-batch."""
    inputs, chains, inds, _, _, buckets = rows
    order = torch.randperm(len(chains), generator=torch.Generator().manual_seed(seed))
    outs = [policy.log_prob(select(inputs, idx), chains[idx], inds[idx], consistent=True, fast_buckets=buckets[idx],
                            prefix=None if kept is None else kept.index_select(idx), **kwargs)
            for idx in order.split(micro)]
    return torch.cat([o.logprobs for o in outs]), torch.cat([o.step_logprobs for o in outs]), order


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_consistent_equals_rollout_bitwise_tiny(dtype):
    policy = fast_policy(dtype=dtype)
    rows = rollout(policy, CALLS, seed=1)
    assert len({tuple(b) for b in rows[5].tolist()}) == 5, "the calls must cover several buckets"
    for micro, autocast in ((3, False), (len(rows[1]), False), (4, True)):
        # the trainer may run under bf16 autocast (grpo.actor): the recompute must not follow it
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got, _, order = recompute_in_micro_batches(policy, rows, micro, seed=micro)
        assert torch.equal(got, rows[3][order]), f"micro-batch {micro}: {(got - rows[3][order]).abs().max()}"
    plain = policy.log_prob(rows[0], rows[1], rows[2]).logprobs.detach()
    if dtype == "bfloat16":
        assert (plain - rows[3]).abs().max() > 1e-3, "the plain recompute differs from a bf16 rollout"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_consistent_equals_rollout_bitwise_pi05_small(dtype):
    policy = fast_policy("pi05_small", dtype, batch_buckets=[1, 2], prompt_buckets=[32, 200])
    rows = rollout(policy, [(1, 30, 4), (2, 150, 9)], seed=2)
    assert sorted({tuple(b[:2]) for b in rows[5].tolist()}) == [(1, 32), (2, 200)]
    got, _, order = recompute_in_micro_batches(policy, rows, 2)  # with autograd
    assert torch.equal(got.detach(), rows[3][order])


def test_sde_all_equals_rollout_bitwise():
    policy = fast_policy()
    rows = rollout(policy, CALLS[:2], mode="sde_all", seed=3)
    with torch.no_grad():
        got, step_lp, order = recompute_in_micro_batches(policy, rows, 4, mode="sde_all")
    assert torch.equal(step_lp, rows[4][order])
    assert torch.equal(got, rows[3][order])


# two buckets (two prefix lengths: two reference calls in the backward, their rows put back in order) with one step
# each; one bucket whose chunks mix rows of steps 1 and 2 (7 rows of bucket (4, 16): chunks of 3 + 1 and 3 rows),
# scored by one reference call over both chunks with each row's own modulation and step constants
@pytest.mark.parametrize(("calls", "buckets_used"), [([CALLS[0], CALLS[3]], [[2, 8], [4, 16]]),
                                                     ([(3, 13, 1), (4, 14, 2)], [[4, 16]])],
                         ids=["one_step_a_chunk", "mixed_steps_a_chunk"])
def test_gradients_match_plain_recompute_fp32(calls, buckets_used):
    policy = fast_policy()
    inputs, chains, inds, _, _, buckets = rollout(policy, calls, seed=4)
    assert buckets[:, :2].unique(dim=0).tolist() == buckets_used
    weights = torch.randn(len(chains), generator=torch.Generator().manual_seed(0))
    grads = []
    for consistent in (False, True):
        policy.model.zero_grad(set_to_none=True)
        out = policy.log_prob(inputs, chains, inds, consistent=consistent, fast_buckets=buckets)
        (out.chunk_logprob * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    plain, consistent = grads
    assert set(plain) == set(consistent)
    for name in ("time_mlp_in.weight", "expert.layers.0.input_norm.dense.weight", "expert.final_norm.dense.bias",
                 "expert.layers.1.qkv.weight", "action_in_proj.bias", "action_out_proj.weight"):
        assert name in plain and plain[name].abs().max() > 0, name
    for name, want in plain.items():
        err = float((consistent[name] - want).norm() / want.norm().clamp_min(1e-12))
        assert err < 1e-4, (name, err)


def test_modulation_table_with_autograd_equals_buffer():
    from policies.fast.recompute import modulation_table

    policy = fast_policy()
    sampler = policy.fast_sampler()
    buffer = sampler.w.table.clone()
    table = modulation_table(sampler)
    assert table.requires_grad and table.dtype == torch.float32
    assert torch.equal(table.detach(), buffer)


def test_pinned_buckets_and_config_flag():
    """One-entry bucket lists pin every row's bucket: no fast_buckets needed; the config flag
    makes consistent the default."""
    policy = fast_policy(batch_buckets=[4], prompt_buckets=[16], attention="sdpa", consistent_recompute=True)
    inputs, chains, inds, logprobs, _, _ = rollout(policy, CALLS[:2], seed=5)
    with torch.no_grad():
        assert torch.equal(policy.log_prob(inputs, chains, inds).logprobs, logprobs)


@pytest.mark.parametrize("update,engine_dtype", [("in_place_add", "bfloat16"), ("fused_adamw", "float32")])
def test_weight_update_is_followed_across_instances(update, engine_dtype):
    """Trainer and rollout as separate policy objects (as in separate processes). The trainer's
    fp32 weights change in place without a refresh call (its fast path keeps bf16 shadows of
    them): by add_ (bumps version counters) or a fused AdamW step (does not). Its consistent
    recompute must still reproduce a rollout made at the new weights by an engine holding them
    in fp32 or as a bf16 policy (policy.dtype=bfloat16: the weights synced by a cast)."""
    trainer = fast_policy(dtype="bfloat16")
    trainer.sample(*random_inputs(trainer.cfg, 2, 9, seed=6)[:1], mode="sde")  # fast path built at the old weights
    trainable = {id(p) for p in trainer.trainable_parameters()}
    for p in trainer.model.parameters():
        p.requires_grad_(id(p) in trainable)
    if update == "in_place_add":
        with torch.no_grad():
            for p in trainer.trainable_parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    else:
        optimizer = torch.optim.AdamW(trainer.trainable_parameters(), lr=3e-2, fused=True)
        inputs, chains, inds, _, _, _ = rollout(trainer, CALLS[:1], seed=11)
        trainer.log_prob(inputs, chains, inds).chunk_logprob.sum().backward()
        optimizer.step()
    engine = build_policy(PolicyConfig.preset("tiny", dtype=engine_dtype, fast=dataclasses.asdict(trainer.cfg.fast)))
    engine.model.load_state_dict(trainer.model.state_dict())
    rows = rollout(engine, CALLS[:2], seed=7)
    with torch.no_grad():
        got, _, order = recompute_in_micro_batches(trainer, rows, 4)
    assert torch.equal(got, rows[3][order])


def test_fp8_trainer_with_fp32_masters_reproduces_a_bf16_engine_bitwise():
    """GRPO's trainer keeps fp32 master weights (grpo.trainer.trainer_policy_config), the engine a bf16
    model synced by a cast: with precision=fp8 both must quantise the same FP8 copies (from the bf16
    value), so the consistent recompute still equals the rollout bit for bit (it differed by ~1e-2 nats)."""
    fast = {"enabled": True, "attention": "sdpa", "precision": "fp8", "batch_buckets": [4], "prompt_buckets": [16],
            "fp8_gemms": ["prefix_gate_up", "prefix_down", "prefix_qkv"], "consistent_recompute": True}
    trainer = build_policy(PolicyConfig.preset("tiny", dtype="float32", fast=fast))
    engine = build_policy(PolicyConfig.preset("tiny", dtype="bfloat16", fast=fast))
    engine.model.load_state_dict(trainer.model.state_dict())  # a weight sync: fp32 -> bf16
    inputs, chains, inds, logprobs, _, _ = rollout(engine, CALLS[:2], seed=12)
    with torch.no_grad():
        got = trainer.log_prob(inputs, chains, inds).logprobs
    ours, theirs = trainer.fast_sampler().w.fp8_weights, engine.fast_sampler().w.fp8_weights
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
    assert torch.equal(got, logprobs), f"gap {(got - logprobs).abs().max()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_kept_prefix_gives_the_rollout_bits_and_the_same_gradients(dtype):
    """grpo.prefix_cache with the consistent recompute: a call's returned prefix K/V, given back for the rows in
    another order and other micro-batches, replaces vision and prefix without changing a bit."""
    policy = fast_policy(dtype=dtype)
    inputs, chains, inds, logprobs, _, buckets = rows = rollout(policy, [CALLS[1], CALLS[3]], seed=6)
    assert {tuple(b[:2]) for b in buckets.tolist()} == {(4, 8), (1, 8), (2, 8)}  # one prompt bucket, 3 batch ones
    with torch.no_grad():
        first = policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets, return_prefix=True)
    assert torch.equal(first.logprobs, logprobs) and first.prefix.offsets.shape == (len(chains),)
    got, _, order = recompute_in_micro_batches(policy, rows, 3, seed=1)  # without a prefix, with autograd
    kept, _, _ = recompute_in_micro_batches(policy, rows, 3, seed=1, kept=first.prefix)
    assert torch.equal(kept.detach(), logprobs[order]) and torch.equal(got.detach(), kept.detach())
    weights = torch.randn(len(chains), generator=torch.Generator().manual_seed(0))
    grads = []
    for prefix in (None, first.prefix.index_select(order)):
        policy.model.zero_grad(set_to_none=True)
        out = policy.log_prob(select(inputs, order), chains[order], inds[order], consistent=True,
                              fast_buckets=buckets[order], prefix=prefix)
        (out.chunk_logprob * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) > 0
    for name, want in grads[0].items():
        assert torch.equal(grads[1][name], want), name


def test_a_kept_prefix_is_refused_where_it_cannot_be_the_rows():
    policy = fast_policy()
    inputs, chains, inds, _, _, buckets = rollout(policy, [CALLS[1], CALLS[3]], seed=6)
    with torch.no_grad():
        plain = policy.log_prob(inputs, chains, inds, consistent=False, return_prefix=True).prefix
        with pytest.raises(ValueError, match="not these rows' in their bucket's layout"):
            policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets, prefix=plain)
        kept = policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets, return_prefix=True).prefix
        others = kept.index_select(torch.arange(len(chains)).flip(0))  # the right layout's length, other rows' counts
        assert not torch.equal(others.offsets, kept.offsets)
        with pytest.raises(ValueError, match="not these rows' in their bucket's layout"):
            policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets, prefix=others)
        mixed = rollout(policy, CALLS[:2], seed=7)  # prompt buckets 16 and 8: K/V of two lengths
        with pytest.raises(ValueError, match=r"several prefix lengths .*one-entry policy.fast.prompt_buckets"):
            policy.log_prob(mixed[0], mixed[1], mixed[2], consistent=True, fast_buckets=mixed[5], return_prefix=True)


def test_errors_name_the_problem():
    policy = fast_policy()
    inputs, chains, inds, _, _, buckets = rollout(policy, CALLS[:1], seed=8)
    with pytest.raises(ValueError, match="policy.fast.batch_buckets"):
        policy.log_prob(inputs, chains, inds, consistent=True)
    with pytest.raises(ValueError, match="fast_buckets must be"):
        policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets[:1])
    with pytest.raises(ValueError, match="cannot hold"):
        policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=torch.tensor([[4, 8]]).repeat(3, 1))
    plain = build_policy(PolicyConfig.preset("tiny"))
    with pytest.raises(ValueError, match="policy.fast.enabled"):
        plain.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets)
    full = build_policy(PolicyConfig.preset("tiny", train_expert_only=False, fast={"enabled": True}))
    with pytest.raises(ValueError, match="policy.train_expert_only"):
        full.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets)
    with pytest.raises(ValueError, match="policy.fast.attention"):
        FastConfig(enabled=True, consistent_recompute=True)
    with pytest.raises(ValueError, match="policy.fast.consistent_recompute needs"):
        FastConfig(attention="sdpa", consistent_recompute=True)


# ----------------------------------------------------------------------------- Triton (interpreter on CPU)

def test_flow_logprob_twins_equal_rollout_kernels_bitwise():
    """Scoring the x_{k+1} that flow_step drew gives flow_step's own log-prob, bit for bit, for
    both the Triton kernel and the PyTorch twin."""
    pytest.importorskip("triton")
    from policies import flow
    from policies.fast import flow_logprob as FL

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(9)
    batch, steps, h, d = 3, 4, 5, 6
    grid = flow.time_grid(steps)
    deltas, sigmas = flow.step_deltas(grid), flow.sde_sigmas(grid, 0.5)
    stochastic = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4]).to(device)
    for k in range(steps):
        consts = (float(grid[k]), float(deltas[k]), float(sigmas[k]))
        chains = torch.randn(batch, steps + 1, h, d, generator=g).to(device)
        v = torch.randn(batch, h, d, generator=g).to(device)
        noise = torch.randn(batch, steps, h, d, generator=g).to(device)
        for step_fn, twin in ((K.flow_step_reference, FL.flow_logprob_reference),
                              (K.flow_step_triton, FL.flow_logprob_triton)):
            drawn, want = chains.clone(), torch.zeros(batch, steps, h, d, device=device)
            step_fn(drawn, v, noise, stochastic, want, k, *consts, -1.0 / steps)
            got = torch.full_like(want, float("nan"))
            twin(drawn, v, stochastic, got, k, *consts)
            assert torch.equal(got[:, k], want[:, k]), (step_fn.__name__, k)


def test_autograd_wrapper_with_triton_flow_kernels(monkeypatch):
    """The rollout's flow_step and the recompute's flow_logprob on Triton (the interpreter on CPU),
    inside the full pipeline with autograd. The other kernels stay on their PyTorch twins here:
    the whole fast path under the interpreter takes minutes (test_fast_kernels covers them)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setattr(K, "triton_usable", lambda t: t.dim() == 4)  # only (B, K+1, H, D) chains
    policy = fast_policy()
    rows = rollout(policy, [CALLS[0], CALLS[2]], seed=10)
    got, _, order = recompute_in_micro_batches(policy, rows, 4)
    assert torch.equal(got.detach(), rows[3][order])
    got.sum().backward()
    assert policy.model.time_mlp_in.weight.grad.abs().max() > 0


def test_a_backward_split_by_its_byte_budget_sums_to_the_same_gradients(monkeypatch):
    """REFERENCE_BYTES so small that each chunk gets its own reference call (2 chunks here): the gradients summed
    over the calls equal one call's, to fp32 rounding."""
    from policies.fast import autograd

    policy = fast_policy()
    inputs, chains, inds, _, _, buckets = rollout(policy, [(3, 13, 1), (4, 14, 2)], seed=4)
    weights = torch.randn(len(chains), generator=torch.Generator().manual_seed(0))
    calls = []
    gather = autograd.CallRun.reference_inputs
    monkeypatch.setattr(autograd.CallRun, "reference_inputs", lambda self, members: calls.append(members) or
                        gather(self, members))
    grads = []
    for budget in (autograd.REFERENCE_BYTES, 1):
        monkeypatch.setattr(autograd, "REFERENCE_BYTES", budget)
        policy.model.zero_grad(set_to_none=True)
        out = policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets)
        (out.chunk_logprob * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert calls == [[0, 1], [0], [1]]
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) > 0
    for name, want in grads[0].items():
        err = float((grads[1][name] - want).norm() / want.norm().clamp_min(1e-12))
        assert err < 1e-5, (name, err)


def test_sde_all_gradients_match_plain_recompute_fp32():
    """Every step of every row scored ("sde_all"): a row's K steps are K rows of the backward's reference call."""
    policy = fast_policy()
    inputs, chains, inds, _, _, buckets = rollout(policy, [(3, 13, 0), (4, 14, 0)], mode="sde_all", seed=5)
    weights = torch.randn(len(chains), generator=torch.Generator().manual_seed(1))
    grads = []
    for consistent in (False, True):
        policy.model.zero_grad(set_to_none=True)
        out = policy.log_prob(inputs, chains, inds, mode="sde_all", consistent=consistent, fast_buckets=buckets)
        (out.chunk_logprob * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    plain, consistent = grads
    assert set(plain) == set(consistent) and plain["expert.layers.1.qkv.weight"].abs().max() > 0
    for name, want in plain.items():
        err = float((consistent[name] - want).norm() / want.norm().clamp_min(1e-12))
        assert err < 1e-4, (name, err)


def test_rows_of_one_step_share_chunks_so_fewer_graphs_run():
    # two calls of 4 rows (one bucket), steps 1 and 2, interleaved: in the given order every 4-row chunk holds
    # both steps (4 step runs); grouped by step, each chunk holds one (2 runs), with the same log-probs
    from policies.fast import recompute

    policy = fast_policy(batch_buckets=[4], prompt_buckets=[16])
    inputs, chains, inds, logprobs, _, buckets = rollout(policy, [(4, 9, 1), (4, 11, 2)], seed=3)
    mixed = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    assert torch.equal(recompute.step_sorted(mixed, inds), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))
    runs = []
    sampler = policy.fast_sampler()
    original = sampler.run_stage

    def counted(bucket, stage, fn=None):
        runs.append(stage)
        return original(bucket, stage, fn)

    sampler.run_stage = counted
    try:
        with torch.no_grad():
            out = policy.log_prob(select(inputs, mixed), chains[mixed], inds[mixed], consistent=True,
                                  fast_buckets=buckets[mixed])
    finally:
        del sampler.run_stage
    assert sorted(stage for stage in runs if stage.startswith("recompute/")) == ["recompute/1", "recompute/2"]
    assert torch.equal(out.logprobs, logprobs[mixed])
