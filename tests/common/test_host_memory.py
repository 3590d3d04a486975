"""common.host_memory: pinned host memory made as touched pageable memory, then registered; unregistered once the
last tensor on it is gone. CUDA's two calls are stood in for here (their GPU run: experiments.probe_host_pinning)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import host_memory

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cuda_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "cuda_can_pin", lambda: True)
    monkeypatch.setattr(host_memory, "_register", lambda ptr, nbytes: calls.append(("register", ptr, nbytes)))
    monkeypatch.setattr(host_memory, "_unregister", lambda ptr: calls.append(("unregister", ptr)))
    return calls


def test_pinned_empty_is_a_zeroed_page_aligned_tensor_registered_once_and_unregistered_after_its_last_view(
        cuda_calls):
    t = host_memory.pinned_empty((3, 5, 7), torch.bfloat16)
    assert (t.shape, t.dtype, t.is_contiguous(), t.device.type) == ((3, 5, 7), torch.bfloat16, True, "cpu")
    assert t.data_ptr() % host_memory.PAGE == 0 and bool((t == 0).all())
    assert cuda_calls == [("register", t.data_ptr(), 3 * 5 * 7 * 2)]
    ptr, view = t.data_ptr(), t[1:2]
    t.fill_(2.5)
    del t
    gc.collect()
    assert len(cuda_calls) == 1  # a view still reads the memory
    assert bool((view == 2.5).all())
    del view
    gc.collect()
    assert cuda_calls[1:] == [("unregister", ptr)]


def test_without_cuda_or_pin_the_memory_is_plain_and_nothing_is_registered(monkeypatch, cuda_calls):
    assert host_memory.pinned_empty((4, 3), torch.float32, pin=False).shape == (4, 3)
    monkeypatch.setattr(host_memory, "cuda_can_pin", lambda: False)
    assert bool((host_memory.pinned_empty((2, 8), torch.int64) == 0).all())
    assert host_memory.pinned_empty((0, 8), torch.int64).shape == (0, 8)
    assert cuda_calls == []


def test_a_refused_registration_raises_and_leaves_nothing_registered(monkeypatch):
    def refuse(ptr, nbytes):
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed")

    monkeypatch.setattr(host_memory, "cuda_can_pin", lambda: True)
    monkeypatch.setattr(host_memory, "_register", refuse)
    unregistered = []
    monkeypatch.setattr(host_memory, "_unregister", unregistered.append)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 64 bytes failed"):
        host_memory.pinned_empty((8,), torch.float64)
    gc.collect()
    assert unregistered == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_memory_is_pinned_and_copies_both_ways():
    t = host_memory.pinned_empty((1024, 257), torch.bfloat16)
    assert t.is_pinned()
    src = torch.randn(1024, 257, device="cuda").to(torch.bfloat16)
    t.copy_(src)
    back = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("made_by", ["registered", "cudaHostAlloc"])
def test_a_mapped_view_reads_and_writes_the_host_memory_from_the_gpu(made_by):
    shape = (64, 3, 257)
    if made_by == "registered":
        host = host_memory.pinned_empty(shape, torch.bfloat16)
    else:
        host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    host.copy_(torch.randn(shape).to(torch.bfloat16))
    mapped = host_memory.mapped_on_device(host, "cuda")
    assert mapped.is_cuda and mapped.shape == host.shape and mapped.dtype == host.dtype
    rows = torch.tensor([5, 0, 63, 5, 17])
    got = mapped.index_select(0, rows.cuda())  # a kernel gathering across PCIe
    assert torch.equal(got.cpu(), host.index_select(0, rows))
    mapped[1].fill_(2.5)  # the device writes, the host sees it once the stream has finished
    torch.cuda.synchronize()
    assert bool((host[1] == 2.5).all())
    del host  # the view keeps the page-locked memory alive
    gc.collect()
    assert torch.equal(mapped.index_select(0, rows.cuda()), got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_memory_registered_on_another_thread_leaves_a_graph_capture_intact():
    """Round 59: the prefix store's spill job registered host memory on its own thread while the engine captured
    its first graphs, and the capture failed (torch's "global" mode: another thread's unsafe call invalidates it).
    common.devices.graph_capture ("thread_local") must let both succeed; the global case shows the probe can tell."""
    def probe(mode: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "tests.common.register_during_capture", mode], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    kept = probe("thread_local")
    assert kept == {"mode": "thread_local", "registered": True, "replay_right": True}, kept
    broken = probe("global")
    assert "capture_error" in broken or "register_error" in broken, broken


def test_a_mapped_view_needs_a_cuda_device_and_page_locked_memory():
    with pytest.raises(ValueError, match="maps host memory for a CUDA device, got device cpu"):
        host_memory.mapped_on_device(torch.zeros(4), "cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a contiguous page-locked CPU tensor.*pinned False"):
            host_memory.mapped_on_device(torch.zeros(4), "cuda")
