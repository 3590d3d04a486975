"""FP8 fast path on CUDA (marker gpu): the Triton quantisation kernel against its PyTorch twin,
`torch._scaled_mm`'s row-wise mode with a bias on this card, CUDA graphs vs eager in FP8, FP8 vs
bf16, and weight updates re-quantised in place without re-capture.

The Triton kernel is tested only here: Triton's CPU interpreter rounds e4m3 casts wrongly when
the mantissa carries into the exponent (policies/fast/fp8.py).
"""

import pytest
import torch

from policies.fast import fp8
from policies.fast.config import FP8_GEMM_GROUPS, FastConfig
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy

from .test_fast_gpu import gpu_cfg, inputs_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("act,width", [("none", 1152), ("none", 100), ("gelu_tanh", 4304), ("gelu_tanh_mul", 16384),
                                       ("none", 20000), ("gelu_tanh_mul", 16400)])  # the last two: two passes
def test_quantize_rows_triton_matches_reference(act, width):
    g = torch.Generator().manual_seed(width)
    cols = 2 * width if act == "gelu_tanh_mul" else width
    wide = torch.randn(77, cols + 16, generator=g) * 10 ** (torch.rand(77, 1, generator=g) * 4 - 2)
    x = wide.to("cuda", torch.bfloat16)[:, :cols]  # a row stride wider than the row
    x[3] = 0.0
    q, scale = fp8.quantize_rows_triton(x, act)
    q_ref, scale_ref = fp8.quantize_rows_reference(x, act)
    if act == "none":  # no activation: bit-equal scales and codes
        assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # The GELU's tanh differs in the last bits between Triton and PyTorch: a row's absolute max,
    # hence its scale, may move by an ulp (and then every code of the row is compared against a
    # slightly different grid), and a value next to a rounding boundary may land one e4m3 step away.
    assert torch.allclose(scale, scale_ref, rtol=1e-6, atol=0)
    got, want = fp8.dequantize_rows(q, scale), fp8.dequantize_rows(q_ref, scale_ref)
    step = 2.0**-3 * want.abs() + 2.0**-9 * scale_ref
    assert bool(((got - want).abs() <= step * 1.001).all())
    # the quantisation itself: the reference's activation on the kernel's own scale grid
    codes = (fp8.activate(x, act) * (1.0 / scale)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    on_grid = fp8.dequantize_rows(codes, scale)
    assert (got != on_grid).float().mean().item() < 1e-2
    assert bool((got[3] == 0).all())


def test_scaled_mm_rowwise_with_bias_on_this_card():
    """fp8_linear (row-wise scales, bf16 bias, M not a multiple of 16) vs its dequantised reference."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(77, 1152, generator=g).to("cuda", torch.bfloat16)
    w = fp8.make_fp8_weight(torch.randn(4304, 1152, generator=g).cuda() / 1152**0.5)
    bias = torch.randn(4304, generator=g).to("cuda", torch.bfloat16)
    got = fp8.fp8_linear(x, w, bias).float()
    q, scale = fp8.quantize_rows(x)
    want = fp8.scaled_linear_reference(q, scale, w, bias)
    assert relative_l2(got, want) < 6e-3  # bf16 output rounding (RMS ~2^-8 / sqrt(3))
    exact = torch.nn.functional.linear(x.float(), w.source.float(), bias.float())
    assert 1e-3 < relative_l2(got, exact) < 5e-2


def _fp8(model, graphs: bool = True) -> FastSampler:
    return FastSampler(model, FastConfig(precision="fp8", cuda_graphs=graphs, attention="sdpa",
                                         fp8_gemms=list(FP8_GEMM_GROUPS)))


def test_fp8_graphs_match_eager_and_stay_near_bf16():
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    cfg = policy.cfg
    eager, graphed = _fp8(policy.model, graphs=False), _fp8(policy.model)
    bf16 = FastSampler(policy.model, FastConfig(attention="sdpa"))
    for seed in (1, 2):
        inputs, noise, step_noise, stoch = inputs_for(cfg, 3, seed)
        want, want_lp = eager.sample_chains(inputs, noise, step_noise, stoch)
        got, got_lp = graphed.sample_chains(inputs, noise, step_noise, stoch)
        assert relative_l2(got, want) < 1e-5 and relative_l2(got_lp, want_lp) < 1e-4
        ref, _ = bf16.sample_chains(inputs, noise, step_noise, stoch)
        assert 1e-4 < relative_l2(got[:, -1], ref[:, -1]) < 8e-2
    assert all(set(b.graphs) == set(graphed.call_stages(b)) for b in graphed.buckets.values())  # overlap: 2
    assert len(graphed.w.fp8_weights) == 4 * cfg.vision.depth + 1 + 4 * cfg.prefix.depth


def test_fp8_weight_update_requantizes_without_recapture():
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    cfg = policy.cfg
    fast = _fp8(policy.model)
    inputs, noise, step_noise, stoch = inputs_for(cfg, 3, 11)
    before, _ = fast.sample_chains(inputs, noise, step_noise, stoch)
    graphs = {k: dict(b.graphs) for k, b in fast.buckets.items()}
    with torch.no_grad():
        for layer in policy.model.prefix.layers:
            layer.gate_up.weight.add_(torch.randn_like(layer.gate_up.weight) * 0.02)
    fast.refresh_weights()
    assert fast.w.last_requantized == cfg.prefix.depth
    after, _ = fast.sample_chains(inputs, noise, step_noise, stoch)
    fresh, _ = _fp8(policy.model, graphs=False).sample_chains(inputs, noise, step_noise, stoch)
    assert {k: dict(b.graphs) for k, b in fast.buckets.items()} == graphs, "no re-capture"
    assert relative_l2(after, before) > 1e-3
    assert relative_l2(after, fresh) < 1e-5
