"""Consistent recompute on CUDA: bf16 fast path with CUDA graphs, compiled Triton kernels. Marker gpu.

    python -m pytest tests/policies/test_consistent_gpu.py -q -s     # -s prints the measured gaps

Rows of several graphed rollout calls (batch buckets 8/16/32, prompt buckets 32/64, different
stochastic steps, a masked camera, ragged prompts) are shuffled and re-scored in micro-batches:
- consistent recompute (the same policy object, and a second object with the same weights, as a
  trainer in another process would be): every element equal to the rollout's (torch.equal);
- the plain recompute in bf16 and in fp32: the gaps the consistent mode removes (printed, > 0);
- gradients of the consistent recompute against the fp32 plain recompute's (printed, loose bound).
Sizes: "small" (tiny widths with the real head_dim 256 and head counts) and "pi05_libero" (the
full pi0.5 widths, random weights, LIBERO's shapes: 2 cameras, chunk 10, 4 steps).
"""

from __future__ import annotations

import json

import pytest
import torch

from policies.config import PolicyConfig
from policies.lerobot_bridge import relative_l2
from policies.observation import ModelInputs
from policies.policy import build_policy

pytestmark = pytest.mark.gpu

# (batch, prompt length, stochastic step) per rollout call
CALLS = [(16, 20, 1), (5, 40, 2), (9, 28, 0), (32, 60, 3), (3, 12, 2)]
FAST = {"enabled": True, "batch_buckets": [8, 16, 32], "prompt_buckets": [32, 64]}


def config(size: str, attention: str, dtype: str = "bfloat16", **fast_options) -> PolicyConfig:
    fast = {**FAST, "attention": attention, **fast_options}
    common = dict(dtype=dtype, chunk_size=10, max_token_len=64, sampling={"num_steps": 4}, fast=fast)
    if size == "small":
        return PolicyConfig.preset(
            "tiny", vocab_size=1024,
            prefix={"width": 512, "depth": 2, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
            expert={"width": 256, "depth": 2, "mlp_dim": 512, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
            **common)
    return PolicyConfig.preset("pi05", cameras=["base_0_rgb", "left_wrist_0_rgb"], **common)


def cuda_inputs(cfg, batch: int, prompt_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    cams, res = len(cfg.cameras), cfg.vision.image_size
    masks = torch.ones(batch, cams, dtype=torch.bool)
    masks[0, -1] = False
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (batch,), generator=g)
    lengths[0] = prompt_len
    inputs = ModelInputs(
        (torch.rand(batch, cams, 3, res, res, generator=g) * 2 - 1).cuda(), masks.cuda(),
        torch.randint(0, cfg.vocab_size, (batch, 64), generator=g).cuda(),
        (torch.arange(64)[None] < lengths[:, None]).cuda(),
    )
    noise = torch.randn(batch, cfg.chunk_size, cfg.max_action_dim, generator=g).cuda()
    step_noise = torch.randn(batch, cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim, generator=g).cuda()
    return inputs, noise, step_noise


def rollout(policy):
    steps, parts = policy.cfg.sampling.num_steps, []
    for i, (batch, prompt_len, step) in enumerate(CALLS):
        inputs, noise, step_noise = cuda_inputs(policy.cfg, batch, prompt_len, seed=100 + i)
        inds = torch.full((batch, steps), step, device="cuda")
        out = policy.sample(inputs, mode="sde", noise=noise, step_noise=step_noise, denoise_inds=inds)
        parts.append((inputs, out, policy.fast_sampler().last_buckets.clone()))
    cat = lambda get: torch.cat([get(p) for p in parts])  # noqa: E731
    inputs = ModelInputs(cat(lambda p: p[0].images), cat(lambda p: p[0].image_masks), cat(lambda p: p[0].tokens),
                         cat(lambda p: p[0].token_mask))
    return (inputs, cat(lambda p: p[1].chains), cat(lambda p: p[1].denoise_inds), cat(lambda p: p[1].logprobs),
            cat(lambda p: p[2]))


def rescore(policy, rows, micro: int, consistent: bool, grad: bool = False):
    inputs, chains, inds, _, buckets = rows
    order = torch.randperm(len(chains), generator=torch.Generator().manual_seed(micro))
    outs = []
    with torch.set_grad_enabled(grad):
        for idx in order.split(micro):
            sub = ModelInputs(*(t[idx.cuda()] for t in (inputs.images, inputs.image_masks, inputs.tokens,
                                                         inputs.token_mask)))
            outs.append(policy.log_prob(sub, chains[idx.cuda()], inds[idx.cuda()], consistent=consistent,
                                        fast_buckets=buckets[idx]))
    return torch.cat([o.logprobs for o in outs]), order


def gradient_errors(got: dict, want: dict, label: str) -> tuple[str, float]:
    """Relative L2 of each parameter's gradient against `want`'s; prints the worst and the median, returns the
    worst (name, error)."""
    assert set(want) == set(got) and want
    errors = {n: relative_l2(got[n], w) for n, w in want.items()}
    worst = max(errors, key=errors.get)
    print(f"\nconsistent_gpu {label}: worst rel L2 {errors[worst]:.3e} ({worst}), "
          f"median {sorted(errors.values())[len(errors) // 2]:.3e}")
    return worst, errors[worst]


def gap_stats(got: torch.Tensor, want: torch.Tensor, clip: float = 0.2) -> dict:
    """Per-element max |difference|, chunk-level |gap| mean/max (nats) and the share of rows whose
    ratio exp(got - want) is outside [1 - clip, 1 + clip] (the clip fraction at lr 0)."""
    got, want = got.detach().double(), want.double()
    chunk = got.flatten(1).sum(1) - want.flatten(1).sum(1)
    ratio = chunk.exp()
    return {"elem_max": float((got - want).abs().max()), "gap_mean_nats": float(chunk.abs().mean()),
            "gap_max_nats": float(chunk.abs().max()),
            "clip_frac_lr0": float(((ratio < 1 - clip) | (ratio > 1 + clip)).double().mean())}


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("size", ["small", "pi05_libero"])
def test_consistent_recompute_equals_graphed_bf16_rollout(size, attention):
    policy = build_policy(config(size, attention), device="cuda")
    rows = rollout(policy)
    want = rows[3]
    assert len({tuple(b) for b in rows[4].tolist()}) >= 4, "several (batch, prompt) buckets"
    results = {}
    for micro in (7, 24):
        got, order = rescore(policy, rows, micro, consistent=True)
        results[f"consistent_mb{micro}"] = gap_stats(got, want[order])
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as grpo.actor runs log_prob
        got, order = rescore(policy, rows, 16, consistent=True)
    results["consistent_autocast"] = gap_stats(got, want[order])
    trainer = build_policy(config(size, attention), device="cuda")
    trainer.model.load_state_dict(policy.model.state_dict())
    got, order = rescore(trainer, rows, 16, consistent=True)
    results["consistent_other_instance"] = gap_stats(got, want[order])
    got, order = rescore(policy, rows, 16, consistent=False)
    results["plain_bf16"] = gap_stats(got, want[order])
    fp32 = build_policy(config(size, attention, dtype="float32"), device="cuda")
    fp32.model.load_state_dict(policy.model.state_dict())
    got, order = rescore(fp32, rows, 16, consistent=False)
    results["plain_fp32"] = gap_stats(got, want[order])
    print(f"\nconsistent_gpu {size} {attention} rows={len(want)} " + json.dumps(results))
    for name in ("consistent_mb7", "consistent_mb24", "consistent_autocast", "consistent_other_instance"):
        assert results[name]["elem_max"] == 0.0, (name, results[name])
    assert results["plain_bf16"]["elem_max"] > 0.0


def test_consistent_gradients_close_to_fp32_reference():
    policy = build_policy(config("small", "sdpa"), device="cuda")
    rows = rollout(policy)
    fp32 = build_policy(config("small", "sdpa", dtype="float32"), device="cuda")
    fp32.model.load_state_dict(policy.model.state_dict())
    weights = torch.randn(len(rows[1]), generator=torch.Generator().manual_seed(0)).cuda()
    grads = []
    for pol, consistent in ((fp32, False), (policy, True)):
        lp, order = rescore(pol, rows, len(rows[1]), consistent=consistent, grad=True)
        (lp.flatten(1).sum(1) * weights[order.cuda()]).sum().backward()
        grads.append({n: p.grad.float() for n, p in pol.model.named_parameters() if p.grad is not None})
    want, got = grads
    _, worst = gradient_errors(got, want, "gradients vs fp32 plain")
    assert worst < 0.1


@pytest.mark.parametrize("backward", ["tf32", "bf16"])
def test_cheaper_backward_keeps_the_forward_and_rounds_the_gradients(backward):
    """policy.fast.recompute_backward: the same log-probs bit for bit, gradients near the fp32 backward's
    (printed: the rounding each mode costs at these widths)."""
    policy = build_policy(config("small", "sdpa"), device="cuda")
    rows = rollout(policy)
    weights = torch.randn(len(rows[1]), generator=torch.Generator().manual_seed(0)).cuda()
    grads, logprobs = [], []
    for mode in ("fp32", backward):
        policy.cfg = policy.cfg.replace(fast={"consistent_recompute": True, "recompute_backward": mode})
        policy.model.zero_grad(set_to_none=True)
        lp, order = rescore(policy, rows, len(rows[1]), consistent=True, grad=True)
        (lp.flatten(1).sum(1) * weights[order.cuda()]).sum().backward()
        logprobs.append(lp.detach())
        grads.append({n: p.grad.float() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert torch.equal(logprobs[0], logprobs[1])
    want, got = grads
    _, worst = gradient_errors(got, want, f"{backward} backward vs fp32")
    assert worst < (1e-2 if backward == "tf32" else 5e-2)
    assert worst > 0.0, f"the {backward} backward computed the fp32 gradients"


@pytest.mark.parametrize("size", ["small", "pi05_libero"])
def test_fp8_consistent_recompute_by_fp32_masters_equals_the_fp8_rollout(size):
    """policy.fast.precision=fp8 in GRPO: a bf16 engine rolls out through its FP8 GEMMs (the prefix's, and qkv's
    too here); a trainer holding fp32 master weights (grpo.trainer.trainer_policy_config), synced into the engine
    by a cast, re-scores through the same compiled kernels and graphs. Both quantise each weight from its bf16
    value, so every log-prob equals the rollout's bit for bit; the plain bf16 recompute's gap is printed."""
    fp8 = {"precision": "fp8", "fp8_gemms": ["prefix_gate_up", "prefix_down", "prefix_qkv"]}
    engine = build_policy(config(size, "sdpa", **fp8), device="cuda")
    trainer = build_policy(config(size, "sdpa", dtype="float32", **fp8), device="cuda")
    engine.model.load_state_dict(trainer.model.state_dict())  # a weight sync: fp32 masters -> bf16 (a cast)
    rows = rollout(engine)
    assert engine.fast_sampler().w.fp8_weights, "the rollout ran no FP8 GEMM"
    results = {}
    got, order = rescore(trainer, rows, 16, consistent=True)
    results["consistent_fp32_masters"] = gap_stats(got, rows[3][order])
    ours, theirs = trainer.fast_sampler().w.fp8_weights, engine.fast_sampler().w.fp8_weights
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
    got, order = rescore(engine, rows, 16, consistent=False)
    results["plain_bf16"] = gap_stats(got, rows[3][order])
    print(f"\nconsistent_gpu fp8 {size} rows={len(order)} " + json.dumps(results))
    assert results["consistent_fp32_masters"]["elem_max"] == 0.0, results
    assert results["plain_bf16"]["elem_max"] > 0.0


@pytest.mark.parametrize("backward", ["fp32", "bf16"])
def test_the_captured_backward_replays_the_eager_gradients(backward):
    """policy.fast.recompute_graph: the backward's reference call replayed as a CUDA graph per shape gives the eager
    call's gradients (printed; the bf16 backward's within 1e-6, the fp32 one's within 1e-4), also after the weights
    changed in place (an optimizer step: no re-capture) and after a weight's storage was replaced (its shape captured
    again)."""
    policy = build_policy(config("small", "sdpa", consistent_recompute=True, recompute_backward=backward),
                          device="cuda")
    rows = rollout(policy)
    weights = torch.randn(len(rows[1]), generator=torch.Generator().manual_seed(0)).cuda()
    graphs = policy.fast_sampler().reference_graphs

    def gradients(graphed: bool) -> dict:
        policy.cfg = policy.cfg.replace(fast={"recompute_graph": graphed})
        policy.model.zero_grad(set_to_none=True)
        # one micro-batch of every row: a reference call per prompt bucket (two shapes, within the capacity)
        lp, order = rescore(policy, rows, len(rows[1]), consistent=True, grad=True)
        (lp.flatten(1).sum(1) * weights[order.cuda()]).sum().backward()
        return {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None}

    def assert_same(label: str) -> None:
        want, again, got = gradients(False), gradients(False), gradients(True)
        gradient_errors(again, want, f"eager {backward} backward vs itself ({label})")  # printed: its own noise
        _, worst = gradient_errors(got, want, f"graphed {backward} backward vs eager ({label})")
        # bf16: the eager kernels; fp32: within 1e-4 (round 63's H100 run: 5.2e-5 at the first capture)
        assert worst <= (1e-6 if backward == "bf16" else 1e-4), (label, worst)

    assert_same("first calls: captured")
    captured = graphs.captures
    assert 0 < captured <= graphs.capacity and graphs.replays > 0
    with torch.no_grad():  # an optimizer step's in-place update
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 1e-2)
    assert_same("weights changed in place")
    assert graphs.captures == captured, "an in-place weight change captured again"
    target = policy.model.action_in_proj.weight
    target.data = target.data.clone()  # the same values in new storage: the old graphs would read the old memory
    with torch.no_grad():
        target.mul_(1.5)
    assert_same("a weight's storage replaced")
    assert graphs.captures > captured


def all_parameters_error(got: dict, want: dict) -> float:
    """Relative L2 of every parameter's gradient at once (one vector), against `want`'s."""
    names = sorted(want)
    return relative_l2(torch.cat([got[n].flatten() for n in names]), torch.cat([want[n].flatten() for n in names]))


@pytest.mark.parametrize("graphed", [False, True])
def test_an_inductor_compiled_backward_rounds_like_the_eager_one(graphed):
    """policy.fast.recompute_compile=inductor with the bf16 backward: the log-probs the rollout's bits, the
    gradients as near the fp32 backward's as the eager bf16 backward's are (printed; inductor keeps bf16
    intermediates in fp32 inside its fused kernels, so it rounds differently, not more). Captured as a CUDA graph
    (recompute_graph), its replays give the uncaptured compiled call's gradients and a second call captures nothing."""
    policy = build_policy(config("small", "sdpa", consistent_recompute=True), device="cuda")
    rows = rollout(policy)
    weights = torch.randn(len(rows[1]), generator=torch.Generator().manual_seed(0)).cuda()

    def gradients(**fast) -> tuple[dict, torch.Tensor]:
        policy.cfg = policy.cfg.replace(fast=fast)
        policy.model.zero_grad(set_to_none=True)
        lp, order = rescore(policy, rows, len(rows[1]), consistent=True, grad=True)
        (lp.flatten(1).sum(1) * weights[order.cuda()]).sum().backward()
        return {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None}, lp

    fp32, want_lp = gradients(recompute_backward="fp32", recompute_compile="off", recompute_graph=False)
    eager, _ = gradients(recompute_backward="bf16", recompute_compile="off", recompute_graph=False)
    compiled, lp = gradients(recompute_backward="bf16", recompute_compile="inductor", recompute_graph=False)
    assert torch.equal(lp, want_lp)
    eager_error, compiled_error = all_parameters_error(eager, fp32), all_parameters_error(compiled, fp32)
    print(f"\nconsistent_gpu bf16 backward vs fp32, all parameters: eager {eager_error:.3e}, inductor "
          f"{compiled_error:.3e}, inductor vs eager {all_parameters_error(compiled, eager):.3e}")
    assert 0.0 < compiled_error <= 1.5 * eager_error + 1e-3
    if graphed:
        graphs = policy.fast_sampler().reference_graphs
        captured = graphs.captures
        first, _ = gradients(recompute_backward="bf16", recompute_compile="inductor", recompute_graph=True)
        after_first = graphs.captures
        again, _ = gradients(recompute_backward="bf16", recompute_compile="inductor", recompute_graph=True)
        assert graphs.captures == after_first > captured  # one capture per prompt bucket, then replays
        for got, label in ((first, "captured"), (again, "replayed")):
            _, worst = gradient_errors(got, compiled, f"inductor bf16 backward {label} vs uncaptured")
            assert worst <= 1e-6, (label, worst)  # the same compiled kernels (round 63's eager bound)


def one_prompt_bucket(rows) -> tuple[tuple, torch.Tensor]:
    """The rows that ran in prompt bucket 32 (one prefix length, whose K/V a call can keep): (inputs, chains,
    denoise indices), their buckets."""
    inputs, chains, inds, _, buckets = rows
    one = (buckets[:, 1] == 32).nonzero().flatten()
    sub = ModelInputs(*(t[one.cuda()] for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)))
    return (sub, chains[one.cuda()], inds[one.cuda()]), buckets[one]


def test_the_captured_backward_with_a_kept_prefix_gathers_the_eager_gradients():
    """policy.fast.recompute_graph with the rows' kept prefix given (grpo.prefix_cache): each chunk's rows are gathered
    from that prefix straight into the graph's buffers (reference_graph.CacheRows); the gradients equal the eager
    backward's (bf16 backward: bit for bit)."""
    policy = build_policy(config("small", "sdpa", consistent_recompute=True, recompute_backward="bf16"),
                          device="cuda")
    args, buckets = one_prompt_bucket(rollout(policy))
    with torch.no_grad():
        kept = policy.log_prob(*args, consistent=True, fast_buckets=buckets, return_prefix=True).prefix
    weights = torch.randn(len(buckets), generator=torch.Generator().manual_seed(1)).cuda()

    def gradients(graphed: bool) -> dict:
        policy.cfg = policy.cfg.replace(fast={"recompute_graph": graphed})
        policy.model.zero_grad(set_to_none=True)
        out = policy.log_prob(*args, consistent=True, fast_buckets=buckets, prefix=kept)
        (out.chunk_logprob * weights).sum().backward()
        policy.settle_checks()
        return {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None}

    want = gradients(False)
    for _ in range(2):  # the capture, then a replay
        _, worst = gradient_errors(gradients(True), want, "graphed bf16 backward with a kept prefix vs eager")
        assert worst == 0.0
    assert policy.fast_sampler().reference_graphs.replays >= 2


def test_a_call_with_fewer_rows_replays_the_larger_graph_padded():
    """policy.fast.recompute_graph: a micro-batch with fewer rows than a captured shape (GRPO's tail micro-batches, two
    a global batch with a capped kept prefix) replays that graph with padding rows of zero incoming gradient instead of
    capturing its own: no capture, and the gradients the eager backward's up to the summation order (bf16 backward;
    printed, bounded at 1e-3 relative L2 per parameter)."""
    policy = build_policy(config("small", "sdpa", consistent_recompute=True, recompute_backward="bf16",
                                 recompute_graph=True), device="cuda")
    (inputs, chains, inds), buckets = one_prompt_bucket(rollout(policy))
    with torch.no_grad():
        kept = policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets, return_prefix=True).prefix
    weights = torch.randn(len(buckets), generator=torch.Generator().manual_seed(2)).cuda()
    graphs = policy.fast_sampler().reference_graphs

    def gradients(rows: torch.Tensor, graphed: bool) -> dict:
        policy.cfg = policy.cfg.replace(fast={"recompute_graph": graphed})
        policy.model.zero_grad(set_to_none=True)
        at = rows.cuda()
        sub = ModelInputs(*(t[at] for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)))
        out = policy.log_prob(sub, chains[at], inds[at], consistent=True, fast_buckets=buckets[rows],
                              prefix=kept.index_select(at))
        (out.chunk_logprob * weights[at]).sum().backward()
        policy.settle_checks()
        return {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None}

    everything, tail = torch.arange(len(buckets)), torch.arange(len(buckets) - 5)
    gradients(everything, graphed=True)  # captures the full shape
    captured, padded = graphs.captures, graphs.padded_replays
    got = gradients(tail, graphed=True)
    assert (graphs.captures, graphs.padded_replays) == (captured, padded + 1), "the tail captured its own graph"
    _, worst = gradient_errors(got, gradients(tail, graphed=False), "padded graphed bf16 backward vs eager (tail)")
    assert worst <= 1e-3, worst


def test_a_wrong_kept_prefix_is_refused_on_cuda_at_the_next_call_or_settle():
    """The restored-prefix check on CUDA is read back without a wait (common/deferred_checks.py): a call given other
    rows' prefix returns, and the error comes at Policy.settle_checks or at the sampler's next consistent call."""
    policy = build_policy(config("small", "sdpa", consistent_recompute=True), device="cuda")
    args, buckets = one_prompt_bucket(rollout(policy))
    with torch.no_grad():
        kept = policy.log_prob(*args, consistent=True, fast_buckets=buckets, return_prefix=True).prefix
        others = kept.index_select(torch.arange(len(buckets)).flip(0).cuda())
        assert not torch.equal(others.offsets, kept.offsets)
        policy.log_prob(*args, consistent=True, fast_buckets=buckets, prefix=kept)
        policy.settle_checks()  # the right rows' prefix: nothing raised
        policy.log_prob(*args, consistent=True, fast_buckets=buckets, prefix=others)  # returns: check pending
        with pytest.raises(ValueError, match="not these rows' in their bucket's layout"):
            policy.settle_checks()
        policy.settle_checks()  # settled: nothing left to raise
        policy.log_prob(*args, consistent=True, fast_buckets=buckets, prefix=others)
        with pytest.raises(ValueError, match="not these rows' in their bucket's layout"):
            policy.log_prob(*args, consistent=True, fast_buckets=buckets, prefix=kept)  # the next call settles
