"""The vision stage as parallel image groups (policies/fast/vision.py, FastSampler.vision_branches).

CPU (fp32, no streams: the groups run one after another) checks the split and the rows each group
writes; the `gpu` tests check the graph branches: each group's rows equal the tower run on that
group's images alone, and the whole chains stay close to the one-branch sampler's.
"""

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast import vision
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.policy import build_policy

from .test_fast_sampler import random_inputs


@pytest.mark.parametrize(("images", "branches", "want"), [
    (3, 1, [3]), (3, 2, [2, 1]), (3, 3, [1, 1, 1]), (2, 5, [1, 1]), (6, 4, [2, 2, 1, 1]), (1, 2, [1]),
])
def test_image_groups_are_contiguous_and_even(images, branches, want):
    assert vision.image_groups(images, branches) == want


def test_image_groups_refuse_zero_branches():
    with pytest.raises(ValueError, match="vision branches must be >= 1, got 0"):
        vision.image_groups(3, 0)


def image_tokens(sampler, inputs, noise, step_noise) -> torch.Tensor:
    stoch = torch.zeros(noise.shape[0], sampler.num_steps, dtype=torch.bool, device=noise.device)
    bucket = sampler.prepare(inputs, noise, step_noise, stoch)
    bucket.tensors["image_embeddings"].fill_(float("nan"))  # poisoned: every row must be written
    sampler.run_stage(bucket, "vision")
    return bucket.tensors["image_embeddings"].clone()


@pytest.mark.parametrize("branches", [2, 3, 4])
def test_branches_compute_the_one_batch_tower_on_cpu(branches):
    policy = build_policy(PolicyConfig.preset("tiny"))
    inputs, noise, step_noise = random_inputs(policy.cfg, 2, 13, seed=7)
    inputs.image_masks[:] = True  # every camera runs: 2 x cameras images
    make = lambda: FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[2],  # noqa: E731
                                                        prompt_buckets=[16], cuda_graphs=False, attention="sdpa"))
    one, split = make(), make()
    split.vision_branches = branches
    want, got = image_tokens(one, inputs, noise, step_noise), image_tokens(split, inputs, noise, step_noise)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tower_on_a_group_writes_only_its_rows():
    policy = build_policy(PolicyConfig.preset("tiny"))
    cfg = policy.cfg
    fast = FastSampler(policy.model, FastConfig(dtype="float32", batch_buckets=[1], prompt_buckets=[16],
                                                cuda_graphs=False))
    images = torch.rand(3, 3, cfg.vision.image_size, cfg.vision.image_size) * 2 - 1
    out = torch.full((3, cfg.vision.num_patches, cfg.prefix.width), float("nan"))
    vision.vision_tower(fast.w.vision, cfg.vision, images[1:], out[1:].flatten(0, 1))
    assert out[0].isnan().all() and not out[1:].isnan().any()
    alone = torch.empty(2, cfg.vision.num_patches, cfg.prefix.width)
    vision.vision_tower(fast.w.vision, cfg.vision, images[1:].clone(), alone.flatten(0, 1))
    assert torch.equal(out[1:], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("branches", [2, 3])
def test_vision_branches_in_a_graph_equal_each_group_alone(branches):
    from .test_fast_gpu import gpu_cfg, inputs_for

    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 1, seed=21)
    inputs.image_masks[:] = True
    cfg = FastConfig(attention="triton", batch_buckets=[1], prompt_buckets=[48])
    one, split = FastSampler(policy.model, cfg), FastSampler(policy.model, cfg)
    split.vision_branches = branches
    for _ in range(3):  # replays, not only the capture run
        want = one.sample_chains(inputs, noise, step_noise, stoch)
        got = split.sample_chains(inputs, noise, step_noise, stoch)
    bucket = next(iter(split.buckets.values()))
    tokens = bucket.tensors["image_embeddings"].view(-1, policy.cfg.vision.num_patches, policy.cfg.prefix.width)
    images = bucket.tensors["images"].flatten(0, 1)
    start = 0
    for count in vision.image_groups(images.shape[0], branches):
        alone = torch.empty_like(tokens[start:start + count])
        vision.vision_tower(split.w.vision, policy.cfg.vision, images[start:start + count].clone(), alone.flatten(0, 1))
        assert torch.equal(tokens[start:start + count], alone), (start, count)
        start += count
    for a, b in zip(got, want, strict=True):
        rel = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        assert rel < 2e-2, rel
