"""FP8 GEMMs of the fast path (policies/fast/fp8.py, `policy.fast.precision: fp8`) on CPU.

`torch._scaled_mm` runs on CPU in torch 2.13, so the same quantised GEMMs the GPU runs are
checked here against fp32 references on fresh random inputs, with error bounds derived from
e4m3's format (3 mantissa bits: a rounded value is within 2^-4 of itself; subnormals are spaced
2^-9 in scaled units) rather than tuned to observed errors. The Triton quantisation kernel and
CUDA graphs are checked in test_fast_fp8_gpu.py.
"""

import pytest
import torch
import torch.nn.functional as F

from policies.config import PolicyConfig
from policies.fast import fp8
from policies.fast.config import FP8_GEMM_GROUPS, FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy

from .test_fast_sampler import random_inputs

U = 2.0**-4  # e4m3 relative rounding bound (half an ulp of a 3-bit mantissa)
SUB = 2.0**-10  # e4m3 absolute rounding bound below the normal range, in units of the scale
BF16 = 2.0**-8  # bf16 relative rounding bound


def spread_rows(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Gaussian rows whose magnitudes span 1e-3..1e3 (per-row scales must follow each row),
    with row 1 all zeros (its scale must stay finite and its values 0)."""
    x = torch.randn(rows, cols, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 6 - 3)
    x[1] = 0.0
    return x


@pytest.mark.parametrize("act", fp8.ACTIVATIONS)
def test_quantize_rows_round_trip(act):
    g = torch.Generator().manual_seed(fp8.ACTIVATIONS.index(act))
    x = spread_rows(g, 9, 96 if act == "gelu_tanh_mul" else 48).to(torch.bfloat16)
    q, scale = fp8.quantize_rows(x, act)
    v = fp8.activate(x, act)
    assert q.dtype == fp8.FP8 and q.shape == v.shape and scale.shape == (9, 1)
    amax = v.abs().amax(dim=-1, keepdim=True)
    nonzero = amax[:, 0] > 0
    assert torch.allclose(scale[nonzero] * fp8.FP8_MAX, amax[nonzero], rtol=1e-6, atol=0)
    back = fp8.dequantize_rows(q, scale)
    assert bool(((back - v).abs() <= U * v.abs() + SUB * scale + 1e-6 * v.abs()).all())
    peak = v.abs().argmax(dim=-1, keepdim=True)  # each row's maximum maps to 448: kept exactly
    assert torch.allclose(back.gather(1, peak), v.gather(1, peak), rtol=1e-6, atol=0)
    assert bool((back[1] == 0).all()) and bool(torch.isfinite(scale).all())
    again, _ = fp8.quantize_rows(back, "none")  # representable values quantise to themselves
    assert torch.equal(again.view(torch.uint8), q.view(torch.uint8))


def test_quantize_weight_per_channel_and_requantize_in_place():
    g = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(spread_rows(g, 32, 80))
    w = fp8.make_fp8_weight(param)
    held = param.detach().to(torch.bfloat16).float()  # the value the fast path holds (fp8 needs bf16)
    amax = held.abs().amax(dim=1)
    assert w.qweight.shape == (32, 80) and w.scale.shape == (32,)
    assert torch.allclose(w.scale[amax > 0] * fp8.FP8_MAX, amax[amax > 0], rtol=1e-6, atol=0)
    back = fp8.dequantize_weight(w)
    bound = U * held.abs() + SUB * w.scale[:, None] + 1e-6 * held.abs()
    assert bool(((back - held).abs() <= bound).all())

    buffers = (w.qweight.data_ptr(), w.scale.data_ptr())
    with torch.no_grad():
        param.mul_(3.0)
    assert w.version != param._version, "an in-place update bumps the parameter's version"
    fp8.requantize_(w)
    assert (w.qweight.data_ptr(), w.scale.data_ptr()) == buffers, "re-quantised into the same storage"
    assert w.version == param._version
    new_amax = param.detach().to(torch.bfloat16).float().abs().amax(dim=1)  # the new weights' scales
    assert torch.allclose(w.scale[amax > 0], new_amax[amax > 0] / fp8.FP8_MAX, rtol=1e-6, atol=0)
    assert torch.allclose(new_amax, 3 * amax, rtol=2.0**-7, atol=0)


def test_quantize_weight_from_the_fast_dtype_whatever_the_parameter_dtype():
    """The GRPO trainer's fp32 master weights and the engine's bf16 copy of them quantise to the same FP8
    codes and scales (else policy.fast.consistent_recompute with precision=fp8 has a log-prob gap)."""
    master = spread_rows(torch.Generator().manual_seed(5), 32, 80)
    assert not torch.equal(master, master.to(torch.bfloat16).float()), "fp32 values bf16 cannot hold"
    from_fp32 = fp8.make_fp8_weight(master)
    from_bf16 = fp8.make_fp8_weight(master.to(torch.bfloat16))
    assert torch.equal(from_fp32.scale, from_bf16.scale)
    assert torch.equal(from_fp32.qweight.view(torch.uint8), from_bf16.qweight.view(torch.uint8))


@pytest.mark.parametrize("act", fp8.ACTIVATIONS)
def test_fp8_linear_within_fp8_error_of_fp32_linear(act):
    g = torch.Generator().manual_seed(10 + fp8.ACTIVATIONS.index(act))
    rows, k, n = 37, 64, 48  # rows not a multiple of 16: only K and N must be
    x = (torch.randn(rows, 2 * k if act == "gelu_tanh_mul" else k, generator=g) * 2).to(torch.bfloat16)
    # bf16 values: weights are quantised from their bf16 rounding, so the bound below stays exact
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).float()
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    w = fp8.make_fp8_weight(weight)
    got = fp8.fp8_linear(x, w, bias, act).float()
    assert got.shape == (rows, n)

    # 1. It is the product of the dequantised operands, up to fp32 summation order and the bf16 output.
    q, scale = fp8.quantize_rows(x, act)
    dequantised = fp8.scaled_linear_reference(q, scale, w, bias)
    magnitude = fp8.dequantize_rows(q, scale).abs() @ fp8.dequantize_weight(w).abs().t()
    assert bool(((got - dequantised).abs() <= BF16 * dequantised.abs() + 1e-5 * magnitude).all())

    # 2. Against the exact fp32 linear of act(x): each product x_k w_k moves by at most
    # (2U + U^2) |x_k w_k| plus the subnormal terms, and the output by one bf16 rounding.
    v = fp8.activate(x, act)
    exact = F.linear(v, weight, bias.float())
    bound = ((2 * U + U * U) * (v.abs() @ weight.abs().t())
             + SUB * (1 + U) * (scale * weight.abs().sum(1) + v.abs().sum(1, keepdim=True) * w.scale)
             + SUB * SUB * k * scale * w.scale + BF16 * exact.abs() + 1e-5 * (v.abs() @ weight.abs().t()))
    assert bool(((got - exact).abs() <= bound).all())
    # 3. Really FP8 (not silently bf16), and near e4m3's ~3.5% RMS error for random data.
    assert 1e-3 < relative_l2(got, exact) < 5e-2


def test_precision_config_is_validated():
    with pytest.raises(ValueError, match="policy.fast.precision must be one of"):
        FastConfig(precision="fp16")
    with pytest.raises(ValueError, match=r"policy.fast.precision=fp8 needs policy.fast.dtype=bfloat16"):
        FastConfig(precision="fp8", dtype="float32")


def test_fp8_gemms_config_is_validated():
    with pytest.raises(ValueError, match=r"policy.fast.fp8_gemms must hold distinct groups .*'prefix_mlp'"):
        FastConfig(precision="fp8", fp8_gemms=["prefix_mlp"])
    with pytest.raises(ValueError, match=r"policy.fast.fp8_gemms must hold distinct groups"):
        FastConfig(precision="fp8", fp8_gemms=["prefix_o", "prefix_o"])
    assert FastConfig(precision="fp8").fp8_gemms == ["prefix_gate_up", "prefix_down"]


def _sampler(model, precision: str, batch_buckets, prompt_buckets, **fast) -> FastSampler:
    return FastSampler(model, FastConfig(dtype="bfloat16", precision=precision, batch_buckets=batch_buckets,
                                         prompt_buckets=prompt_buckets, **fast))


@pytest.mark.parametrize("groups", [["prefix_gate_up"], ["prefix_down", "vision_mlp"], ["prefix_qkv", "prefix_o"]])
def test_fp8_gemms_quantises_only_the_chosen_groups(groups):
    """Each group's projections get FP8 shadows and no other's; a mixed MLP (one side FP8, the other
    bf16) still computes the GeGLU / GELU between them: actions stay within FP8 error of bf16."""
    cfg = PolicyConfig.preset("tiny")
    policy = build_policy(cfg)
    inputs, noise, step_noise = random_inputs(cfg, 2, 10, seed=3)
    stochastic = torch.zeros(2, cfg.sampling.num_steps, dtype=torch.bool)
    fast = _sampler(policy.model, "fp8", [2], [16], fp8_gemms=groups)
    w = fast.w
    named = {f"prefix_{n}": [layer[n] for layer in w.prefix] for n in ("qkv", "o", "gate_up", "down")}
    named["vision_attention"] = [layer[n] for layer in w.vision["layers"] for n in ("qkv", "out")]
    named["vision_mlp"] = [layer[n] for layer in w.vision["layers"] for n in ("fc1", "fc2")]
    named["vision_projector"] = [w.vision["proj"]]
    assert set(named) == set(FP8_GEMM_GROUPS)
    for group, linears in named.items():
        assert all((lw.fp8 is not None) == (group in groups) for lw in linears), group
    assert len(w.fp8_weights) == sum(len(named[g]) for g in groups)
    want, _ = _sampler(policy.model, "bf16", [2], [16]).sample_chains(inputs, noise, step_noise, stochastic)
    got, _ = fast.sample_chains(inputs, noise, step_noise, stochastic)
    assert 1e-4 < relative_l2(got[:, -1], want[:, -1]) < 8e-2


@pytest.mark.parametrize("preset,batch,prompt_len,prompt_buckets", [("tiny", 3, 13, [16]), ("pi05_small", 2, 40, [64])])
def test_fp8_fast_path_close_to_bf16(preset, batch, prompt_len, prompt_buckets):
    """Every vision and prefix GEMM in FP8, the expert in bf16: actions stay within the error one FP8
    GEMM makes on random data (~3.5% RMS, 8e-2 allowed); a wrong scale or activation gives O(1)."""
    cfg = PolicyConfig.preset(preset)
    policy = build_policy(cfg)
    inputs, noise, step_noise = random_inputs(cfg, batch, prompt_len, seed=5)
    stochastic = torch.zeros(batch, cfg.sampling.num_steps, dtype=torch.bool)
    stochastic[:, 1] = True
    bf16 = _sampler(policy.model, "bf16", [4], prompt_buckets)
    fp8_path = _sampler(policy.model, "fp8", [4], prompt_buckets, fp8_gemms=list(FP8_GEMM_GROUPS))
    quantised = 4 * cfg.vision.depth + 1 + 4 * cfg.prefix.depth  # qkv/out/fc1/fc2 + projector; qkv/o/gate_up/down
    assert len(fp8_path.w.fp8_weights) == quantised and not bf16.w.fp8_weights
    assert all(lw.fp8 is None for layer in fp8_path.w.expert for lw in layer.values()), "expert stays bf16"
    want, _ = bf16.sample_chains(inputs, noise, step_noise, stochastic)
    got, _ = fp8_path.sample_chains(inputs, noise, step_noise, stochastic)
    assert 1e-3 < relative_l2(got[:, -1], want[:, -1]) < 8e-2


def test_refresh_requantizes_only_changed_weights_without_new_buckets():
    cfg = PolicyConfig.preset("tiny")
    policy = build_policy(cfg)
    fast = _sampler(policy.model, "fp8", [2], [16], fp8_gemms=list(FP8_GEMM_GROUPS))
    inputs, noise, step_noise = random_inputs(cfg, 2, 10, seed=9)
    stochastic = torch.zeros(2, cfg.sampling.num_steps, dtype=torch.bool)
    before, _ = fast.sample_chains(inputs, noise, step_noise, stochastic)
    buckets = {key: id(bucket) for key, bucket in fast.buckets.items()}
    storage = [(w.qweight.data_ptr(), w.scale.data_ptr()) for w in fast.w.fp8_weights]

    fast.refresh_weights()
    assert fast.w.last_requantized == 0, "nothing changed, nothing re-quantised"
    with torch.no_grad():
        policy.model.prefix.layers[0].gate_up.weight.mul_(1.5)
        policy.model.vision.layers[1].fc1.weight.add_(0.05)
    fast.refresh_weights()
    assert fast.w.last_requantized == 2
    after, _ = fast.sample_chains(inputs, noise, step_noise, stochastic)
    fresh_sampler = _sampler(policy.model, "fp8", [2], [16], fp8_gemms=list(FP8_GEMM_GROUPS))
    fresh, _ = fresh_sampler.sample_chains(inputs, noise, step_noise, stochastic)
    assert relative_l2(after, before) > 1e-3
    assert torch.equal(after, fresh), "in-place re-quantisation equals quantising the new weights"
    assert {key: id(bucket) for key, bucket in fast.buckets.items()} == buckets
    assert [(w.qweight.data_ptr(), w.scale.data_ptr()) for w in fast.w.fp8_weights] == storage

    # Writes through `.data` do not bump version counters (documented): force re-quantises all.
    policy.model.prefix.layers[1].down.weight.data.mul_(2.0)
    fast.refresh_weights()
    assert fast.w.last_requantized == 0
    fast.w.refresh(force=True)
    assert fast.w.last_requantized == len(fast.w.fp8_weights)


def test_bias_added_after_the_gemm_where_scaled_mm_cannot_fuse_it(monkeypatch):
    """Builds whose row-wise `_scaled_mm` refuses a bias (probed once per device) add it afterwards."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(19, 32, generator=g).to(torch.bfloat16)
    w = fp8.make_fp8_weight(torch.randn(48, 32, generator=g))
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    fused = fp8.fp8_linear(x, w, bias).float()
    monkeypatch.setattr(fp8, "_bias_fusable", lambda device, dtype: False)
    separate = fp8.fp8_linear(x, w, bias).float()
    assert not torch.equal(fp8.fp8_linear(x, w, None).float(), separate)
    assert torch.allclose(separate, fused, rtol=2 * BF16, atol=2 * BF16 * float(bias.abs().max()))
