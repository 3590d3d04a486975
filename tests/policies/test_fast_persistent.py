"""The persistent expert kernel (policies/fast/persistent.py) against the per-kernel denoise loop.
On CPU it runs under Triton's interpreter with one program, which walks every tile of every phase
(the grid-wide barriers pass at once); test_persistent_gpu.py runs it with one program per SM."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.config import PolicyConfig  # noqa: E402
from policies.fast import persistent  # noqa: E402
from policies.fast.config import FastConfig  # noqa: E402
from policies.fast.runner import FastSampler  # noqa: E402
from policies.policy import build_policy  # noqa: E402

from .test_fast_sampler import random_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (GPU: test_persistent_gpu)")


def small_cfg() -> PolicyConfig:
    """tiny with 32-wide heads: RoPE pairs of 16 columns, the smallest tl.dot operand."""
    return PolicyConfig.preset("tiny").replace(prefix={"head_dim": 32},
                                               expert={"head_dim": 32, "width": 64, "mlp_dim": 128})


@pytest.fixture(scope="module")
def policy():
    return build_policy(small_cfg())


def sample(policy, batch, persistent_mode, att_splits=None, seed=4):
    cfg = policy.cfg
    inputs, noise, step_noise = random_inputs(cfg, batch, 13, seed=seed)
    stoch = torch.zeros(batch, cfg.sampling.num_steps, dtype=torch.bool)
    stoch[:, 1] = True
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16],
                                                persistent=persistent_mode, cuda_graphs=False, attention="sdpa"))
    if att_splits is not None:  # rebuild the bucket's kernel with a forced KV split
        bucket = fast.prepare(inputs, noise, step_noise, stoch)
        planned = bucket.persistent
        bucket.persistent = persistent.PersistentExpert(
            fast.w, cfg, bucket.k_cache, bucket.v_cache, bucket.tensors["suffix_slots"], bucket.batch * cfg.chunk_size,
            bucket.batch, fast.device, planned.shape, att_splits=att_splits)
        bucket.persistent.plan(planned.key_len)  # the layout is not re-uploaded for the same masks
    chains, logps = fast.sample_chains(inputs, noise, step_noise, stoch)
    return fast, chains, logps


@pytest.mark.parametrize("att_splits", [None, 3])
def test_persistent_matches_per_kernel_loop(policy, att_splits):
    fast, chains, logps = sample(policy, 3, "on", att_splits)
    bucket = next(iter(fast.buckets.values()))
    assert bucket.persistent is not None and bucket.persistent.att_splits == (att_splits or 1)
    _, want_chains, want_logps = sample(policy, 3, "off")
    assert torch.allclose(chains, want_chains, atol=1e-5, rtol=1e-5), (chains - want_chains).abs().max()
    assert torch.allclose(logps, want_logps, atol=1e-4, rtol=1e-4), (logps - want_logps).abs().max()


def test_weight_update_is_seen_without_rebuilding(policy):
    """The pointer tables hold the parameters' storage: an in-place update reaches the kernel."""
    pol = build_policy(small_cfg())
    fast, before, _ = sample(pol, 2, "on")
    with torch.no_grad():
        pol.model.expert.layers[1].down.weight.mul_(-1.5)
    fast.refresh_weights()
    inputs, noise, step_noise = random_inputs(pol.cfg, 2, 13, seed=4)
    stoch = torch.zeros(2, pol.cfg.sampling.num_steps, dtype=torch.bool)
    stoch[:, 1] = True
    after, _ = fast.sample_chains(inputs, noise, step_noise, stoch)
    _, want, _ = sample(pol, 2, "off")
    assert not torch.allclose(after, before, atol=1e-3)
    assert torch.allclose(after, want, atol=1e-5, rtol=1e-5), (after - want).abs().max()


def test_modes_and_reasons():
    cfg = small_cfg()
    assert persistent.shape_for(64, cfg.expert) == persistent.SMALL_SHAPE
    assert persistent.shape_for(65, cfg.expert) is None
    pi05 = PolicyConfig.preset("pi05").expert
    assert persistent.shape_for(50, pi05) == persistent.PersistentShape()
    assert "65 rows > 64" in persistent.usable(65, pi05, persistent.PersistentShape())
    assert "head_dim/2=8" in persistent.usable(8, PolicyConfig.preset("tiny").expert, persistent.PersistentShape())
    with pytest.raises(ValueError, match="policy.fast.persistent must be one of"):
        FastConfig(persistent="always")
    pol = build_policy(cfg)
    inputs, noise, step_noise = random_inputs(cfg, 2, 13, seed=1)
    stoch = torch.zeros(2, cfg.sampling.num_steps, dtype=torch.bool)
    big = FastSampler(pol.model, FastConfig(dtype="float32", batch_buckets=[16], prompt_buckets=[16], persistent="on",
                                            cuda_graphs=False))
    with pytest.raises(ValueError, match="batch-16 bucket cannot use it: 128 rows > 64"):
        big.sample_chains(inputs, noise, step_noise, stoch)
    auto = FastSampler(pol.model, FastConfig(dtype="float32", batch_buckets=[4], prompt_buckets=[16],
                                             cuda_graphs=False))
    auto.sample_chains(inputs, noise, step_noise, stoch)
    assert next(iter(auto.buckets.values())).persistent is None  # auto: CUDA graphs only
