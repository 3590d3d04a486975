"""The schedule picture's recording: what it shows is what the scheduler did."""

from __future__ import annotations

from worldmodels.schedule_plot import plot_timeline, record_demo


def test_recorded_demo_and_picture(tmp_path):
    records, server = record_demo(stages=2, streams=2, chunks=2, lookahead=2)
    by_tick = {}
    for r in records:
        by_tick.setdefault(r.tick, []).append(r)
    # every stage runs at most once per tick; every (stream, chunk, pass) visits every stage once
    assert all(len({r.rank for r in recs}) == len(recs) for recs in by_tick.values())
    visits = [(s, c, k, r.rank) for r in records for s, c, k in r.items]
    assert len(visits) == len(set(visits))
    passes = server.cfg.passes_per_chunk
    assert len(visits) == 2 * 2 * (1 + 2 * passes)  # stages x streams x (prefill + chunks x passes)
    path = plot_timeline(records, server.placement.ring_sizes, tmp_path / "schedule.png", "test", passes)
    assert path.stat().st_size > 10_000
