"""Analytic FLOP/byte counts against torch's FLOP counter on the running model."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from policies import PolicyConfig
from policies.flops import DTYPE_BYTES, stage_costs
from tests.policies.conftest import raw_obs


def counted(fn) -> int:
    # the math SDPA backend decomposes attention into matmuls the counter sees
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("batch, wrist_mapped", [(2, True), (3, False)])
def test_stage_flops_match_the_flop_counter(tiny_policy, batch, wrist_mapped):
    policy, m = tiny_policy, tiny_policy.model
    inputs = policy.inputs(policy.make_batch(raw_obs(batch)))
    tokens, token_mask = (
        inputs.tokens[:, :100],
        inputs.token_mask[:, :100],
    )  # shorter than max_token_len
    if not wrist_mapped:
        inputs.image_masks[:, 1] = False  # masked cameras still run through SigLIP
    costs = stage_costs(policy.cfg, batch, prompt_len=100, modulation_precomputed=True)
    with torch.no_grad():
        embs, pad = m.embed_prefix(inputs.images, inputs.image_masks, tokens, token_mask)
        cache = m.compute_prefix_cache(embs, pad)
        table = m.modulation_table(torch.tensor([1.0]))
    x = torch.zeros(batch, policy.cfg.chunk_size, policy.cfg.max_action_dim)
    assert counted(lambda: m.vision(inputs.images.flatten(0, 1))) == costs["vision"].flops
    assert counted(lambda: m.compute_prefix_cache(embs, pad)) == costs["prefix"].flops
    assert counted(lambda: m.velocity(cache, x, table)) == costs["expert_step"].flops
    with_table = stage_costs(policy.cfg, batch, prompt_len=100)["expert_step"].flops
    assert with_table == costs["expert_step"].flops + counted(
        lambda: m.modulation_table(torch.ones(batch))
    )


def test_full_pi05_counts():
    cfg = PolicyConfig.preset("pi05", dtype="bfloat16")
    costs = stage_costs(cfg, batch=1)
    tf = {k: v.flops / 1e12 for k, v in costs.items()}
    # DESIGN.md: ~4.9 TFLOP per sample (3 cams, 200 tokens, chunk 50, 10 steps)
    assert 4.6 < tf["total"] < 5.1
    assert tf["prefix"] > tf["vision"] > tf["expert_total"]
    lerobot_like = stage_costs(cfg, batch=1, full_last_layer=True)["prefix"].flops / 1e12
    assert lerobot_like - tf["prefix"] == pytest.approx(tf["prefix"] / 17.9, rel=0.05)  # ~one layer
    # weights read once per stage: the prefix stage reads ~2B bf16 parameters (embedding excluded)
    g = cfg.prefix
    per_layer = (
        g.width * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
        + g.num_heads * g.head_dim * g.width
        + 3 * g.width * g.mlp_dim
    )
    last = g.width * 2 * g.num_kv_heads * g.head_dim
    assert costs["prefix"].weight_bytes == (17 * per_layer + last) * DTYPE_BYTES["bfloat16"]
    # batch scales FLOPs linearly but not weight bytes
    b8 = stage_costs(cfg, batch=8)
    assert b8["prefix"].flops == pytest.approx(8 * costs["prefix"].flops)
    assert b8["prefix"].weight_bytes == costs["prefix"].weight_bytes
    assert b8["expert_step"].intensity > 4 * costs["expert_step"].intensity
