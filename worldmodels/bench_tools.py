"""Measurement helpers of the world-model benchmark (experiments/bench_worldmodel.py).

Every timing synchronises the device (CUDA events or a synchronize before reading the clock);
medians after warm-up. Nothing here asserts a speed.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from worldmodels.baselines import regenerate_chunk
from worldmodels.functional import chunk_noise
from worldmodels.kvpool import DISCARD
from worldmodels.model import CausalWanDiT
from worldmodels.reference import SequentialStream
from worldmodels.serve import WorldModelServer
from worldmodels.stage import StageBatch, StageRunner
from worldmodels.vae import SmallCausalVAE

GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|aten::addmm|aten::mm$|aten::bmm", re.IGNORECASE)
NOT_GEMM = re.compile(r"fmha|flash|attn|attention|softmax|sdpa|fprop", re.IGNORECASE)


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclass
class StreamRun:
    streams: int
    measured_chunks: int
    elapsed_s: float
    chunks_per_s: float
    interval_ms_p50: float | None
    interval_ms_p99: float | None
    interval_ms_mean: float | None
    ticks: int
    tick_ms_median: float | None
    items_per_tick_median: float | None
    refused: list[str]
    # the admission's output interval for the admitted load, the ring's worst, when the last stream was let in
    predicted_interval_ms: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def run_closed_loop(server: WorldModelServer, num_streams: int, warmup_chunks: int, chunks: int,
                    lookahead: int = 1, seed: int = 0, slo_ms: float | None = None, spread_ticks: int = 0,
                    on_tick: Callable[[], None] | None = None) -> StreamRun:
    """S streams, each submitting its next action chunk as soon as it is `lookahead` chunks
    ahead of its outputs (lookahead 1: a closed loop, the policy answering at once). Stream i
    opens at tick floor(i * spread_ticks / S): spread over a pipeline's cycle (passes x stages
    ticks), closed-loop streams keep distinct phases, so every stage has work every tick (the
    admission does not count on it: it predicts streams in phase, worldmodels/admission.py).
    Measures the chunks finished after every stream's warm-up chunks: aggregate rate and
    per-stream output intervals."""
    cfg = server.cfg
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.frames_per_chunk, cfg.dit.latent_channels, *cfg.latent_hw)
    total = warmup_chunks + chunks
    contexts = [torch.randn(shape, generator=gen) for _ in range(num_streams)]
    opens = [i * spread_ticks // num_streams for i in range(num_streams)]
    actions = torch.rand(total, cfg.chunk_actions, cfg.dit.action_dim, generator=gen) * 2 - 1
    ids, refused, sent, times = [], [], {}, {}
    tick_ms, items = [], []
    ticks, predicted = 0, None
    while len(ids) + len(refused) < num_streams or any(len(times[sid]) < total for sid in ids):
        for i in range(len(ids) + len(refused), num_streams):
            if opens[i] > ticks:
                break
            sid, reason = server.try_open_stream(contexts[i], seed=seed + i, slo_ms=slo_ms)
            if sid is None:
                refused.append(reason)
            else:
                ids.append(sid)
                sent[sid], times[sid] = 0, []
                predicted = max(server.admission.predicted_interval(g)
                                for g in range(len(server.placement.ring_sizes))) * 1e3
        for sid in ids:
            while sent[sid] < total and sent[sid] - len(times[sid]) < lookahead:
                server.submit(sid, actions[sent[sid]])
                sent[sid] += 1
        start = time.perf_counter()
        outputs = server.tick()
        tick_ms.append((time.perf_counter() - start) * 1e3)
        items.append(server.last_tick_items)
        ticks += 1
        for out in outputs:
            times[out.stream].append(out.finished_at)
        if on_tick is not None:
            on_tick()
    for sid in ids:
        server.close_stream(sid)
    run = summarize(num_streams, times, warmup_chunks, ticks, tick_ms, items, refused)
    run.predicted_interval_ms = predicted
    return run


def summarize(num_streams, times, warmup_chunks, ticks, tick_ms, items, refused) -> StreamRun:
    starts = [t[warmup_chunks - 1] for t in times.values() if len(t) >= warmup_chunks and warmup_chunks > 0]
    t0 = min(starts) if starts else min((t[0] for t in times.values() if t), default=0.0)
    measured = [x for t in times.values() for c, x in enumerate(t) if c >= warmup_chunks and x > t0]
    t1 = max(measured, default=t0)
    elapsed = t1 - t0
    intervals = [(t[c] - t[c - 1]) * 1e3 for t in times.values() for c in range(max(warmup_chunks, 1), len(t))]
    return StreamRun(num_streams, len(measured), elapsed, len(measured) / elapsed if elapsed > 0 else 0.0,
                     percentile(intervals, 50), percentile(intervals, 99),
                     statistics.fmean(intervals) if intervals else None, ticks,
                     statistics.median(tick_ms) if tick_ms else None,
                     statistics.median([i for i in items if i]) if any(items) else None, refused)


@torch.no_grad()
def time_sequential(model: CausalWanDiT, chunks: int, warmup: int, schedule: str = "clean", seed: int = 0) -> dict:
    """The plain per-stream loop (Self-Forcing's clean re-cache by default), batch 1, eager."""
    cfg = model.cfg
    stream = SequentialStream(model, seed=seed, schedule=schedule)
    shape = (cfg.frames_per_chunk, cfg.dit.latent_channels, *cfg.latent_hw)
    stream.prefill(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    per_chunk = []
    actions = torch.rand(cfg.chunk_actions, cfg.dit.action_dim) * 2 - 1
    for c in range(warmup + chunks):
        synchronize(model.device)
        start = time.perf_counter()
        stream.step(actions)
        synchronize(model.device)
        if c >= warmup:
            per_chunk.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(per_chunk)
    return {"schedule": schedule, "chunk_ms_median": median, "chunk_ms_all": per_chunk,
            "chunks_per_s": 1e3 / median}


@torch.no_grad()
def time_regeneration(model: CausalWanDiT, vae: SmallCausalVAE, calls: int, warmup: int, cond_frames: int,
                      new_frames: int, steps: int, seed: int = 0) -> dict:
    """RLinf-style whole-clip regeneration per env, batch 1; rate in our chunks (frames_per_chunk
    new latent frames) per second."""
    cfg = model.cfg
    stride = cfg.vae.stride[0]
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    video = (torch.rand(1, 1 + stride * (cond_frames - 1), 3, cfg.height, cfg.width, generator=gen) * 2 - 1)
    video = video.to(device, vae.enc_in.weight.dtype)
    actions = torch.rand(1, new_frames * cfg.dit.actions_per_frame, cfg.dit.action_dim, generator=gen) * 2 - 1
    noise = chunk_noise(seed, 0, (1, new_frames, cfg.dit.latent_channels, *cfg.latent_hw)).to(device)
    per_call = []
    for c in range(warmup + calls):
        synchronize(device)
        start = time.perf_counter()
        regenerate_chunk(model, vae, video, actions, new_frames, steps, cfg.timestep_shift, noise)
        synchronize(device)
        if c >= warmup:
            per_call.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(per_call)
    latent_frames_per_s = new_frames * 1e3 / median
    return {"call_ms_median": median, "call_ms_all": per_call, "condition_latent_frames": cond_frames,
            "new_latent_frames": new_frames, "steps": steps, "latent_frames_per_s": latent_frames_per_s,
            "chunks_per_s": latent_frames_per_s / cfg.frames_per_chunk}


def steady_batch(runner: StageRunner, n: int) -> StageBatch:
    """n items with full K/V windows (the sentinel page) at a mid timestep: a steady-state tick."""
    cfg = runner.model.cfg
    d = cfg.dit
    return StageBatch(
        t=torch.full((n,), 500.0), dt=torch.full((n,), -0.1),
        actions_pf=torch.zeros(n, cfg.frames_per_chunk, d.actions_per_frame * (d.action_dim + 1)),
        frame0=torch.full((n,), 3 * cfg.frames_per_chunk, dtype=torch.long), ctx_ids=torch.zeros(n, dtype=torch.long),
        read_pages=torch.zeros(n, cfg.context_chunks, dtype=torch.long),
        write_pages=torch.full((n,), DISCARD, dtype=torch.long),
        latents=torch.zeros(n, cfg.frames_per_chunk, d.latent_channels, *cfg.latent_hw)
        if (runner.first or runner.last) else None,
        hidden=None if runner.first else torch.zeros(n, cfg.chunk_tokens, d.width, dtype=runner.model.dtype),
    ).to(runner.device)


@torch.no_grad()
def profile_gemms(runner: StageRunner, n: int) -> dict:
    """Kernel time of one eager steady-state stage pass over n items, split into GEMM kernels and
    the rest (torch.profiler). The GEMMs are the same kernels the graphs replay."""
    from torch.profiler import ProfilerActivity, profile

    batch = steady_batch(runner, n)
    runner.forward(batch)
    synchronize(runner.device)
    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        runner.forward(batch)
        synchronize(runner.device)
    gemm = other = 0.0
    names: dict[str, float] = {}
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = (event.device_time if cuda else event.self_cpu_time_total) / 1e6
        if seconds <= 0:
            continue
        if GEMM_KERNEL.search(event.name) and not NOT_GEMM.search(event.name):
            gemm += seconds
            names[event.name[:60]] = names.get(event.name[:60], 0.0) + seconds
        else:
            other += seconds
    top = sorted(names.items(), key=lambda kv: -kv[1])[:5]
    return {"items": n, "gemm_s": gemm, "other_s": other, "gemm_share": gemm / (gemm + other) if gemm else 0.0,
            "top_gemm_kernels": top}


@torch.no_grad()
def block_times(runner: StageRunner, n: int, repeats: int = 3) -> list[float]:
    """Seconds per block of one eager pass over n items (for balanced_split)."""
    model = runner.model
    batch = steady_batch(runner, n)
    x = model.embed(batch.latents) if batch.latents is not None else batch.hidden
    _, e0 = model.conditioning(batch.t, batch.actions_pf)
    rope = model.rope.cos_sin(batch.frame0, model.dtype, runner.device)
    context = model.context_kv()
    out = []
    for j, index in enumerate(range(*runner.blocks)):
        ck, cv = context[index]
        best = float("inf")
        for _ in range(repeats):
            synchronize(runner.device)
            start = time.perf_counter()
            past = runner.pool.gather(j, batch.read_pages)
            model.blocks[index](x, e0, rope, (ck[batch.ctx_ids], cv[batch.ctx_ids]), past)
            synchronize(runner.device)
            best = min(best, time.perf_counter() - start)
        out.append(best)
    return out
