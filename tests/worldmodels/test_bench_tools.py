"""The benchmark's pieces on the tiny model (CPU): the regeneration baseline, closed-loop runs,
GEMM profiling, block timing for the split, and both benchmark modes end to end (small)."""

from __future__ import annotations

import pytest
import torch

from experiments.bench_worldmodel import BenchWorldModelConfig, run_single
from worldmodels.baselines import regenerate_chunk
from worldmodels.bench_pipeline import run_pipeline
from worldmodels.bench_tools import block_times, profile_gemms, run_closed_loop, summarize
from worldmodels.config import WorldModelConfig
from worldmodels.flops import block_parameters, pass_flops
from worldmodels.model import build_model
from worldmodels.serve import WorldModelServer
from worldmodels.serve_config import ServeConfig
from worldmodels.vae import build_vae

CFG = WorldModelConfig.preset("tiny")


def test_regeneration_baseline_decodes_the_new_frames():
    model, vae = build_model(CFG), build_vae(CFG)
    video = torch.rand(1, 5, 3, 32, 32) * 2 - 1
    actions = torch.rand(1, 8, 7)
    noise = torch.randn(1, 2, 4, 4, 4)
    frames = regenerate_chunk(model, vae, video, actions, 2, 3, 5.0, noise)
    assert frames.shape == (1, 8, 3, 32, 32)
    torch.testing.assert_close(frames, regenerate_chunk(model, vae, video, actions, 2, 3, 5.0, noise))
    other = regenerate_chunk(model, vae, -video, actions, 2, 3, 5.0, noise)
    assert (other - frames).abs().max() > 1e-4  # the condition frames matter


def test_closed_loop_run_counts_and_spreads():
    server = WorldModelServer(CFG, ServeConfig(rings=[["cpu", "cpu"]], max_streams=4))
    run = run_closed_loop(server, 4, warmup_chunks=1, chunks=2, spread_ticks=8)
    assert run.measured_chunks == 8 and not run.refused
    assert run.interval_ms_p50 > 0 and run.chunks_per_s > 0
    assert not server.streams  # closed afterwards


def test_summarize_hand_example():
    times = {0: [1.0, 2.0, 3.0], 1: [1.5, 2.5, 3.5]}
    run = summarize(2, times, 1, ticks=7, tick_ms=[1.0, 3.0], items=[0, 2, 2], refused=[])
    # after warm-up (from t = 1.0): 4 chunks over 2.5 s; intervals all 1 s
    assert run.measured_chunks == 4 and run.chunks_per_s == pytest.approx(4 / 2.5)
    assert run.interval_ms_p50 == pytest.approx(1000.0) and run.tick_ms_median == 2.0


def test_profile_and_block_times():
    server = WorldModelServer(CFG, ServeConfig())
    prof = profile_gemms(server.runners[0], 4)
    assert prof["gemm_s"] > 0 and 0 < prof["gemm_share"] < 1
    times = block_times(server.runners[0], 2)
    assert len(times) == CFG.dit.num_blocks and min(times) > 0


def test_flops_and_parameter_count():
    model = build_model(CFG)
    blocks = sum(p.numel() for p in model.blocks.parameters())
    assert block_parameters(CFG) == blocks
    f = pass_flops(CFG)
    d, ffn, tokens = 32, 64, 12
    assert f.block_gemm == 2 * tokens * (6 * d * d + 2 * d * ffn) * 2
    assert f.attention == 2 * tokens * 4 * d * (3 * tokens + 4)


def test_benchmark_modes_end_to_end():
    bench = BenchWorldModelConfig(streams=[1, 2], warmup_chunks=1, chunks_per_stream=1, sequential_chunks=1,
                                  regenerate_calls=1, gpu_counts=[1, 2], pipeline_streams=[2])
    _, summary = run_single(CFG, bench, torch.device("cpu"))
    for key in ("ours_chunks_per_s_s64", "ours_interval_ms_s1", "sequential_chunks_per_s", "regenerate_chunks_per_s",
                "speedup_s64", "mfu_s64"):
        assert key in summary
    assert summary["largest_s"] == 2 and summary["ours_chunks_per_s_s64"] > 0
    _, summary = run_pipeline(CFG, bench, torch.device("cpu"))
    assert summary["gpu_counts"] == [1, 2] and summary["parity_rel_l2_g2"] < 1e-5


def test_graph_failures_fall_back_to_eager_and_are_recorded():
    from experiments.bench_worldmodel import with_graph_fallback

    def run(graphs: bool) -> dict:
        if graphs:
            raise RuntimeError("capture failed: operation not permitted when stream is capturing")
        return {"eager": True}

    payload: dict = {}
    assert with_graph_fallback(run, True, payload, "ours") == {"eager": True}
    assert "operation not permitted" in payload["graph_errors"]["ours"]
    assert with_graph_fallback(run, False, {}, "ours") == {"eager": True}
