"""Review 38: benchmarks label their result with the device they ran on. On a GPU host (emulated by
patching torch.cuda, as in test_results.py), a CPU run of bench_worldmodel / bench_weight_sync and
bench_profiler (CPU work whatever the host) were named after cuda:0, because they called
write_result without their device. The measurements themselves are replaced by stubs: only the
labelling is under test. CPU only."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.results import REPO_ROOT

GPU_NAME = "NVIDIA H200"


@pytest.fixture
def gpu_host(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU_NAME)
    monkeypatch.delenv("VLA_COMMIT_RESULTS", raising=False)
    monkeypatch.setenv("VLA_RESULTS_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)  # the mains set the CPU run's thread count


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _only_result(folder) -> dict:
    (path,) = folder.glob("*.json")
    assert "h200" not in path.name, path.name
    return json.loads(path.read_text())


def test_bench_worldmodel_cpu_run_on_a_gpu_host_is_labelled_cpu(gpu_host, monkeypatch):
    from experiments import bench_worldmodel

    monkeypatch.setattr(bench_worldmodel, "run_single", lambda cfg, bench, device: ({"ran_on": str(device)}, {}))
    bench_worldmodel.main(_compose("bench_worldmodel", ["bench.device=cpu", f"bench.out_dir={gpu_host}"]))
    record = _only_result(gpu_host)
    assert record["ran_on"] == "cpu" and record["device"].startswith("cpu: ")


def test_bench_weight_sync_cpu_run_on_a_gpu_host_is_labelled_cpu(gpu_host, monkeypatch):
    from experiments import bench_weight_sync

    monkeypatch.setattr(bench_weight_sync, "run", lambda bench, policy_cfg, device: {"ran_on": device})
    monkeypatch.setattr(bench_weight_sync, "summarise", lambda results, goals_apply: {})
    monkeypatch.setattr(bench_weight_sync, "print_table", lambda summary: None)
    bench_weight_sync.main(_compose("bench_weight_sync", ["bench.device=cpu", f"bench.out_dir={gpu_host}"]))
    record = _only_result(gpu_host)
    assert record["results"]["ran_on"] == "cpu" and record["device"].startswith("cpu: ")


def test_bench_profiler_is_labelled_with_the_cpu_on_a_gpu_host(gpu_host):
    from experiments import bench_profiler

    bench_profiler.main(["--spans", "20", "--repeats", "1"])
    assert _only_result(gpu_host)["device"].startswith("cpu: ")
