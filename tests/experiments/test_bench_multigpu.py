"""experiments/bench_multigpu.py: the CPU smoke run (local ranks, gloo broadcast, exact checks on
every rank), device planning, scaling efficiency by hand, skipped configurations recorded."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.bench_multigpu import (
    BenchMultiGPUConfig,
    add_efficiency,
    attempt,
    observation_batches,
    report,
    run,
    summarise,
    throughput_devices,
    unavailable,
)
from experiments.bench_multigpu_sync import check_ranks, default_sync_receivers, goal_check, sync_devices
from policies import build_policy
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from rollout.engine_core import bit_checksum
from rollout.weights import expert_names
from tests.rollout.engine_fixtures import TINY, one_thread  # noqa: F401 - fixture used by pytestmark

pytestmark = pytest.mark.usefixtures("one_thread")
POLICY = TINY.replace(chunk_size=10)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (gloo, CPU ranks)")
def test_cpu_smoke_run_one_and_two_ranks_and_gloo_broadcast(tmp_path):
    bench = BenchMultiGPUConfig(parts=["sync", "throughput"], ranks=[1, 2, 4], backends=["local"], batch_per_rank=4,
                                image_size=32, warmup=1, iters=2, sync_receivers=[2, 3], sync_warmup=1, sync_iters=2,
                                out_dir=str(tmp_path))
    results = run(bench, POLICY)
    one, two, four = results["throughput"]
    assert (one["ranks"], one["rows"], len(one["calls"]), one["efficiency"]) == (1, 4, 2, 1.0)
    assert two["rows"] == 8 and [len(c["predict_s"]) for c in two["calls"]] == [2, 2]  # both ranks timed
    assert two["efficiency"] == two["samples_per_s"] / (2 * one["samples_per_s"])
    assert "bench.max_cpu_ranks=2" in four["skipped"]
    sync, skipped = results["sync"]
    assert "3 receivers > bench.max_cpu_ranks=2" in skipped["skipped"]
    params = dict(build_policy(POLICY).model.named_parameters())
    expert = expert_names(build_policy(POLICY).model)
    assert (sync["receivers"], sync["dist_backend"], sync["devices"]) == (2, "gloo", ["cpu", "cpu"])
    assert sync["full"]["bytes"] == sum(p.numel() * p.element_size() for p in params.values())
    assert sync["expert"]["tensors"] == len(expert) < sync["full"]["tensors"] == len(params)
    assert sync["full"]["ranks_equal_trainer"] and sync["expert"]["ranks_equal_trainer"]
    assert len(sync["full"]["send_s_times"]) == 2 and goal_check(sync, POLICY.name) is None
    path = report(bench, POLICY, results)
    summary = json.loads(path.read_text())["summary"]
    assert summary["samples_per_s_local_4"] is None and summary["efficiency_local_2"] == two["efficiency"]
    assert summary["sync_2_full_s"] == sync["full"]["send_s"]


def test_check_ranks_names_a_rank_that_differs():
    with PolicyEngine(EngineConfig(backend="inproc", num_ranks=2, devices="cpu"), TINY) as engine:
        state = engine.state_dict(rank=0)
        expected = {n: bit_checksum(t) for n, t in state.items()}
        assert check_ranks(engine, expected)
        name = next(iter(expected))
        expected[name] += 1
        with pytest.raises(AssertionError, match=f"rank 0 differs from the trainer in 1 parameters, e.g. \\['{name}'"):
            check_ranks(engine, expected)


@pytest.mark.parametrize("n, gpus, share, expected", [
    (2, 0, False, ["cpu", "cpu"]),
    (4, 0, False, "4 ranks > bench.max_cpu_ranks=2"),
    (4, 8, False, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    (8, 4, False, "8 ranks need 8 GPUs, 4 visible"),
    (4, 1, True, ["cuda:0"] * 4),
    (3, 2, True, ["cuda:0", "cuda:1", "cuda:0"]),
])
def test_throughput_devices(n, gpus, share, expected):
    got = throughput_devices(n, gpus, share, max_cpu_ranks=2)
    assert got == expected if isinstance(expected, list) else expected in got


def test_sync_devices_keep_the_trainers_gpu_apart():
    assert sync_devices(7, 8, 2) == ("cuda:0", [f"cuda:{i}" for i in range(1, 8)])
    assert sync_devices(2, 0, 2) == ("cpu", ["cpu", "cpu"])
    assert "need 2 GPUs (NCCL: one per member), 1 visible" in sync_devices(1, 1, 2)
    assert (default_sync_receivers(8, 2), default_sync_receivers(2, 2), default_sync_receivers(1, 2),
            default_sync_receivers(0, 2)) == ([7], [1], [1], [2])


def test_goal_applies_only_to_pi05_over_nccl_to_seven_ranks():
    entry = {"receivers": 7, "dist_backend": "nccl", "full": {"send_s": 0.059}}
    assert goal_check(entry, "pi05") is True
    assert goal_check({**entry, "full": {"send_s": 0.061}}, "pi05") is False
    assert goal_check({**entry, "receivers": 3}, "pi05") is None and goal_check(entry, "tiny") is None


def test_efficiency_by_hand():
    entries = [{"backend": "local", "ranks": 1, "samples_per_s": 100.0, "device_samples_per_s": 120.0},
               {"backend": "local", "ranks": 4, "samples_per_s": 360.0, "device_samples_per_s": 480.0},
               {"backend": "ray", "ranks": 2, "samples_per_s": 150.0},
               {"backend": "local", "ranks": 8, "skipped": "8 ranks need 8 GPUs"}]
    add_efficiency(entries)
    assert entries[1]["efficiency"] == 0.9 and entries[1]["device_efficiency"] == 1.0
    assert "efficiency" not in entries[2] and "efficiency" not in entries[3]  # no 1-rank ray measurement


def test_same_rows_for_every_run_and_libero_like_fields():
    first, second = observation_batches(POLICY, rows=6, image_size=32, count=2, seed=0)
    assert first["agentview_image"].shape == (6, 32, 32, 3) and first["agentview_image"].dtype.name == "uint8"
    assert first["state"].shape == (6, POLICY.state_dim) and len(first["prompt"]) == 6
    again = observation_batches(POLICY, rows=6, image_size=32, count=1, seed=0)[0]
    assert (again["wrist_image"] == first["wrist_image"]).all()  # seeded: every run sees the same rows
    assert not (second["wrist_image"] == first["wrist_image"]).all()  # the calls cycle distinct batches


def test_missing_backend_is_recorded_not_fatal():
    assert unavailable("json") is None
    assert unavailable("no_such_module_for_bench").startswith("no_such_module_for_bench not importable: ")


@pytest.mark.parametrize("kw, match", [
    ({"parts": ["speed"]}, "bench.parts entries must be one of"),
    ({"backends": ["mpi"]}, "bench.backends entries must be one of"),
    ({"ranks": [1, 0]}, "bench.ranks entries must be a positive integer, got 0"),
    ({"sync_warmup": -1}, "bench.sync_warmup must be a non-negative integer"),
    ({"actor_modes": ["zero"]}, "bench.actor_modes entries must be one of"),
    ({"actor_ranks": [0]}, "bench.actor_ranks entries must be a positive integer, got 0"),
    ({"actor_rows": 0}, "bench.actor_rows must be a positive integer"),
])
def test_config_errors_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        BenchMultiGPUConfig(**kw)
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['bench.rankz'\]"):
        BenchMultiGPUConfig.from_mapping({"rankz": [1]})


def test_a_failed_measurement_is_recorded_and_the_others_kept():
    def broken():
        raise RuntimeError("NCCL error: unhandled system error")

    entry = attempt(broken, {"backend": "local", "ranks": 2})
    assert entry["ranks"] == 2 and "RuntimeError: NCCL error: unhandled system error" in entry["error"]
    assert "Traceback" in entry["error"]
    ok = {"backend": "local", "ranks": 1, "samples_per_s": 10.0, "device_samples_per_s": 12.0}
    add_efficiency([ok, entry])
    results = {"cuda_count": 2, "throughput": [ok, entry], "sync": [{"receivers": 1, "error": "x"}]}
    summary = summarise(results, POLICY)
    assert summary["samples_per_s_local_2"] is None and summary["efficiency_local_1"] == 1.0
    assert not any(k.startswith("sync_") for k in summary)
