"""Pipeline mode of the world-model benchmark: one ring of G stages over G devices (issue 14).

    python -m experiments.bench_worldmodel worldmodel.preset=wan1_3b bench.mode=pipeline
    python -m experiments.bench_worldmodel bench.mode=pipeline bench.gpu_counts=[1,2,3]   # CPU: G CPU ranks

For each G in bench.gpu_counts (those the machine has): the blocks are cut by measured stage
times (`balanced_split` on per-block times and the first/last stages' extra work, measured at
the batch a full single-stream pipeline gives each stage: K items), then
- one stream with actions sent ahead (passes x G chunks): output interval p50 / p99; once the
  pipeline is full a chunk leaves every tick, so the interval is the slowest stage's time;
- S = bench.pipeline_streams closed-loop streams with admission control under an SLO (the tick
  models calibrated on synthetic batches first): chunks/s, intervals, streams refused + reasons;
- the same latents as the sequential reference for a fixed seed (bf16 difference stated).
The largest G's schedule is recorded and drawn (bench.schedule_png).
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch

from worldmodels.admission import TickTimeModel
from worldmodels.bench_tools import block_times, run_closed_loop, synchronize
from worldmodels.config import WorldModelConfig
from worldmodels.functional import frame_actions
from worldmodels.model import build_model
from worldmodels.reference import SequentialStream
from worldmodels.serve import WorldModelServer
from worldmodels.serve_config import ServeConfig
from worldmodels.split import balanced_split, equal_split, stage_times
from worldmodels.vae import build_vae


def devices_for(count: int, device: torch.device) -> list[str] | None:
    if device.type == "cuda":
        return [f"cuda:{i}" for i in range(count)] if count <= torch.cuda.device_count() else None
    return ["cpu"] * count


@torch.no_grad()
def extra_times(server: WorldModelServer, n: int, repeats: int = 3) -> tuple[float, float]:
    """Seconds of the first stage's extra work (patch embedding, conditioning) and the last's
    (head, Euler update) for n items."""
    model = server.runners[0].model
    cfg = model.cfg
    latents = torch.zeros(n, cfg.frames_per_chunk, cfg.dit.latent_channels, *cfg.latent_hw, device=model.device)
    t = torch.full((n,), 500.0, device=model.device)
    pf = frame_actions(torch.zeros(n, 1, cfg.dit.action_dim), cfg.frames_per_chunk,
                       cfg.dit.actions_per_frame).to(model.device)
    x = torch.zeros(n, cfg.chunk_tokens, cfg.dit.width, device=model.device, dtype=model.dtype)

    def best(fn) -> float:
        out = float("inf")
        for _ in range(repeats):
            synchronize(model.device)
            start = time.perf_counter()
            fn()
            synchronize(model.device)
            out = min(out, time.perf_counter() - start)
        return out

    first = best(lambda: (model.embed(latents), model.conditioning(t, pf)))
    e, _ = model.conditioning(t, pf)
    last = best(lambda: model.readout(x, e, cfg.frames_per_chunk) * 0.1 + latents)
    return first, last


def measured_split(cfg: WorldModelConfig, model, vae, devices: list[str], n: int) -> tuple[list[int], dict]:
    probe = WorldModelServer(cfg, ServeConfig(rings=[[devices[0]]], max_streams=1), model=model, vae=vae)
    times = block_times(probe.runners[0], n)
    first, last = extra_times(probe, n)
    del probe
    stages = len(devices)
    extra = [0.0] * stages
    extra[0] += first
    extra[-1] += last
    split = balanced_split(times, stages, extra)
    equal = equal_split(len(times), stages)
    info = {"block_ms": [t * 1e3 for t in times], "first_extra_ms": first * 1e3, "last_extra_ms": last * 1e3,
            "split": split, "stage_ms": [t * 1e3 for t in stage_times(times, split, extra)],
            "equal_split_stage_ms": [t * 1e3 for t in stage_times(times, equal, extra)]}
    return [b - a for a, b in split], info


@torch.no_grad()
def parity(server: WorldModelServer, model, chunks: int = 3, seed: int = 11) -> dict:
    cfg = server.cfg
    shape = (cfg.frames_per_chunk, cfg.dit.latent_channels, *cfg.latent_hw)
    context = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    actions = [torch.rand(cfg.chunk_actions, cfg.dit.action_dim, generator=torch.Generator().manual_seed(seed + c))
               for c in range(chunks)]
    sid = server.open_stream(context, seed=seed)
    outs = []
    for a in actions:
        server.submit(sid, a)
        while (out := server.poll(sid)) is None:
            server.tick()
        outs.append(out.latents)
    server.close_stream(sid)
    ref = SequentialStream(model, seed=seed)
    ref.prefill(context)
    diffs = []
    for a, out in zip(actions, outs, strict=True):
        expected = ref.step(a).float().cpu()
        diffs.append({"max_abs": float((out - expected).abs().max()),
                      "rel_l2": float((out - expected).norm() / expected.norm())})
    return {"chunks": diffs, "dtype": cfg.dtype}


def model_ms(model: TickTimeModel) -> dict:
    """A tick-time model in ms: its least-squares line and the measured points it predicts through."""
    return {"line": [model.a * 1e3, model.b * 1e3], "points": [[n, t * 1e3] for n, t in model.points]}


def run_pipeline(cfg: WorldModelConfig, bench, device: torch.device) -> tuple[dict, dict]:
    graphs = device.type == "cuda" if bench.cuda_graphs is None else bench.cuda_graphs
    started = time.perf_counter()
    model = build_model(cfg, device)
    vae = build_vae(cfg, device)
    passes = cfg.passes_per_chunk
    payload = {"worldmodel": cfg.to_dict(), "bench": dataclasses.asdict(bench), "runs": {}, "unavailable": []}
    slo = bench.slo_ms
    timeline_owner = None
    counts = sorted(bench.gpu_counts)
    for g in counts:
        devices = devices_for(g, device)
        if devices is None or g > cfg.dit.num_blocks or time.perf_counter() - started > bench.time_budget_s:
            payload["unavailable"].append(g)
            continue
        split, split_info = (measured_split(cfg, model, vae, devices, passes) if bench.rebalance
                             else ([b - a for a, b in equal_split(cfg.dit.num_blocks, g)], {}))
        serve = ServeConfig(rings=[devices], block_split=[split], max_streams=max(bench.pipeline_streams),
                            max_batch=max(bench.pipeline_streams), cuda_graphs=graphs,
                            record_timeline=g == counts[-1])
        server = WorldModelServer(cfg, serve, model=model, vae=vae)
        run = {"devices": devices, "block_split": split, "split": split_info}
        single = run_closed_loop(server, 1, bench.warmup_chunks, bench.chunks_per_stream * 2, passes * g)
        run["single_stream"] = single.to_dict()
        server.calibrate(batch_sizes=(1, 8, 32), repeats=2)
        run["tick_models_ms"] = {r: model_ms(m) for r, m in server.tick_models.items()}
        run["streams"] = {}
        for s in bench.pipeline_streams:
            result = run_closed_loop(server, s, bench.warmup_chunks, bench.chunks_per_stream, 1, slo_ms=slo,
                                     spread_ticks=passes * g)
            run["streams"][str(s)] = result.to_dict()
            if slo is None and g == counts[0] and s == bench.pipeline_streams[0] and result.interval_ms_p50:
                slo = 1.5 * result.interval_ms_p50  # SLO for the rest: 1.5 x the first interval measured
                run["slo_ms_set_here"] = slo
        run["tick_models_end_ms"] = {r: model_ms(m) for r, m in server.tick_models.items()}
        run["host_model_ms"] = model_ms(server.admission.host_model)  # by items a tick, learnt from the ticks above
        run["parity"] = parity(server, model)
        payload["runs"][str(g)] = run
        print(f"G={g}: split {split}, single-stream interval p50 {single.interval_ms_p50:.1f} ms, "
              + ", ".join(f"S={k}: {v['chunks_per_s']:.1f} chunks/s, {len(v['refused'])} refused"
                          for k, v in run["streams"].items()))
        if serve.record_timeline:
            timeline_owner = server
        else:
            del server
            gc.collect()
    payload["slo_ms"] = slo
    if timeline_owner is not None and bench.schedule_png:
        from worldmodels.schedule_plot import plot_timeline

        records = [r for r in timeline_owner.timeline if r.tick < 60]
        plot_timeline(records, timeline_owner.placement.ring_sizes, bench.schedule_png,
                      f"{cfg.name}, {len(timeline_owner.placement.ranks)} stages, first 60 ticks", passes)
        payload["schedule_png"] = bench.schedule_png
    payload["wall_s"] = time.perf_counter() - started
    return payload, summarize(payload)


def summarize(p: dict) -> dict:
    runs = p["runs"]
    out: dict = {"model": p["worldmodel"]["name"], "gpu_counts": [int(g) for g in runs], "slo_ms": p["slo_ms"],
                 "unavailable": p["unavailable"]}
    for g, run in runs.items():
        out[f"interval_ms_g{g}"] = run["single_stream"]["interval_ms_p50"]
        out[f"interval_ms_p99_g{g}"] = run["single_stream"]["interval_ms_p99"]
        for s, r in run["streams"].items():
            out[f"chunks_per_s_g{g}_s{s}"] = r["chunks_per_s"]
            out[f"interval_ms_g{g}_s{s}"] = r["interval_ms_p50"]
            out[f"refused_g{g}_s{s}"] = len(r["refused"])
            out[f"interval_pred_ms_g{g}_s{s}"] = r.get("predicted_interval_ms")
        out[f"parity_rel_l2_g{g}"] = max(c["rel_l2"] for c in run["parity"]["chunks"])
    if "1" in runs and runs:
        top = str(max(int(g) for g in runs))
        one, many = out.get("interval_ms_g1"), out.get(f"interval_ms_g{top}")
        out["interval_ratio_top_vs_1"] = many / one if one and many else None
    return out
