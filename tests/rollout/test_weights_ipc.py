"""Weights from another process through IPC handles (CPU: shared memory; CUDA IPC is gpu-marked).

A spawned producer (the collocated trainer) exports its tensors once; the engine opens the
handles once and reuses them: after the producer writes new values in place and says "go",
the same handles deliver the new weights (in-process engine, and a local engine whose rank
processes open the handles themselves)."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from rollout.weights_ipc import IpcExporter
from tests.rollout.engine_fixtures import (
    TINY,
    assert_matches_reference,
    existing_segments,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    perturbed_weights,
    reference_outputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def producer_main(conn, seeds: list[int]) -> None:
    """The trainer side: export once, then per "next" write the next weights in place, say go."""
    torch.set_num_threads(1)
    exporter = IpcExporter(perturbed_weights(TINY, seeds[0]))
    try:
        conn.send(exporter.handles)
        for seed in seeds[1:]:
            assert conn.recv() == "next"
            new = perturbed_weights(TINY, seed)
            for name, tensor in exporter.tensors.items():
                tensor.copy_(new[name])
            conn.send("go")
        assert conn.recv() == "close"
    finally:
        exporter.close()
        conn.send("closed")


def test_ipc_handles_opened_once_and_reused():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    producer = ctx.Process(target=producer_main, args=(child, [21, 22, 23]), daemon=True)
    producer.start()
    try:
        handles = parent.recv()
        assert handles.kind == "cpu" and len(handles.payload) < 10_000  # names + offsets, no tensor data
        segment = pickle.loads(handles.payload)[0]
        calls = [(obs(3, seed=8), "train")]
        with PolicyEngine(EngineConfig(devices="cpu", seed=1), TINY) as e:
            e.update_weights(handles, version=1)
            assert_equal_params(e.state_dict(), perturbed_weights(TINY, 21))
            parent.send("next")
            assert parent.recv() == "go"
            e.update_weights(handles, version=2)  # the same handles: opened once, new values
            assert_equal_params(e.state_dict(), perturbed_weights(TINY, 22))
            out = e.predict(*calls[0])
        assert out.version == 2
        assert_matches_reference(out, reference_outputs(TINY, perturbed_weights(TINY, 22), calls, seed=1)[0])
        parent.send("next")
        assert parent.recv() == "go"
        with PolicyEngine(EngineConfig(backend="local", num_ranks=2, devices="cpu", torch_threads=1), TINY) as e:
            e.update_weights(handles, version=5)
            assert_equal_params(e.state_dict(rank=1), perturbed_weights(TINY, 23))
            assert e.predict(obs(2)).version == 5
        parent.send("close")
        assert parent.recv() == "closed"
    finally:
        producer.join(10)
        if producer.is_alive():
            producer.kill()
    assert existing_segments([segment]) == []


def test_ipc_refuses_bad_names_before_writing():
    exporter = IpcExporter({"expert.final_norm.dense.bias": torch.zeros(5)})
    try:
        with PolicyEngine(EngineConfig(devices="cpu"), TINY) as e, pytest.raises(ValueError, match="has shape"):
            e.update_weights(exporter.handles, version=1, partial=True)
    finally:
        exporter.close()


def assert_equal_params(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.gpu
def test_cuda_ipc_from_another_process_keeps_graphs_valid():
    """CUDA IPC on one GPU with the fast path (CUDA graphs) on: the second update through the same
    (cached) handles lands in place and the graphs captured before it see it: outputs equal those
    of an engine that got the same weights before capturing."""
    cfg = TINY.replace(fast={"enabled": True, "dtype": "float32", "attention": "sdpa"})
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    producer = ctx.Process(target=cuda_producer_main, args=(child, [31, 32]), daemon=True)
    producer.start()
    call = obs(3, seed=2)
    try:
        handles = parent.recv()
        assert handles.kind == "cuda"
        with PolicyEngine(EngineConfig(devices="cuda:0"), cfg) as e:
            e.update_weights(handles, version=1)
            first = e.predict(call, "train")  # captures the graphs
            parent.send("next")
            assert parent.recv() == "go"
            e.update_weights(handles, version=2)
            e.reseed()
            out = e.predict(call, "train")
        parent.send("close")
        parent.recv()
    finally:
        producer.join(10)
        if producer.is_alive():
            producer.kill()
    with PolicyEngine(EngineConfig(devices="cuda:0"), cfg) as fresh:
        fresh.update_weights({k: v.cuda() for k, v in perturbed_weights(TINY, 32).items()}, version=2)
        expected = fresh.predict(call, "train")
    assert out.version == 2 and not torch.equal(first.chains, out.chains)
    assert torch.equal(out.chains, expected.chains) and torch.equal(out.logprobs, expected.logprobs)


def cuda_producer_main(conn, seeds: list[int]) -> None:
    weights = {k: v.cuda() for k, v in perturbed_weights(TINY, seeds[0]).items()}
    exporter = IpcExporter(weights)
    try:
        conn.send(exporter.handles)
        for seed in seeds[1:]:
            assert conn.recv() == "next"
            for name, value in perturbed_weights(TINY, seed).items():
                weights[name].copy_(value)
            torch.cuda.synchronize()
            conn.send("go")
        assert conn.recv() == "close"
    finally:
        exporter.close()
        conn.send("closed")
