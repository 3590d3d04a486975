"""The engine on a GPU: local ranks sharing one device match the in-process backend; weight
updates land in place and the fast path's captured CUDA graphs see them (no re-capture)."""

from __future__ import annotations

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from tests.rollout.engine_fixtures import TINY, assert_outputs_equal, obs, perturbed_weights

pytestmark = pytest.mark.gpu

# sdpa: the "auto" attention choice is timed, so two engines could pick different kernels
FAST_BF16 = TINY.replace(dtype="bfloat16", fast={"enabled": True, "dtype": "bfloat16", "attention": "sdpa"})


def test_local_ranks_sharing_a_gpu_match_inproc():
    results = {}
    for backend in ("inproc", "local"):
        with PolicyEngine(EngineConfig(backend=backend, num_ranks=2, devices="cuda:0", seed=3), TINY) as e:
            outs = [e.predict(obs(5, seed=1), "train"), e.predict(obs(3, seed=2), "eval")]
            e.update_weights({k: v.cuda() for k, v in perturbed_weights(TINY, 8).items()}, version=1)
            outs.append(e.predict(obs(6, seed=4), "train", group_size=3))
            results[backend] = outs
    for a, b in zip(results["inproc"], results["local"]):
        assert_outputs_equal(a, b)


def test_update_keeps_captured_graphs_valid():
    """Engine A captures its graphs on the initial weights, then receives new weights; engine B
    gets the same weights before it ever captures. Same calls -> bit-identical outputs."""
    new = {k: v.cuda() for k, v in perturbed_weights(FAST_BF16, 9).items()}
    call = obs(4, seed=6)
    with PolicyEngine(EngineConfig(devices="cuda:0"), FAST_BF16) as a:
        before = a.predict(call, "train")  # captures vision / prefix / denoise graphs of bucket 4
        graphs = {key: dict(b.graphs) for key, b in a.client.cores[0].policy.fast_sampler().buckets.items()}
        a.update_weights(new, version=1)
        a.reseed()
        after = a.predict(call, "train")
        still = {key: dict(b.graphs) for key, b in a.client.cores[0].policy.fast_sampler().buckets.items()}
    with PolicyEngine(EngineConfig(devices="cuda:0"), FAST_BF16) as b:
        b.update_weights(new, version=1)
        fresh = b.predict(call, "train")
    assert all(still[k][s] is graphs[k][s] for k in graphs for s in graphs[k])  # no re-capture
    assert not torch.equal(before.chains, after.chains)
    assert torch.equal(after.chains, fresh.chains) and torch.equal(after.logprobs, fresh.logprobs)
