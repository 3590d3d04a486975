"""A broadcast update the engine refuses before taking it (a version not above its own, a before-hook
that raises) is refused through the group: the receivers read the trainer's manifest and agree False,
so `broadcast_weights` raises WeightRefusedError at once (it used to wait out the group's timeout, the
group then out of step), the engine raises its own error, untouched, and the next update goes through.
Gloo on CPU, the trainer a spawned process, as in test_weights_dist.py."""

from __future__ import annotations

import time

import pytest
import torch

from rollout.config import RolloutConfig
from rollout.engine import PolicyEngine
from rollout.weights import WeightRefusedError
from rollout.weights_dist import DistBroadcast
from tests.rollout.engine_fixtures import (
    TINY,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    perturbed_weights,
)
from tests.rollout.test_weights_dist import BUCKET_BYTES, assert_params, trainer_process

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
GROUP_TIMEOUT_S = 30  # the engine's dist_timeout_s; the trainer joins with the same
PROMPT_S = 10  # a refusal must come well before the group's timeout


def rollout_cfg(backend: str, num_ranks: int) -> RolloutConfig:
    return RolloutConfig.from_mapping({
        "engine": {"backend": backend, "num_ranks": num_ranks, "devices": "cpu", "torch_threads": 1,
                   "ray_num_cpus": 2},
        "weights": {"dist_backend": "gloo", "dist_timeout_s": GROUP_TIMEOUT_S},
    })


def trainer_main(conn, init_method: str, world_size: int, steps: list[tuple]) -> None:
    """Rank 0: broadcast each (kind, seed, version), report (outcome, message, seconds) through the pipe."""
    from rollout.weights_dist import broadcast_weights, join_trainer, leave

    torch.set_num_threads(1)
    join_trainer(init_method, world_size, "gloo", timeout_s=GROUP_TIMEOUT_S)
    try:
        for kind, seed, version in steps:
            weights = perturbed_weights(TINY, seed)
            if kind == "not_a_tensor":  # the trainer fails before sending: its manifest carries the error
                name = "expert.final_norm.dense.bias"
                weights = {**weights, name: weights[name].numpy()}
            start = time.monotonic()
            try:
                broadcast_weights(weights, version, BUCKET_BYTES)
                outcome, message = "ok", ""
            except WeightRefusedError as exc:
                outcome, message = "refused", str(exc)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which names what it expected
                outcome, message = type(exc).__name__, str(exc)
            conn.send((outcome, message, time.monotonic() - start))
    finally:
        leave()


def refuse_version_once(version: int):
    """A before-hook that refuses the first update to `version` (a trainer-side check that says no)."""
    refused = []

    def hook(event) -> None:
        if event.version == version and not refused:
            refused.append(version)
            raise RuntimeError(f"hook refuses weight version {event.version}")

    return hook


def assert_refused_at_once(e: PolicyEngine, conn, version: int, error, match: str, trainer_kind: str = "refused",
                           trainer_match: str | None = None) -> None:
    """update_weights(version) raises `error`; the trainer's broadcast ends at once with `trainer_kind`."""
    before = e.version
    start = time.monotonic()
    with pytest.raises(error, match=match):
        e.update_weights(DistBroadcast(src=0), version=version)
    engine_s = time.monotonic() - start
    kind, message, trainer_s = conn.recv()
    assert kind == trainer_kind, (kind, message, trainer_s)
    if trainer_match is not None:
        assert trainer_match in message
    assert engine_s < PROMPT_S and trainer_s < PROMPT_S, (engine_s, trainer_s)
    assert e.version == before and e.predict(obs(2)).version == before  # untouched, still serving


def test_refused_broadcasts_end_the_trainers_wait_at_once_inproc():
    steps = [("full", 71, 1), ("full", 72, 1), ("full", 73, 2), ("not_a_tensor", 74, 2), ("full", 75, 2)]
    with trainer_process(2, steps, target=trainer_main, timeout_s=GROUP_TIMEOUT_S) as (trainer, conn, init_method):
        with PolicyEngine(rollout_cfg("inproc", 1), TINY) as e:
            e.add_hook(before=refuse_version_once(2))
            e.join_weight_group(init_method, world_size=2, first_rank=1)
            e.update_weights(DistBroadcast(src=0), version=1)
            assert conn.recv()[0] == "ok"

            # a stale version (the trainer resends 1)
            assert_refused_at_once(e, conn, 1, ValueError, r"greater than the current 1, got 1",
                                   trainer_match="refused weight version 1")
            # a before-hook refuses version 2
            assert_refused_at_once(e, conn, 2, RuntimeError, "hook refuses weight version 2",
                                   trainer_match="refused weight version 2")
            # a stale version while the trainer could not send (its manifest is an error: no agreement follows)
            assert_refused_at_once(e, conn, 1, ValueError, r"greater than the current 1, got 1",
                                   trainer_kind="TypeError", trainer_match="must be a torch")

            e.update_weights(DistBroadcast(src=0), version=2)  # the group is in step: the next update lands
            assert conn.recv()[0] == "ok"
            assert e.version == 2
            assert_params(e.state_dict(), perturbed_weights(TINY, 75))
    assert trainer.exitcode == 0


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_refused_broadcasts_end_the_trainers_wait_at_once_rank_processes(backend):
    """Every rank process refuses (each is a member of the group), routed like a broadcast update."""
    steps = [("full", 81, 1), ("full", 82, 1), ("full", 83, 2), ("full", 84, 2)]
    with trainer_process(3, steps, target=trainer_main, timeout_s=GROUP_TIMEOUT_S) as (trainer, conn, init_method):
        with PolicyEngine(rollout_cfg(backend, 2), TINY) as e:
            e.add_hook(before=refuse_version_once(2))
            e.join_weight_group(init_method, world_size=3, first_rank=1)
            e.update_weights(DistBroadcast(src=0), version=1)
            assert conn.recv()[0] == "ok"
            assert_refused_at_once(e, conn, 1, ValueError, r"greater than the current 1, got 1",
                                   trainer_match="refused weight version 1")
            assert_refused_at_once(e, conn, 2, RuntimeError, "hook refuses weight version 2",
                                   trainer_match="refused weight version 2")
            e.update_weights(DistBroadcast(src=0), version=2)
            assert conn.recv()[0] == "ok"
            for rank in range(2):
                assert_params(e.state_dict(rank=rank), perturbed_weights(TINY, 84))
    assert trainer.exitcode == 0


def test_a_refusal_without_a_weight_group_still_raises_the_engines_error():
    """No group joined: there is nothing to refuse through, the version's error is raised as before (noted)."""
    with PolicyEngine(rollout_cfg("inproc", 1), TINY) as e:
        with pytest.raises(ValueError, match=r"greater than the current 0, got 0") as info:
            e.update_weights(DistBroadcast(src=0), version=0)
        assert any("no weight group joined" in note for note in info.value.__notes__)
        assert e.alive and e.predict(obs(2)).version == 0
