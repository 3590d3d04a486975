"""Virtual ranks, the measured tick-time model and admission control. Plain Python.

A placement is one or more rings; a ring is a sequence of stages (block ranges covering the
whole model) on devices. Each stage is a virtual rank: several may share a device (several
rings on a box, or many stages on one GPU / CPU for testing). A stream is placed on one ring
when it opens: its K/V pages are reserved on every stage of that ring and it never moves.

Admission: a stream is admitted only when all its stages fit, i.e. every stage of some ring
has the pages it needs, the ring's stage batches stay within `max_batch`, and the predicted
output interval of every stream (the new one included) stays within its SLO. The prediction
uses per-stage tick models t_r(n) = a_r + b_r m(n) (m: the rows the stage runs, a graph's padded
bucket) fitted on measured ticks, and a host model h(n) by the tick's items, in the lockstep
execution the server uses: a tick lasts as long as the busiest device (the sum of its stages'
times) plus the host's share; a closed-loop stream (one chunk in flight: the policy needs chunk
n's frames to act on chunk n+1) has one item in its ring at a time and needs passes x stages
ticks per chunk. Nothing spreads a ring's streams over its stages: streams opened and answered
together (the world-model env's) stay in phase, so one stage runs all S of them in a tick while
the others idle, and spreading them could even cost more (an idle stage costs nothing, each busy
one its intercept). Whatever the phases, no stage runs more than S items, so the prediction takes S
items on every stage (a tick may carry more than S items of a ring where a chunk's passes overlap,
but a chunk then takes fewer ticks: with the linear tick models the interval below stays an upper
bound, 108 vs 108 ms noisy and 135 vs 129.5 ms clean in a 4-stream, 2-stage simulation; the host's
share is counted at S items a ring):

    interval = passes * R * (max_device sum_{r on device} t_r(S_ring(r)) + h(sum_rings S)).

Exact for one stage (R = 1) and for in-phase streams on balanced stages with a device each; up to
R times pessimistic where a ring's stages share a device (in phase, one of them runs a tick). A
stage may run all S, so a ring serves at most `max_batch` streams (more would be cut to
`max_batch` a tick, breaking the passes x stages ticks a chunk takes).

Refusals say which ring and stage failed and by how much.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from worldmodels.kvpool import PageAllocator


@dataclass(frozen=True)
class StageSpec:
    device: str
    blocks: tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class VirtualRank:
    rank: int
    ring: int
    stage: int
    device: str
    blocks: tuple[int, int]

    @property
    def label(self) -> str:
        first, last = self.blocks[0], self.blocks[1] - 1
        return f"ring {self.ring} stage {self.stage} (rank {self.rank} on {self.device}, blocks {first}-{last})"


class Placement:
    def __init__(self, rings: list[list[StageSpec]], num_blocks: int):
        if not rings or any(not ring for ring in rings):
            raise ValueError("a placement needs at least one ring of at least one stage")
        self.ranks: list[VirtualRank] = []
        for g, ring in enumerate(rings):
            cursor = 0
            for s, spec in enumerate(ring):
                start, end = spec.blocks
                if start != cursor or end <= start:
                    raise ValueError(
                        f"ring {g} stage {s}: blocks {spec.blocks} must start at {cursor} and be non-empty "
                        f"(stages cover blocks 0..{num_blocks - 1} in order)"
                    )
                self.ranks.append(VirtualRank(len(self.ranks), g, s, spec.device, (start, end)))
                cursor = end
            if cursor != num_blocks:
                raise ValueError(f"ring {g} covers blocks 0..{cursor - 1}, the model has {num_blocks}")
        self.ring_sizes = [len(ring) for ring in rings]

    def rank_of(self, ring: int, stage: int) -> VirtualRank:
        return next(r for r in self.ranks if r.ring == ring and r.stage == stage)

    def ring_ranks(self, ring: int) -> list[VirtualRank]:
        return [r for r in self.ranks if r.ring == ring]

    @property
    def devices(self) -> list[str]:
        return sorted({r.device for r in self.ranks})


class TickTimeModel:
    """Seconds one stage needs for a batch of n items, as a function of m = rows_run(n), the rows the stage really
    runs (a CUDA graph's padded bucket: 13 items cost what 16 do; n without padding). Until two distinct sizes
    are measured: the prior line a + b m (one measurement scales it). Then: through the per-size measurements,
    linear between them, flat below the smallest, the last segment's slope above the largest. A line fitted
    through all sizes misses: a stage's time is flat at small batches and linear at large ones, so on the H200
    the line's 64 ms intercept put the 8-row tick at 98 ms where it took 54. `a`, `b` keep that least-squares
    line for reports."""

    def __init__(self, prior_a: float = 0.0, prior_b: float = 0.0, rows_run: Callable[[int], int] | None = None):
        self.a, self.b = float(prior_a), float(prior_b)
        self.rows_run = rows_run or (lambda n: n)
        self._samples: dict[int, list[float]] = defaultdict(list)
        self.points: list[tuple[int, float]] = []  # (rows, seconds), sorted, non-decreasing; >= 2 once measured

    def observe(self, n: int, seconds: float) -> None:
        if n > 0:
            self._samples[self.rows_run(n)].append(float(seconds))
            self._fit()

    def _fit(self) -> None:
        # per size the lower median (robust to a slow first tick, also of two samples: the upper one of a
        # capture tick and a replay was the capture, 72-140 ms intercepts on the H200s, round 31)
        points = sorted((n, sorted(v)[(len(v) - 1) // 2]) for n, v in self._samples.items())
        if len(points) < 2:
            n, t = points[0]
            if self.a + self.b * n > 0:  # scale the prior's shape to the measurement
                scale = t / (self.a + self.b * n)
                self.a, self.b = self.a * scale, self.b * scale
            else:
                self.a, self.b = 0.0, t / n
            return
        # more rows never run faster; a noisy size that says otherwise is lifted to its predecessor
        self.points = list(zip([n for n, _ in points], itertools.accumulate((t for _, t in points), max),
                               strict=True))
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        var = sum((n - mean_n) ** 2 for n, _ in points)
        b = max(sum((n - mean_n) * (t - mean_t) for n, t in points) / var, 0.0)
        self.a, self.b = max(mean_t - b * mean_n, 0.0), b

    def predict(self, n: int) -> float:
        if n <= 0:
            return 0.0
        m = self.rows_run(n)
        if not self.points:
            return self.a + self.b * m
        if m <= self.points[0][0]:
            return self.points[0][1]
        k = next((k for k in range(1, len(self.points)) if m <= self.points[k][0]), len(self.points) - 1)
        (n0, t0), (n1, t1) = self.points[k - 1], self.points[k]
        return t0 + (t1 - t0) / (n1 - n0) * (m - n0)


@dataclass
class Decision:
    admitted: bool
    ring: int | None = None
    pages: dict[int, list[int]] = field(default_factory=dict)  # rank -> reserved page ids
    reason: str = ""


class AdmissionController:
    def __init__(self, placement: Placement, allocators: dict[int, PageAllocator], pages_per_stream: int,
                 tick_models: dict[int, TickTimeModel], passes: int, max_batch: int,
                 host_model: TickTimeModel | None = None):
        self.placement = placement
        self.allocators = allocators
        self.pages_per_stream = pages_per_stream
        self.tick_models = tick_models
        # the tick's host time outside the stages (batch building, routing, delivery, the chunks' submits) by the
        # items of the whole tick: 3.8 ms of an 8-stream 53 ms tick on the H200 (round 32)
        self.host_model = host_model or TickTimeModel()
        self.passes = passes
        self.max_batch = max_batch
        self.members: dict[int, tuple[int, float | None]] = {}  # stream -> (ring, slo seconds)

    def ring_load(self, ring: int) -> int:
        return sum(1 for g, _ in self.members.values() if g == ring)

    def _ring_items(self, loads: dict[int, int]) -> dict[int, int]:
        """The most items one stage of a ring, and the whole ring, run in a tick: all S of its closed-loop
        streams (in phase, nothing staggers them; module docstring), at most max_batch."""
        return {g: min(loads.get(g, 0), self.max_batch) for g in range(len(self.placement.ring_sizes))}

    def _stage_items(self, loads: dict[int, int]) -> dict[int, int]:
        """Items per rank: its ring's S on every stage (the bound of any tick, whatever the phases)."""
        ring = self._ring_items(loads)
        return {r.rank: ring[r.ring] for r in self.placement.ranks}

    def predicted_stages(self, loads: dict[int, int]) -> float:
        """The busiest device's summed stage times (stages run in lockstep, devices in parallel)."""
        items = self._stage_items(loads)
        per_device: dict[str, float] = defaultdict(float)
        for r in self.placement.ranks:
            per_device[r.device] += self.tick_models[r.rank].predict(items[r.rank])
        return max(per_device.values(), default=0.0)

    def predicted_host(self, loads: dict[int, int]) -> float:
        """The host's share by the tick's items: at most S per ring (one item per closed-loop stream)."""
        return self.host_model.predict(sum(self._ring_items(loads).values()))

    def predicted_tick(self, loads: dict[int, int]) -> float:
        """Lockstep tick: the busiest device's stage times, then the host's share of the tick."""
        return self.predicted_stages(loads) + self.predicted_host(loads)

    def predicted_interval(self, ring: int, loads: dict[int, int] | None = None) -> float:
        loads = loads if loads is not None else {g: self.ring_load(g) for g in range(len(self.placement.ring_sizes))}
        return self.passes * self.placement.ring_sizes[ring] * self.predicted_tick(loads)

    def try_admit(self, stream: int, slo_s: float | None = None) -> Decision:
        if stream in self.members:
            raise ValueError(f"stream {stream} is already admitted")
        reasons, options = [], []
        base = {g: self.ring_load(g) for g in range(len(self.placement.ring_sizes))}
        for ring in range(len(self.placement.ring_sizes)):
            why = self._check_ring(ring, slo_s, base)
            if why:
                reasons.append(f"ring {ring}: {why}")
            else:
                loads = {**base, ring: base[ring] + 1}
                options.append((base[ring], self.predicted_interval(ring, loads), ring))
        if not options:
            return Decision(False, reason=f"stream {stream} refused: " + "; ".join(reasons))
        ring = min(options)[2]
        pages = {r.rank: self.allocators[r.rank].allocate(self.pages_per_stream)
                 for r in self.placement.ring_ranks(ring)}
        self.members[stream] = (ring, slo_s)
        return Decision(True, ring, pages)

    def release(self, stream: int, pages: dict[int, list[int]]) -> None:
        self.members.pop(stream, None)
        for rank, ids in pages.items():
            self.allocators[rank].free(ids)

    def _check_ring(self, ring: int, slo_s: float | None, base: dict[int, int]) -> str:
        for r in self.placement.ring_ranks(ring):
            free = self.allocators[r.rank].free_count
            if free < self.pages_per_stream:
                return f"{r.label} has {free} free KV pages, the stream needs {self.pages_per_stream}"
        if base[ring] + 1 > self.max_batch:  # in phase, one stage runs every stream of the ring in a tick
            return (f"already serves {base[ring]} streams = max_batch ({self.max_batch}), the most one stage "
                    f"runs in a tick")
        loads = {**base, ring: base[ring] + 1}
        tick = self.predicted_tick(loads)
        for other, (g, slo) in [(None, (ring, slo_s)), *self.members.items()]:
            if slo is None:
                continue
            interval = self.passes * self.placement.ring_sizes[g] * tick
            if interval > slo:
                who = "the new stream" if other is None else f"stream {other}"
                return (f"predicted output interval {interval * 1e3:.1f} ms > SLO {slo * 1e3:.1f} ms for {who} "
                        f"(tick {tick * 1e3:.2f} ms x {self.passes} passes x {self.placement.ring_sizes[g]} stages, "
                        f"{loads[ring]} streams on the ring; host {self.predicted_host(loads) * 1e3:.2f} ms of "
                        f"the tick)")
        return ""
