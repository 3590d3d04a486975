"""The trainer's side of weight sync (rollout/weights_push.py): dtype casting, running both sides
of a collective together, and exact bit checksums (rollout/engine_core.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout.engine_core import bit_checksum
from rollout.weights_push import cast_to, engine_param_dtypes, together
from tests.rollout.engine_fixtures import TINY


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
