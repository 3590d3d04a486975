"""Review 39: the benchmark / profiling scripts run on the GPU box and their result plumbing.

- bench_rollout: env alone or engine alone failing lost ours' measured epoch (and the variants and the
  baseline never ran); now each is recorded beside ours' numbers like a variant or the baseline.
- profile_rollout: rollout.device=cuda:0 was not taken for a GPU run (compared with "cuda": no fast
  path, no GPU span timing); a CPU run on a GPU host was labelled with cuda:0's name; a device that is
  not cpu/cuda is refused by key.
CPU only: the measurements are replaced by stubs where only the plumbing is under test."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.results import REPO_ROOT
from tests.rollout.test_collector import countdown_env, one_torch_thread, tiny_policy  # noqa: F401 (fixture)

GPU_NAME = "NVIDIA H200"


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


# ----------------------------------------------------------------------------- bench_rollout


@pytest.mark.parametrize("side, key", [("env_alone", "env_only"), ("engine_alone", "predict_only")])
def test_bench_rollout_keeps_ours_when_env_or_engine_alone_fails(monkeypatch, side, key):
    from experiments import bench_rollout
    from experiments.bench_rollout import BenchRolloutConfig, run, summarize
    from rollout.collector_config import CollectorConfig
    from rollout.config import EngineConfig, RolloutConfig

    def broken(*args, **kwargs):
        raise RuntimeError(f"{side} broke")

    monkeypatch.setattr(bench_rollout, side, broken)
    env_cfg = countdown_env(num_envs=4, group_size=2, max_episode_steps=40)
    rollout = RolloutConfig(engine=EngineConfig(seed=0), collector=CollectorConfig(stages=2, in_process=True))
    bench = BenchRolloutConfig(warmup_chunks=1, timed_chunks=2, baseline=False, device="cpu",
                               variants=["no_pipeline"])
    payload = run(env_cfg, tiny_policy(), rollout, bench)
    assert payload["ours"][key]["error"] == f"RuntimeError: {side} broke"
    assert payload["ours"]["env_steps_per_s"] > 0
    assert payload["variants"]["no_pipeline"]["env_steps_per_s"] > 0  # the run went on
    summary = summarize(env_cfg, payload)
    assert summary["ours_env_steps_per_s"] > 0
    missing = "env_only_env_steps_per_s" if key == "env_only" else "predict_only_sps"
    assert missing not in summary
    # the other side is still measured, and bounds the overlap on its own
    other = "predict_only_sps" if key == "env_only" else "env_only_env_steps_per_s"
    assert summary["overlap_bound_env_steps_per_s"] == summary[other]


# ----------------------------------------------------------------------------- profile_rollout


class _StopRun(Exception):
    pass


def _profile_rollout_cfg(tmp_path, *overrides: str):
    return _compose("profile_rollout", ["logger=none", f"rollout.run_dir={tmp_path / 'run'}", *overrides])


def test_profile_rollout_cuda_with_an_index_is_a_gpu_run(monkeypatch, tmp_path):
    from experiments import profile_rollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}
    real_make_timeline = profile_rollout.make_timeline

    def make_timeline(prof, **kwargs):
        seen["gpu_timing"] = prof.gpu_timing
        return real_make_timeline(prof, **kwargs)

    def engine(cfg, pcfg):
        seen["devices"], seen["fast"] = cfg.devices, pcfg.fast.enabled
        raise _StopRun

    monkeypatch.setattr(profile_rollout, "make_timeline", make_timeline)
    monkeypatch.setattr(profile_rollout, "PolicyEngine", engine)
    with pytest.raises(_StopRun):
        profile_rollout.main.__wrapped__(_profile_rollout_cfg(tmp_path, "rollout.device=cuda:0"))
    assert seen == {"gpu_timing": "sync", "devices": "cuda:0", "fast": True}


def test_profile_rollout_refuses_a_device_that_is_not_cpu_or_cuda():
    from experiments.profile_rollout import RolloutProfileConfig

    for bad in ("gpu", "cuda:x", "meta"):
        with pytest.raises(ValueError, match=rf"rollout\.device must be auto, cpu, cuda or cuda:N, got '{bad}'"):
            RolloutProfileConfig(device=bad)
    RolloutProfileConfig(device="cuda:1")


def test_profile_rollout_cpu_run_on_a_gpu_host_is_labelled_cpu(monkeypatch, tmp_path):
    from experiments import profile_rollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU_NAME)
    monkeypatch.delenv("VLA_COMMIT_RESULTS", raising=False)
    out = tmp_path / "results"
    monkeypatch.setenv("VLA_RESULTS_DIR", str(out))

    class Engine:
        def __init__(self, cfg, pcfg):
            assert cfg.devices == "cpu" and not pcfg.fast.enabled

        def state_dict(self):
            return {}

        def update_weights(self, weights, version):
            pass

        def close(self):
            pass

    class Collector:
        def __init__(self, *args, **kwargs):
            pass

        def collect(self, seed, step):
            return SimpleNamespace(success=np.array([1.0]), lost=np.array([False]))

        def close(self):
            pass

    report = SimpleNamespace(to_dict=lambda skip_first: {})
    monkeypatch.setattr(profile_rollout, "PolicyEngine", Engine)
    monkeypatch.setattr(profile_rollout, "RolloutCollector", Collector)
    monkeypatch.setattr(profile_rollout, "build_exports", lambda run_dir, prof, skip_first: (report, {}))
    monkeypatch.setattr(profile_rollout, "result_summary", lambda report, skip_first: {"step_s": 1.0})
    profile_rollout.main.__wrapped__(_profile_rollout_cfg(tmp_path, "rollout.device=cpu", "rollout.steps=1"))
    (path,) = out.glob("*.json")
    assert "h200" not in path.name, path.name
    assert json.loads(path.read_text())["device"].startswith("cpu: ")


# ----------------------------------------------------------------------------- bench_reach


def test_bench_reach_is_labelled_with_the_cpu_on_a_gpu_host(monkeypatch, tmp_path):
    """bench_reach runs its envs and the tiny policy on the CPU whatever the host."""
    from experiments import bench_reach

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU_NAME)
    monkeypatch.delenv("VLA_COMMIT_RESULTS", raising=False)
    monkeypatch.setenv("VLA_RESULTS_DIR", str(tmp_path))
    bench_reach.main(["--quick", "--skip-speed", "--skip-success"])
    (path,) = tmp_path.glob("*.json")
    assert "h200" not in path.name and json.loads(path.read_text())["device"].startswith("cpu: ")


# ----------------------------------------------------------------------------- bench_multigpu


def test_bench_multigpu_keeps_the_other_parts_when_the_actor_setup_fails(monkeypatch, tmp_path):
    """The actor part's rows (the policy's own samples) are made before any configuration: a failure there
    (e.g. out of memory) propagated out of run() and lost the measured sync / throughput parts."""
    from experiments import bench_multigpu, bench_multigpu_actor
    from experiments.bench_multigpu import BenchMultiGPUConfig, print_table, report, run, summarise
    from policies import PolicyConfig

    measured = {"backend": "local", "ranks": 1, "samples_per_s": 10.0}
    monkeypatch.setattr(bench_multigpu, "run_throughput", lambda *args: [dict(measured)])

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench_multigpu_actor, "synthetic_samples", out_of_memory)
    bench = BenchMultiGPUConfig(parts=["throughput", "actor"], image_size=16, actor_micro_batch=2, actor_rows=4,
                                actor_chunks=2, actor_group_size=2, out_dir=str(tmp_path))
    results = run(bench, PolicyConfig.preset("tiny"))
    assert results["throughput"] == [measured]
    (entry,) = results["actor"]
    assert entry["mode"] == "none" and "CUDA out of memory (simulated)" in entry["error"]
    summary = summarise(results, PolicyConfig.preset("tiny"))
    assert summary["samples_per_s_local_1"] == 10.0 and summary["actor_rows_per_s_none_1"] is None
    print_table(results)
    record = json.loads(report(bench, PolicyConfig.preset("tiny"), results).read_text())
    assert record["results"]["throughput"] == [measured]


# ----------------------------------------------------------------------------- bench_worldmodel


@pytest.mark.parametrize("side", ["time_regeneration", "measure_ours"])
def test_bench_worldmodel_keeps_the_other_sides_when_one_fails(monkeypatch, tmp_path, side):
    """A failing side (here the regeneration baseline, or ours in both the graph and the eager attempt)
    raised out of run_single: no JSON, the sequential loop's measured numbers lost. Now recorded by name,
    the JSON written, and the exit status non-zero."""
    from experiments import bench_worldmodel

    def broken(*args, **kwargs):
        raise RuntimeError(f"{side} broke")

    monkeypatch.setattr(bench_worldmodel, side, broken)
    threads = torch.get_num_threads()  # main sets bench.cpu_threads
    overrides = ["bench.device=cpu", f"bench.out_dir={tmp_path}", "bench.streams=[1,2]", "bench.warmup_chunks=1",
                 "bench.chunks_per_stream=1", "bench.sequential_chunks=1", "bench.regenerate_calls=1",
                 "bench.profile=false"]
    try:
        with pytest.raises(SystemExit, match=r"bench_worldmodel: \['(ours|regenerate)'\] failed"):
            bench_worldmodel.main.__wrapped__(_compose("bench_worldmodel", overrides))
    finally:
        torch.set_num_threads(threads)
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    label = "regenerate" if side == "time_regeneration" else "ours"
    assert f"RuntimeError: {side} broke" in record["errors"][label]
    assert record["sequential_eager"]["chunks_per_s"] > 0
    assert record["summary"]["sequential_chunks_per_s"] > 0 and record["summary"]["failed"] == [label]
    if label == "regenerate":
        assert record["summary"]["regenerate_chunks_per_s"] is None and record["summary"]["largest_s"] == 2
    else:
        assert record["summary"]["regenerate_chunks_per_s"] > 0 and record["summary"]["largest_s"] is None


def test_bench_worldmodel_model_override_the_config_documents_composes():
    """conf/bench_worldmodel.yaml documented `worldmodel.context_chunks=3`, which Hydra refuses (the key is
    not in the file); the documented form must compose and reach the model config."""
    import re

    from omegaconf import OmegaConf

    from experiments.bench_worldmodel import model_config

    text = (REPO_ROOT / "conf" / "bench_worldmodel.yaml").read_text()
    (override,) = re.findall(r"\((\+?worldmodel\.context_chunks=\d+)", text)
    cfg = _compose("bench_worldmodel", [override])
    assert model_config(OmegaConf.to_container(cfg.worldmodel), torch.device("cpu")).context_chunks == 3
