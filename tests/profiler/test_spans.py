import pytest

import profiler
from profiler.config import ProfilerConfig
from profiler.spans import (
    NULL_SPAN,
    NULL_TIMELINE,
    Timeline,
    make_timeline,
    set_timeline,
    span,
    spanned,
)
from profiler.trace import load_trace, span_file_path


def test_context_manager_and_decorator_record_names_attrs_and_nesting(tmp_path):
    tl = Timeline(tmp_path, rank=2, worker="driver", keep_in_memory=True)

    @tl.spanned("actor_train")
    def train(x):
        return x * 2

    with tl.span("step", step=0):
        with tl.span("rollout/predict", stage=1, chunk=3):
            pass
        assert train(21) == 42
    tl.close()
    names = [s[0] for s in tl.spans]
    assert names == ["rollout/predict", "actor_train", "step"]  # recorded when each closes
    trace = load_trace(tmp_path)
    by_name = {s.name: s for s in trace.spans}
    assert by_name["rollout/predict"].attrs == {"stage": 1, "chunk": 3}
    assert by_name["step"].start_ns <= by_name["rollout/predict"].start_ns
    assert by_name["actor_train"].end_ns <= by_name["step"].end_ns
    assert {(s.rank, s.worker) for s in trace.spans} == {(2, "driver")}


def test_exception_is_recorded_and_propagates(tmp_path):
    tl = Timeline(tmp_path, keep_in_memory=True)
    with pytest.raises(KeyError), tl.span("weight_sync"):
        raise KeyError("boom")
    tl.close()
    assert tl.spans[0][3] == {"error": "KeyError"}


def test_disabled_profiler_records_nothing(tmp_path):
    tl = make_timeline(ProfilerConfig(enabled=False, out_dir=str(tmp_path)), rank=0, worker="x")
    assert tl is NULL_TIMELINE
    first, second = tl.span("a"), tl.span("b", gpu=True, chunk=1)
    assert first is second is NULL_SPAN  # one shared object: nothing allocated per span

    def fn():
        return 7

    assert tl.spanned("c")(fn) is fn  # the decorator hands back the function itself
    with first:
        pass
    tl.flush()
    tl.close()
    assert tl.spans == ()
    assert not any(tmp_path.iterdir())  # no trace files at all


def test_module_level_span_uses_the_current_timeline(tmp_path):
    @spanned("rollout/env_step", stage=0)
    def step_env():
        return "ok"

    assert step_env() == "ok"  # no timeline set: a no-op
    tl = Timeline(tmp_path, keep_in_memory=True)
    previous = set_timeline(tl)
    try:
        assert profiler.get_timeline() is tl
        step_env()
        with span("advantages"):
            pass
    finally:
        set_timeline(previous)
    tl.close()
    assert [(s[0], s[3]) for s in tl.spans] == [("rollout/env_step", {"stage": 0}), ("advantages", None)]


def test_flush_every_writes_in_batches_and_close_completes(tmp_path):
    tl = Timeline(tmp_path, worker="w", flush_every=3)
    for i in range(4):
        with tl.span("s", i=i):
            pass
    path = span_file_path(tmp_path, 0, "w", tl.pid)
    assert len(path.read_text().splitlines()) == 1 + 3  # header + first batch of 3
    tl.close()
    assert len(path.read_text().splitlines()) == 1 + 4
    assert [s.attrs["i"] for s in load_trace(tmp_path).spans] == [0, 1, 2, 3]


def test_truncated_last_line_is_skipped(tmp_path):
    tl = Timeline(tmp_path, worker="w")
    with tl.span("kept"):
        pass
    tl.close()
    with open(tl.path, "a") as f:
        f.write('{"name": "half", "start_')  # the process died mid-write
    with pytest.warns(UserWarning, match="truncated"):
        trace = load_trace(tmp_path)
    assert [s.name for s in trace.spans] == ["kept"]


class FakeGpu:
    """Counts calls; events carry a fake GPU time so resolution can be checked by hand."""

    def __init__(self):
        self.syncs = 0
        self.events = []
        self.gpu_time = 0.0

    def synchronize(self):
        self.syncs += 1

    def record_event(self):
        self.gpu_time += 1_000.0  # each event 1 us after the previous on the fake GPU
        self.events.append(self.gpu_time)
        return self.gpu_time

    def wait(self, event):
        pass

    def elapsed_ns(self, start, end):
        return end - start


def test_gpu_timing_none_never_touches_the_gpu(tmp_path):
    gpu = FakeGpu()
    tl = Timeline(None, gpu_timing="none", gpu_backend=gpu, keep_in_memory=True)
    with tl.span("rollout/predict", gpu=True):
        pass
    tl.close()
    assert gpu.syncs == 0 and gpu.events == [] and len(tl.spans) == 1


def test_gpu_timing_sync_synchronizes_only_gpu_spans():
    gpu = FakeGpu()
    tl = Timeline(None, gpu_timing="sync", gpu_backend=gpu, keep_in_memory=True)
    with tl.span("rollout/env_step"):  # a CPU span: no synchronize
        pass
    assert gpu.syncs == 0
    with tl.span("rollout/predict", gpu=True):
        pass
    assert gpu.syncs == 2  # before reading the clock at each end
    tl.close()


def test_gpu_timing_cuda_event_places_events_via_the_anchor():
    gpu = FakeGpu()
    tl = Timeline(None, gpu_timing="cuda_event", gpu_backend=gpu, keep_in_memory=True)
    with tl.span("rollout/predict", gpu=True, chunk=0):
        pass
    assert gpu.syncs == 1  # only the anchor's, at the first GPU span; none on the hot path
    anchor_cpu = tl._anchor.cpu_ns
    tl.flush()
    _, start, end, attrs = tl.spans[0]
    # events at fake GPU times 2000 and 3000 ns, anchor event at 1000 ns
    assert (start - anchor_cpu, end - anchor_cpu) == (1_000, 2_000)
    assert attrs["gpu"] == "cuda_event" and attrs["chunk"] == 0 and "cpu_start_ns" in attrs
    tl.close()


def test_gpu_span_without_cuda_fails_clearly():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tl = Timeline(None, gpu_timing="sync")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        tl.span("rollout/predict", gpu=True)


def test_span_lines_round_trip_through_json():
    import json
    import math

    import numpy as np

    from profiler.trace import span_line

    cases = [None, {}, {"stage": 1, "chunk": -3}, {"x": 1.5, "s": 'é"\n\\', "b": True, "n": None},
             {"f": math.inf}, {"a": np.int64(3), "v": np.float32(0.5)}, {"l": [1, 2], "d": {"k": "v"}}]
    for attrs in cases:
        record = json.loads(span_line("rollout/predict", 10, 20, attrs))
        assert (record["name"], record["start_ns"], record["end_ns"]) == ("rollout/predict", 10, 20)
        expected = {k: (v.item() if hasattr(v, "item") else v) for k, v in (attrs or {}).items()}
        assert record.get("attrs", {}) == expected


def test_workers_find_the_profiler_through_the_environment(tmp_path):
    from profiler.spans import profiler_environ, timeline_from_environ

    assert profiler_environ(ProfilerConfig(enabled=False)) == {}
    assert timeline_from_environ(0, "env0", environ={}) is NULL_TIMELINE
    environ = profiler_environ(ProfilerConfig(out_dir=str(tmp_path)))
    tl = timeline_from_environ(3, "env7", environ=environ)
    with tl.span("rollout/env_step"):
        pass
    tl.close()
    span_, = load_trace(tmp_path).spans
    assert (span_.rank, span_.worker) == (3, "env7")
