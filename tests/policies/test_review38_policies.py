"""Review round 38: the policy package outside the fast path (sampling inputs, observation masks,
checkpoint reading, batched prompts)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from policies import PolicyConfig, build_policy
from policies.loaders import read_safetensors
from tests.policies.conftest import raw_obs


@pytest.mark.parametrize("rows", [1, 2])
def test_sample_refuses_denoise_inds_of_another_batch_size(tiny_policy, rows):
    # (1, K) used to be accepted and returned as the output's denoise_inds (log_prob then refused
    # them); (2, K) for a batch of 4 failed inside the log-prob gather with an IndexError
    batch = tiny_policy.make_batch(raw_obs(4, image_size=56))
    inds = torch.zeros(rows, tiny_policy.cfg.sampling.num_steps, dtype=torch.long)
    with pytest.raises(ValueError, match=r"denoise_inds must be \(B, K\) = \(4, 4\).*got \(" + str(rows)):
        tiny_policy.sample(batch, mode="sde", denoise_inds=inds)


def test_sample_with_given_denoise_inds_still_round_trips(tiny_policy):
    batch = tiny_policy.make_batch(raw_obs(3, image_size=56))
    inds = torch.full((3, tiny_policy.cfg.sampling.num_steps), 2, dtype=torch.long)
    out = tiny_policy.sample(batch, mode="sde", denoise_inds=inds)
    lp = tiny_policy.log_prob(batch, out.chains, out.denoise_inds)
    torch.testing.assert_close(lp.chunk_logprob.detach(), out.chunk_logprob)


def test_image_mask_under_an_unknown_camera_is_refused(tiny_policy):
    # a misspelt mask key used to be dropped silently: the camera it meant to mask read as valid
    batch = tiny_policy.make_batch(raw_obs(2, image_size=56))
    masks = dict(batch.image_masks)
    masks["left_wrist_rgb"] = torch.zeros(2, dtype=torch.bool)
    bad = dataclasses.replace(batch, image_masks=masks)
    with pytest.raises(ValueError, match=r"observation.image_masks has unknown camera\(s\) \['left_wrist_rgb'\]"):
        tiny_policy.inputs(bad)


def test_unreadable_checkpoint_error_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\xff" * 64)  # not a safetensors header
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        read_safetensors(tmp_path)
    cfg = PolicyConfig.preset("tiny", checkpoint=str(path))
    with pytest.raises(ValueError, match=str(path)):
        build_policy(cfg)


def test_batched_prompt_keeps_a_trailing_nul_like_the_reference(tiny_policy):
    # numpy's fixed-width str dtype strips trailing "\x00", so the batched path used to tokenise
    # "put it\x00" as "put it" while the per-sample reference kept the byte
    raw = raw_obs(3, image_size=56)
    raw["prompt"] = ["put it\x00", "put it", "open the drawer"]
    fast, ref = tiny_policy.transform(raw), tiny_policy.transform.reference(raw)
    assert torch.equal(fast.tokenized_prompt, ref.tokenized_prompt)
    assert torch.equal(fast.tokenized_prompt_mask, ref.tokenized_prompt_mask)
    assert not torch.equal(fast.tokenized_prompt[0], fast.tokenized_prompt[1])


def test_batched_prompts_match_the_reference_on_awkward_tasks(tiny_policy):
    rng = np.random.default_rng(38)
    tasks = ["pick_up the\nbowl ", "  é café", "a", "open drawer\t", "x" * 40, "", "  "]
    for trial in range(6):
        n = int(rng.integers(1, 6))
        raw = raw_obs(n, image_size=56, seed=trial)
        raw["state"] = rng.uniform(-1.3, 1.3, (n, 8)).astype(np.float32)  # bins -1 and 255 too
        raw["prompt"] = [tasks[int(rng.integers(len(tasks)))] for _ in range(n)]
        fast, ref = tiny_policy.transform(raw), tiny_policy.transform.reference(raw)
        assert torch.equal(fast.tokenized_prompt, ref.tokenized_prompt), raw["prompt"]
        assert torch.equal(fast.tokenized_prompt_mask, ref.tokenized_prompt_mask), raw["prompt"]


def test_config_name_key_can_be_given_and_round_trips():
    # PolicyConfig.preset's own parameter was called `name`, so any mapping with the config's
    # `name` key (every to_dict()) failed with "preset() got multiple values for argument 'name'"
    cfg = PolicyConfig.preset("tiny", name="my_tiny", dtype="bfloat16")
    assert cfg.name == "my_tiny" and cfg.vision.width == 32
    assert PolicyConfig.from_mapping(cfg.to_dict()) == cfg
    assert PolicyConfig.from_mapping(PolicyConfig.preset("pi05_small").to_dict()).name == "pi05_small"
    assert PolicyConfig.from_mapping({"preset": "tiny", "name": "run_a"}).name == "run_a"
    # no preset and a name that is not one: the documented default preset, pi05
    assert PolicyConfig.from_mapping({"name": "run_b"}).prefix.width == 2048


@pytest.mark.parametrize("stats,match", [
    ({"state_q01": [0.0] * 7 + [float("nan")], "state_q99": [1.0] * 8}, r"inputs\.state_q01 must be a list of finite"),
    ({"action_q01": [0.0] * 7, "action_q99": [1.0] * 6 + [float("inf")]},
     r"inputs\.action_q99 must be a list of finite"),
    ({"state_q01": "stats.json", "state_q99": [1.0] * 8}, r"inputs\.state_q01 must be a list of finite"),
    ({"action_q01": [0.0] * 6 + [2.0], "action_q99": [1.0] * 7}, r"action_q01 exceeds .*action_q99 at dim 6"),
])
def test_normalisation_stats_must_be_finite_and_ordered(stats, match):
    # review round 36: a NaN or inf quantile came back only as non-finite actions from the engine
    with pytest.raises(ValueError, match=match):
        PolicyConfig.preset("tiny", inputs=stats)
