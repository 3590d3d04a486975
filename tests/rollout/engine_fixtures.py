"""Shared helpers of the engine and weight-sync tests (tiny policy, reference outputs, leak checks)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from policies import PolicyConfig, build_policy
from rollout.engine import draw_noise
from rollout.types import PolicyOutput
from tests.policies.conftest import raw_obs

TINY = PolicyConfig.preset("tiny")


@pytest.fixture
def one_thread():
    """2 shared cores: one torch thread per process avoids oversubscription (50x slower here)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def obs(n: int, seed: int = 0, image_size: int = 64) -> dict:
    return raw_obs(n, image_size=image_size, seed=seed)


def perturbed_weights(cfg: PolicyConfig, seed: int) -> dict[str, torch.Tensor]:
    """New weights in our layout: a differently seeded random init."""
    return {k: v.detach().clone() for k, v in build_policy(cfg.replace(seed=seed)).model.named_parameters()}


def reference_outputs(cfg: PolicyConfig, weights: dict | None, calls: list[tuple[dict, str]], seed: int) -> list[dict]:
    """What an engine with these weights must return for `calls`: a plain `build_policy` model
    fed the noise the engine's generator (seed) draws, call after call."""
    policy = build_policy(cfg)
    if weights is not None:
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                p.copy_(weights[name])
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for raw, mode in calls:
        batch = policy.make_batch(raw)
        from policies.sampling import canonical_mode

        mode = canonical_mode(mode, cfg.sampling.train_mode)
        noise, step_noise, inds = draw_noise(cfg, batch.batch_size, mode, gen)
        out = policy.sample(batch, mode=mode, noise=noise, step_noise=step_noise, denoise_inds=inds)
        outs.append({
            "actions": policy.transform.unnormalize_actions(out.model_actions), "chains": out.chains,
            "logprobs": out.logprobs, "denoise_inds": out.denoise_inds, "tokens": batch.tokenized_prompt,
        })
    return outs


def assert_outputs_equal(a: PolicyOutput, b: PolicyOutput) -> None:
    for name in PolicyOutput.TENSOR_FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.version, a.mode) == (b.version, b.mode)


def assert_matches_reference(out: PolicyOutput, ref: dict, exact: bool = True) -> None:
    for name, value in ref.items():
        if exact or value.dtype in (torch.int64, torch.bool):
            assert torch.equal(getattr(out, name), value), name
        else:
            torch.testing.assert_close(getattr(out, name), value, rtol=1e-5, atol=1e-5)


def existing_segments(names: list[str]) -> list[str]:
    """Which of these POSIX shared-memory segments still exist (other tests may own others)."""
    return [n for n in names if os.path.exists("/dev/shm/" + n)]


def live_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
