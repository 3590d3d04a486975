"""Admission control, virtual-rank placement, the tick-time model, the split rebalancer and the
page bookkeeping, without a model (several ranks on CPU-only plain Python)."""

from __future__ import annotations

import itertools

import pytest

from worldmodels.admission import AdmissionController, Placement, StageSpec, TickTimeModel
from worldmodels.kvpool import SENTINEL, PageAllocator, PoolExhausted, StreamPages
from worldmodels.split import balanced_split, equal_split, stage_times


def two_rings(devices=("cuda:0", "cuda:1", "cuda:2", "cuda:3")):
    return Placement([[StageSpec(devices[0], (0, 4)), StageSpec(devices[1], (4, 8))],
                      [StageSpec(devices[2], (0, 3)), StageSpec(devices[3], (3, 8))]], num_blocks=8)


def controller(placement, capacity=8, pages=2, a=0.001, b=0.002, max_batch=64, passes=4):
    allocators = {r.rank: PageAllocator(capacity) for r in placement.ranks}
    models = {r.rank: TickTimeModel(a, b) for r in placement.ranks}
    return AdmissionController(placement, allocators, pages, models, passes, max_batch)


def test_placement_validates_block_coverage():
    placement = two_rings()
    assert [r.rank for r in placement.ring_ranks(1)] == [2, 3]
    assert placement.rank_of(1, 1).blocks == (3, 8)
    assert "rank 3 on cuda:3, blocks 3-7" in placement.rank_of(1, 1).label
    with pytest.raises(ValueError, match="ring 0 stage 1: blocks \\(5, 8\\) must start at 4"):
        Placement([[StageSpec("cpu", (0, 4)), StageSpec("cpu", (5, 8))]], 8)
    with pytest.raises(ValueError, match="covers blocks 0..5, the model has 8"):
        Placement([[StageSpec("cpu", (0, 6))]], 8)


def test_streams_fill_the_least_loaded_ring_and_never_move():
    ctl = controller(two_rings(), capacity=4, pages=2)
    decisions = [ctl.try_admit(s) for s in range(4)]
    assert [d.ring for d in decisions] == [0, 1, 0, 1]
    assert all(len(d.pages[r]) == 2 for d in decisions for r in d.pages)
    assert set(decisions[1].pages) == {2, 3}  # the ring's ranks
    refused = ctl.try_admit(9)
    assert not refused.admitted
    expected = "ring 0: ring 0 stage 0 (rank 0 on cuda:0, blocks 0-3) has 0 free KV pages, the stream needs 2"
    assert expected in refused.reason
    assert "ring 1: ring 1 stage 0" in refused.reason
    ctl.release(1, decisions[1].pages)
    again = ctl.try_admit(9)
    assert again.admitted and again.ring == 1
    assert ctl.members[0][0] == 0 and ctl.members[2][0] == 0  # running streams stayed where they were


def test_slo_refusal_uses_the_tick_model_and_names_the_victim():
    placement = Placement([[StageSpec("cpu", (0, 8))]], 8)
    ctl = controller(placement, capacity=100, pages=1, a=0.010, b=0.005, passes=4)
    # interval with n streams = 4 passes x 1 stage x (10 + 5 n) ms
    assert ctl.try_admit(0, slo_s=0.100).admitted  # 60 ms
    assert ctl.try_admit(1, slo_s=0.200).admitted  # 80 ms <= both SLOs
    refused = ctl.try_admit(2, slo_s=1.0)  # 100 ms: ok for itself, fine for 1, equal for 0 -> still ok
    assert refused.admitted
    refused = ctl.try_admit(3, slo_s=1.0)  # 120 ms > stream 0's 100 ms
    assert not refused.admitted
    assert "predicted output interval 120.0 ms > SLO 100.0 ms for stream 0" in refused.reason
    assert "tick 30.00 ms x 4 passes x 1 stages, 4 streams" in refused.reason
    tight = ctl.try_admit(4, slo_s=0.05)
    assert "for the new stream" in tight.reason


def test_the_hosts_share_of_a_tick_counts_every_stages_items():
    host = TickTimeModel(0.002, 0.001)  # 2 ms a tick + 1 ms an item, on top of the stages
    single = controller(Placement([[StageSpec("cpu", (0, 8))]], 8), capacity=100, pages=1, a=0.010, b=0.005)
    single.host_model = host
    assert single.predicted_tick({0: 2}) == pytest.approx(0.010 + 0.005 * 2 + 0.002 + 0.001 * 2)
    ctl = controller(two_rings(), a=0.001, b=0.002)
    ctl.host_model = host
    # ring 0: 3 streams, maybe in phase: 3 items on either of its ranks, 3 in the tick; ring 1: 1 stream
    assert ctl.predicted_host({0: 3, 1: 1}) == pytest.approx(0.002 + 0.001 * (3 + 1))
    assert ctl.predicted_tick({0: 3, 1: 1}) == pytest.approx(0.001 + 0.002 * 3 + 0.002 + 0.001 * 4)
    # an SLO that the stages alone would meet is refused once the host's share is counted
    single.try_admit(0, slo_s=1.0)
    refused = single.try_admit(1, slo_s=4 * (0.010 + 0.005 * 2) + 1e-4)
    assert not refused.admitted
    assert "tick 24.00 ms x 4 passes x 1 stages, 2 streams on the ring; host 4.00 ms of the tick" in refused.reason


def test_devices_shared_by_virtual_ranks_add_up():
    shared = Placement([[StageSpec("cpu:0", (0, 4)), StageSpec("cpu:0", (4, 8))]], 8)
    split = Placement([[StageSpec("cpu:0", (0, 4)), StageSpec("cpu:1", (4, 8))]], 8)
    for placement, tick in ((shared, 2 * 0.003), (split, 0.003)):
        ctl = controller(placement, a=0.001, b=0.002)
        ctl.try_admit(0)
        assert ctl.predicted_tick({0: 1}) == pytest.approx(tick)
        assert ctl.predicted_interval(0) == pytest.approx(4 * 2 * tick)


def test_a_rings_streams_may_all_run_on_one_stage():
    """S streams on a ring of R stages are not spread over its phases: any stage may run all S in a tick."""
    placement = Placement([[StageSpec("cuda:0", (0, 4)), StageSpec("cuda:1", (4, 8))]], 8)
    ctl = controller(placement, a=0.001, b=0.002)
    for s in range(3):
        ctl.try_admit(s)
    assert ctl.predicted_tick({0: 3}) == pytest.approx(0.001 + 0.002 * 3)
    assert ctl.predicted_interval(0) == pytest.approx(4 * 2 * 0.007)


def test_max_batch_bounds_a_ring():
    ctl = controller(Placement([[StageSpec("cpu", (0, 8))]], 8), capacity=100, pages=1, max_batch=2)
    assert ctl.try_admit(0).admitted and ctl.try_admit(1).admitted
    assert "already serves 2 streams = max_batch (2)" in ctl.try_admit(2).reason


def test_tick_time_model_fits_measurements():
    model = TickTimeModel(prior_a=1.0, prior_b=1.0)
    assert model.predict(3) == 4.0
    model.observe(4, 10.0)  # one size: the prior's shape scaled through the measurement
    assert model.predict(4) == pytest.approx(10.0)
    for n in (1, 2, 8, 16):
        model.observe(n, 0.5 + 0.25 * n)
    model.observe(4, 0.5 + 0.25 * 4)
    model.observe(4, 0.5 + 0.25 * 4)  # the median of size 4 is now on the line
    assert (model.a, model.b) == pytest.approx((0.5, 0.25))
    assert model.predict(0) == 0.0


def test_tick_time_model_goes_through_each_measured_size():
    """A stage's time is flat at small batches and linear at large ones, which a line through all sizes misses."""
    model = TickTimeModel(prior_a=1.0, prior_b=1.0)
    for n, t in ((1, 0.020), (4, 0.022), (8, 0.030), (16, 0.060), (32, 0.120), (2, 0.019)):
        model.observe(n, t)
    assert model.points == [(1, 0.020), (2, 0.020), (4, 0.022), (8, 0.030), (16, 0.060), (32, 0.120)]  # 2 lifted
    assert model.predict(8) == pytest.approx(0.030)
    assert model.a + model.b * 8 == pytest.approx(0.0368, abs=1e-4)  # the least-squares line through all six
    assert model.predict(12) == pytest.approx(0.045)  # between 8 and 16
    assert model.predict(1) == pytest.approx(0.020)
    assert model.predict(64) == pytest.approx(0.240)  # past the largest: the last segment's slope
    assert model.predict(0) == 0.0


def test_tick_time_model_ignores_a_slow_first_tick_of_two():
    model = TickTimeModel()
    for n in (1, 8):
        model.observe(n, 0.2)  # the bucket's first tick: a graph capture
        model.observe(n, 0.01 + 0.001 * n)  # its replays
    assert (model.a, model.b) == pytest.approx((0.01, 0.001))


def test_tick_time_model_fits_and_predicts_the_rows_a_padded_stage_runs():
    bucket = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 13: 16, 16: 16}.__getitem__
    model = TickTimeModel(rows_run=bucket)
    model.observe(3, 0.01 + 0.002 * 4)  # 3 items ran the 4-row graph
    model.observe(13, 0.01 + 0.002 * 16)
    assert (model.a, model.b) == pytest.approx((0.01, 0.002))
    assert model.predict(5) == pytest.approx(0.01 + 0.002 * 8)  # 5 items will run 8 rows
    assert TickTimeModel(0.01, 0.002).predict(5) == pytest.approx(0.01 + 0.002 * 5)  # unpadded: the items


def test_balanced_split_matches_brute_force():
    times = [1.0, 1.0, 3.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    extra = [0.5, 0.0, 1.5]
    best = min(
        (max(stage_times(times, [(0, a), (a, b), (b, 8)], extra)), [(0, a), (a, b), (b, 8)])
        for a, b in itertools.combinations(range(1, 8), 2)
    )
    split = balanced_split(times, 3, extra)
    assert max(stage_times(times, split, extra)) == pytest.approx(best[0])
    # equal blocks with a heavy last stage: the last stage gets fewer blocks
    assert balanced_split([1.0] * 30, 2, [0.0, 4.0]) == [(0, 17), (17, 30)]
    assert equal_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="num_stages must be in 1..3"):
        balanced_split([1, 1, 1], 4)


def test_page_allocator_and_stream_pages():
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert SENTINEL not in pages and alloc.free_count == 1
    with pytest.raises(PoolExhausted, match="2 KV pages requested, 1 of 5 free"):
        alloc.allocate(2)
    table = StreamPages(pages, step_slots=2, window=2)
    assert table.read(0, 0) == ([SENTINEL, SENTINEL], 0)
    assert table.read(1, 1) == ([pages[2], SENTINEL], 1)  # the context page of slot 1
    assert table.write(2, 1) == pages[2]  # position 2 replaces position 0
    assert table.read(3, 0) == ([pages[1], pages[0]], 2)  # positions 1, 2, oldest first
    alloc.free(pages)
    with pytest.raises(ValueError, match="page 1 is not an allocated page"):
        alloc.free([1])
