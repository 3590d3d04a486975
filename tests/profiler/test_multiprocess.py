import multiprocessing as mp

from profiler.config import ProfilerConfig
from profiler.spans import make_timeline
from profiler.trace import load_trace
from tests.profiler.mp_worker import record_spans


def test_spans_from_spawned_workers_merge_into_one_timeline(tmp_path):
    driver = make_timeline(ProfilerConfig(out_dir=str(tmp_path)), rank=0, worker="driver")
    ctx = mp.get_context("spawn")
    with driver.span("rollout"):
        workers = [ctx.Process(target=record_spans, args=(str(tmp_path), rank, f"env{rank}", 3))
                   for rank in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
    driver.close()
    assert [w.exitcode for w in workers] == [0, 0]
    trace = load_trace(tmp_path)
    assert len({s.pid for s in trace.spans}) == 3  # three processes, one file each
    assert trace.lanes() == [(0, "driver"), (0, "env0"), (1, "env1")]
    rollout, = trace.named("rollout")
    steps = trace.named("rollout/env_step")
    assert len(steps) == 6
    # one clock: every worker span lies inside the driver span that spawned and joined them
    assert all(rollout.start_ns < s.start_ns <= s.end_ns < rollout.end_ns for s in steps)
    # the merged timeline is ordered by start time
    starts = [s.start_ns for s in trace.spans]
    assert starts == sorted(starts)
    for rank in (0, 1):
        chunks = [s.attrs["chunk"] for s in steps if s.rank == rank]
        assert chunks == [0, 1, 2]
