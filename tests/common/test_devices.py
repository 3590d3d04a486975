"""common/devices.py: the one rule for a configured GPU against the machine's (rollout.placement.resolve_device
and the world-model server's ServeConfig.check_visible both use it), every refusal naming the key and value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.devices import auto_device, visible_cuda_index


@pytest.mark.parametrize(("cuda", "expected"), [(True, "cuda"), (False, "cpu")])
def test_auto_is_the_gpu_where_torch_sees_one(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert auto_device("auto") == torch.device(expected)
    # any other name is taken as written, whatever the machine has
    assert auto_device("cpu") == torch.device("cpu")
    assert auto_device("cuda:1") == torch.device("cuda", 1)
    assert auto_device(torch.device("cuda", 2)) == torch.device("cuda", 2)


@pytest.mark.parametrize(("name", "count", "index"), [
    ("cuda", 1, 0),  # no index: GPU 0, the current device before anything is placed
    ("cuda:0", 1, 0), ("cuda:3", 4, 3),
    ("cpu", 0, None), ("cpu:0", 0, None), ("meta", 0, None),  # other devices need no GPU
])
def test_the_index_a_visible_device_names(name, count, index):
    assert visible_cuda_index("run.device", name, count) == index


@pytest.mark.parametrize(("name", "count", "match"), [
    ("cuda:2", 2, r"run\.device is 'cuda:2', but only 2 GPU\(s\) are visible \(cuda:0\.\.cuda:1\)"),
    ("cuda", 0, r"run\.device is 'cuda', but no GPU is visible \(torch\.cuda\.device_count\(\) == 0\)"),
])
def test_a_gpu_the_machine_lacks_is_refused_by_key_and_value(name, count, match):
    with pytest.raises(ValueError, match=match):
        visible_cuda_index("run.device", name, count)


@pytest.mark.parametrize("name", ["gpu:0", "cuda:", "cuda:-1", "cuda:x", "CUDA", ""])
def test_a_name_that_is_no_device_is_refused_by_key_and_value(name):
    with pytest.raises(ValueError, match=rf"run\.device must be a device name .*, got {name!r}"):
        visible_cuda_index("run.device", name, 8)


@pytest.mark.parametrize("name", ["cuda:01", "cuda:00", "cuda:\u0661"])
def test_an_index_torch_does_not_spell_is_refused_by_key_and_value(name):
    """torch.device refuses a leading zero and non-ASCII digits ("Invalid device string"): the rule refused
    none of them (cuda:01 was GPU 1), so the name reached a rank's torch.device and failed there, naming no key."""
    import torch

    from rollout.placement import resolve_device

    with pytest.raises(RuntimeError):
        torch.device(name)
    with pytest.raises(ValueError, match=rf"run\.device must be a device name .*, got {name!r}"):
        visible_cuda_index("run.device", name, 8)
    with pytest.raises(ValueError, match=rf"rollout\.engine\.devices must be a device name .*, got {name!r}"):
        resolve_device("rollout.engine.devices", name, 8)


def test_every_library_graph_capture_goes_through_graph_capture():
    """A capture in torch's default "global" mode fails when another thread makes an unsafe CUDA call meanwhile
    (round 59: the prefix store's spill registration during the engine's first capture). The library's captures
    all go through common.devices.graph_capture; experiments' probes may capture as they like."""
    root = Path(__file__).resolve().parents[2]
    offenders = [f"{path.relative_to(root)}:{number}"
                 for folder in ("common", "envs", "grpo", "policies", "profiler", "rollout", "worldmodels")
                 for path in sorted((root / folder).rglob("*.py")) if path.name != "devices.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if "torch.cuda.graph(" in line]
    assert offenders == []
