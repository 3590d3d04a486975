"""Engine failure paths of a review: commands cut short, blocks replaced meanwhile, broadcast waits,
the lock, unopenable IPC handles, timeouts out of range, images with negative strides."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import rollout.engine_local as engine_local
from rollout import weights_ipc
from rollout.config import MAX_TIMEOUT_S, EngineConfig, RolloutConfig, WeightSyncConfig
from rollout.engine import PolicyEngine
from rollout.engine_client import RankFailedError
from rollout.engine_local import LocalClient
from rollout.engine_ray import RayClient
from rollout.weights import TensorMeta, WeightRefusedError, bucket_layout
from rollout.weights_ipc import IpcExporter
from tests.policies.test_transforms_strides import flipped
from tests.rollout.engine_fixtures import (
    TINY,
    assert_matches_reference,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    perturbed_weights,
    reference_outputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(backend: str = "inproc", num_ranks: int = 1, **kw) -> PolicyEngine:
    return PolicyEngine(EngineConfig(backend=backend, num_ranks=num_ranks, devices="cpu", torch_threads=1, **kw), TINY)


def interrupt_once(monkeypatch, module, name: str, nth: int = 1) -> None:
    """module.name raises KeyboardInterrupt (a Ctrl-C landing there) on its nth call, then works again."""
    real, calls = getattr(module, name), [0]

    def cut_short(*args, **kw):
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(module, name, cut_short)


# ---------------------------------------------------------------------- commands cut short (local backend)
def test_a_predict_cut_short_with_replies_owed_breaks_the_client_until_restart(monkeypatch):
    """The rank answers the interrupted predict anyway: the next command would read that reply as its own."""
    with engine("local") as e:
        interrupt_once(monkeypatch, engine_local.mp_connection, "wait")  # Ctrl-C while the parent waits
        with pytest.raises(KeyboardInterrupt):
            e.predict(obs(4, seed=1), "train")
        monkeypatch.undo()
        assert not e.alive
        with pytest.raises(RuntimeError, match=r"refuses to predict: rank 0 failed.*cut short.*restart"):
            e.predict(obs(6, seed=2), "train")
        with pytest.raises(RankFailedError, match=r"stale reply.*call engine.restart\(\)"):
            e.state_dict()
        e.restart()
        e.reseed()
        assert e.alive
        call = (obs(6, seed=2), "train")
        assert_matches_reference(e.predict(*call), reference_outputs(TINY, None, [call], seed=0)[0])


def test_a_rank_that_does_not_answer_leaves_the_client_broken_and_the_error_names_the_key():
    """Unit-level (no rank process): a pipe nobody answers; the timeout names the key that bounded the
    wait, and the reply still owed makes every later command refuse."""
    conn, _other_end = mp.Pipe()
    never_ready, write_end = os.pipe()
    process = SimpleNamespace(sentinel=never_ready, pid=None, is_alive=lambda: True)
    client = LocalClient.__new__(LocalClient)
    client.broken, client.cfg = None, EngineConfig(rank_timeout_s=60)
    client._ranks = [engine_local.RankHandle(0, "cpu", process, conn)]
    try:
        with pytest.raises(RankFailedError, match=r"did not answer within 0 s \(the key\) during dist"):
            client._exchange({0: ("dist", None)}, "dist", 0.01, "the key")
        with pytest.raises(RankFailedError, match=r"rank 0 .* still owed its reply.*call engine.restart\(\)"):
            client._exchange({0: ("call", ("info", ()))}, "info")
    finally:
        os.close(never_ready)
        os.close(write_end)


def test_a_block_replaced_by_a_call_cut_short_reaches_its_rank(monkeypatch):
    """Growing rank 1's block is interrupted after rank 0's grew, before any command went out: rank 0
    must still learn its new block (it would otherwise read and write its old, unlinked one)."""
    calls = [(obs(8, seed=1), "train"), (obs(8, seed=2, image_size=56), "train"), (obs(8, seed=3, image_size=56),
                                                                                 "train")]
    with engine("local", num_ranks=2) as e:
        e.predict(*calls[0])
        interrupt_once(monkeypatch, engine_local.SharedBlock, "create", nth=2)  # rank 0's request block grew
        with pytest.raises(KeyboardInterrupt):
            e.predict(*calls[1])
        monkeypatch.undo()
        assert e.alive  # nothing was sent: no reply owed
        out = e.predict(*calls[2])
    assert_matches_reference(out, reference_outputs(TINY, None, calls, seed=0)[2], exact=False)


# ---------------------------------------------------------------------- broadcast waits
@pytest.mark.parametrize("client_cls, wait_of", [
    (LocalClient, lambda args, kw: args[2:]),  # _exchange(messages, what, wait_s, key)
    (RayClient, lambda args, kw: (args[2], kw["key"])),  # _all(submit, what, wait_s, key=key)
], ids=["local", "ray"])
def test_a_broadcast_update_waits_dist_timeout_s_for_every_collective(client_cls, wait_of):
    cfg = RolloutConfig.from_mapping({"engine": {"rank_timeout_s": 5}, "weights": {"dist_timeout_s": 120,
                                                                                   "bucket_mb": 0.0625}})
    with PolicyEngine(cfg, TINY) as e:
        metas = [TensorMeta.of(name, p) for name, p in e.state_dict().items()]
        buckets = len(bucket_layout(metas, cfg.weights.bucket_bytes))
        options = e._dist_options()
        assert buckets > 1 and options["timeout_s"] == 120 and options["collectives"] == buckets + 4
        assert e.broadcast_wait_s == 5 + (buckets + 4) * 120
        seen = []
        fake = SimpleNamespace(cfg=cfg.engine, _ranks=[SimpleNamespace(rank=0)], actors=[None],
                               _exchange=lambda *args, **kw: seen.append(wait_of(args, kw)),
                               _all=lambda *args, **kw: seen.append(wait_of(args, kw)))
        client_cls.apply_dist(fake, 0, 1, False, options)
    keys = f"rollout.engine.rank_timeout_s + {buckets + 4} collectives x rollout.weights.dist_timeout_s"
    assert seen == [(e.broadcast_wait_s, keys)]


# ---------------------------------------------------------------------- the lock
def test_refresh_weights_holds_the_engine_lock():
    """Every client command runs under the engine's lock (a local rank's pipe carries one exchange)."""
    with engine() as e:
        client, free = e._client, []

        class Spy:
            def __getattr__(self, name):
                return getattr(client, name)

            def call(self, method, *args):
                def probe():  # another thread: the lock must be taken
                    if e._lock.acquire(blocking=False):
                        free.append(True)
                        e._lock.release()
                    else:
                        free.append(False)
                thread = threading.Thread(target=probe)
                thread.start()
                thread.join()
                return client.call(method, *args)

        e._client = Spy()
        try:
            e.refresh_weights()
        finally:
            e._client = client
    assert free == [False]


# ---------------------------------------------------------------------- IPC handles
def closed_elsewhere() -> weights_ipc.IpcHandles:
    """Handles of "another process" whose exporter has closed (its segment is gone)."""
    exporter = IpcExporter(perturbed_weights(TINY, 3))
    exporter.close()
    return dataclasses.replace(exporter.handles, producer_pid=os.getppid())


@pytest.mark.parametrize("backend, ranks, handles, message", [
    ("inproc", 1, "same_process", r"opened in the process that exported them"),
    ("inproc", 1, "closed", r"cannot open the cpu IpcHandles .*still open"),
    ("local", 2, "closed", r"(?s)rank 0 refused the weight update.*cannot open the cpu IpcHandles"),
], ids=["inproc-same-process", "inproc-closed", "local-closed"])
def test_unopenable_ipc_handles_are_refused_and_the_engine_keeps_serving(backend, ranks, handles, message):
    exporter = IpcExporter(perturbed_weights(TINY, 3))
    try:
        source = exporter.handles if handles == "same_process" else closed_elsewhere()
        with engine(backend, ranks) as e:
            before = e.state_dict(rank=ranks - 1)
            with pytest.raises(WeightRefusedError, match=message):
                e.update_weights(source, version=1)
            after = e.state_dict(rank=ranks - 1)
            assert all(torch.equal(before[k], v) for k, v in after.items())
            assert e.version == 0 and e.alive and e.predict(obs(2)).version == 0
            e.update_weights(perturbed_weights(TINY, 4), version=1)  # the next update goes through
    finally:
        exporter.close()


def test_closing_an_inproc_engine_releases_the_ipc_handles_it_opened():
    """The producer's segment stays mapped (CUDA: its memory held) while a consumer keeps it open."""
    with IpcExporter(perturbed_weights(TINY, 5)) as exporter:
        handles = dataclasses.replace(exporter.handles, producer_pid=os.getppid())  # as if from another process
        segment = weights_ipc.pickle.loads(handles.payload)[0]
        with engine() as e:
            e.update_weights(handles, version=1)
            assert handles.uid in weights_ipc._opened and mappings(segment) == 2  # the producer's and ours
        assert handles.uid not in weights_ipc._opened and mappings(segment) == 1


def mappings(segment: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(segment in line for line in maps)


# ---------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("section, key, value", [
    ("engine", "rank_timeout_s", float("inf")),
    ("engine", "start_timeout_s", 1e7),
    ("weights", "dist_timeout_s", float("inf")),
    ("weights", "dist_timeout_s", MAX_TIMEOUT_S * 2),
])
def test_timeouts_must_be_finite_and_at_most_a_week(section, key, value):
    with pytest.raises(ValueError, match=rf"rollout.{section}.{key} must be a finite number of seconds <= 604800"):
        RolloutConfig.from_mapping({section: {key: value}})
    assert EngineConfig(rank_timeout_s=MAX_TIMEOUT_S).rank_timeout_s == MAX_TIMEOUT_S
    assert WeightSyncConfig(dist_timeout_s=MAX_TIMEOUT_S).dist_timeout_s == MAX_TIMEOUT_S


# ---------------------------------------------------------------------- negative strides
def test_flipped_images_predict_alike_on_every_backend():
    views = flipped(obs(4, seed=7))
    copies = {k: (np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v) for k, v in views.items()}
    expected = reference_outputs(TINY, None, [(copies, "train")], seed=0)[0]
    with engine() as e:
        assert_matches_reference(e.predict(views, "train"), expected)
