"""Stored transitions made by a real (tiny) policy's sampling, no env needed."""

from __future__ import annotations

import numpy as np
import torch

from grpo.samples import Samples
from policies import PolicyConfig, build_policy

TASKS = ["put the bowl on the plate", "open the top drawer", "turn on the stove"]


def tiny_policy(seed: int = 0, **overrides):
    return build_policy(PolicyConfig.preset("tiny", seed=seed, **overrides))


def record_stages(policy) -> list[str]:
    """The list every stage `policy`'s fast path runs from now on is appended to (its name: "vision", "prefix",
    "recompute/k", ...): which forwards ran vision or the prefix."""
    sampler, runs = policy.fast_sampler(), []
    original = sampler.run_stage
    sampler.run_stage = lambda bucket, stage, fn=None: (runs.append(stage), original(bucket, stage, fn))[1]
    return runs


def raw_obs(n: int, image_size: int = 64, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "agentview_image": rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8),
        "wrist_image": rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8),
        "state": rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        "prompt": [TASKS[i % len(TASKS)] for i in range(n)],
    }


def random_advantages(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def sampled_rows(policy, n: int, seed: int = 0, advantages: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None) -> Samples:
    """n rows sampled by `policy` in train mode (the rollout log-probs are the policy's own)."""
    raw = raw_obs(n, seed=seed)
    batch = policy.make_batch(raw)
    out = policy.sample(batch, mode="train", generator=torch.Generator().manual_seed(seed))
    return Samples(
        images={k: torch.from_numpy(raw[k]) for k in ("agentview_image", "wrist_image")},
        states=torch.from_numpy(raw["state"]),
        tokens=batch.tokenized_prompt.long(),
        token_mask=batch.tokenized_prompt_mask.bool(),
        chains=out.chains.float(),
        denoise_inds=out.denoise_inds.long(),
        rollout_logprob=out.chunk_logprob.float(),
        versions=torch.zeros(n, dtype=torch.int64),
        trajectory=torch.arange(n) // 2,
        chunk=torch.arange(n) % 2,
        advantages=advantages if advantages is not None else random_advantages(n, seed),
        trajectory_length=lengths if lengths is not None else torch.full((n,), 2, dtype=torch.int64),
    )


def assert_same_update_to_rounding(params: list[torch.Tensor], expected: list[torch.Tensor], lr: float) -> None:
    """Weights after AdamW updates whose micro-batches held other rows (other fp32 sums): AdamW divides each
    gradient by its running RMS, so a weight whose gradient is near zero can move by a rounding-sized share of a
    whole step (lr) either way, which a fixed atol of the weights' size cannot bound on every CPU (round 58: 7.6e-6
    on an AMD EPYC, lr 1e-2). Allowed: 1e-3 of one step; a wrong row or prefix moves weights by whole steps."""
    for a, b in zip(params, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3 * lr)
