"""Clocks: one monotonic clock per host, and an NTP-style offset estimator across hosts.

All processes of one host read CLOCK_MONOTONIC (`time.monotonic_ns`), which Linux keeps
system-wide, so their spans line up without correction. Another host's monotonic clock has an
arbitrary origin: estimate `offset = remote_clock - local_clock` with a few request/response
exchanges and keep the one with the smallest round trip (its error is at most half that round
trip, whatever the asymmetry of the two directions). The exchange is pluggable: anything that
returns the remote clock's receive and send times (a multiprocessing Connection, a TCP socket,
torch.distributed, a Ray call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A worker on another host measures the reference host (rank 0's) as the "remote" and passes
# `estimate.offset_ns` to its Timeline as `clock_offset_ns`: its spans are then written on the
# reference clock (local + offset).

now_ns: Callable[[], int] = time.monotonic_ns


@dataclass(frozen=True)
class ClockSample:
    """One exchange. t0/t3: local send/receive; t1/t2: remote receive/send (remote clock)."""

    t0: int
    t1: int
    t2: int
    t3: int

    @property
    def round_trip_ns(self) -> int:
        """Time on the wire, both ways (excludes the remote's own processing time)."""
        return (self.t3 - self.t0) - (self.t2 - self.t1)

    @property
    def offset_ns(self) -> float:
        """remote - local, exact when both directions take the same time."""
        return ((self.t1 - self.t0) + (self.t2 - self.t3)) / 2.0


@dataclass(frozen=True)
class OffsetEstimate:
    offset_ns: int  # remote clock - local clock
    error_bound_ns: int  # |true offset - offset_ns| <= this (half the best round trip)
    round_trip_ns: int
    samples: int

    def to_local(self, remote_ns: int) -> int:
        """A remote timestamp expressed on the local clock."""
        return remote_ns - self.offset_ns

    def to_remote(self, local_ns: int) -> int:
        return local_ns + self.offset_ns


def estimate_offset(samples: Sequence[ClockSample]) -> OffsetEstimate:
    """Min-RTT estimate: the sample that spent least time on the wire bounds the error best."""
    if not samples:
        raise ValueError("estimate_offset needs at least one ClockSample, got none")
    for i, s in enumerate(samples):
        if s.t3 < s.t0 or s.t2 < s.t1:
            raise ValueError(f"clock sample {i} is not causal: {s}")
    best = min(samples, key=lambda s: s.round_trip_ns)
    rtt = max(best.round_trip_ns, 0)
    return OffsetEstimate(
        offset_ns=round(best.offset_ns),
        error_bound_ns=(rtt + 1) // 2,
        round_trip_ns=rtt,
        samples=len(samples),
    )


def measure_offset(
    exchange: Callable[[], tuple[int, int]],
    rounds: int = 16,
    local_clock: Callable[[], int] = now_ns,
) -> OffsetEstimate:
    """Run `rounds` exchanges. `exchange()` asks the remote for its (receive, send) times."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples = []
    for _ in range(rounds):
        t0 = local_clock()
        t1, t2 = exchange()
        t3 = local_clock()
        samples.append(ClockSample(t0, int(t1), int(t2), t3))
    return estimate_offset(samples)


# --- a ready exchange over multiprocessing.connection (Pipe, or Listener/Client across hosts) ---

_PING, _STOP = "clock_ping", "clock_stop"


def serve_clock(conn, clock: Callable[[], int] = now_ns) -> None:
    """Answer clock pings on `conn` until the peer sends stop (run it in the reference process)."""
    while True:
        message = conn.recv()
        t1 = clock()
        if message == _STOP:
            return
        if message != _PING:
            raise ValueError(f"serve_clock: unexpected message {message!r}")
        conn.send((t1, clock()))


def connection_exchange(conn) -> Callable[[], tuple[int, int]]:
    """An exchange function for `measure_offset` talking to `serve_clock` on the other end."""

    def exchange() -> tuple[int, int]:
        conn.send(_PING)
        return conn.recv()

    return exchange


def stop_clock_server(conn) -> None:
    conn.send(_STOP)
