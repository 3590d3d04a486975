"""Fast path on CUDA: graphs vs eager, flashinfer vs SDPA, bf16 vs the fp32 reference, weight
updates without re-capture. Skipped without a GPU (marker `gpu`).

Sizes: small widths but the real head_dim (256) and head counts, so flashinfer's kernels are
the ones the full model uses.
"""

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast.attention import flashinfer_available
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.observation import ModelInputs
from policies.policy import build_policy

pytestmark = pytest.mark.gpu


def gpu_cfg(dtype: str) -> PolicyConfig:
    return PolicyConfig.preset(
        "tiny", dtype=dtype, vocab_size=1024, chunk_size=10, max_token_len=48,
        prefix={"width": 512, "depth": 2, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
        expert={"width": 256, "depth": 2, "mlp_dim": 512, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
        sampling={"num_steps": 4},
    )


def inputs_for(cfg, batch, seed):
    g = torch.Generator().manual_seed(seed)
    cams, res = len(cfg.cameras), cfg.vision.image_size
    masks = torch.ones(batch, cams, dtype=torch.bool)
    masks[0, -1] = False
    lengths = torch.randint(3, 40, (batch,), generator=g)
    inputs = ModelInputs(
        (torch.rand(batch, cams, 3, res, res, generator=g) * 2 - 1).cuda(), masks.cuda(),
        torch.randint(0, cfg.vocab_size, (batch, 40), generator=g).cuda(),
        (torch.arange(40)[None] < lengths[:, None]).cuda(),
    )
    noise = torch.randn(batch, cfg.chunk_size, cfg.max_action_dim, generator=g).cuda()
    step_noise = torch.randn(batch, cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim, generator=g).cuda()
    stoch = torch.zeros(batch, cfg.sampling.num_steps, dtype=torch.bool, device="cuda")
    stoch[:, 1] = True
    return inputs, noise, step_noise, stoch


@pytest.fixture(scope="module")
def policy():
    return build_policy(gpu_cfg("bfloat16"), device="cuda")


def run(sampler, cfg, seed, batch=3):
    inputs, noise, step_noise, stoch = inputs_for(cfg, batch, seed)
    return sampler.sample_chains(inputs, noise, step_noise, stoch)


def test_graphs_match_eager(policy):
    cfg = policy.cfg
    eager = FastSampler(policy.model, FastConfig(cuda_graphs=False, attention="sdpa"))
    graphed = FastSampler(policy.model, FastConfig(cuda_graphs=True, attention="sdpa"))
    for seed in (1, 2):  # the second call replays graphs captured for the first one's lengths
        want, want_lp = run(eager, cfg, seed)
        got, got_lp = run(graphed, cfg, seed)
        assert relative_l2(got, want) < 1e-5 and relative_l2(got_lp, want_lp) < 1e-4
    assert all(set(b.graphs) == set(graphed.call_stages(b)) for b in graphed.buckets.values())  # overlap: 2


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer not importable")
def test_flashinfer_matches_sdpa_with_replanning(policy):
    cfg = policy.cfg
    sdpa = FastSampler(policy.model, FastConfig(attention="sdpa"))
    fi = FastSampler(policy.model, FastConfig(attention="flashinfer"))
    for seed in (3, 4, 5):  # different prompt lengths per call: plan() before each replay
        want, _ = run(sdpa, cfg, seed)
        got, _ = run(fi, cfg, seed)
        assert relative_l2(got, want) < 2e-2


def test_bf16_fast_path_close_to_fp32_reference():
    ref_policy = build_policy(gpu_cfg("float32"), device="cuda")
    cfg = ref_policy.cfg
    fast = FastSampler(ref_policy.model, FastConfig(dtype="bfloat16"))
    inputs, noise, step_noise, stoch = inputs_for(cfg, 4, 7)
    got, _ = fast.sample_chains(inputs, noise, step_noise, stoch)
    inds = torch.full((4, cfg.sampling.num_steps), 1, device="cuda")
    want = ref_policy.sample(inputs, mode="sde", noise=noise, step_noise=step_noise, denoise_inds=inds).chains
    assert relative_l2(got, want) < 3e-2


def test_weight_update_without_recapture():
    pol = build_policy(gpu_cfg("bfloat16"), device="cuda")
    cfg = pol.cfg
    fast = FastSampler(pol.model, FastConfig())
    before, _ = run(fast, cfg, 11)
    graphs = {k: dict(b.graphs) for k, b in fast.buckets.items()}
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    fast.refresh_weights()
    after, _ = run(fast, cfg, 11)
    fresh, _ = run(FastSampler(pol.model, FastConfig(cuda_graphs=False)), cfg, 11)
    assert {k: dict(b.graphs) for k, b in fast.buckets.items()} == graphs, "no re-capture"
    assert relative_l2(after, before) > 1e-3
    assert relative_l2(after, fresh) < 1e-2


def test_tma_attention_in_the_fast_path_matches_sdpa():
    """From batch 16 the Triton backend runs the one-KV-head TMA kernel where its blocks need no KV
    split (here the prefix at batch 32): graphs replayed for new prompt lengths, against SDPA."""
    pol = build_policy(gpu_cfg("bfloat16"), device="cuda")
    cfg = pol.cfg
    sdpa = FastSampler(pol.model, FastConfig(attention="sdpa", batch_buckets=[32]))
    triton = FastSampler(pol.model, FastConfig(attention="triton", batch_buckets=[32]))
    for seed in (12, 13):
        want, want_lp = run(sdpa, cfg, seed, batch=32)
        got, got_lp = run(triton, cfg, seed, batch=32)
        assert relative_l2(got, want) < 2e-2 and relative_l2(got_lp, want_lp) < 2e-2
    (bucket,) = triton.buckets.values()
    assert bucket.prefix_attn.tma, "the prefix at batch 32 should run the TMA kernel"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a policy on the second of 2 GPUs")
def test_a_policy_on_the_second_gpu_samples_through_graphs_while_the_first_is_current():
    """Streams, graph captures and Triton launches act on the current device: the policy makes its own current
    (common/devices.py; the world model's stage ring failed its capture on cuda:1 without it, round 31)."""
    cfg = gpu_cfg("bfloat16").replace(fast={"enabled": True, "attention": "sdpa", "overlap": "off"})
    policies = {d: build_policy(cfg, device=d) for d in ("cuda:0", "cuda:1")}
    policies["cuda:1"].model.load_state_dict(policies["cuda:0"].model.state_dict())
    inputs, noise, step_noise, _ = inputs_for(cfg, 3, 21)
    inds = torch.full((3, cfg.sampling.num_steps), 1)
    chains = {}
    for device, pol in policies.items():
        torch.cuda.set_device(0)
        moved = ModelInputs(*(getattr(inputs, f).to(device) for f in ("images", "image_masks", "tokens", "token_mask")))
        out = pol.sample(moved, mode="sde", noise=noise.to(device), step_noise=step_noise.to(device),
                         denoise_inds=inds.to(device))
        assert out.chains.device == torch.device(device) and torch.cuda.current_device() == 0
        (bucket,) = pol.fast_sampler().buckets.values()
        assert bucket.graphs, f"no graphs captured on {device}"
        chains[device] = out.chains.cpu()
    assert relative_l2(chains["cuda:1"], chains["cuda:0"]) < 1e-2  # timed choices (cuBLASLt algorithms) may differ
