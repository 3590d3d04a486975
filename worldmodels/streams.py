"""Per-stream state of the server, the batch builder (items -> one StageBatch per stage) and
the stage timer.

What one item needs comes from its stream: the context latents (prefill), the chunk's noise
(pass 0) or the latents after the previous pass, the hidden states the previous stage sent,
the chunk's actions, the sigma pair of its pass, and its pages on this stage.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from worldmodels.admission import VirtualRank
from worldmodels.config import WorldModelConfig
from worldmodels.kvpool import DISCARD, SENTINEL, StreamPages
from worldmodels.scheduler import WorkItem
from worldmodels.stage import StageBatch


@dataclass
class ChunkOutput:
    stream: int
    chunk: int
    latents: Tensor  # (F, C, h, w) float32, CPU
    success_prob: float
    state: np.ndarray  # (state_dim,) float32
    frames: Tensor | None  # (T, 3, H, W) in [-1, 1], CPU: all frames of the chunk, or only the last
    submitted_at: float
    finished_at: float


@dataclass
class StreamState:
    stream: int
    ring: int
    seed: int
    context_id: int
    slo_s: float | None
    frames: str
    pages: dict[int, StreamPages]  # rank -> this stream's pages there
    raw_pages: dict[int, list[int]]
    context: Tensor  # (F, C, h, w) float32
    actions: dict[int, Tensor] = field(default_factory=dict)  # chunk -> (F, A * (dim + 1))
    noise: dict[int, Tensor] = field(default_factory=dict)  # chunk -> (F, C, h, w)
    submitted_at: dict[int, float] = field(default_factory=dict)
    latents: dict[int, Tensor] = field(default_factory=dict)  # position -> latents after the last pass
    hidden: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)  # (position, pass, stage) -> input
    previous_frame: Tensor | None = None  # the last latent frame of the previous chunk (VAE context)
    outbox: deque = field(default_factory=deque)
    submitted: int = 0
    failed: str | None = None  # why the stream cannot go on (a tick failed after running its items)


class BatchBuilder:
    def __init__(self, cfg: WorldModelConfig, sigmas: list[float]):
        self.cfg = cfg
        self.sigmas = sigmas
        self.steps = cfg.num_denoise_steps
        self.noisy = cfg.kv_schedule == "noisy"
        self.window = cfg.context_chunks

    def step_slot(self, item: WorkItem) -> int:
        return item.step if (self.noisy and not item.is_prefill) else 0

    def writes_kv(self, item: WorkItem) -> bool:
        return item.is_prefill or self.noisy or item.step == self.steps

    def input_latents(self, st: StreamState, item: WorkItem) -> Tensor:
        if item.is_prefill:
            return st.context
        if item.step == 0:
            return st.noise[item.chunk]
        return st.latents[item.position]

    def build(self, rank: VirtualRank, first: bool, last: bool, items: list[WorkItem],
              streams: dict[int, StreamState], device: torch.device) -> StageBatch:
        """Reads the streams and changes nothing: a tick builds every stage's batch before any runs, and a
        failed build leaves its items as they were."""
        t, dt, frame0, ctx, reads, writes, real, actions, latents, hidden = ([] for _ in range(10))
        frames = self.cfg.frames_per_chunk
        for item in items:
            st = streams[item.stream]
            pages = st.pages[rank.rank]
            slot = self.step_slot(item)
            if item.is_prefill or item.step == self.steps:  # context prefill and clean re-cache: t = 0
                t.append(0.0)
                dt.append(0.0)
            else:
                t.append(self.sigmas[item.step] * 1000.0)
                dt.append(self.sigmas[item.step + 1] - self.sigmas[item.step])
            if item.is_prefill:
                read, count = [SENTINEL] * self.window, 0
                actions.append(self._no_actions())
            else:
                read, count = pages.read(item.position, slot)
                actions.append(st.actions[item.chunk])
            reads.append(read)
            real.append(count)
            writes.append(pages.write(item.position, slot) if self.writes_kv(item) else DISCARD)
            frame0.append(item.position * frames)
            ctx.append(st.context_id)
            if first or last:
                latents.append(self.input_latents(st, item).to(device, non_blocking=True))
            if not first:  # left in place until the stage has run (the server drops it): a failed tick can retry
                hidden.append(st.hidden[(item.position, item.step, rank.stage)])
        mask = None
        if min(real) < self.window:
            mask = torch.tensor([[w < c for w in range(self.window)] for c in real], dtype=torch.bool)
        batch = StageBatch(
            t=torch.tensor(t, dtype=torch.float32), dt=torch.tensor(dt, dtype=torch.float32),
            actions_pf=torch.stack([a.to("cpu") for a in actions]), frame0=torch.tensor(frame0),
            ctx_ids=torch.tensor(ctx), read_pages=torch.tensor(reads), write_pages=torch.tensor(writes),
            page_mask=mask,
        ).to(device)
        if latents:
            batch.latents = torch.stack(latents)
        if hidden:
            batch.hidden = torch.stack(hidden)
        return batch

    def _no_actions(self) -> Tensor:
        d = self.cfg.dit
        return torch.zeros(self.cfg.frames_per_chunk, d.actions_per_frame * (d.action_dim + 1))


def now() -> float:
    return time.perf_counter()


class Timer:
    """Wall time on the CPU; CUDA events on a GPU (read after the tick's synchronisation)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.current_stream(device)
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record(self.stream)
            self.host_start = now()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end_event.record(self.stream)
        else:
            self.t1 = time.perf_counter()

    def result(self) -> tuple[float, float]:
        if self.cuda:
            return self.host_start, self.host_start + self.start_event.elapsed_time(self.end_event) / 1e3
        return self.t0, self.t1
