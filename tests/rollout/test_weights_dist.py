"""Weights broadcast over torch.distributed (gloo on CPU): a trainer process and the engine's
receivers in one group. Manifest validated by every receiver before any byte is sent; buckets;
a trainer dying mid-update leaves the engine refusing until a full update succeeds."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

from rollout.config import RolloutConfig
from rollout.engine import PolicyEngine
from rollout.weights import WeightRefusedError, WeightUpdateError, expert_names
from rollout.weights_dist import DistBroadcast
from tests.rollout.engine_fixtures import (
    TINY,
    assert_matches_reference,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    perturbed_weights,
    reference_outputs,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny policy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_main(conn, init_method: str, world_size: int, steps: list[tuple]) -> None:
    """Rank 0: run the scripted updates, report each outcome through the pipe."""
    from rollout.weights_dist import broadcast_weights, join_trainer, leave

    torch.set_num_threads(1)
    join_trainer(init_method, world_size, "gloo", timeout_s=60)
    try:
        for kind, seed, version in steps:
            weights = perturbed_weights(TINY, seed)
            on_bucket = None
            if kind == "expert":
                weights = {n: weights[n] for n in expert_set()}
            if kind == "bad_shape":
                weights = {"expert.final_norm.dense.bias": torch.zeros(3)}
            if kind == "not_a_tensor":  # a trainer mistake found before anything is sent
                name = "expert.final_norm.dense.bias"
                weights = {**weights, name: weights[name].numpy()}
            if kind == "crash":
                on_bucket = lambda i, total: os._exit(3)  # noqa: E731 - dies after the first bucket
            try:
                broadcast_weights(weights, version, BUCKET_BYTES, on_bucket=on_bucket)
                conn.send(("ok", version))
            except WeightRefusedError as exc:
                conn.send(("refused", str(exc)))
            except TypeError as exc:
                conn.send(("trainer error", str(exc)))
    finally:
        leave()


@contextlib.contextmanager
def trainer_process(world_size: int, steps: list[tuple], target=None, timeout_s: float = 30.0):
    """Rank 0 as a spawned process running `target(conn, init_method, world_size, steps)` (default this
    file's trainer_main); yields (process, conn, init_method) and joins it on exit (killed if still alive
    after timeout_s), so the caller can check its exit code after the block."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    process = ctx.Process(target=target or trainer_main, args=(child, init_method, world_size, steps), daemon=True)
    process.start()
    try:
        yield process, parent, init_method
    finally:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()


def rollout_cfg(backend: str, num_ranks: int) -> RolloutConfig:
    return RolloutConfig.from_mapping({
        "engine": {"backend": backend, "num_ranks": num_ranks, "devices": "cpu", "torch_threads": 1},
        "weights": {"dist_backend": "gloo", "dist_timeout_s": 30},
    })


def test_broadcast_updates_refusal_and_trainer_crash():
    steps = [("full", 41, 1), ("bad_shape", 0, 2), ("crash", 42, 2)]
    calls = [(obs(3, seed=3), "train")]
    with trainer_process(2, steps) as (trainer, conn, init_method):
        with PolicyEngine(rollout_cfg("inproc", 1), TINY) as e:
            e.join_weight_group(init_method, world_size=2, first_rank=1)
            e.update_weights(DistBroadcast(src=0), version=1)
            assert conn.recv() == ("ok", 1)
            out = e.predict(*calls[0])
            assert_matches_reference(out, reference_outputs(TINY, perturbed_weights(TINY, 41), calls, seed=0)[0])

            with pytest.raises(WeightRefusedError, match=r"'expert.final_norm.dense.bias' has shape \(3,\)"):
                e.update_weights(DistBroadcast(src=0), version=2, partial=True)
            kind, message = conn.recv()
            assert kind == "refused" and "refused weight version 2" in message
            assert e.predict(obs(2)).version == 1  # refused before any write: still serving

            with pytest.raises(WeightUpdateError, match="version 2 failed"):
                e.update_weights(DistBroadcast(src=0), version=2)
            with pytest.raises(RuntimeError, match="version 2 failed while writing"):
                e.predict(obs(2))
            e.update_weights(perturbed_weights(TINY, 43), version=3)  # a full update from elsewhere
            assert e.predict(obs(2)).version == 3
    assert trainer.exitcode == 3  # it died where the script said


def test_a_trainer_that_cannot_send_makes_the_receivers_refuse_at_once():
    """A source the trainer cannot send (a numpy array among the tensors) fails before the manifest: the
    receivers, already waiting for one, refuse by name at once; the engine keeps serving and the group takes
    the next update. They used to wait on: for the trainer's next update, taken as the failed one (here), or
    dist_timeout_s, then refusing to predict as if a write had failed."""
    with trainer_process(2, [("not_a_tensor", 61, 1), ("full", 62, 1)]) as (trainer, conn, init_method):
        with PolicyEngine(rollout_cfg("inproc", 1), TINY) as e:
            e.join_weight_group(init_method, world_size=2, first_rank=1)
            start = time.monotonic()
            with pytest.raises(WeightRefusedError, match=r"trainer could not send weight version 1: TypeError: "
                                                         r"weight 'expert.final_norm.dense.bias' must be a torch"):
                e.update_weights(DistBroadcast(src=0), version=1)
            assert time.monotonic() - start < 20  # not the group's 30 s timeout
            kind, message = conn.recv()
            assert kind == "trainer error" and "ndarray" in message
            assert e.predict(obs(2)).version == 0  # refused before any write: still serving
            e.update_weights(DistBroadcast(src=0), version=1)
            assert conn.recv() == ("ok", 1)
            assert_params(e.state_dict(), perturbed_weights(TINY, 62))


def test_broadcast_to_local_rank_processes_partial_expert():
    steps = [("full", 51, 1), ("expert", 52, 2)]
    with trainer_process(3, steps) as (trainer, conn, init_method):
        with PolicyEngine(rollout_cfg("local", 2), TINY) as e:
            e.join_weight_group(init_method, world_size=3, first_rank=1)
            e.update_weights(DistBroadcast(src=0), version=1)
            assert conn.recv() == ("ok", 1)
            assert_params(e.state_dict(rank=1), perturbed_weights(TINY, 51))
            e.update_weights(DistBroadcast(src=0), version=2, partial=True)
            assert conn.recv() == ("ok", 2)
            got = e.state_dict(rank=0)
            assert_params(got, perturbed_weights(TINY, 52), only=expert_set())
            assert_params(got, perturbed_weights(TINY, 51), only=set(got) - expert_set())


def assert_params(got: dict, expected: dict, only: set | None = None) -> None:
    for name, value in expected.items():
        if only is None or name in only:
            assert torch.equal(got[name], value), name



def expert_set() -> set[str]:
    from policies import build_policy

    return set(expert_names(build_policy(TINY).model))
