"""experiments/bench_rollout.py on the countdown env (no LIBERO, no baseline): every measurement
of ours runs and the summary's ratios follow from the measured numbers (the benchmark itself is
run by hand; its RLinf-style side needs LIBERO)."""

from __future__ import annotations

import pytest

from experiments.bench_rollout import BenchRolloutConfig, run, summarize
from rollout.collector_config import CollectorConfig
from rollout.config import EngineConfig, RolloutConfig
from tests.rollout.test_collector import countdown_env, one_torch_thread, tiny_policy  # noqa: F401 (fixture)


def test_bench_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"bench\.timed_chunks must be a positive integer, got 0"):
        BenchRolloutConfig(timed_chunks=0)
    with pytest.raises(ValueError, match=r"bench\.variants entries must be one of .* got 'fast'"):
        BenchRolloutConfig(variants=["fast"])


def test_bench_measures_ours_env_alone_engine_alone_and_variants(tmp_path):
    env_cfg = countdown_env(num_envs=4, group_size=2, max_episode_steps=40)
    collector = CollectorConfig(stages=2, workers_per_stage=1, in_process=True)
    rollout = RolloutConfig(engine=EngineConfig(seed=0), collector=collector)
    bench = BenchRolloutConfig(warmup_chunks=1, timed_chunks=2, baseline=False, device="cpu",
                               variants=["no_pipeline", "disjoint_workers"], trace_dir=str(tmp_path / "trace"))
    payload = run(env_cfg, tiny_policy(), rollout, bench)
    summary = summarize(env_cfg, payload)
    ours = payload["ours"]
    assert ours["stats"]["chunks"] == 3 and ours["collector"]["max_chunks"] == 3
    assert ours["predict_only"]["calls"] == 2 * 2 and ours["predict_only"]["rows"] == 2 * 4
    # env alone replays ours' actions from the same init states: the same episodes (replay_matches is
    # False only because the countdown state shows the episode seed, new at every reset)
    assert ours["env_only"]["replay_matches"] is False
    assert ours["env_only"]["env_steps"] == sum(ours["stats"]["steps_per_chunk"][t] for t in (1, 2))
    assert payload["variants"]["no_pipeline"]["collector"]["stages"] == 1
    assert payload["variants"]["disjoint_workers"]["collector"]["workers_per_stage"] == 1
    bound = min(summary["env_only_env_steps_per_s"], summary["predict_only_sps"])
    assert summary["overlap_efficiency"] == pytest.approx(summary["ours_env_steps_per_s"] / bound)
    assert summary["predict_only_sps"] == pytest.approx(4 * summary["predict_only_samples_per_s"])
    assert "speedup" not in summary and summary["ours_no_pipeline_env_steps_per_s"] > 0
    assert set(payload["trace_exports"]) == {"json", "perfetto"}


def test_bench_times_only_the_chunks_ours_ran_and_keeps_ours_when_a_side_fails(tmp_path, monkeypatch):
    """Episodes end after 2 of the 4 chunks: engine alone predicts what ours predicted (not 4 chunks of
    finished envs); a variant that fails is recorded beside ours' numbers instead of losing them."""
    from experiments import bench_rollout

    env_cfg = countdown_env(num_envs=4, group_size=2, max_episode_steps=8)  # chunks of 4: done after 2
    rollout = RolloutConfig(engine=EngineConfig(seed=0), collector=CollectorConfig(stages=2, in_process=True))
    bench = BenchRolloutConfig(warmup_chunks=1, timed_chunks=3, baseline=False, device="cpu", variants=["no_pipeline"])

    def broken_variant(*args):
        raise RuntimeError("variant broke")

    monkeypatch.setattr(bench_rollout, "variant_config", broken_variant)
    payload = run(env_cfg, tiny_policy(), rollout, bench)
    # at most chunk 1 of each stage (a stage whose envs all succeed in chunk 0 has none); chunks 2-3 ran nothing
    assert 1 <= payload["ours"]["predict_only"]["calls"] <= 2 < 2 * bench.timed_chunks
    assert payload["variants"]["no_pipeline"]["error"] == "RuntimeError: variant broke"
    summary = summarize(env_cfg, payload)
    assert "ours_no_pipeline_env_steps_per_s" not in summary and summary["ours_env_steps_per_s"] > 0
    no_images = RolloutConfig(engine=EngineConfig(seed=0), collector=CollectorConfig(record_images=False))
    with pytest.raises(ValueError, match="bench.predict_only=true needs rollout.collector.record_images=true"):
        run(env_cfg, tiny_policy(), no_images, bench)
