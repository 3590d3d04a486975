"""World-model serving benchmark: our server vs the sequential loop and whole-clip regeneration.

    python -m experiments.bench_worldmodel                                  # CPU smoke run (tiny, fp32, eager)
    python -m experiments.bench_worldmodel worldmodel.preset=wan1_3b        # one GPU: bf16, CUDA graphs
    python -m experiments.bench_worldmodel worldmodel.preset=wan1_3b bench.mode=pipeline   # 2..8 GPUs

Single mode, same model weights, one run: (a) the plain per-stream loop with Self-Forcing's clean
re-cache at batch 1 (eager, and through our stage runner with graphs: the faster counts as the
baseline); (b) RLinf-style whole-clip regeneration per env at batch 1; ours: S = 1, 4, 16, 64
closed-loop streams through the server (noisy per-step K/V, all ready items of a stage batched
per block, CUDA graphs per batch bucket): aggregate chunks/s and per-stream output intervals
(p50, p99); MFU of the block GEMMs (GEMM-kernel time of a profiled steady-state pass) and of the
whole tick; an admission-control demonstration with the measured tick model.
Pipeline mode (several GPUs): worldmodels/bench_pipeline.py.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
from dataclasses import dataclass, field

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from common.devices import auto_device
from experiments.results import measured_or_recorded, write_result
from worldmodels.bench_tools import profile_gemms, run_closed_loop, time_regeneration, time_sequential
from worldmodels.config import WorldModelConfig
from worldmodels.flops import block_parameters, kv_bytes, pass_flops
from worldmodels.model import build_model
from worldmodels.serve import WorldModelServer
from worldmodels.serve_config import ServeConfig
from worldmodels.vae import build_vae

SPEC_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense, per the vendors' data sheets


@dataclass
class BenchWorldModelConfig:
    mode: str = "single"
    device: str = "auto"
    streams: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    warmup_chunks: int = 2
    chunks_per_stream: int = 4
    lookahead: int = 1
    sequential_chunks: int = 6
    regenerate_calls: int = 3
    regen_condition_frames: int = 2
    regen_new_frames: int = 2
    regen_steps: int = 5
    cuda_graphs: bool | None = None
    time_budget_s: float = 240.0
    profile: bool = True
    peak_tflops: float | None = None
    cpu_threads: int = 1
    gpu_counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    pipeline_streams: list[int] = field(default_factory=lambda: [8, 32, 64])
    slo_ms: float | None = None
    rebalance: bool = True
    schedule_png: str | None = None
    out_dir: str | None = None
    commit: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("single", "pipeline"):
            raise ValueError(f"bench.mode must be 'single' or 'pipeline', got {self.mode!r}")
        if not self.streams or min(self.streams) < 1:
            raise ValueError(f"bench.streams must be positive stream counts, got {self.streams}")
        for name in ("warmup_chunks", "chunks_per_stream", "lookahead", "sequential_chunks", "regenerate_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench.{name} must be >= 1, got {getattr(self, name)}")


def model_config(raw, device: torch.device) -> WorldModelConfig:
    cfg = WorldModelConfig.from_mapping(raw)
    if device.type == "cpu" and cfg.dtype == "bfloat16":
        cfg = cfg.replace(dtype="float32")  # the CPU smoke run: fp32 (bf16 GEMMs are slow there)
    return cfg


def peak_flops(bench: BenchWorldModelConfig, device: torch.device) -> tuple[float, str, dict | None]:
    ceilings = None
    if device.type == "cuda":
        from profiler.ceilings import measure_ceilings

        c = measure_ceilings(str(device), dtype="bfloat16", matmul_n=8192, copy_mb=1024, repeats=5)
        ceilings = {"matmul_tflops": c.peak_flops / 1e12, "copy_tb_s": c.peak_bytes_per_s / 1e12}
    if bench.peak_tflops:
        return bench.peak_tflops * 1e12, "bench.peak_tflops", ceilings
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in SPEC_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{key} data-sheet bf16 dense", ceilings
        return ceilings["matmul_tflops"] * 1e12, "measured 8192^3 bf16 matmul", ceilings
    from profiler.ceilings import measure_ceilings

    c = measure_ceilings("cpu", dtype="float32", matmul_n=512, copy_mb=64, repeats=3)
    return c.peak_flops, "measured 512^3 fp32 matmul (CPU)", None


def release_memory() -> None:
    """Free what the caller dropped (KV pools, graph pools) before the next server is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sequential_with_graphs(cfg: WorldModelConfig, model, vae, device: torch.device, graphs: bool, chunks: int) -> dict:
    """The sequential loop through our stage runner: one stream, clean re-cache, batch 1."""
    clean = cfg.replace(kv_schedule="clean")
    server = WorldModelServer(clean, ServeConfig(rings=[[str(device)]], max_streams=1, batch_buckets=[1],
                                                 cuda_graphs=graphs), model=model, vae=vae)
    return run_closed_loop(server, 1, 2, chunks).to_dict()


def run_single(cfg: WorldModelConfig, bench: BenchWorldModelConfig, device: torch.device) -> tuple[dict, dict]:
    graphs = device.type == "cuda" if bench.cuda_graphs is None else bench.cuda_graphs
    started = time.perf_counter()
    peak, peak_source, ceilings = peak_flops(bench, device)
    model = build_model(cfg, device)
    vae = build_vae(cfg, device)
    flops = pass_flops(cfg)
    payload: dict = {"worldmodel": cfg.to_dict(), "bench": dataclasses.asdict(bench), "peak_flops": peak,
                     "peak_source": peak_source, "ceilings": ceilings, "block_parameters": block_parameters(cfg),
                     "pass_flops": dataclasses.asdict(flops), "chunk_tokens": cfg.chunk_tokens}
    print(f"world model {cfg.name}: {block_parameters(cfg) / 1e9:.2f}B block parameters, {cfg.chunk_tokens} tokens "
          f"per chunk, {flops.total / 1e12:.3f} TFLOP per pass, {cfg.kv_schedule} KV, window {cfg.context_chunks}")

    # each side's failure is recorded (payload["errors"]) and the others still run: raised, one side's
    # error lost every number of the call (main exits non-zero after writing the JSON)
    # (a) the sequential per-stream loop, clean re-cache, batch 1: eager, and with our graphs
    payload["sequential_eager"] = recorded(payload, "sequential_eager", lambda: time_sequential(
        model, bench.sequential_chunks, 2, "clean"))
    payload["sequential_graphs"] = recorded(payload, "sequential_graphs", lambda: with_graph_fallback(
        lambda g: sequential_with_graphs(cfg, model, vae, device, g, bench.sequential_chunks), graphs, payload,
        "sequential_graphs"))
    release_memory()

    # (b) whole-clip regeneration, RLinf's way
    payload["regenerate"] = recorded(payload, "regenerate", lambda: time_regeneration(
        model, vae, bench.regenerate_calls, 1, bench.regen_condition_frames, bench.regen_new_frames,
        bench.regen_steps))

    # ours
    payload.update(recorded(payload, "ours", lambda: with_graph_fallback(
        lambda g: measure_ours(cfg, bench, model, vae, device, g, started, flops, peak), graphs, payload,
        "ours")) or {"ours": {}})
    release_memory()
    payload["wall_s"] = time.perf_counter() - started
    return payload, summarize(payload)


def recorded(payload: dict, label: str, measure):
    """measure(), or None with its traceback in payload["errors"][label]; the GPU memory freed either way."""
    result = measured_or_recorded(payload, label, measure)
    if result is None:
        release_memory()
    return result


def with_graph_fallback(run, graphs: bool, payload: dict, label: str):
    """run(graphs): with CUDA graphs first; if capture or replay fails, record the traceback and
    run eagerly (a single GPU call must not be lost to one failure)."""
    if not graphs:
        return run(False)
    try:
        return run(True)
    except Exception:  # noqa: BLE001 - recorded in the result, then the eager path
        error = traceback.format_exc()
    print(f"{label}: CUDA graphs failed, running eagerly:\n{error[-1500:]}")
    payload.setdefault("graph_errors", {})[label] = error[-4000:]
    release_memory()  # the failed server's pools go with the finished exception
    return run(False)


def measure_ours(cfg: WorldModelConfig, bench: BenchWorldModelConfig, model, vae, device: torch.device, graphs: bool,
                 started: float, flops, peak: float) -> dict:
    """Our server: S closed-loop streams per entry of bench.streams (1 and the largest first, the
    rest while the time budget lasts), the GEMM profile and the admission demonstration."""
    streams = sorted(bench.streams, key=lambda s: (s != 1, s != max(bench.streams), s))
    serve = ServeConfig(rings=[[str(device)]], max_streams=max(streams), max_batch=max(streams),
                        batch_buckets=sorted(set(streams)), cuda_graphs=graphs)
    server = WorldModelServer(cfg, serve, model=model, vae=vae)
    out: dict = {"kv_pool_bytes": server.kv_bytes_per_device, "kv_bytes_64_streams": kv_bytes(cfg, 64),
                 "ours": {}, "skipped_streams": [], "ours_cuda_graphs": graphs}
    for s in streams:
        if time.perf_counter() - started > bench.time_budget_s:
            out["skipped_streams"].append(s)
            print(f"S={s}: skipped (time budget {bench.time_budget_s} s spent)")
            continue
        run = run_closed_loop(server, s, bench.warmup_chunks, bench.chunks_per_stream, bench.lookahead)
        tick_s = (run.tick_ms_median or 0.0) / 1e3
        run_dict = run.to_dict()
        run_dict["tick_mfu"] = (s * flops.total / tick_s / peak) if tick_s else None
        out["ours"][str(s)] = run_dict
        print(f"S={s}: {run.chunks_per_s:.2f} chunks/s, interval p50 {run.interval_ms_p50:.1f} ms "
              f"p99 {run.interval_ms_p99:.1f} ms, tick {run.tick_ms_median:.1f} ms")
    out["graphs_captured"] = server.runners[0].captured
    if bench.profile:
        big = max(int(k) for k in out["ours"]) if out["ours"] else 1
        try:
            prof = profile_gemms(server.runners[0], big)
            prof["gemm_mfu"] = big * flops.block_gemm / prof["gemm_s"] / peak if prof["gemm_s"] else None
        except Exception:  # noqa: BLE001 - the profiler is optional; the rest of the run stands
            prof = {"error": traceback.format_exc()[-2000:]}
        out["gemm_profile"] = prof
    out["admission"] = admission_demo(server, out["ours"])
    return out


def admission_demo(server: WorldModelServer, ours: dict) -> dict:
    """With the tick model fitted on the runs above: admit streams under an SLO of 1.25 x the
    measured interval of 4 streams until one is refused; report the reason."""
    if "4" not in ours or ours["4"]["interval_ms_p50"] is None:
        return {}
    slo = 1.25 * ours["4"]["interval_ms_p50"]
    shape = (server.cfg.frames_per_chunk, server.cfg.dit.latent_channels, *server.cfg.latent_hw)
    admitted, reason = [], ""
    while len(admitted) < server.serve.max_streams:
        sid, reason = server.try_open_stream(torch.zeros(shape), slo_ms=slo)
        if sid is None:
            break
        admitted.append(sid)
    model = server.tick_models[0]
    for sid in admitted:
        server.close_stream(sid)
    return {"slo_ms": slo, "admitted": len(admitted), "refusal": reason,
            "tick_model_ms": {"a": model.a * 1e3, "b": model.b * 1e3}}


def summarize(p: dict) -> dict:
    """The RESULT line; a side that failed (p["errors"]) has None where its numbers would be."""
    ours = p["ours"]
    big = max((int(k) for k in ours), default=None)
    seq_eager = (p["sequential_eager"] or {}).get("chunks_per_s")
    seq_graphs = (p["sequential_graphs"] or {}).get("chunks_per_s")
    sequential = max((r for r in (seq_eager, seq_graphs) if r is not None), default=None)
    seq_chunk_ms = 1e3 / sequential if sequential else None
    regenerate = (p["regenerate"] or {}).get("chunks_per_s")
    s64 = ours.get("64") or (ours.get(str(big)) if big else None)
    s1 = ours.get("1")
    out = {
        "model": p["worldmodel"]["name"],
        "kv_schedule": p["worldmodel"]["kv_schedule"],
        "largest_s": big,
        "ours_chunks_per_s_s64": s64["chunks_per_s"] if s64 else None,
        "ours_interval_ms_s1": s1["interval_ms_p50"] if s1 else None,
        "ours_interval_ms_p99_s1": s1["interval_ms_p99"] if s1 else None,
        "ours_interval_ms_s64": s64["interval_ms_p50"] if s64 else None,
        "ours_interval_ms_p99_s64": s64["interval_ms_p99"] if s64 else None,
        "sequential_chunks_per_s": sequential,
        "sequential_eager_chunks_per_s": seq_eager,
        "sequential_graphs_chunks_per_s": seq_graphs,
        "regenerate_chunks_per_s": regenerate,
        "speedup_s64": s64["chunks_per_s"] / sequential if s64 and sequential else None,
        "speedup_vs_regenerate_s64": s64["chunks_per_s"] / regenerate if s64 and regenerate else None,
        "interval_ratio_s1": s1["interval_ms_p50"] / seq_chunk_ms if s1 and s1["interval_ms_p50"] and seq_chunk_ms
        else None,
        "mfu_s64": (p.get("gemm_profile") or {}).get("gemm_mfu"),
        "tick_mfu_s64": s64["tick_mfu"] if s64 else None,
        "kv_pool_gb": sum(p["kv_pool_bytes"].values()) / 1e9 if "kv_pool_bytes" in p else None,
        "skipped_streams": p.get("skipped_streams", []),
        "failed": sorted(p.get("errors", {})),
    }
    for key, run in ours.items():
        out[f"ours_chunks_per_s_s{key}"] = run["chunks_per_s"]
        out[f"ours_interval_ms_s{key}"] = run["interval_ms_p50"]
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_worldmodel")
def main(raw: DictConfig) -> None:
    bench = BenchWorldModelConfig(**OmegaConf.to_container(raw.bench, resolve=True))
    device = auto_device(bench.device)
    if device.type == "cpu":
        torch.set_num_threads(bench.cpu_threads)
    cfg = model_config(OmegaConf.to_container(raw.worldmodel, resolve=True), device)
    torch.backends.cuda.matmul.allow_tf32 = True
    if bench.mode == "pipeline":
        from worldmodels.bench_pipeline import run_pipeline

        payload, summary = run_pipeline(cfg, bench, device)
        write_result("bench_worldmodel_pipeline", payload, summary, bench.out_dir, commit=bench.commit, device=device)
        return
    payload, summary = run_single(cfg, bench, device)
    # labelled with the device it ran on (bench.device=cpu on a GPU host is a CPU run)
    write_result("bench_worldmodel", payload, summary, bench.out_dir, commit=bench.commit, device=device)
    if payload.get("errors"):
        raise SystemExit(f"bench_worldmodel: {sorted(payload['errors'])} failed (their tracebacks are in the JSON)")


if __name__ == "__main__":
    main()
