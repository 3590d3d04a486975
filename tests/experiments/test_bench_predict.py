"""The predict benchmark's own logic on CPU: gap metrics, the time budget, the bounded worker,
picking the fastest LeRobot variant, the summary keys, and one tiny end-to-end configuration."""

import time

import pytest
import torch

from experiments import bench_predict as bench_mod
from experiments.bench_predict_common import Budget, BudgetExceeded, time_calls
from experiments.bench_predict_ours import gap_metrics


def test_gap_metrics_hand_computed():
    rollout = torch.tensor([0.0, 1.0, -2.0, 5.0])
    recompute = torch.tensor([0.1, 0.7, -2.0, 5.25])  # diffs 0.1, -0.3, 0, 0.25
    m = gap_metrics(recompute, rollout, clip=0.2)
    assert m["mean_nats"] == pytest.approx((0.1 + 0.3 + 0.0 + 0.25) / 4)
    assert m["max_nats"] == pytest.approx(0.3)
    # ratios e^0.1 = 1.105 (in), e^-0.3 = 0.741 (out), 1 (in), e^0.25 = 1.284 (out)
    assert m["clip_fraction"] == pytest.approx(0.5) and m["chunks"] == 4


def test_time_calls_refuses_what_would_overrun_the_budget():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.05)

    with pytest.raises(BudgetExceeded, match="bench.time_budget_s=0.2"):
        time_calls(slow, torch.device("cpu"), warmup=2, iters=10, budget=Budget(0.2), what="slow side")
    assert len(calls) == 2, "only the warm-up ran: no timed call was started"
    out = time_calls(lambda: 7, torch.device("cpu"), warmup=1, iters=3, budget=Budget(60))
    assert out["output"] == 7 and len(out["ms_all"]) == 3


def _side(ms, actions):
    return {"ms": ms, "actions": actions, "stages": {}}


def test_finalize_quotes_the_fastest_lerobot_variant():
    a = torch.ones(2, 3, 4)
    row = {"batch": 32, "sides": {
        "ours": _side(100.0, a), "ours_fp8": _side(80.0, a * 1.01),
        "lerobot_shipped": _side(500.0, a * 1.1), "lerobot_bf16": _side(400.0, a),
        "lerobot_compiled_reduce-overhead": {"skipped": "timeout: killed after 90 s"},
    }}
    result = {"rows": [row], "lerobot": {}, "dtype": "bfloat16"}
    bench_mod.finalize(result)
    assert row["lerobot_best_variant"] == "lerobot_bf16" and row["lerobot_ms"] == 400.0
    assert row["speedup"] == pytest.approx(4.0) and row["fp8_speedup"] == pytest.approx(5.0)
    assert row["speedup_by_variant"] == pytest.approx({"lerobot_shipped": 5.0, "lerobot_bf16": 4.0})
    assert row["parity_rel_l2"]["lerobot_bf16"] == 0.0
    assert row["parity_rel_l2"]["lerobot_shipped"] == pytest.approx(0.1 / 1.1)
    assert row["fp8_rel_l2"] == pytest.approx(0.01) and row["ours_samples_per_s"] == pytest.approx(320.0)
    assert all("actions" not in s for s in row["sides"].values()), "tensors never reach the JSON"

    summary = bench_mod.summarise({"phyai": result}, Budget(10))
    assert summary["lerobot_variant_b32"] == "lerobot_bf16" and summary["speedup_b32"] == pytest.approx(4.0)
    assert summary["parity_rel_l2"] == 0.0 and summary["fp8_b32_sps"] == pytest.approx(400.0)
    assert summary["skipped_or_failed"] == 1
    assert summary["lerobot_unmeasured_b32"] == ["lerobot_compiled_reduce-overhead"], "the speed-up says what it lacks"
    assert "lerobot_unmeasured_b1" not in summary


def test_config_is_validated_and_full_sweep():
    assert bench_mod.BenchPredictConfig(full_sweep=True).batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="bench.precisions must contain 'bf16'"):
        bench_mod.BenchPredictConfig(precisions=["fp8"])
    with pytest.raises(ValueError, match="bench.lerobot_variants"):
        bench_mod.BenchPredictConfig(lerobot_variants=["fp16"])
    for bad in ([], ["static", "symbolic"]):
        with pytest.raises(ValueError, match=r"bench.lerobot_compile_shapes must list one or both of .*got"):
            bench_mod.BenchPredictConfig(lerobot_compile_shapes=bad)
    with pytest.raises(ValueError, match="bench.lerobot_compile_parallel must be >= 0"):
        bench_mod.BenchPredictConfig(lerobot_compile_parallel=-1)


@pytest.mark.parametrize("bad", ["", "  ", "a_file"])
def test_a_compile_cache_that_is_no_directory_is_refused_before_the_run(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ValueError, match="bench.lerobot_compile_cache_dir must be a directory"):
        bench_mod.BenchPredictConfig(lerobot_compile_cache_dir=bad)
    assert bench_mod.BenchPredictConfig(lerobot_compile_cache_dir=str(tmp_path / "new")).lerobot_compile_cache_dir


def test_tiny_configuration_end_to_end():
    """One LIBERO-shaped configuration of the tiny policy: both precisions, the gap, the summary."""
    from policies.config import PolicyConfig

    bench = bench_mod.BenchPredictConfig(configurations=["libero_rl"], batch_sizes=[2], warmup=1, iters=1,
                                         lerobot=False, gap_batch=2, gap_calls=2, lerobot_compile_modes=[])
    budget, device = Budget(600), torch.device("cpu")
    ceilings = {"matmul_tflops": 1.0, "copy_tb_s": 0.01, "dtype": "float32", "source": "test"}
    result, pending = bench_mod.bench_configuration("libero_rl", PolicyConfig.preset("tiny"), bench, device,
                                                    ceilings, budget)
    bench_mod.finalize(result)
    row = result["rows"][0]
    assert {"ours", "ours_fp8"} <= set(row["sides"]) and row["sides"]["ours_fp8"]["fp8_gemms"] > 0
    assert 0 < row["fp8_rel_l2"] < 0.1 and result["parity_fast_vs_our_reference_rel_l2"] < 1e-5
    summary = bench_mod.summarise({"libero_rl": result}, budget)
    for key in ("libero_best_sps", "fp8_libero_best_sps", "fp8_rel_l2", "fp8_logprob_gap_mean", "fp8_clip_fraction"):
        assert key in summary, key
    assert summary["bf16_logprob_gap_max"] < 1e-4, "fp32 fast rollout vs fp32 plain recompute agree"


def test_our_sides_measure_the_runs_policy_fast_settings_against_the_plain_path(monkeypatch):
    """policy.fast overrides reach the samplers measured, each side records the FastConfig it used, and with
    policy.fast.enabled=true the parity reference is still the plain path (it was the policy's own bf16 fast
    path: fast vs fast). A gap_batch outside batch_sizes leaves its reason in the record."""
    import dataclasses

    from experiments import bench_predict_ours as ours_side
    from policies.config import PolicyConfig

    used = []

    class Spy(ours_side.FastSampler):
        def __init__(self, model, fast):
            used.append(fast)
            super().__init__(model, fast)

    monkeypatch.setattr(ours_side, "FastSampler", Spy)
    overrides = {"gemm": "cublas", "overlap": "off", "pdl": "off", "mlp": "split", "geglu": "cublas"}
    base = PolicyConfig.preset("tiny", fast={"enabled": True, **overrides})  # its fast dtype: bf16 (the default)
    bench = bench_mod.BenchPredictConfig(configurations=["libero_rl"], batch_sizes=[2], precisions=["bf16"], warmup=1,
                                         iters=1, lerobot=False, gap_batch=3, lerobot_compile_modes=[])
    ceilings = {"matmul_tflops": 1.0, "copy_tb_s": 0.01, "dtype": "float32", "source": "test"}
    result, _ = bench_mod.bench_configuration("libero_rl", base, bench, torch.device("cpu"), ceilings, Budget(600))
    side = result["rows"][0]["sides"]["ours"]
    assert len(used) == 1 and side["fast"] == dataclasses.asdict(used[0])
    assert {k: side["fast"][k] for k in overrides} == overrides
    assert (side["fast"]["batch_buckets"], side["fast"]["dtype"]) == ([2], "float32")
    assert result["parity_fast_vs_our_reference_rel_l2"] < 1e-5, "fp32 fast path vs the fp32 plain path"
    assert result["logprob_gap"] == {"skipped": "bench.gap_batch=3 is not among bench.batch_sizes=[2]: "
                                                "no log-prob gap measured"}
    assert "logprob_gap" not in side


def test_a_gap_batch_that_cannot_be_measured_is_refused_or_recorded():
    with pytest.raises(ValueError, match=r"bench.gap_batch must be a positive batch size .*"
                                         r"bench.batch_sizes=\[1, 4\]\), got 0"):
        bench_mod.BenchPredictConfig(batch_sizes=[1, 4], gap_batch=0)
    with pytest.raises(ValueError, match=r"bench.gap_calls must be .*got -1"):
        bench_mod.BenchPredictConfig(gap_calls=-1)
    skipped = bench_mod.BenchPredictConfig(batch_sizes=[1, 4]).gap_skipped()
    assert skipped == "bench.gap_batch=32 is not among bench.batch_sizes=[1, 4]"
    # the README's device command (gap_batch=64, batch_sizes [1, 32]) still runs, its gap recorded as skipped
    assert "bench.gap_batch=64" in bench_mod.BenchPredictConfig(batch_sizes=[1, 32], gap_batch=64).gap_skipped()
    assert bench_mod.BenchPredictConfig(gap_calls=0).gap_skipped() == "bench.gap_calls=0"
    assert bench_mod.BenchPredictConfig().gap_skipped() is None
    assert bench_mod.BenchPredictConfig(full_sweep=True, gap_batch=4).gap_skipped() is None
