"""PolicyEngine: splitting, determinism, backends identical, references, refusals, failures, cleanup."""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest
import torch

from rollout.config import EngineConfig, RolloutConfig
from rollout.engine import PolicyEngine, split_rows
from rollout.engine_client import RankFailedError
from tests.rollout.engine_fixtures import (
    TINY,
    assert_matches_reference,
    assert_outputs_equal,
    existing_segments,
    live_children,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    perturbed_weights,
    reference_outputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CALLS = [(obs(5, seed=1), "train"), (obs(3, seed=2, image_size=56), "eval"), (obs(4, seed=3), "sde_all"),
         (obs(6, seed=4), "train")]


def engine(backend: str = "inproc", num_ranks: int = 1, **kw) -> PolicyEngine:
    return PolicyEngine(EngineConfig(backend=backend, num_ranks=num_ranks, devices="cpu", torch_threads=1, **kw), TINY)


# ---------------------------------------------------------------------- splitting (pure)
@pytest.mark.parametrize("batch, ranks, group, expected", [
    (5, 2, None, [(0, 3), (3, 5)]),
    (7, 3, None, [(0, 3), (3, 5), (5, 7)]),
    (2, 4, None, [(0, 1), (1, 2), (2, 2), (2, 2)]),
    (24, 2, 8, [(0, 16), (16, 24)]),
    (16, 3, 4, [(0, 8), (8, 12), (12, 16)]),
    (8, 1, 8, [(0, 8)]),
])
def test_split_rows_balanced_on_group_boundaries(batch, ranks, group, expected):
    assert split_rows(batch, ranks, group) == expected


def test_split_refuses_partial_groups():
    with pytest.raises(ValueError, match="not a whole number of groups of 8"):
        split_rows(12, 2, 8)


# ---------------------------------------------------------------------- outputs
def test_inproc_matches_reference_model_and_is_seeded():
    with engine(seed=3) as e:
        outs = [e.predict(raw, mode) for raw, mode in CALLS]
    for out, ref in zip(outs, reference_outputs(TINY, None, CALLS, seed=3)):
        assert_matches_reference(out, ref)
        assert out.version == 0 and [t.rows for t in out.timings] == [out.batch_size]
    assert outs[0].denoise_inds.unique().numel() == 1  # one SDE step for the whole batch (RLinf)
    assert (outs[1].denoise_inds == -1).all() and outs[1].mode == "ode"
    with engine(seed=4) as other:
        assert not torch.equal(other.predict(*CALLS[0]).chains, outs[0].chains)


def test_local_backend_identical_to_inproc(tmp_path, monkeypatch):
    """Same seed, weights and num_ranks: bit-identical outputs, before and after a weight update;
    each rank process records its own "rollout/predict" spans."""
    from profiler import load_trace
    from profiler.spans import ENV_RUN_DIR

    new = perturbed_weights(TINY, seed=11)
    results = {}
    for backend in ("inproc", "local"):
        if backend == "local":
            monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path))
        with engine(backend, num_ranks=2) as e:
            outs = [e.predict(raw, mode) for raw, mode in CALLS[:3]]
            e.update_weights(new, version=1)
            outs.append(e.predict(obs(8, seed=5), "train", group_size=4))
            results[backend] = outs
            if backend == "local":  # train and eval calls of one shape reuse the shared blocks
                names = e.client.segment_names
                e.predict(obs(8, seed=6), "eval")
                e.predict(obs(8, seed=6), "train")
                assert e.client.segment_names == names
    for a, b in zip(results["inproc"], results["local"]):
        assert_outputs_equal(a, b)
    last = results["local"][-1]
    assert last.version == 1 and [(t.rank, t.rows) for t in last.timings] == [(0, 4), (1, 4)]
    assert [t.rows for t in results["local"][0].timings] == [3, 2]
    spans = [s for s in load_trace(tmp_path).spans if s.name == "rollout/predict"]
    assert sorted({s.rank for s in spans}) == [0, 1] and len(spans) == 12


def test_fast_buckets_report_each_ranks_first_calls():
    """Every rank answers `fast_buckets` through the client (local processes here): [] before the fast path's
    first call, then one bucket per shape with its first call's seconds, kept by later calls."""
    cfg = TINY.replace(fast={"enabled": True, "dtype": "float32", "batch_buckets": [2, 4]})
    with PolicyEngine(EngineConfig(backend="local", num_ranks=2, devices="cpu", torch_threads=1), cfg) as e:
        assert e.client.call("fast_buckets") == [[], []]
        e.predict(obs(6, seed=1), "train")  # 3 rows a rank: bucket 4
        first = e.client.call("fast_buckets")
        e.predict(obs(6, seed=2), "train")
        assert e.client.call("fast_buckets") == first
    for report in first:
        (bucket,) = report
        assert bucket["batch"] == 4 and bucket["first_call_s"] > 0 and bucket["graphs"] == []


def test_local_ranks_log_at_the_parents_level(capfd):
    """A spawned rank configures logging at the parent's root level, to the stderr it inherits: the fast path's
    first-call line (INFO) reaches the terminal from every rank."""
    cfg = TINY.replace(fast={"enabled": True, "dtype": "float32", "batch_buckets": [2, 4]})
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    try:
        with PolicyEngine(EngineConfig(backend="local", num_ranks=2, devices="cpu", torch_threads=1), cfg) as e:
            e.predict(obs(6, seed=1), "train")
    finally:
        root.setLevel(before)
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"rank {rank} policies.fast.runner INFO: fast path: bucket (batch 4" in err, err[-3000:]


def test_group_split_keeps_groups_on_one_rank():
    with engine(num_ranks=3) as e:
        out = e.predict(obs(12, seed=6), "train", group_size=4)
    assert [t.rows for t in out.timings] == [4, 4, 4]
    with engine(num_ranks=2) as e, pytest.raises(ValueError, match="groups of 4"):
        e.predict(obs(6), "train", group_size=4)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("wrist_image"), r"missing camera 'wrist_image'"),
    (lambda r: r.update(agentview_image=r["agentview_image"].astype(np.float32)), r"must be uint8 images"),
    (lambda r: r["state"].__setitem__((2, 5), np.nan), r"'state' has a non-finite value nan at env 2, dim 5"),
    (lambda r: r.update(state=r["state"][:, :7]), r"'state' must be \(N, 8\)"),
    (lambda r: r.update(prompt=r["prompt"][:2]), r"2 prompts for 4 observations"),
])
def test_bad_input_refused_before_any_work(mutate, message):
    with engine(num_ranks=2) as e:
        raw = obs(4)
        mutate(raw)
        with pytest.raises(ValueError, match=message):
            e.predict(raw)
        assert e.predict(obs(4), "train").batch_size == 4  # nothing consumed, nothing broken


def test_bad_mode_and_config_keys():
    with pytest.raises(ValueError, match="rollout.engine.backend must be one of"):
        EngineConfig(backend="tcp")
    with pytest.raises(ValueError, match=r"rollout.engine.devices lists 1 devices for 2 ranks"):
        RolloutConfig.from_mapping({"engine": {"num_ranks": 2, "devices": ["cpu"]}})
    with pytest.raises(ValueError, match=r"\['rollout.weights.bucket'\]"):
        RolloutConfig.from_mapping({"weights": {"bucket": 1}})


# ---------------------------------------------------------------------- failures and cleanup
@pytest.mark.slow
def test_hung_and_dead_ranks_are_named_restart_works_close_leaves_nothing():
    before_children = {p.pid for p in live_children()}
    e = engine("local", num_ranks=2, rank_timeout_s=3)
    e.predict(obs(4), "train")
    hung = e.client.pids[0]
    os.kill(hung, signal.SIGSTOP)
    try:
        with pytest.raises(RankFailedError, match=r"engine rank 0 \(pid \d+, cpu\) did not answer within 3 s"):
            e.predict(obs(4), "train")
    finally:
        os.kill(hung, signal.SIGCONT)
    with pytest.raises(RuntimeError, match=r"refuses to predict: rank 0 failed.*restart"):
        e.predict(obs(4), "train")
    e.restart()
    assert e.predict(obs(4), "train").batch_size == 4
    os.kill(e.client.pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"engine rank 1 \(pid \d+, cpu\) died \(exit code -9\) during predict"):
        e.predict(obs(4), "train")
    assert time.monotonic() - start < 3  # seen through the process sentinel, not the timeout
    e.restart()
    e.update_weights(perturbed_weights(TINY, seed=5), version=1)  # the staging block too
    assert e.predict(obs(4), "train").version == 1
    segments, pids = e.client.segment_names, list(e.client.pids)
    assert len(segments) == 5 and existing_segments(segments) == segments  # 2 x (request, reply), staging
    e.close()
    e.close()  # idempotent
    assert existing_segments(segments) == []
    leftover = [p for p in live_children() if p.pid in pids or (p.pid not in before_children
                and "resource_tracker" not in " ".join(p.cmdline()))]
    assert leftover == []
    with pytest.raises(RuntimeError, match="closed"):
        e.predict(obs(2))


def test_restart_after_pushed_weights_needs_a_full_update():
    with engine() as e:
        e.update_weights(perturbed_weights(TINY, seed=2), version=1)
        e.restart()
        assert e.version == 0
        with pytest.raises(RuntimeError, match="restarted.*not version 1"):
            e.predict(obs(2))
        e.update_weights(perturbed_weights(TINY, seed=2), version=1)
        assert e.predict(obs(2)).version == 1
