"""Where the trainer and the ranks live and how weights travel (rollout/placement.py): pure
decisions, and every refusal naming the key and the value."""

from __future__ import annotations

import pytest

from rollout.config import RolloutConfig
from rollout.placement import plan_placement, resolve_device


def rollout(backend: str = "local", devices="auto", num_ranks: int = 2, transport: str = "auto",
            dist_backend: str = "auto") -> RolloutConfig:
    return RolloutConfig.from_mapping({
        "engine": {"backend": backend, "num_ranks": num_ranks, "devices": devices},
        "weights": {"transport": transport, "dist_backend": dist_backend}})


@pytest.mark.parametrize("name, count, expected", [
    ("auto", 0, "cpu"), ("auto", 2, "cuda:0"), ("cuda", 1, "cuda:0"), ("cuda:3", 4, "cuda:3"), ("cpu", 8, "cpu"),
])
def test_resolve_device(name, count, expected):
    assert resolve_device("run.device", name, count) == expected


@pytest.mark.parametrize("name, count, match", [
    ("cuda:2", 2, r"run.device is 'cuda:2', but only 2 GPU\(s\) are visible \(cuda:0..cuda:1\)"),
    ("cuda", 0, "run.device is 'cuda', but no GPU is visible"),
    ("gpu:0", 2, "run.device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got 'gpu:0'"),
])
def test_resolve_device_refusals_name_the_key(name, count, match):
    with pytest.raises(ValueError, match=match):
        resolve_device("run.device", name, count)


def test_auto_broadcasts_over_nccl_only_when_every_member_has_its_own_gpu():
    apart = plan_placement("cuda:0", "run.device", rollout(devices=["cuda:1", "cuda:2"]), cuda_count=3)
    assert (apart.transport, apart.dist_backend, apart.engine_devices) == ("broadcast", "nccl", ["cuda:1", "cuda:2"])
    shared = plan_placement("cuda:0", "run.device", rollout(devices=["cuda:0", "cuda:1"]), cuda_count=2)
    assert shared.transport == "tensors" and "rank 0 and the trainer (run.device) both on cuda:0" in shared.why
    auto = plan_placement("auto", "run.device", rollout(devices="auto", num_ranks=4), cuda_count=2)
    assert auto.engine_devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"] and auto.transport == "tensors"
    cpu = plan_placement("cpu", "run.device", rollout(devices="cpu"), cuda_count=0)
    assert (cpu.transport, cpu.engine_devices) == ("tensors", ["cpu", "cpu"])
    for backend in ("inproc", "ray"):
        other = plan_placement("cuda:0", "run.device", rollout(backend, devices=["cuda:1", "cuda:2"]), cuda_count=3)
        assert other.transport == "tensors" and backend in other.why


def test_explicit_broadcast_over_gloo_allows_any_devices():
    p = plan_placement("cpu", "run.device", rollout(devices="cpu", transport="broadcast"), cuda_count=0)
    assert (p.transport, p.dist_backend) == ("broadcast", "gloo")
    p = plan_placement("cuda:0", "run.device", rollout(devices="cuda:0", transport="broadcast", dist_backend="gloo"),
                       cuda_count=1)
    assert (p.transport, p.dist_backend) == ("broadcast", "gloo")


@pytest.mark.parametrize("trainer, cfg, count, match", [
    ("cuda:0", rollout(devices=["cuda:1", "cuda:1"], transport="broadcast"), 2,
     r"NCCL: rank 1 and rank 0 both on cuda:1 \(rollout.engine.devices\)"),
    ("cpu", rollout(devices=["cuda:0", "cuda:1"], transport="broadcast"), 2,
     "NCCL: run.device is 'cpu': the trainer needs a GPU"),
    ("cuda:0", rollout(devices=["cuda:1", "cpu"], transport="broadcast", dist_backend="nccl"), 2,
     "rollout.engine.devices gives rank 1 'cpu': every rank needs a GPU"),
    ("cuda:0", rollout(devices=["cuda:1", "cuda:5"]), 4, r"rollout.engine.devices\[1\] is 'cuda:5', but only 4"),
    ("cuda:0", rollout(devices="cuda:2"), 2, "rollout.engine.devices is 'cuda:2', but only 2"),
    ("cuda:0", rollout("inproc", devices="cpu", transport="broadcast"), 1,
     "rollout.weights.transport=broadcast needs rank processes"),
    ("cuda:0", rollout("ray", devices=["cuda:1", "cuda:2"], transport="broadcast", dist_backend="nccl"), 3,
     "Ray picks its actors' GPUs itself"),
])
def test_refusals_name_the_key(trainer, cfg, count, match):
    with pytest.raises(ValueError, match=match):
        plan_placement(trainer, "run.device", cfg, cuda_count=count)


def test_transport_value_is_validated():
    with pytest.raises(ValueError, match=r"rollout.weights.transport must be one of \['auto', 'tensors', 'broad"):
        rollout(transport="nvlink")
