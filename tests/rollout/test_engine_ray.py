"""The Ray backend on CPU with two actors: identical to the in-process backend, a dead actor is
named, and close() shuts down the local Ray it started."""

from __future__ import annotations

import os
import signal

import pytest

from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from rollout.engine_client import RankFailedError
from tests.rollout.engine_fixtures import (
    TINY,
    assert_outputs_equal,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    perturbed_weights,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
CALLS = [(obs(5, seed=1), "train"), (obs(3, seed=2, image_size=56), "eval")]


def run(backend: str) -> tuple[list, PolicyEngine]:
    cfg = EngineConfig(backend=backend, num_ranks=2, devices="cpu", torch_threads=1, ray_num_cpus=2,
                       rank_timeout_s=60)
    e = PolicyEngine(cfg, TINY)
    outs = [e.predict(raw, mode) for raw, mode in CALLS]
    e.update_weights(perturbed_weights(TINY, seed=9), version=1)
    outs.append(e.predict(obs(8, seed=3), "train", group_size=4))
    return outs, e


def test_ray_backend_identical_dead_actor_named_and_closed():
    import ray

    expected, inproc = run("inproc")
    inproc.close()
    outs, e = run("ray")
    try:
        for a, b in zip(expected, outs):
            assert_outputs_equal(a, b)
        pid = e.client.info[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailedError, match=r"engine rank 1 \(Ray actor, cpu\) died during predict"):
            e.predict(obs(4), "train")
        e.restart()  # new actors in the same Ray
        e.update_weights(perturbed_weights(TINY, seed=9), version=1)
        assert e.predict(obs(4), "train").version == 1
    finally:
        e.close()
    assert not ray.is_initialized()
