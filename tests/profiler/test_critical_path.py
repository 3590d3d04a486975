"""The replay model on timelines worked out by hand (times in ms).

The two-stage pipeline of helpers.PIPELINE (predict 4 ms on one engine lane, env 10 ms per stage):
    engine: p(0,0) 0-4, p(1,0) 4-8, p(0,1) 14-18, p(1,1) 18-22
    env0:   e(0,0) 4-14, e(0,1) 18-28        env1: e(1,0) 8-18, e(1,1) 22-32
Predict 2x faster (2 ms): p(0,0) 0-2, p(1,0) 2-4, e(0,0) 2-12, e(1,0) 4-14, p(0,1) 12-14,
    p(1,1) 14-16, e(0,1) 14-24, e(1,1) 16-26 -> rollout 26 ms (ideal Amdahl: 32 - 16 + 8 = 24).
Predict 4x faster (1 ms): p(0,0) 0-1, p(1,0) 1-2, e(0,0) 1-11, e(1,0) 2-12, p(0,1) 11-12,
    p(1,1) 12-13, e(0,1) 12-22, e(1,1) 13-23 -> 23 ms (ideal: 20).
Predict infinitely fast: e(*,0) 0-10, e(*,1) 10-20 -> 20 ms (ideal: 16).
Critical path at 1x: p(0,0) -> p(1,0) -> e(1,0) -> p(1,1) -> e(1,1) (or through e(0,0), same
    length): 12 ms of predict is exposed, 4 ms overlapped.
"""

import math
import random

import pytest

from profiler.critical_path import build_graph, on_path_ns, replay
from tests.profiler.helpers import MS, pipeline_spans, sp


def _graph(spans, window=(0, 32 * MS)):
    return build_graph(spans, window, predict_name="rollout/predict")


def test_replay_at_speedup_one_reproduces_the_recording():
    nodes, dropped = _graph(pipeline_spans())
    assert dropped == 0
    result = replay(nodes, 0)
    assert result.replayed_end_ns == result.recorded_end_ns == 32 * MS


@pytest.mark.parametrize("speedup, rollout_ms", [(2.0, 26.0), (math.inf, 20.0), (4.0, 23.0)])
def test_faster_predict_in_an_overlapped_pipeline(speedup, rollout_ms):
    nodes, _ = _graph(pipeline_spans())
    result = replay(nodes, 0, "rollout/predict", speedup)
    assert result.replayed_end_ns == pytest.approx(rollout_ms * MS)


def test_exposed_predict_on_the_critical_path():
    nodes, _ = _graph(pipeline_spans())
    path = replay(nodes, 0).critical_path
    assert on_path_ns(path, "rollout/predict") == 12 * MS
    assert sum(n.duration_ns for n in path) == 32 * MS  # the path accounts for the whole rollout


def test_overhead_is_kept_and_children_inherit_pipeline_keys():
    # predict has children (vision, expert) carrying no keys; 1 ms launch gap before env steps
    spans = [
        sp("rollout/predict", "engine", 0, 4, stage=0, chunk=0),
        sp("rollout/predict/vision", "engine", 0, 1),
        sp("rollout/predict/expert", "engine", 1, 4),
        sp("rollout/env_step", "env0", 5, 15, stage=0, chunk=0),
        sp("rollout/predict", "engine", 15, 19, stage=0, chunk=1),
        sp("rollout/predict/expert", "engine", 15, 19),
    ]
    nodes, dropped = build_graph(spans, (0, 19 * MS))
    assert [n.name for n in nodes] == ["rollout/predict/vision", "rollout/predict/expert",
                                       "rollout/env_step", "rollout/predict/expert"]
    assert nodes[3].attrs["chunk"] == 1 and dropped == 0
    # predict 2x: vision 0-0.5, expert 0.5-2, env 3-13 (1 ms overhead kept), expert 13-15
    assert replay(nodes, 0, "rollout/predict", 2.0).replayed_end_ns == pytest.approx(15 * MS)


def test_explicit_after_edges_and_dropped_contradictions():
    spans = [
        sp("a", "x", 0, 5, id="load"),
        sp("b", "y", 6, 8, after=["load"]),
        sp("c", "z", 1, 3, after="b"),  # says it waits for b, but ran before b: contradiction
    ]
    nodes, dropped = build_graph(spans, (0, 10 * MS))
    assert dropped == 1
    result = replay(nodes, 0, "a", 5.0)  # a: 1 ms -> b: 2-4 (its 1 ms gap after a is overhead)
    assert result.replayed_end_ns == pytest.approx(4 * MS)


def _simulate(durations_p, durations_e, stages, chunks, gap=0.3):
    """A slow reference: event-by-event simulation of the stage pipeline (one engine lane, one
    env lane per stage), with a fixed gap before each span."""
    spans, engine_free, env_done = [], 0.0, {}
    env_free = [0.0] * stages
    for c in range(chunks):
        for s in range(stages):
            start = max(engine_free, env_done.get((s, c - 1), 0.0)) + gap
            end = start + durations_p[c][s]
            spans.append(sp("rollout/predict", "engine", start, end, stage=s, chunk=c))
            engine_free = end
            e_start = max(end, env_free[s]) + gap
            e_end = e_start + durations_e[c][s]
            spans.append(sp("rollout/env_step", f"env{s}", e_start, e_end, stage=s, chunk=c))
            env_free[s] = env_done[(s, c)] = e_end
    return spans


def test_replay_matches_a_slow_reference_simulation_on_random_pipelines():
    rng = random.Random(0)
    for _ in range(20):
        stages, chunks = rng.randint(1, 3), rng.randint(1, 5)
        p = [[rng.uniform(1, 8) for _ in range(stages)] for _ in range(chunks)]
        e = [[rng.uniform(1, 15) for _ in range(stages)] for _ in range(chunks)]
        speedup = rng.choice([1.5, 2.0, 3.0])
        recorded = _simulate(p, e, stages, chunks)
        fast = _simulate([[x / speedup for x in row] for row in p], e, stages, chunks)
        end = max(s.end_ns for s in recorded)
        nodes, dropped = build_graph(recorded, (0, end))
        assert dropped == 0
        assert replay(nodes, 0).replayed_end_ns == pytest.approx(end, abs=2)
        expected = max(s.end_ns for s in fast)
        assert replay(nodes, 0, "rollout/predict", speedup).replayed_end_ns == pytest.approx(expected, abs=10)


def test_parent_self_time_is_kept_and_scaled_with_the_parent():
    # predict 0-4 holds vision 0-1; its own work 1-4 is a piece named rollout/predict
    spans = [sp("rollout/predict", "engine", 0, 4, stage=0, chunk=0),
             sp("rollout/predict/vision", "engine", 0, 1),
             sp("rollout/env_step", "env0", 4, 14, stage=0, chunk=0)]
    nodes, _ = build_graph(spans, (0, 14 * MS))
    assert [(n.name, n.span.start_ns // MS, n.span.end_ns // MS) for n in nodes] == [
        ("rollout/predict/vision", 0, 1), ("rollout/predict", 1, 4), ("rollout/env_step", 4, 14)]
    assert replay(nodes, 0, "rollout/predict", 2.0).replayed_end_ns == pytest.approx(12 * MS)
    assert replay(nodes, 0, "rollout/predict/vision", math.inf).replayed_end_ns == pytest.approx(13 * MS)
    assert on_path_ns(replay(nodes, 0).critical_path, "rollout/predict") == 4 * MS
