"""The fast sampler (bucketed buffers, slot KV layout, fused kernels) against the plain model.

CPU, fp32 (the fused kernels' PyTorch twins; test_fast_kernels checks the Triton kernels
against those twins): the fast path must compute the same chains and log-probs as `Policy.sample` (its
reference and normal paths) on fresh random inputs, with masked cameras, ragged prompts,
batch padding into a bucket and batch splitting over the largest bucket.
"""

import time

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.observation import ModelInputs
from policies.policy import build_policy


@pytest.fixture(scope="module")
def policy():
    return build_policy(PolicyConfig.preset("tiny"))


def random_inputs(cfg, batch, prompt_len, seed, device="cpu"):
    """(ModelInputs, noise, step_noise) drawn on the CPU from `seed`, then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    cams, res = len(cfg.cameras), cfg.vision.image_size
    images = torch.rand(batch, cams, 3, res, res, generator=g) * 2 - 1
    image_masks = torch.rand(batch, cams, generator=g) > 0.3
    image_masks[:, 0] = True
    tokens = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g)
    lengths = torch.randint(1, prompt_len + 1, (batch,), generator=g)
    token_mask = torch.arange(prompt_len)[None, :] < lengths[:, None]
    shape = (batch, cfg.chunk_size, cfg.max_action_dim)
    noise = torch.randn(shape, generator=g)
    step_noise = torch.randn(batch, cfg.sampling.num_steps, *shape[1:], generator=g)
    inputs = ModelInputs(images.to(device), image_masks.to(device), tokens.to(device), token_mask.to(device))
    return inputs, noise.to(device), step_noise.to(device)


def tiny_loop_case(seed, stochastic_step, device="cpu"):
    """The tiny fp32 policy on `device` and sample_chains' arguments (3 samples, a 13-token prompt, step
    `stochastic_step` stochastic): the whole-loop case the kernel files run their paths through."""
    policy = build_policy(PolicyConfig.preset("tiny"), device=device)
    inputs, noise, step_noise = random_inputs(policy.cfg, 3, 13, seed=seed, device=device)
    stoch = torch.zeros(3, policy.cfg.sampling.num_steps, dtype=torch.bool, device=device)
    stoch[:, stochastic_step] = True
    return policy, (inputs, noise, step_noise, stoch)


def eager_sampler(model, **fast) -> FastSampler:
    """An fp32 sampler without CUDA graphs, SDPA attention, one batch and prompt bucket (for tiny_loop_case)."""
    return FastSampler(model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16], cuda_graphs=False,
                                         attention="sdpa", **fast))


def denoise_inds_for(mode, batch, steps, index=1):
    if mode == "ode":
        return torch.full((batch, steps), -1)
    if mode == "sde_all":
        return torch.arange(steps).repeat(batch, 1)
    return torch.full((batch, steps), index)


@pytest.mark.parametrize("mode", ["ode", "sde", "sde_all"])
@pytest.mark.parametrize("batch,buckets", [(3, [1, 2, 4]), (5, [1, 2])])
def test_fast_matches_reference(policy, mode, batch, buckets):
    cfg = policy.cfg
    inputs, noise, step_noise = random_inputs(cfg, batch, 13, seed=batch * 7 + len(mode))
    steps = cfg.sampling.num_steps
    inds = denoise_inds_for(mode, batch, steps)
    ref = policy.sample(inputs, mode=mode, noise=noise, step_noise=step_noise, denoise_inds=inds, reference_path=True)
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=buckets, prompt_buckets=[8, 16]))
    chains, step_lp = fast.sample_chains(inputs, noise, step_noise, inds == torch.arange(steps))
    assert chains.shape == ref.chains.shape
    assert torch.allclose(chains, ref.chains, atol=2e-5, rtol=1e-5), (chains - ref.chains).abs().max()
    assert torch.allclose(step_lp, ref.step_logprobs, atol=2e-4, rtol=1e-5)


def test_prompt_bucket_and_reuse(policy):
    """Two calls landing in the same bucket reuse its buffers; results stay per-call correct."""
    cfg = policy.cfg
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16]))
    for seed in (1, 2):
        inputs, noise, step_noise = random_inputs(cfg, 4, 16, seed)
        inds = denoise_inds_for("ode", 4, cfg.sampling.num_steps)
        ref = policy.sample(inputs, mode="ode", noise=noise, denoise_inds=inds)
        ode = torch.zeros(4, cfg.sampling.num_steps, dtype=torch.bool)
        chains, _ = fast.sample_chains(inputs, noise, step_noise, ode)
        assert torch.allclose(chains, ref.chains, atol=2e-5, rtol=1e-5)
    assert list(fast.buckets) == [(4, 16)]


def test_token_layout_is_reuploaded_only_when_the_masks_change(policy, monkeypatch):
    """Calls with the masks the bucket already holds skip the layout upload and the attention plans;
    calls with other masks redo them: every call stays per-call correct against the plain
    reference, in an order that returns to earlier masks."""
    from policies.fast.attention import SdpaAttention

    plans, plan = [], SdpaAttention.plan
    monkeypatch.setattr(SdpaAttention, "plan", lambda self, lens: plans.append(lens.clone()) or plan(self, lens))
    cfg = policy.cfg
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16],
                                                attention="sdpa"))
    ode = torch.zeros(3, cfg.sampling.num_steps, dtype=torch.bool)
    first, noise, step_noise = random_inputs(cfg, 3, 16, seed=3)
    other, _, _ = random_inputs(cfg, 3, 16, seed=4)
    assert not torch.equal(first.token_mask, other.token_mask)
    planned = []
    for inputs in (first, first, other, first, first):
        before = len(plans)
        ref = policy.sample(inputs, mode="ode", noise=noise, denoise_inds=torch.full((3, cfg.sampling.num_steps), -1))
        chains, _ = fast.sample_chains(inputs, noise, step_noise, ode)
        assert torch.allclose(chains, ref.chains, atol=2e-5, rtol=1e-5)
        planned.append(len(plans) > before)
    assert planned == [True, False, True, True, False]  # prefix and expert planned on a change only


def test_weight_update_is_seen_after_refresh(policy):
    """In-place weight updates reach the fast path; weight-derived tables are refreshed."""
    cfg = PolicyConfig.preset("tiny")
    pol = build_policy(cfg)
    fast = FastSampler(pol.model, FastConfig(dtype="float32", batch_buckets=[2], prompt_buckets=[16]))
    inputs, noise, step_noise = random_inputs(cfg, 2, 10, seed=9)
    stoch = torch.zeros(2, cfg.sampling.num_steps, dtype=torch.bool)
    before, _ = fast.sample_chains(inputs, noise, step_noise, stoch)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fast.refresh_weights()
    after, _ = fast.sample_chains(inputs, noise, step_noise, stoch)
    inds = denoise_inds_for("ode", 2, cfg.sampling.num_steps)
    ref = pol.sample(inputs, mode="ode", noise=noise, denoise_inds=inds)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, ref.chains, atol=2e-5, rtol=1e-5)


def test_bad_bucket_config_names_key():
    with pytest.raises(ValueError, match="policy.fast.batch_buckets"):
        FastConfig(batch_buckets=[4, 2])
    with pytest.raises(ValueError, match="policy.fast.attention"):
        FastConfig(attention="xformers")


def test_policy_sample_uses_fast_path_when_enabled():
    """`policy.fast.enabled` routes Policy.sample through the fast sampler, same results."""
    cfg = PolicyConfig.preset("tiny", fast={"enabled": True, "dtype": "float32", "batch_buckets": [4]})
    pol = build_policy(cfg)
    inputs, noise, step_noise = random_inputs(cfg, 3, 11, seed=21)
    inds = denoise_inds_for("sde", 3, cfg.sampling.num_steps, index=2)
    fast = pol.sample(inputs, mode="sde", noise=noise, step_noise=step_noise, denoise_inds=inds)
    ref = pol.sample(inputs, mode="sde", noise=noise, step_noise=step_noise, denoise_inds=inds, reference_path=True)
    assert pol._fast is not None and list(pol._fast.buckets) == [(4, 32)]  # default prompt buckets
    assert torch.allclose(fast.chains, ref.chains, atol=2e-5, rtol=1e-5)
    assert torch.allclose(fast.chunk_logprob, ref.chunk_logprob, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dropped", [0, 1, 2])
def test_camera_masked_in_every_row_is_skipped_exactly(dropped):
    """A slot masked in every row (pi0.5's third camera on LIBERO) is left out of vision and the
    prefix: same chains as the reference, which runs it and masks its tokens; smaller bucket. The kept
    slots as a view (a run: slots 0-1, 1-2) or gathered (slots 0 and 2)."""
    policy = build_policy(PolicyConfig.preset("tiny", cameras=["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]))
    cfg = policy.cfg
    inputs, noise, step_noise = random_inputs(cfg, 3, 13, seed=11 + dropped)
    inputs.image_masks[:, :] = True
    inputs.image_masks[:, 2 - dropped] = False
    inds = denoise_inds_for("sde", 3, cfg.sampling.num_steps)
    ref = policy.sample(inputs, mode="sde", noise=noise, step_noise=step_noise, denoise_inds=inds, reference_path=True)
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16]))
    chains, step_lp = fast.sample_chains(inputs, noise, step_noise, inds == torch.arange(cfg.sampling.num_steps))
    assert torch.allclose(chains, ref.chains, atol=2e-5, rtol=1e-5), (chains - ref.chains).abs().max()
    assert torch.allclose(step_lp, ref.step_logprobs, atol=2e-4, rtol=1e-5)
    (bucket,) = fast.buckets.values()
    assert bucket.tensors["images"].shape[1] == 2  # two camera slots went through SigLIP, not three
    assert list(fast.buckets) == [(4, 16, 2)]


def test_patch_embed_gemm_equals_the_convolution():
    """The fast path's patch embedding (one GEMM over unfolded patches) is SigLIP's strided conv."""
    from policies.fast.layer_ops import patch_embed

    g = torch.Generator().manual_seed(2)
    conv = torch.nn.Conv2d(3, 24, kernel_size=7, stride=7)
    images = torch.randn(5, 3, 28, 28, generator=g)
    pos = torch.randn(16, 24, generator=g)
    want = (conv(images).flatten(2).transpose(1, 2) + pos).reshape(5 * 16, 24)
    got = patch_embed(images, conv, pos, 7)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_pdl_auto_follows_the_denoise_rows(policy):
    """pdl "auto" is on up to pdl.AUTO_MAX_ROWS denoise rows (batch x chunk), "on" at every batch (the
    sampler's code is set by hand here: CPU has no PDL)."""
    from types import SimpleNamespace

    from policies.fast import pdl

    chunk = policy.cfg.chunk_size
    last = pdl.AUTO_MAX_ROWS // chunk
    for mode, want_above in (("auto", 0), ("on", 1)):
        fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16], pdl=mode))
        fast.pdl = 1
        assert fast._pdl_for(SimpleNamespace(batch=last)) == 1
        assert fast._pdl_for(SimpleNamespace(batch=last + 1)) == want_above


@pytest.mark.parametrize("step0_pdl", [True, False])
def test_prefix_denoise_stage_equals_prefix_then_denoise(step0_pdl):
    """overlap.py's stage (here on the CPU: its steps in order, no side stream) computes what the prefix
    and denoise stages compute, with step 0 as overlap runs it (its PDL code, the MLP split or not)."""
    policy, (inputs, noise, step_noise, stoch) = tiny_loop_case(seed=5, stochastic_step=0)
    fast = eager_sampler(policy.model)
    fast.step0_pdl = step0_pdl
    bucket = fast.prepare(inputs, noise, step_noise, stoch)
    outputs = []
    for stages in (("vision", "prefix", "denoise"), ("vision", "prefix_denoise")):
        for name in ("chains", "step_logprobs"):
            bucket.tensors[name].zero_()
        for stage in stages:
            fast.run_stage(bucket, stage)
        outputs.append([bucket.tensors[name].clone() for name in ("chains", "step_logprobs")])
    for got, want in zip(outputs[1], outputs[0], strict=True):
        assert torch.equal(got, want)


def test_overlap_choice_follows_the_mode_rows_and_graphs():
    from policies.fast import overlap

    assert overlap.choose("auto", overlap.AUTO_MAX_ROWS, graphs=True) is None  # timed at the first call (pick)
    assert overlap.choose("auto", overlap.AUTO_MAX_ROWS + 1, graphs=True) is False
    assert overlap.choose("auto", 1, graphs=False) is False
    assert overlap.choose("on", 10 * overlap.AUTO_MAX_ROWS, graphs=True) is True
    assert overlap.choose("off", 1, graphs=True) is False
    assert overlap.choose("on", 1, graphs=False) is False  # the side stream is a branch of the graph
    with pytest.raises(ValueError, match="policy.fast.overlap must be one of"):
        overlap.choose("sometimes", 1, graphs=True)
    with pytest.raises(ValueError, match="policy.fast.overlap must be one of"):
        FastConfig(overlap="sometimes")


@pytest.mark.parametrize(("on_ms", "want"), [(9.0, True), (11.0, False)])
def test_overlap_pick_keeps_the_faster_way_and_drops_the_other_graphs(on_ms, want):
    """overlap.pick on a stand-in sampler whose stages cost fixed times (one noisy round each way):
    it captures both ways first, times them round-robin, keeps the faster by median, deletes the rest."""
    from types import SimpleNamespace

    from policies.fast import overlap

    cost = {"prefix": 4.0, "denoise": 6.0, "prefix_denoise": on_ms}
    runs = []
    bucket = SimpleNamespace(graphs={}, overlap_ms=None)

    def run_stage(bk, stage):
        runs.append(stage)
        bk.graphs.setdefault(stage, object())

    noisy = iter([0.0, 0.0, 100.0, 0.0, 0.0, -100.0, 0.0, 0.0])  # an outlier round each way: the median ignores it

    def timer(fn):
        before = len(runs)
        fn()
        return sum(cost[s] for s in runs[before:]) + next(noisy)

    chosen = overlap.pick(SimpleNamespace(run_stage=run_stage), bucket, timer=timer, rounds=4, replays=2)
    assert chosen is want
    assert runs[:3] == ["prefix", "denoise", "prefix_denoise"]  # captured before the timed rounds
    assert runs[3:7] == ["prefix", "denoise", "prefix", "denoise"]  # a round: `replays` replays of one way
    assert set(bucket.graphs) == ({"prefix_denoise"} if want else {"prefix", "denoise"})
    assert bucket.overlap_ms == {"off": 10.0, "on": on_ms}


def test_overlap_call_runs_vision_then_prefix_denoise(policy):
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[1], prompt_buckets=[16],
                                                cuda_graphs=False))
    bucket = fast._bucket(1, 16)
    assert not bucket.overlap and fast.call_stages(bucket) == ("vision", "prefix", "denoise")  # no graphs on CPU
    bucket.overlap = True
    assert fast.call_stages(bucket) == ("vision", "prefix_denoise")


def test_first_call_is_timed_once_per_bucket_and_logged(policy, caplog, monkeypatch, tmp_path):
    """A bucket's building call records its wall time and logs it with the Triton cache it compiled into; later
    calls leave both alone, and another bucket gets its own."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    cfg = policy.cfg
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[2, 4], prompt_buckets=[16],
                                                cuda_graphs=False, attention="sdpa"))
    build = fast._bucket

    def slow_build(*args, **kwargs):  # the build itself (attention choice, searches) counts in the first call
        if len(fast.buckets) == 0:
            time.sleep(0.2)
        return build(*args, **kwargs)

    monkeypatch.setattr(fast, "_bucket", slow_build)
    stoch = torch.zeros(3, cfg.sampling.num_steps, dtype=torch.bool)
    inputs, noise, step_noise = random_inputs(cfg, 3, 13, seed=5)
    with caplog.at_level("INFO", logger="policies.fast.runner"):
        fast.sample_chains(inputs, noise, step_noise, stoch)
    (record,) = [r for r in caplog.records if "built by its first call" in r.getMessage()]
    assert "bucket (batch 4, prompt 16" in record.getMessage() and str(tmp_path / "triton") in record.getMessage()
    (bucket,) = fast.buckets.values()
    first = bucket.first_call_s
    assert first is not None and first >= 0.2
    caplog.clear()
    with caplog.at_level("INFO", logger="policies.fast.runner"):
        fast.sample_chains(inputs, noise, step_noise, stoch)
    assert bucket.first_call_s == first and not caplog.records
    small, small_noise, small_steps = random_inputs(cfg, 2, 13, seed=6)
    fast.sample_chains(small, small_noise, small_steps, stoch[:2])
    report = {(r["batch"], r["prompt_len"]): r for r in fast.bucket_report()}
    assert set(report) == {(4, 16), (2, 16)} and report[(4, 16)]["first_call_s"] == first
    assert report[(2, 16)]["first_call_s"] > 0 and report[(4, 16)]["graphs"] == []
