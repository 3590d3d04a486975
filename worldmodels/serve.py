"""The world-model server: many streams, one model, stage-wise time-division multiplexing.

    server = WorldModelServer(WorldModelConfig.preset("tiny"), ServeConfig())
    sid = server.open_stream(context_latents, seed=7)      # admitted, or AdmissionRefused(reason)
    server.submit(sid, actions)                            # (H, 7) action chunk
    while (out := server.poll(sid)) is None:
        server.tick()                                      # every stage runs all its ready items once
    out.latents, out.success_prob, out.frames
    server.close_stream(sid)

Each tick the scheduler (plain Python) hands every stage all ready (stream, chunk, pass) items;
the stage runs each of its blocks once over them as one batch (per-item K/V windows from the
paged pool, per-item timestep/action modulation), on its device. Stages run in lockstep: a tick
dispatches every stage (asynchronously on GPUs), then waits once; an item moves one stage per
tick. Streams are admitted only where all their stages fit (worldmodels/admission.py).

A tick builds every stage's batch before any stage runs. If a tick raises, no stream waits
silently: items whose stage had not run are ready again, and a stream whose item ran (or was
running) fails with the cause (`StreamFailed` from its poll and submit until it is closed): a
pass at position p writes its K/V over the page of p - window, which it reads itself, so it
cannot run twice.
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from worldmodels.admission import AdmissionController, TickTimeModel, VirtualRank
from worldmodels.config import WorldModelConfig
from worldmodels.functional import chunk_noise, frame_actions, sigma_schedule
from worldmodels.kvpool import DISCARD, FIRST_PAGE, KVPool, StreamPages
from worldmodels.model import CausalWanDiT, build_model
from worldmodels.readout import RewardFn, SuccessHead, build_readout, read_chunk
from worldmodels.scheduler import ChunkFinished, StageScheduler, WorkItem
from worldmodels.serve_config import FRAME_MODES, ServeConfig, device_key
from worldmodels.stage import StageBatch, StageRunner
from worldmodels.streams import BatchBuilder, ChunkOutput, StreamState, Timer, now
from worldmodels.vae import SmallCausalVAE, build_vae, still_clip


class AdmissionRefused(RuntimeError):
    pass


class StreamFailed(RuntimeError):
    """The stream's state was lost in a failed tick: close it (that frees its pages) and open a new one."""


@dataclass
class TickRecord:
    tick: int
    rank: int
    device: str
    items: list[tuple[int, int, int]]  # (stream, chunk, pass); chunk -1 = context prefill
    start_s: float
    end_s: float


def locked(method):
    """Serialise the public calls: the server may be shared by threads (e.g. collector stages)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class WorldModelServer:
    def __init__(self, cfg: WorldModelConfig, serve: ServeConfig | None = None, model: CausalWanDiT | None = None,
                 vae: SmallCausalVAE | None = None, readout: SuccessHead | None = None,
                 reward_fn: RewardFn | None = None):
        self.cfg = cfg
        self.serve = serve or ServeConfig()
        self.lock = threading.RLock()
        self.serve.check_visible(torch.cuda.device_count() if torch.cuda.is_available() else 0)
        self.placement = self.serve.placement(cfg.dit.num_blocks)
        devices = self.placement.devices
        base = model if model is not None else build_model(cfg, devices[0])
        self.models = {device_key(base.device): base}
        for device in devices:
            if device_key(device) not in self.models:
                replica = copy.deepcopy(base).to(device)
                replica.refresh()  # weight-derived caches (context K/V, fused QKV) follow to the device
                self.models[device_key(device)] = replica
        if self.serve.fuse_qkv:
            for m in self.models.values():
                m.fuse()
        self.vae = vae if vae is not None else build_vae(cfg, devices[0])
        self.readout = readout if readout is not None else build_readout(cfg, devices[-1])
        self.reward_fn = reward_fn
        self.sigmas = sigma_schedule(cfg.num_denoise_steps, cfg.timestep_shift)
        self.builder = BatchBuilder(cfg, self.sigmas)
        passes = cfg.passes_per_chunk
        self._build_stages()
        inflight = self.serve.max_inflight_chunks or passes * max(self.placement.ring_sizes)
        self.scheduler = StageScheduler(self.placement.ring_sizes, cfg.num_denoise_steps, cfg.kv_schedule,
                                        self.serve.max_batch, inflight)
        a, b = (v / 1e3 for v in self.serve.tick_prior_ms)
        self.tick_models = {r.rank: TickTimeModel(a, b, self.runners[r.rank].rows_run) for r in self.placement.ranks}
        self.admission = AdmissionController(
            self.placement, {r: p.allocator for r, p in self.pools.items()}, cfg.kv_pages_per_stream(),
            self.tick_models, passes, self.serve.max_batch)
        self.streams: dict[int, StreamState] = {}
        self._next_id = 0
        self.tick_count = 0
        self.last_tick_items = 0
        self._submit_s = 0.0
        self.timeline: list[TickRecord] = []

    # ------------------------------------------------------------------ construction
    def _model_on(self, device: str) -> CausalWanDiT:
        return self.models[device_key(device)]

    def _build_stages(self) -> None:
        cfg, serve = self.cfg, self.serve
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        capacity = serve.kv_pages_per_stage or serve.max_streams * cfg.kv_pages_per_stream()
        self.pools: dict[int, KVPool] = {}
        self.runners: dict[int, StageRunner] = {}
        per_device: dict[str, int] = {}
        for r in self.placement.ranks:
            blocks = r.blocks[1] - r.blocks[0]
            nbytes = (FIRST_PAGE + capacity) * KVPool.page_bytes(blocks, cfg.chunk_tokens, cfg.dit.width, dtype)
            per_device[r.device] = per_device.get(r.device, 0) + nbytes
            if serve.kv_memory_gb is not None and per_device[r.device] > serve.kv_memory_gb * 1e9:
                raise ValueError(
                    f"KV pools on {r.device} need {per_device[r.device] / 1e9:.1f} GB > serve.kv_memory_gb "
                    f"({serve.kv_memory_gb}); lower serve.max_streams or worldmodel.context_chunks")
            self.pools[r.rank] = KVPool(blocks, capacity, cfg.chunk_tokens, cfg.dit.num_heads, cfg.dit.head_dim,
                                        dtype, r.device)
            last = r.stage == self.placement.ring_sizes[r.ring] - 1
            self.runners[r.rank] = StageRunner(
                self._model_on(r.device), r.blocks, self.pools[r.rank], first=r.stage == 0, last=last,
                window=cfg.context_chunks, cuda_graphs=serve.cuda_graphs, pad_to_bucket=serve.pad_to_bucket,
                buckets=tuple(serve.batch_buckets))
        self.kv_bytes_per_device = per_device

    # ------------------------------------------------------------------ streams
    def encode_frames(self, frames: Tensor) -> Tensor:
        """Initial frames (n, 3, H, W) in [-1, 1] -> context latents (n, F, C, h, w)."""
        clip = still_clip(frames, self.cfg.frames_per_chunk, self.cfg.vae.stride[0])
        with torch.no_grad():
            return self.vae.encode(clip.to(self.vae.enc_in.weight.device)).float().cpu()

    @locked
    def try_open_stream(self, context_latents: Tensor, seed: int = 0, context_id: int = 0,
                        slo_ms: float | None = None, frames: str | None = None) -> tuple[int | None, str]:
        """Admit a stream starting from context latents (F, C, h, w); (id, "") or (None, reason)."""
        shape = (self.cfg.frames_per_chunk, self.cfg.dit.latent_channels, *self.cfg.latent_hw)
        if tuple(context_latents.shape) != shape:
            raise ValueError(f"context latents must have shape {shape}, got {tuple(context_latents.shape)}")
        # checked here as submit checks the noise: a non-finite context spoils every chunk of its stream
        if not torch.isfinite(context_latents.float()).all():  # as stored: float64 past float32's range is inf
            raise ValueError("context latents are not finite")
        if not 0 <= context_id < self.cfg.dit.num_contexts:
            raise ValueError(f"context_id {context_id} out of range (worldmodel.dit.num_contexts = "
                             f"{self.cfg.dit.num_contexts})")
        frames = frames or self.serve.frames
        if frames not in FRAME_MODES:
            raise ValueError(f"frames must be one of {list(FRAME_MODES)}, got {frames!r}")
        slo = slo_ms if slo_ms is not None else self.serve.slo_interval_ms
        sid = self._next_id
        decision = self.admission.try_admit(sid, None if slo is None else slo / 1e3)
        if not decision.admitted:
            return None, decision.reason
        self._next_id += 1
        slots, window = self.cfg.kv_step_slots, self.cfg.context_chunks
        pages = {rank: StreamPages(ids, slots, window) for rank, ids in decision.pages.items()}
        self.streams[sid] = StreamState(sid, decision.ring, seed, context_id, None if slo is None else slo / 1e3,
                                        frames, pages, decision.pages, context_latents.float().cpu(),
                                        previous_frame=context_latents[-1].float().cpu())
        self.scheduler.add_stream(sid, decision.ring)
        self.scheduler.set_context(sid)
        return sid, ""

    def open_stream(self, context_latents: Tensor, **kwargs) -> int:
        sid, reason = self.try_open_stream(context_latents, **kwargs)
        if sid is None:
            raise AdmissionRefused(reason)
        return sid

    @locked
    def close_stream(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is None:
            return
        self.scheduler.remove_stream(sid)
        self.admission.release(sid, st.raw_pages)

    @locked
    def submit(self, sid: int, actions, noise: Tensor | None = None) -> int:
        """Queue the action chunk (H, action_dim) of the stream's next chunk; returns its index."""
        started = now()
        st = self._live_stream(sid)
        actions = torch.as_tensor(np.asarray(actions, dtype=np.float32))
        if actions.ndim != 2 or actions.shape[1] != self.cfg.dit.action_dim:
            raise ValueError(
                f"stream {sid}: actions must be (H, {self.cfg.dit.action_dim}), got {tuple(actions.shape)}")
        if not torch.isfinite(actions).all():
            raise ValueError(f"stream {sid}: actions are not finite")
        chunk = st.submitted
        last_frame = (chunk + 2) * self.cfg.frames_per_chunk - 1
        if chunk >= self.cfg.max_chunks:
            raise ValueError(f"stream {sid}: chunk {chunk} would reach latent frame {last_frame}, past "
                             f"worldmodel.dit.max_frames ({self.cfg.dit.max_frames})")
        shape = (self.cfg.frames_per_chunk, self.cfg.dit.latent_channels, *self.cfg.latent_hw)
        if noise is None:
            noise = chunk_noise(st.seed, chunk, shape)
        else:  # checked here: a bad one would fail the tick that batches it, and every stream in that batch
            noise = torch.as_tensor(noise).float().cpu()
            if tuple(noise.shape) != shape:
                raise ValueError(f"stream {sid}: noise of chunk {chunk} must have the chunk's latent shape {shape}, "
                                 f"got {tuple(noise.shape)}")
            if not torch.isfinite(noise).all():
                raise ValueError(f"stream {sid}: noise of chunk {chunk} is not finite")
        framed = frame_actions(actions[None], self.cfg.frames_per_chunk, self.cfg.dit.actions_per_frame)[0]
        st.noise[chunk] = noise
        st.actions[chunk] = framed
        st.submitted_at[chunk] = now()
        st.submitted += 1
        self.scheduler.submit(sid)
        self._submit_s += now() - started  # the chunk's host work (noise, action framing): the next tick's share
        return chunk

    @locked
    def poll(self, sid: int) -> ChunkOutput | None:
        """The stream's next finished chunk, or None; a failed stream's outputs first, then StreamFailed."""
        st = self._stream(sid)
        if st.outbox:
            return st.outbox.popleft()
        self._live_stream(sid)
        return None

    def _stream(self, sid: int) -> StreamState:
        if sid not in self.streams:
            raise KeyError(f"stream {sid} is not open")
        return self.streams[sid]

    def _live_stream(self, sid: int) -> StreamState:
        st = self._stream(sid)
        if st.failed is not None:
            raise StreamFailed(f"stream {sid} failed: {st.failed}; it cannot go on: close it and open a new one")
        return st

    # ------------------------------------------------------------------ ticks
    @locked
    @torch.no_grad()
    def tick(self) -> list[ChunkOutput]:
        """Run every stage once over its ready items; returns the chunks finished in this tick. On an
        error, the items of stages that had not run are ready again and the streams whose items ran fail
        (module docstring); then the error is raised."""
        plan = self.scheduler.plan_tick()
        if not plan:
            return []
        tick_start = now()
        stages = [(self.placement.rank_of(ring, stage), items) for (ring, stage), items in plan.items()]
        planned = [item for _, items in stages for item in items]
        try:  # building changes nothing: a failed build gives every item back
            batches = [self._build(rank, items) for rank, items in stages]
        except BaseException:
            self.scheduler.requeue(planned)
            raise
        at_risk: set[int] = set()  # the streams an error now would leave unable to go on
        completed = False  # the scheduler counted every planned item as done
        try:
            timers = []
            for (rank, items), batch in zip(stages, batches, strict=True):
                at_risk.update(item.stream for item in items)
                graphs = self._graphs(rank.rank)
                timers.append((rank, items, self._run_stage(rank, items, batch), self._graphs(rank.rank) != graphs))
            self._synchronize()
            busy = self._observe(timers, tick_start)
            self.last_tick_items = len(planned)
            finished = self.scheduler.complete(planned)
            at_risk = {f.stream for f in finished}  # every item is done; only these chunks' outputs are pending
            completed = True
            outputs = self._deliver(finished)
        except BaseException as error:  # an interrupt leaves the same half-run state
            self._recover(planned, at_risk, error)
            if completed:  # the streams that go on still drop what their finished chunks held
                self._retire([item for item in planned if item.stream not in at_risk])
            raise
        self._retire(planned)
        # what the tick took beyond its busiest device's stages is host work the admission must count too
        # (not a tick that captured a new bucket's graph: its capture is host time no later tick pays)
        if not any(captured for *_, captured in timers):
            host = now() - tick_start - max(busy.values()) + self._submit_s
            self.admission.host_model.observe(len(planned), max(host, 0.0))
        self._submit_s = 0.0
        self.tick_count += 1
        return outputs

    @locked
    def run_until_idle(self, max_ticks: int = 100_000) -> list[ChunkOutput]:
        outputs = []
        for _ in range(max_ticks):
            if self.scheduler.idle():
                return outputs
            outputs += self.tick()
        raise RuntimeError(f"still busy after {max_ticks} ticks")

    def _build(self, rank: VirtualRank, items: list[WorkItem]) -> StageBatch:
        runner = self.runners[rank.rank]
        return self.builder.build(rank, runner.first, runner.last, items, self.streams, runner.device)

    def _run_stage(self, rank: VirtualRank, items: list[WorkItem], batch: StageBatch):
        runner = self.runners[rank.rank]
        timer = Timer(runner.device)
        out = runner.run(batch)
        timer.stop()
        self._route(rank, runner, items, out)
        return timer

    def _observe(self, timers: list, tick_start: float) -> dict[str, float]:
        """Feed the stage times to the tick models (and the timeline); returns each device's busy seconds."""
        busy: dict[str, float] = {}
        for rank, items, timer, captured in timers:
            start, end = timer.result()
            if not captured:  # a capture's run is no later tick's time (round 31's 72-140 ms intercepts)
                self.tick_models[rank.rank].observe(len(items), end - start)
            busy[rank.device] = busy.get(rank.device, 0.0) + end - start
            if self.serve.record_timeline:
                self.timeline.append(TickRecord(self.tick_count, rank.rank, rank.device,
                                                [(i.stream, i.chunk, i.step) for i in items],
                                                start - tick_start, end - tick_start))
        return busy

    def _recover(self, planned: list[WorkItem], at_risk: set[int], error: BaseException) -> None:
        """After a tick raised: the planned items of the other streams had not run (or are done), so they
        are ready again; a stream in `at_risk` ran an item that may have overwritten K/V it reads itself, or
        lost a finished chunk's output, so it fails instead of waiting forever for work never planned again."""
        self.scheduler.requeue(item for item in planned if item.stream not in at_risk)
        for sid in sorted(at_risk):
            st = self.streams.get(sid)
            if st is None or st.failed is not None:
                continue
            st.failed = f"tick {self.tick_count} raised {type(error).__name__}: {error}"
            st.hidden.clear()
            self.scheduler.remove_stream(sid)  # never planned again; its pages stay reserved until close_stream

    def _route(self, rank: VirtualRank, runner: StageRunner, items: list[WorkItem], out: Tensor) -> None:
        if not runner.first:  # the hidden states the previous stage sent are consumed now
            for item in items:
                self.streams[item.stream].hidden.pop((item.position, item.step, rank.stage), None)
        if runner.last:
            new = out.clone()
            for i, item in enumerate(items):
                if not item.is_prefill:
                    self.streams[item.stream].latents[item.position] = new[i]
        else:
            nxt = self.placement.rank_of(rank.ring, rank.stage + 1)
            rows = out.to(nxt.device, copy=True)
            for i, item in enumerate(items):
                self.streams[item.stream].hidden[(item.position, item.step, rank.stage + 1)] = rows[i]
        if self.cfg.kv_schedule == "noisy":
            pool = self.pools[rank.rank]
            for item in items:
                if item.is_prefill:  # every step slot starts from the same clean context K/V
                    table = self.streams[item.stream].pages[rank.rank].table
                    for slot in table[1:]:
                        pool.copy_page(table[0][0], slot[0])

    def _graphs(self, rank: int) -> int:
        return len(self.runners[rank].captured)

    def _synchronize(self) -> None:
        for device in self.placement.devices:
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)

    def _deliver(self, finished: list[ChunkFinished]) -> list[ChunkOutput]:
        if not finished:
            return []
        states = [self.streams[f.stream] for f in finished]
        latents = torch.stack([st.latents[f.chunk + 1] for f, st in zip(finished, states, strict=True)])
        head_device = self.readout.net[0].weight.device
        latents = latents.to(head_device)
        frames = self._decode(states, latents)
        readout = read_chunk(self.readout, latents, frames, self.reward_fn)
        outputs, stamp = [], now()
        cpu_latents = latents.float().cpu()
        for i, (f, st) in enumerate(zip(finished, states, strict=True)):
            out = ChunkOutput(f.stream, f.chunk, cpu_latents[i], float(readout.success_prob[i]),
                              readout.state[i].cpu().numpy(), self._frames_for(st, frames, i),
                              st.submitted_at.get(f.chunk, stamp), stamp)
            st.previous_frame = cpu_latents[i, -1]
            st.outbox.append(out)
            outputs.append(out)
        return outputs

    def _decode(self, states: list[StreamState], latents: Tensor) -> Tensor | None:
        if all(st.frames == "none" for st in states) and self.reward_fn is None:
            return None
        device = self.vae.enc_in.weight.device
        previous = torch.stack([st.previous_frame for st in states]).to(device)
        return self.vae.decode(latents.to(device), previous).float().cpu()

    @staticmethod
    def _frames_for(st: StreamState, frames: Tensor | None, i: int) -> Tensor | None:
        if frames is None or st.frames == "none":
            return None
        return frames[i] if st.frames == "all" else frames[i, -1:]

    def _retire(self, executed: list[WorkItem]) -> None:
        """Forget what a chunk needs no more once its last pass left the last stage."""
        passes = self.cfg.passes_per_chunk
        for item in executed:
            st = self.streams.get(item.stream)
            last = item.stage == self.placement.ring_sizes[st.ring] - 1 if st else False
            if st is None or not last or item.is_prefill or item.step != passes - 1:
                continue
            st.latents.pop(item.position, None)
            st.actions.pop(item.chunk, None)
            st.noise.pop(item.chunk, None)
            st.submitted_at.pop(item.chunk, None)

    # ------------------------------------------------------------------ measurement
    @torch.no_grad()
    @locked
    def calibrate(self, batch_sizes: tuple[int, ...] = (1, 2, 4), repeats: int = 2) -> dict[int, tuple[float, float]]:
        """Time every stage on synthetic batches (sentinel pages only) to fit the tick models
        before admitting streams with SLOs; returns {rank: (a, b) seconds}. Each batch size runs once untimed
        first: its first run captures the bucket's CUDA graph, which no later tick pays."""
        for r in self.placement.ranks:
            runner = self.runners[r.rank]
            for n in batch_sizes:
                batch = self._synthetic_batch(runner, n)
                runner.run(batch)
                self._synchronize()
                for _ in range(repeats):
                    timer = Timer(runner.device)
                    runner.run(batch)
                    timer.stop()
                    self._synchronize()
                    start, end = timer.result()
                    self.tick_models[r.rank].observe(n, end - start)
        return {rank: (m.a, m.b) for rank, m in self.tick_models.items()}

    def _synthetic_batch(self, runner: StageRunner, n: int) -> StageBatch:
        cfg, d = self.cfg, self.cfg.dit
        latent_shape = (n, cfg.frames_per_chunk, d.latent_channels, *cfg.latent_hw)
        return StageBatch(
            t=torch.full((n,), 500.0), dt=torch.zeros(n),
            actions_pf=torch.zeros(n, cfg.frames_per_chunk, d.actions_per_frame * (d.action_dim + 1)),
            frame0=torch.full((n,), cfg.frames_per_chunk, dtype=torch.long), ctx_ids=torch.zeros(n, dtype=torch.long),
            read_pages=torch.zeros(n, cfg.context_chunks, dtype=torch.long),
            write_pages=torch.full((n,), DISCARD, dtype=torch.long),
            latents=torch.zeros(latent_shape) if (runner.first or runner.last) else None,
            hidden=None if runner.first else torch.zeros(n, cfg.chunk_tokens, d.width, dtype=runner.model.dtype),
        ).to(runner.device)
