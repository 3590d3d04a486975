"""GPU: writes through the openpi-named views, as RLinf's syncers make them, reach the fast path's
captured CUDA graphs without a re-capture once `refresh_weights` ran.

Needs no rlinf (the lent GPU machine cannot carry ray): the writes are the two RLinf makes on the
rollout side, a sparse COO assignment into each tensor's 2-D view (PatchWeightSyncer.apply) and a
whole-tensor copy (load_state_dict per bucket); tests/rollout/test_rlinf_gpu.py runs RLinf's own
syncers where rlinf is installed.
"""

from __future__ import annotations

import pytest
import torch

from policies import PolicyConfig, build_policy
from policies.loaders import EXPERT, LLM, VISION, export_state_dict, load_state_dict
from rollout.rlinf.weights import openpi_views

pytestmark = pytest.mark.gpu

PATCHED = [
    EXPERT + "layers.0.self_attn.q_proj.weight",  # bf16, a row slice of the fused qkv
    EXPERT + "layers.1.mlp.up_proj.weight",  # bf16, second half of gate_up
    EXPERT + "layers.0.input_layernorm.dense.weight",  # fp32 AdaRMS: the modulation table
    "time_mlp_in.weight",  # fp32: the modulation table
    VISION + "encoder.layers.0.self_attn.v_proj.weight",  # fp32 vision: the fast path's bf16 shadow
]
COPIED = LLM + "layers.1.self_attn.k_proj.weight"


def cfg():
    return PolicyConfig.preset(
        "pi05_small",
        chunk_size=10,
        dtype="bfloat16",
        sampling={"num_steps": 4},
        fast={"enabled": True, "dtype": "bfloat16", "attention": "sdpa"},
    )


def inputs(policy, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    raw = {
        "agentview_image": torch.randint(0, 256, (batch, 224, 224, 3), dtype=torch.uint8, generator=gen),
        "wrist_image": torch.randint(0, 256, (batch, 224, 224, 3), dtype=torch.uint8, generator=gen),
        "state": torch.rand(batch, 8, generator=gen) * 2 - 1,
        "prompt": ["put the bowl on the plate"] * batch,
    }
    noise = torch.randn(batch, policy.cfg.chunk_size, policy.cfg.max_action_dim, generator=gen)
    return policy.make_batch(raw), noise.cuda()


def sparse_writes(views: dict, seed: int) -> None:
    """RLinf's patch apply: value_2dview[rows, cols] = values, on each tensor's 2-D view."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name in PATCHED:
        view = views[name]
        view2d = view.view(view.shape[0], -1) if view.dim() > 1 else view.view(1, -1)
        count = max(1, view2d.numel() // 50)
        flat = torch.randperm(view2d.numel(), generator=gen, device="cuda")[:count]
        rows, cols = flat // view2d.shape[1], flat % view2d.shape[1]
        view2d[rows, cols] = view2d[rows, cols] + 0.5
    views[COPIED].copy_(views[COPIED] * -1.0)  # the bucket syncer's load_state_dict


@torch.no_grad()
def test_view_writes_reach_captured_graphs_after_refresh():
    policy = build_policy(cfg(), device="cuda")
    batch, noise = inputs(policy, 4, seed=1)
    before = policy.sample(batch, mode="eval", noise=noise).actions
    fast = policy.fast_sampler()
    graphs = {key: dict(bucket.graphs) for key, bucket in fast.buckets.items()}
    assert any(graphs.values()), "the fast path captured graphs"
    pointers = {name: p.data_ptr() for name, p in policy.model.named_parameters()}

    sparse_writes(openpi_views(policy.model), seed=2)
    policy.refresh_weights()
    after = policy.sample(batch, mode="eval", noise=noise).actions

    assert {key: dict(bucket.graphs) for key, bucket in fast.buckets.items()} == graphs, "no re-capture"
    assert {name: p.data_ptr() for name, p in policy.model.named_parameters()} == pointers
    reference = build_policy(cfg(), device="cuda")
    load_state_dict(reference.model, export_state_dict(policy.model, "openpi"), "openpi")
    for name, param in reference.model.named_parameters():
        assert torch.equal(param, policy.model.get_parameter(name)), name
    expected = reference.sample(batch, mode="eval", noise=noise).actions
    assert torch.allclose(after, expected, atol=1e-3, rtol=1e-3), (after - expected).abs().max()
    assert not torch.allclose(after, before, atol=1e-3, rtol=1e-3)
