"""Review round 39 (c): the world-model server's ring devices. "cuda" and "cuda:0" are one GPU, but
admission keyed its stages by the names as written and so modelled two devices running in parallel
(predicting half the tick time); a GPU this machine lacks failed in torch naming no key. CPU only:
the placement is plain Python, and "cuda" names GPU 0 where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from worldmodels.config import WorldModelConfig
from worldmodels.serve import WorldModelServer
from worldmodels.serve_config import ServeConfig


def test_cuda_and_cuda_0_are_one_device_to_admission():
    placement = ServeConfig(rings=[["cuda", "cuda:0"]]).placement(num_blocks=2)
    expected = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cuda:0"
    assert placement.devices == [expected]
    assert {rank.device for rank in placement.ranks} == {expected}


@pytest.mark.parametrize(("rings", "count", "key"), [
    ([["cuda:1"]], 1, r"serve.rings\[0\]\[0\] is 'cuda:1', but only 1 GPU\(s\) are visible \(cuda:0..cuda:0\)"),
    ([["cpu"], ["cuda:0", "cuda:2"]], 2, r"serve.rings\[1\]\[1\] is 'cuda:2', but only 2 GPU\(s\)"),
    ([["cuda"]], 0, r"serve.rings\[0\]\[0\] is 'cuda', but no GPU is visible"),
])
def test_a_gpu_the_machine_lacks_is_named_by_key(rings, count, key):
    with pytest.raises(ValueError, match=key):
        ServeConfig(rings=rings).check_visible(count)
    ServeConfig(rings=[["cpu"]]).check_visible(0)  # a CPU ring needs no GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the server on a CUDA-less machine")
def test_the_server_checks_its_rings_before_building():
    with pytest.raises(ValueError, match=r"serve.rings\[0\]\[0\] is 'cuda:0', but no GPU is visible"):
        WorldModelServer(WorldModelConfig.preset("tiny"), ServeConfig(rings=[["cuda:0"]]))


@pytest.mark.parametrize(("overrides", "key"), [
    ({"timestep_shift": float("inf")}, "worldmodel.timestep_shift"),  # sigma = inf * s / ... : NaN sigmas
    ({"vae": {"scale": float("inf")}}, "worldmodel.vae.scale"),
])
def test_an_infinite_model_scale_is_refused_by_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + " must be a positive finite number"):
        WorldModelConfig.preset("tiny", **overrides)


@pytest.mark.parametrize("name", ["slo_interval_ms", "kv_memory_gb"])
def test_an_infinite_serve_budget_is_refused_by_key(name):
    with pytest.raises(ValueError, match=f"serve.{name} must be a positive finite number"):
        ServeConfig(**{name: float("inf")})
