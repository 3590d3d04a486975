import threading

import numpy as np
import pytest

from profiler.clock import (
    ClockSample,
    connection_exchange,
    estimate_offset,
    measure_offset,
    serve_clock,
    stop_clock_server,
)
from profiler.spans import Timeline
from profiler.trace import load_trace


class SkewedHost:
    """A simulated remote host: its clock = local clock + offset; messages take given delays."""

    def __init__(self, offset_ns, forward_ns, backward_ns):
        self.now = 1_000_000_000  # the local clock (virtual)
        self.offset = offset_ns
        self.forward, self.backward = forward_ns, backward_ns

    def local_clock(self):
        return self.now

    def exchange(self):
        self.now += int(next(self.forward))  # request on the wire
        t1 = self.now + self.offset
        self.now += 5_000  # remote processing
        t2 = self.now + self.offset
        self.now += int(next(self.backward))  # reply on the wire
        return t1, t2


def test_asymmetric_delays_by_hand():
    # forward 100 us, back 300 us: offset is off by (100 - 300) / 2 = -100 us; bound = rtt / 2 = 200 us
    host = SkewedHost(7_000_000_123, iter([100_000] * 4), iter([300_000] * 4))
    est = measure_offset(host.exchange, rounds=4, local_clock=host.local_clock)
    assert est.round_trip_ns == 400_000
    assert est.offset_ns == 7_000_000_123 - 100_000
    assert est.error_bound_ns == 200_000


def test_min_rtt_sample_wins_under_jitter():
    rng = np.random.default_rng(0)
    true_offset = -3_456_789_012
    forward = iter((50_000 + rng.exponential(2_000_000, size=64)).astype(int))
    backward = iter((50_000 + rng.exponential(2_000_000, size=64)).astype(int))
    host = SkewedHost(true_offset, forward, backward)
    est = measure_offset(host.exchange, rounds=64, local_clock=host.local_clock)
    assert abs(est.offset_ns - true_offset) <= est.error_bound_ns
    # the best of 64 jittered exchanges is far tighter than a typical one (~4 ms round trip)
    assert est.error_bound_ns < 500_000
    # and remote times map back onto the local clock
    assert est.to_local(host.now + true_offset) == pytest.approx(host.now, abs=est.error_bound_ns)


def test_non_causal_sample_rejected():
    with pytest.raises(ValueError, match="not causal"):
        estimate_offset([ClockSample(t0=10, t1=5, t2=4, t3=20)])
    with pytest.raises(ValueError, match="at least one"):
        estimate_offset([])


def test_connection_exchange_on_one_host_finds_no_offset():
    import multiprocessing as mp

    ours, theirs = mp.Pipe()
    server = threading.Thread(target=serve_clock, args=(theirs,), daemon=True)
    server.start()
    est = measure_offset(connection_exchange(ours), rounds=20)
    stop_clock_server(ours)
    server.join(timeout=5)
    assert abs(est.offset_ns) <= est.error_bound_ns + 1  # one clock: only the wire error remains


def test_timeline_offset_moves_spans_onto_the_reference_clock(tmp_path):
    timeline = Timeline(tmp_path, rank=1, worker="remote", clock_offset_ns=5_000_000_000, keep_in_memory=True)
    with timeline.span("x"):
        pass
    timeline.close()
    (local_start, *_), = [(s[1],) for s in timeline.spans]
    span, = load_trace(tmp_path).spans
    assert span.start_ns == local_start + 5_000_000_000
