"""The stage scheduler without a model: dependencies of both KV schedules, batching across
streams, pipelining over several stages, in-flight limits; checked tick by tick against a
brute-force dependency oracle and hand-derived timings."""

from __future__ import annotations

import itertools
import random

import pytest

from worldmodels.scheduler import ChunkFinished, StageScheduler, WorkItem


def drive(sched: StageScheduler, ticks: int, log: list | None = None):
    finished = []
    for t in range(ticks):
        plan = sched.plan_tick()
        items = [item for batch in plan.values() for item in batch]
        if log is not None:
            log.append((t, plan))
        finished += [(t, f) for f in sched.complete(items)]
    return finished


def test_single_stage_noisy_closed_loop():
    sched = StageScheduler([1], num_steps=4, schedule="noisy", max_batch=8, max_inflight=4)
    sched.add_stream(0, ring=0)
    sched.set_context(0)
    sched.submit(0)
    log = []
    finished = drive(sched, 6, log)
    # tick 0: prefill; ticks 1-4: chunk 0 steps 0-3; then nothing (no actions for chunk 1)
    assert [len(p[(0, 0)]) if (0, 0) in p else 0 for _, p in log] == [1, 1, 1, 1, 1, 0]
    assert log[1][1][(0, 0)] == [WorkItem(0, 1, 0, 0)]
    assert finished == [(4, ChunkFinished(0, 0))]
    assert sched.streams[0].finished_chunks == 1


def test_clean_schedule_adds_the_recache_pass_before_the_next_chunk():
    sched = StageScheduler([1], num_steps=4, schedule="clean", max_batch=8, max_inflight=4)
    sched.add_stream(0, ring=0)
    sched.set_context(0)
    sched.submit(0)
    sched.submit(0)
    log = []
    finished = drive(sched, 11, log)
    steps = [[(i.position, i.step) for i in p.get((0, 0), [])] for _, p in log]
    # chunk 1 (position 2) starts only after chunk 0's re-cache pass (step 4)
    assert steps[:11] == [[(0, 0)], [(1, 0)], [(1, 1)], [(1, 2)], [(1, 3)], [(1, 4)], [(2, 0)], [(2, 1)],
                          [(2, 2)], [(2, 3)], [(2, 4)]]
    assert [f for _, f in finished] == [ChunkFinished(0, 0), ChunkFinished(0, 1)]
    assert finished[0][0] == 4  # the output exists before its re-cache pass


def test_noisy_lookahead_overlaps_chunks_on_one_stage():
    """With actions known ahead, chunk n+1's step k runs in the same tick as chunk n's step k+1."""
    sched = StageScheduler([1], num_steps=4, schedule="noisy", max_batch=8, max_inflight=4)
    sched.add_stream(0, ring=0)
    sched.set_context(0)
    for _ in range(3):
        sched.submit(0)
    log = []
    drive(sched, 4, log)
    assert sorted((i.position, i.step) for i in log[2][1][(0, 0)]) == [(1, 1), (2, 0)]
    assert sorted((i.position, i.step) for i in log[3][1][(0, 0)]) == [(1, 2), (2, 1), (3, 0)]


def test_pipeline_interval_is_one_tick_with_lookahead():
    """R stages, K steps, open loop: chunk j finishes at tick prefill_pipeline + K R + j - ..."""
    stages, steps = 3, 4
    sched = StageScheduler([stages], num_steps=steps, schedule="noisy", max_batch=16, max_inflight=steps * stages)
    sched.add_stream(0, ring=0)
    sched.set_context(0)
    for _ in range(8):
        sched.submit(0)
    finished = drive(sched, 60)
    ticks = [t for t, _ in finished]
    assert len(ticks) == 8
    # hand derivation: item (chunk j, step k) enters stage 0 at tick 1 + k R + j (prefill at stage 0
    # in tick 0, chunk j's KV at stage 0 ready one tick after chunk j-1's), leaves the last stage R-1 later
    assert ticks == [1 + steps * stages - 1 + j for j in range(8)]


def test_closed_loop_pipeline_interval_is_passes_times_stages():
    stages, steps = 2, 4
    sched = StageScheduler([stages], num_steps=steps, schedule="noisy", max_batch=16, max_inflight=steps * stages)
    sched.add_stream(0, ring=0)
    sched.set_context(0)
    sched.submit(0)
    done_ticks = []
    for t in range(40):
        plan = sched.plan_tick()
        for f in sched.complete([i for b in plan.values() for i in b]):
            done_ticks.append(t)
            sched.submit(f.stream)  # the policy answers at once
    gaps = {b - a for a, b in itertools.pairwise(done_ticks)}
    assert gaps == {steps * stages}


def test_streams_batch_together_and_max_batch_caps_the_oldest_first():
    sched = StageScheduler([1], num_steps=2, schedule="noisy", max_batch=3, max_inflight=2)
    for s in range(5):
        sched.add_stream(s, ring=0)
        sched.set_context(s)
        sched.submit(s)
    plan = sched.plan_tick()
    assert [i.stream for i in plan[(0, 0)]] == [0, 1, 2]  # prefills, capped at 3
    sched.complete(plan[(0, 0)])
    plan = sched.plan_tick()
    # streams 3, 4 still need their prefill (position 0 sorts first); 0 gets the last seat
    assert [(i.stream, i.position) for i in plan[(0, 0)]] == [(3, 0), (4, 0), (0, 1)]


def test_rings_are_independent():
    sched = StageScheduler([1, 2], num_steps=2, schedule="noisy", max_batch=4, max_inflight=2)
    sched.add_stream(0, ring=0)
    sched.add_stream(1, ring=1)
    for s in (0, 1):
        sched.set_context(s)
    plan = sched.plan_tick()
    assert set(plan) == {(0, 0), (1, 0)}
    with pytest.raises(ValueError, match="ring 2 does not exist"):
        sched.add_stream(2, ring=2)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_stream(0, ring=0)


def _oracle_ready(done: set, item: WorkItem, stages: int, steps: int, schedule: str, submitted: int) -> bool:
    """Dependencies written out from the definitions, over the set of finished items."""
    p, k, r = item.position, item.step, item.stage
    if p == 0:
        return r == 0 or (0, 0, r - 1) in done
    if p - 1 >= submitted:
        return False
    kv_pass = k if schedule == "noisy" else steps
    kv_ok = (0, 0, r) in done if p == 1 else (p - 1, kv_pass, r) in done
    if r > 0:
        return kv_ok and (p, k, r - 1) in done
    return kv_ok and (k == 0 or (p, k - 1, stages - 1) in done)


@pytest.mark.parametrize("schedule", ["noisy", "clean"])
def test_random_runs_respect_every_dependency(schedule):
    rng = random.Random(7)
    stages, steps = 3, 3
    passes = steps + (schedule == "clean")
    sched = StageScheduler([stages], num_steps=steps, schedule=schedule, max_batch=64, max_inflight=100)
    for s in range(3):
        sched.add_stream(s, ring=0)
        sched.set_context(s)
    done = {s: set() for s in range(3)}
    submitted = {s: 0 for s in range(3)}
    for _ in range(200):
        for s in range(3):
            if rng.random() < 0.3 and submitted[s] < 6:
                sched.submit(s)
                submitted[s] += 1
        plan = sched.plan_tick()
        items = [i for b in plan.values() for i in b]
        for item in items:
            assert _oracle_ready(done[item.stream], item, stages, steps, schedule, submitted[item.stream]), item
            assert (item.position, item.step, item.stage) not in done[item.stream]
        # the oracle finds nothing ready that the scheduler left out (max_batch is not binding)
        for s in range(3):
            for p, k, r in itertools.product(range(8), range(passes), range(stages)):
                cand = WorkItem(s, p, k, r)
                if (p == 0 and k) or (p, k, r) in done[s] or any(i == cand for i in items):
                    continue
                in_order = all((q, k if p else 0, r) in done[s] for q in range(1, p))
                if in_order and _oracle_ready(done[s], cand, stages, steps, schedule, submitted[s]):
                    if p == 0 or (p - sched.streams[s].done[-1][passes - 1]) <= 100:
                        raise AssertionError(f"ready item {cand} was not scheduled")
        for item in items:
            done[item.stream].add((item.position, item.step, item.stage))
        sched.complete(items)
    assert all(sched.streams[s].finished_chunks == 6 for s in range(3))
