"""The trainer's side of weight sync (rollout/weights_push.py): dtype casting, running both sides
of a collective together, and exact bit checksums (rollout/engine_core.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout.engine_core import bit_checksum
from rollout.weights_push import cast_to, engine_param_dtypes, together
from tests.rollout.engine_fixtures import TINY, one_thread  # noqa: F401 - fixture


def test_cast_to_engine_dtypes_rounds_like_the_receivers_copy():
    x = torch.randn(64, 3)
    out = cast_to({"a": x, "b": torch.arange(4), "c": x}, {"a": torch.bfloat16, "b": torch.bfloat16})
    receiver = torch.empty(64, 3, dtype=torch.bfloat16).copy_(x)  # what a bf16 parameter would hold
    assert out["a"].dtype == torch.bfloat16 and torch.equal(out["a"], receiver)
    assert out["b"].dtype == torch.int64 and out["c"] is x  # integers and unknown names untouched
    assert cast_to({"a": x}, None)["a"] is x


def test_engine_param_dtypes_follow_the_policy_precision():
    dtypes = engine_param_dtypes(TINY.replace(dtype="bfloat16"))
    assert torch.bfloat16 in set(dtypes.values())
    assert set(engine_param_dtypes(TINY).values()) == {torch.float32}


def test_together_runs_both_sides_at_once_and_times_them():
    met = threading.Barrier(2, timeout=10)  # each side waits for the other: only concurrent calls finish
    trainer_s, engine_s = together(met.wait, met.wait, timeout_s=30, what="test")
    assert trainer_s >= 0 and engine_s >= 0


def test_together_prefers_the_engines_error_and_chains_the_trainers():
    def trainer():
        raise RuntimeError("trainer side")

    def engine():
        raise ValueError("rank 1 refused 'expert.x'")

    with pytest.raises(ValueError, match="rank 1 refused") as info:
        together(trainer, engine, timeout_s=30, what="test")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="trainer side"):
        together(trainer, lambda: None, timeout_s=30, what="test")


def test_together_reports_an_engine_that_never_finishes():
    release = threading.Event()
    try:
        with pytest.raises(RuntimeError, match="did not finish weight update to version 3 within 0 s"):
            together(lambda: None, release.wait, timeout_s=0.2, what="weight update to version 3")
    finally:
        release.set()


def test_bit_checksum_is_exact_and_order_independent():
    x = torch.randn(1000, dtype=torch.bfloat16)
    assert bit_checksum(x) == bit_checksum(x.flip(0)) == bit_checksum(x.clone().view(10, 100))
    y = x.clone()
    y.view(torch.int16)[17] += 1  # one value, one ulp
    assert bit_checksum(y) != bit_checksum(x)
    words = torch.tensor([1.0, -2.5]).view(torch.int32)
    assert bit_checksum(torch.tensor([1.0, -2.5])) == int(words[0]) + int(words[1])  # by hand: the two words


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_closing_a_broadcast_push_takes_the_engines_ranks_out_of_the_group_with_the_trainer(backend):
    """NCCL's group destroy is collective: the trainer's close must make the ranks leave at the same time (gloo
    here, whose destroy is local, so the test checks who left, not the hang a lone leave gives on NCCL)."""
    import torch.distributed as dist

    if backend == "ray":
        pytest.importorskip("ray")
    from rollout.config import RolloutConfig
    from rollout.engine import PolicyEngine
    from rollout.placement import plan_placement
    from rollout.weights_push import BroadcastPush
    from tests.rollout.engine_fixtures import perturbed_weights

    rollout = RolloutConfig.from_mapping({
        "engine": {"backend": backend, "num_ranks": 2, "devices": "cpu", "torch_threads": 1},
        "weights": {"dist_backend": "gloo", "dist_timeout_s": 60, "transport": "broadcast"},
    })
    with PolicyEngine(rollout, TINY) as engine:
        pusher = BroadcastPush(engine, plan_placement("cpu", "test trainer", rollout, 0), rollout.weights)
        try:
            pusher.push(perturbed_weights(TINY, 7), version=1)
            assert [i["weight_group"] for i in engine.client.call("info")] == [True, True] and dist.is_initialized()
        finally:
            pusher.close()
        assert [i["weight_group"] for i in engine.client.call("info")] == [False, False]
        assert not dist.is_initialized()
        pusher.close()  # idempotent


class _Engine:
    def __init__(self, alive: bool):
        self.alive, self.left = alive, 0

    def leave_weight_group(self):
        self.left += 1
        raise RuntimeError("rank 1 failed")


@pytest.mark.parametrize("backend, trainer_leaves", [("gloo", True), ("nccl", False)])
def test_a_push_whose_engine_cannot_leave_leaves_alone_only_over_gloo(monkeypatch, caplog, backend, trainer_leaves):
    from rollout import weights_dist
    from rollout.weights_push import BroadcastPush

    left = []
    monkeypatch.setattr(weights_dist, "leave", lambda: left.append(1))
    for engine in (_Engine(alive=False), _Engine(alive=True)):
        pusher = BroadcastPush.__new__(BroadcastPush)
        pusher.engine, pusher.backend, pusher.joined, pusher.timeout_s = engine, backend, True, 5
        pusher.engine.cfg = type("Cfg", (), {"rank_timeout_s": 5})()
        left.clear()
        caplog.clear()
        pusher.close()
        assert engine.left == int(engine.alive)  # a closed engine is not asked
        # alive: the joint leave ran (the trainer's side too) and failed on the engine's side: warned, not raised
        assert len(left) == int(engine.alive) + int(trainer_leaves)
        assert ("could not leave" in caplog.text) == engine.alive
        assert ("left to the process's exit" in caplog.text) == (backend == "nccl")
        # the warning says whether the trainer's destroy was already tried
        assert ("was tried beside them" in caplog.text) == (backend == "nccl" and engine.alive)
        assert ("the engine is closed" in caplog.text) == (backend == "nccl" and not engine.alive)
