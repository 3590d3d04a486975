"""The plain path's prefix leaves out what no output reads: camera slots masked in every row (Policy.prefix_cache)
and, for the trainer's stored rows, prompt columns past every row's last token (Samples.without_prompt_padding)."""

from __future__ import annotations

import dataclasses

import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from policies import PolicyConfig, build_policy
from tests.grpo.helpers import sampled_rows, tiny_policy
from tests.policies.conftest import raw_obs

THREE_SLOTS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]  # pi0.5's; LIBERO fills two


def full_cache(policy, inputs):
    return policy.model.prefix_cache(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)


def valid_keys(cache, row: int) -> list[torch.Tensor]:
    return [k[row][:, cache.pad_mask[row]] for k in cache.keys]


def test_a_camera_slot_masked_in_every_row_is_left_out_and_changes_nothing():
    policy = build_policy(PolicyConfig.preset("tiny", cameras=THREE_SLOTS))
    inputs = policy.inputs(policy.make_batch(raw_obs(3)))
    assert inputs.image_masks[:, :2].all() and not inputs.image_masks[:, 2].any()
    kept, full = policy.prefix_cache(inputs), full_cache(policy, inputs)
    patches = full.pad_mask.shape[1] - kept.pad_mask.shape[1]
    assert patches == (policy.cfg.vision.image_size // policy.cfg.vision.patch_size) ** 2  # one image's tokens
    assert kept.keys[0].shape[2] == full.keys[0].shape[2] - patches
    assert torch.equal(kept.offsets, full.offsets)
    for row in range(3):
        for a, b in zip(valid_keys(kept, row), valid_keys(full, row), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, policy.cfg.chunk_size, policy.cfg.max_action_dim, generator=torch.Generator().manual_seed(1))
    table = policy.model.modulation_table(torch.tensor([0.5]))
    torch.testing.assert_close(policy.model.velocity(kept, x, table), policy.model.velocity(full, x, table),
                               rtol=1e-5, atol=1e-5)


def test_a_camera_slot_with_an_image_in_some_row_is_kept():
    policy = build_policy(PolicyConfig.preset("tiny", cameras=THREE_SLOTS))
    inputs = policy.inputs(policy.make_batch(raw_obs(2)))
    masks = inputs.image_masks.clone()
    masks[1, 2] = True
    inputs = dataclasses.replace(inputs, image_masks=masks)
    assert policy.prefix_cache(inputs).pad_mask.shape == full_cache(policy, inputs).pad_mask.shape


def test_prompt_columns_no_row_uses_are_left_out_with_the_same_log_probs():
    policy = tiny_policy()
    padded = sampled_rows(policy, 4)  # stored at policy.max_token_len, as the collector stores them
    used = int(torch.nonzero(padded.token_mask.any(dim=0))[-1]) + 1
    assert used < padded.tokens.shape[1] == policy.cfg.max_token_len
    trimmed = padded.without_prompt_padding()
    assert trimmed.tokens.shape == (4, used) and trimmed.token_mask.shape == (4, used)
    assert torch.equal(trimmed.tokens, padded.tokens[:, :used])
    assert torch.equal(trimmed.token_mask, padded.token_mask[:, :used])
    assert trimmed.without_prompt_padding() is trimmed  # nothing left to cut: the rows as they are
    actor = Actor(policy, GRPOConfig(micro_batch=2))
    with torch.no_grad():  # chunk_logprob runs the rows at the width given
        untrimmed = torch.cat([actor.chunk_logprob(policy, padded.select(torch.arange(i, i + 2))) for i in (0, 2)])
    torch.testing.assert_close(actor.recompute(padded), untrimmed.cpu(), rtol=1e-5, atol=1e-5)


def test_rows_without_any_prompt_token_keep_one_column():
    rows = sampled_rows(tiny_policy(), 2)
    empty = dataclasses.replace(rows, token_mask=torch.zeros_like(rows.token_mask))
    assert empty.without_prompt_padding().tokens.shape == (2, 1)
