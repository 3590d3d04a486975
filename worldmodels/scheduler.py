"""The stage scheduler: which (stream, chunk, pass) items each stage runs this tick. Plain Python.

A stream's work is a grid of items (position p, pass k) run through the stages of its ring
(each stage a block range on a device). Position 0 is the context prefill (one pass); position
p >= 1 is chunk p - 1 with passes 0..K-1 (denoise steps) and, in the clean schedule, pass K
(the t = 0 re-cache). Item (p, k) may run at stage r in a tick when

- its input exists: stage 0 of pass 0 needs the chunk's actions; stage 0 of pass k > 0 needs
  pass k - 1 finished at the last stage (the Euler update happened); stage r > 0 needs stage
  r - 1 of the same pass finished in an earlier tick;
- the K/V it reads at stage r is written: position p - 1's pass k (noisy schedule: chunk n+1
  at step k reads chunk n's step-k K/V) or pass K (clean: the re-cache) finished at stage r;
- positions run in order per (stage, pass), and at most `max_inflight` positions of a stream
  are between their first pass and their last (bounds the latent slots).

Each tick every stage takes all its ready items (up to `max_batch`, longest-waiting first:
by the tick an item became ready, then by position): the executor runs each block once over
them as one batch. Ordering by position alone let a late-joining stream, whose positions are
low, take every seat for as long as its positions trail an older stream's (unbounded with
repeated joins); by waiting time, an item waits at most for the items that were ready before
it. Any order gives the same latents: every ready item's inputs and K/V exist already. The
scheduler holds no tensors; the server executes a plan and reports it back with `complete`
(or, when the plan's execution failed before an item ran, `requeue`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkItem:
    stream: int
    position: int  # 0: the context prefill; p >= 1: chunk p - 1
    step: int  # pass: 0..K-1 denoise steps, K: the clean re-cache; 0 for the prefill
    stage: int  # index of the stage within the stream's ring

    @property
    def chunk(self) -> int:
        return self.position - 1

    @property
    def is_prefill(self) -> bool:
        return self.position == 0


@dataclass(frozen=True)
class ChunkFinished:
    stream: int
    chunk: int


@dataclass
class StreamProgress:
    stream: int
    ring: int
    num_stages: int
    num_steps: int  # K denoise steps
    schedule: str  # "noisy" | "clean"
    max_inflight: int
    submitted: int = 0  # chunks whose actions have arrived
    context_ready: bool = False
    done: list[list[int]] = field(default_factory=list)  # done[stage][pass] = last position finished
    dispatched: set[tuple[int, int, int]] = field(default_factory=set)  # (position, pass, stage) in flight
    ready_since: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (position, pass, stage) -> tick

    def __post_init__(self) -> None:
        self.done = [[-1] * self.passes for _ in range(self.num_stages)]

    @property
    def passes(self) -> int:
        return self.num_steps + (1 if self.schedule == "clean" else 0)

    def kv_pass(self, step: int) -> int:
        """The pass whose K/V a pass reads at the previous position."""
        return step if self.schedule == "noisy" else self.num_steps

    def writes_kv(self, item: WorkItem) -> bool:
        return item.is_prefill or self.schedule == "noisy" or item.step == self.num_steps

    @property
    def finished_chunks(self) -> int:
        """Chunks whose output exists (last denoise step done at the last stage)."""
        return max(self.done[-1][self.num_steps - 1], 0)

    def ready(self, stage: int) -> list[WorkItem]:
        done = self.done[stage]
        if done[0] == -1:  # the prefill has not run at this stage
            prefill_input = self.context_ready if stage == 0 else self.done[stage - 1][0] >= 0
            if prefill_input and (0, 0, stage) not in self.dispatched:
                return [WorkItem(self.stream, 0, 0, stage)]
            return []
        retired = max(self.done[-1][self.passes - 1], 0)  # last position whose every pass is done
        items = []
        for step in range(self.passes):
            position = done[step] + 1
            if (position, step, stage) in self.dispatched:
                continue
            if position - 1 >= self.submitted or position - retired > self.max_inflight:
                continue
            if stage == 0:
                has_input = step == 0 or self.done[-1][step - 1] >= position
            else:
                has_input = self.done[stage - 1][step] >= position
            if has_input and done[self.kv_pass(step)] >= position - 1:
                items.append(WorkItem(self.stream, position, step, stage))
        return items

    def waiting_since(self, item: WorkItem, tick: int) -> int:
        """The tick the item was first seen ready (kept until it finishes: a requeued item keeps its place)."""
        return self.ready_since.setdefault((item.position, item.step, item.stage), tick)

    def finish(self, item: WorkItem) -> None:
        self.dispatched.discard((item.position, item.step, item.stage))
        self.ready_since.pop((item.position, item.step, item.stage), None)
        done = self.done[item.stage]
        if item.is_prefill:
            done[:] = [0] * self.passes
            return
        if item.position != done[item.step] + 1:
            raise RuntimeError(f"stream {self.stream}: item {item} finished out of order (done {done})")
        done[item.step] = item.position


class StageScheduler:
    def __init__(self, ring_sizes: list[int], num_steps: int, schedule: str, max_batch: int, max_inflight: int):
        if schedule not in ("noisy", "clean"):
            raise ValueError(f"schedule must be 'noisy' or 'clean', got {schedule!r}")
        self.ring_sizes = list(ring_sizes)
        self.num_steps = num_steps
        self.schedule = schedule
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.streams: dict[int, StreamProgress] = {}
        self.tick_index = 0

    # ------------------------------------------------------------------ streams
    def add_stream(self, stream: int, ring: int) -> None:
        if stream in self.streams:
            raise ValueError(f"stream {stream} is already scheduled")
        if not 0 <= ring < len(self.ring_sizes):
            raise ValueError(f"ring {ring} does not exist ({len(self.ring_sizes)} rings)")
        self.streams[stream] = StreamProgress(stream, ring, self.ring_sizes[ring], self.num_steps,
                                              self.schedule, self.max_inflight)

    def remove_stream(self, stream: int) -> None:
        self.streams.pop(stream, None)

    def set_context(self, stream: int) -> None:
        self.streams[stream].context_ready = True

    def submit(self, stream: int) -> int:
        """Actions for the stream's next chunk arrived; returns that chunk's index."""
        progress = self.streams[stream]
        progress.submitted += 1
        return progress.submitted - 1

    # ------------------------------------------------------------------ ticks
    def plan_tick(self) -> dict[tuple[int, int], list[WorkItem]]:
        """{(ring, stage): items} for this tick; the items are marked in flight."""
        plan: dict[tuple[int, int], list[WorkItem]] = {}
        for ring, size in enumerate(self.ring_sizes):
            members = [p for p in self.streams.values() if p.ring == ring]
            for stage in range(size):
                ready = [item for p in members for item in p.ready(stage)]
                if not ready:
                    continue
                since = {item: self.streams[item.stream].waiting_since(item, self.tick_index) for item in ready}
                ready.sort(key=lambda it: (since[it], it.position, it.step, it.stream))  # longest waiting first
                chosen = ready[: self.max_batch]
                for item in chosen:
                    self.streams[item.stream].dispatched.add((item.position, item.step, item.stage))
                plan[(ring, stage)] = chosen
        self.tick_index += 1
        return plan

    def complete(self, items: Iterable[WorkItem]) -> list[ChunkFinished]:
        """Mark executed items done; returns the chunks whose output now exists."""
        finished = []
        for item in items:
            progress = self.streams.get(item.stream)
            if progress is None:
                continue  # closed while in flight
            progress.finish(item)
            last_stage = item.stage == progress.num_stages - 1
            if last_stage and not item.is_prefill and item.step == self.num_steps - 1:
                finished.append(ChunkFinished(item.stream, item.chunk))
        return finished

    def requeue(self, items: Iterable[WorkItem]) -> None:
        """Planned items that never ran (the tick failed before their stage did): ready again, in their place."""
        for item in items:
            progress = self.streams.get(item.stream)
            if progress is not None:
                progress.dispatched.discard((item.position, item.step, item.stage))

    def idle(self) -> bool:
        return not any(p.ready(s) for p in self.streams.values() for s in range(p.num_stages))
