"""GPU timing on a real CUDA device (skipped without one: run on the GPU machine)."""

import pytest

from profiler.spans import Timeline
from profiler.trace import load_trace


def _work_ms(torch, a, repeats=3):
    """Reference GPU time of the workload, from CUDA events around it."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.gpu
def test_cuda_event_spans_measure_the_gpu_work(tmp_path):
    torch = pytest.importorskip("torch")
    a = torch.randn(4096, 4096, device="cuda")
    reference_ms = _work_ms(torch, a)
    tl = Timeline(tmp_path, worker="engine", gpu_timing="cuda_event")
    for chunk in range(3):
        with tl.span("rollout/predict", gpu=True, chunk=chunk):
            for _ in range(10):
                a @ a
    tl.close()
    spans = load_trace(tmp_path).named("rollout/predict")
    assert len(spans) == 3
    for s in spans:
        assert s.attrs["gpu"] == "cuda_event"
        assert s.duration_ns / 1e6 == pytest.approx(reference_ms, rel=0.25)
        # the launch returns at once: the GPU finishes after the CPU left the span
        assert s.end_ns >= s.attrs["cpu_end_ns"]
    starts = [s.start_ns for s in spans]
    assert starts == sorted(starts)  # back-to-back on one stream, in order


@pytest.mark.gpu
def test_sync_spans_cover_the_gpu_work(tmp_path):
    torch = pytest.importorskip("torch")
    a = torch.randn(4096, 4096, device="cuda")
    reference_ms = _work_ms(torch, a)
    tl = Timeline(tmp_path, gpu_timing="sync", keep_in_memory=True)
    with tl.span("rollout/predict", gpu=True):
        for _ in range(10):
            a @ a
    with tl.span("cpu_only"):  # no synchronize: returns before the GPU is done
        for _ in range(10):
            a @ a
    tl.close()
    synced, unsynced = tl.spans
    assert (synced[2] - synced[1]) / 1e6 >= 0.9 * reference_ms
    assert (unsynced[2] - unsynced[1]) / 1e6 < 0.5 * reference_ms
