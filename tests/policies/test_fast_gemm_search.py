"""policies/fast/gemm_search.py: when a bucket searches (CPU), and that what it keeps computes torch's bits
(GPU: one GEMM on fresh inputs, and the whole sampler's chains against gemm_search "off")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from policies.fast import gemm_search
from policies.fast.config import FastConfig


def test_choose_by_mode_rows_and_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gemm_search.choose("auto", 768, cuda)
    assert gemm_search.choose("auto", gemm_search.AUTO_MAX_ROWS, cuda)
    assert not gemm_search.choose("auto", gemm_search.AUTO_MAX_ROWS + 1, cuda)
    assert not gemm_search.choose("auto", 768, cpu)
    assert not gemm_search.choose("off", 768, cuda)
    with pytest.raises(ValueError, match="gemm_search"):
        gemm_search.choose("always", 768, cuda)


def test_config_names_the_bad_value():
    with pytest.raises(ValueError, match="gemm_search"):
        FastConfig(gemm_search="fastest")


def test_torch_call_where_nothing_was_kept():
    class LinearW:  # the fields gemm_search.linear reads (weights.LinearW)
        def __init__(self, weight, bias):
            self.weight, self.bias, self.fp8 = weight, bias, None

    x, lw = torch.randn(5, 8), LinearW(torch.randn(3, 8), torch.randn(3))
    torch.testing.assert_close(gemm_search.linear(x, lw, None), F.linear(x, lw.weight, lw.bias), rtol=0, atol=0)
    assert gemm_search.summary({"qkv": None}) == {}


def test_search_vision_says_whether_every_searched_gemm_was_kept(monkeypatch):
    """A bucket's `tuned["gemm_search"]`: "kept" only where every searched GEMM took a kept answer; an FP8 GEMM
    is not searched and says nothing (CPU: the search itself stubbed)."""
    class LinearW:
        def __init__(self, fp8=None):
            self.weight, self.bias, self.fp8 = torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2), fp8

    def vision(fp8_names=()):
        layer = {name: LinearW("fp8" if name in fp8_names else None) for name in gemm_search.VISION_GEMMS}
        return {"layers": [layer], "proj": LinearW("fp8" if "proj" in fp8_names else None)}

    hows = {}
    monkeypatch.setattr(gemm_search, "_search_linear", lambda rows, layers, seed, tuning: (None, hows[id(layers[0])]))
    every = vision()
    for name in gemm_search.VISION_GEMMS:
        hows[id(every["layers"][0][name])] = "kept"
    hows[id(every["proj"])] = "kept"
    assert gemm_search.search_vision(every, 8) == ({"qkv": None, "out": None, "fc2": None, "proj": None}, "kept")
    hows[id(every["layers"][0]["fc2"])] = "measured"  # e.g. a kept algorithm that no longer holds
    assert gemm_search.search_vision(every, 8)[1] == "measured"
    none = vision(fp8_names=(*gemm_search.VISION_GEMMS, "proj"))
    assert gemm_search.search_vision(none, 8) == ({"qkv": None, "out": None, "fc2": None, "proj": None}, None)


@pytest.mark.gpu
def test_kept_algorithm_is_bit_exact_on_fresh_inputs(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(gemm_search, "MIN_GAIN", -1.0)  # keep the fastest exact one even if torch is faster
    g = torch.Generator(device="cuda").manual_seed(3)
    layers = [SimpleNamespace(weight=torch.randn(1152, 4304, device="cuda", dtype=torch.bfloat16, generator=g),
                              bias=torch.randn(1152, device="cuda", dtype=torch.bfloat16, generator=g), fp8=None)
              for _ in range(4)]  # SigLIP's fc2
    pick = gemm_search.search_linear(768, layers)
    assert pick is not None and pick.plan.results[pick.index].workspace_size == 0
    for seed in range(3):
        x = torch.randn(768, 4304, device="cuda", dtype=torch.bfloat16, generator=g.manual_seed(100 + seed))
        for lw in layers:
            assert torch.equal(gemm_search.linear(x, lw, pick), F.linear(x, lw.weight, lw.bias))


@pytest.mark.gpu
def test_sampler_chains_equal_without_search(monkeypatch):
    from policies.fast.runner import FastSampler
    from policies.policy import build_policy

    from .test_fast_gpu import gpu_cfg, inputs_for

    monkeypatch.setattr(gemm_search, "MIN_GAIN", -1.0)  # the tiny tower's picks, even where torch is as fast
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 2, seed=9)
    outs, picks = {}, None
    for mode in ("auto", "off"):
        fast = FastSampler(policy.model, FastConfig(attention="triton", batch_buckets=[2], prompt_buckets=[48],
                                                    gemm_search=mode))
        for _ in range(2):  # the capture run and a replay
            outs[mode] = fast.sample_chains(inputs, noise, step_noise, stoch)
        if mode == "auto":
            picks = next(iter(fast.buckets.values())).vision_gemms
    assert set(picks) == {"qkv", "out", "fc2", "proj"} and any(picks.values())
    for got, want in zip(outs["auto"], outs["off"], strict=True):
        assert torch.equal(got, want)
