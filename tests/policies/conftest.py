"""Shared helpers for the policy tests: small policies and raw env observations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policies import PolicyConfig, build_policy

TASKS = [
    "put the bowl on the plate",
    "open the top drawer",
    "turn on the stove and put the moka pot on it",
]


def raw_obs(n: int, image_size: int = 64, seed: int = 0, state_dim: int = 8) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "agentview_image": rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8),
        "wrist_image": rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8),
        "state": rng.uniform(-1, 1, (n, state_dim)).astype(np.float32),
        "prompt": [TASKS[i % len(TASKS)] for i in range(n)],
    }


@pytest.fixture(scope="module")
def tiny_policy():
    return build_policy(PolicyConfig.preset("tiny"))


@pytest.fixture(scope="module")
def small_policy():
    return build_policy(PolicyConfig.preset("pi05_small"))


def noise_for(policy, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = policy.cfg
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, cfg.chunk_size, cfg.max_action_dim, generator=gen)
    steps = torch.randn(
        batch, cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim, generator=gen
    )
    return noise, steps
