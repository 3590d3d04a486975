"""policies/fast/cublaslt.py: the shape's validation and layout (CPU), every offered algorithm against
torch's GEMM on fresh random operands (GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from policies.fast.cublaslt import GemmShape, column_major_operands


def test_shape_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="rows"):
        GemmShape(0, 8, 8)
    with pytest.raises(ValueError, match="epilogue"):
        GemmShape(4, 8, 8, "relu")
    with pytest.raises(ValueError, match="accumulate"):
        GemmShape(4, 8, 8, "gelu_bias", accumulate=True)


def test_column_major_view_of_the_row_major_call():
    # y (M, N) = x (M, K) W (N, K)^T row-major is D (N x M) = A^T B column-major with A = W (K x N), B = x (K x M)
    ops = column_major_operands(GemmShape(rows=768, cols=1152, depth=4304, epilogue="bias"))
    assert (ops["m"], ops["n"], ops["k"]) == (1152, 768, 4304)
    assert ops["a"] == (4304, 1152, 4304) and ops["b"] == (4304, 768, 4304) and ops["d"] == (1152, 768, 1152)
    assert (ops["trans_a"], ops["trans_b"]) == (1, 0)


def test_flops():
    assert GemmShape(3, 5, 7).flops == 2 * 3 * 5 * 7


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue,accumulate", [("none", False), ("bias", False), ("gelu_bias", False),
                                                  ("none", True)])
def test_every_algorithm_matches_torch(epilogue, accumulate):
    from policies.fast.cublaslt import LtGemm

    shape = GemmShape(rows=300, cols=520, depth=1152, epilogue=epilogue, accumulate=accumulate)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(shape.rows, shape.depth, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(shape.cols, shape.depth, device="cuda", dtype=torch.bfloat16, generator=g) / shape.depth ** 0.5
    b = torch.randn(shape.cols, device="cuda", dtype=torch.bfloat16, generator=g) if epilogue != "none" else None
    base = torch.randn(shape.rows, shape.cols, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    if epilogue == "gelu_bias":
        ref = F.gelu(ref, approximate="tanh")
    if accumulate:
        ref = ref + base.float()
    plan = LtGemm(shape)
    assert plan.results, "the heuristic offered nothing"
    for index in range(len(plan.results)):
        out = base.clone()
        plan(x, w, b, out, index)
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"algorithm {index} ({plan.describe(index)}): rel L2 {err}"
    with pytest.raises(ValueError, match="weight"):
        plan(x, w.t().contiguous(), b, base.clone())
    plan.close()


def test_probe_cases_are_the_runner_gemms():
    from experiments.probe_cublaslt import gemm_cases
    from policies.config import PolicyConfig

    cfg = PolicyConfig.preset("pi05")
    small = gemm_cases(cfg, cameras=2, prompt_len=48, batch=1)  # LIBERO b1: 512 image rows, 560 prefix rows
    assert small["vision_fc1"] == GemmShape(512, 4304, 1152, "gelu_bias")
    assert small["prefix_down"] == GemmShape(560, 2048, 16384, accumulate=True)
    assert small["prefix_gate_up"].cols == 2 * 16384  # cuBLAS runs it below the fused GeGLU GEMM's rows
    assert "prefix_gate_up" not in gemm_cases(cfg, cameras=3, prompt_len=200, batch=1)  # 968 rows: fused
