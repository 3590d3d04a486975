"""action_io.py's fused kernels (fp32 action projections + AdaRMS norms) against their plain-PyTorch
references and against the layers they replace, on fresh random inputs.

On CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); on a CUDA machine they run compiled.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from policies.fast import action_io as A  # noqa: E402
from policies.fast import kernels as K  # noqa: E402

from .test_fast_kernels import DEVICE, TOL, rel  # noqa: E402


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,width,per_row", [(32, 48, False), (7, 40, True), (12, 64, False), (32, 1024, False)])
def test_action_in_norm_matches_reference(dtype, d, width, per_row):
    """x is a (B, T, D) view of a chains buffer (batch stride > T x D), as chains[:, k] in the sampler."""
    g = torch.Generator().manual_seed(d * 100 + width)
    b, t, steps = 3, 5, 4
    chains = _randn(g, b, steps + 1, t, d)
    x = chains[:, 2]
    weight, bias = _randn(g, width, d), _randn(g, width)
    scale = _randn(g, b * t, width) if per_row else _randn(g, width)
    shift = _randn(g, width)
    want_h, want = A.action_in_norm_reference(x, weight, bias, dtype, scale, shift, 1e-6)
    got_h, got = A.action_in_norm_triton(x, weight, bias, dtype, scale, shift, 1e-6)
    assert got_h.dtype == dtype and got.dtype == dtype and got.shape == (b * t, width)
    assert rel(got_h, want_h) < TOL[dtype]
    assert rel(got, want) < TOL[dtype]


def test_action_in_norm_reference_is_the_plain_layers():
    """The reference is nn.Linear then the AdaRMS norm of kernels.add_rms_norm_reference."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=g)
    layer = torch.nn.Linear(8, 16)
    scale, shift = torch.randn(16, generator=g), torch.randn(16, generator=g)
    h, normed = A.action_in_norm_reference(x, layer.weight, layer.bias, torch.bfloat16, scale, shift, 1e-6)
    with torch.no_grad():
        want_h = layer(x).to(torch.bfloat16).reshape(6, 16)
    assert torch.equal(h, want_h)
    assert torch.equal(normed, K.add_rms_norm_reference(want_h, None, None, scale, shift, 1e-6)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,n_out,with_gate,width", [(1, 32, True, 48), (4, 32, True, 48), (3, 7, False, 40),
                                                           (2, 12, True, 100), (8, 32, True, 1024)])
def test_add_norm_action_out_matches_reference(dtype, splits, n_out, with_gate, width):
    """Widths below the program's thread count too (on the H200 those gave wrong projections with more
    threads than row elements: action_io._warps)."""
    g = torch.Generator().manual_seed(splits * 31 + n_out)
    rows = 9
    h = _randn(g, rows, width, dtype=dtype)
    y = _randn(g, splits, rows, width) if splits > 1 else _randn(g, rows, width, dtype=dtype)
    gate = _randn(g, width) if with_gate else None
    scale, shift = _randn(g, width), _randn(g, width)
    weight, bias = _randn(g, n_out, width), _randn(g, n_out)
    h_ref, h_got = h.clone(), h.clone()
    want = A.add_norm_action_out_reference(h_ref, y, gate, scale, shift, 1e-6, weight, bias)
    got = A.add_norm_action_out_triton(h_got, y, gate, scale, shift, 1e-6, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n_out)
    assert rel(h_got, h_ref) < TOL[dtype], "the residual stream is updated in place"
    assert rel(got, want) < TOL[dtype]


def test_add_norm_action_out_reference_is_the_plain_layers():
    """The reference is the residual AdaRMS step (normed rounded to h's dtype) then an fp32 nn.Linear."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 16, generator=g).to(torch.bfloat16)
    partials = torch.randn(3, 6, 16, generator=g)
    gate, scale, shift = (torch.randn(16, generator=g) for _ in range(3))
    layer = torch.nn.Linear(16, 4)
    want_h, normed = K.add_rms_norm_reference(h.clone(), K.sum_partials(partials), gate, scale, shift, 1e-6)
    got = A.add_norm_action_out_reference(h, partials, gate, scale, shift, 1e-6, layer.weight, layer.bias)
    with torch.no_grad():
        assert torch.equal(got, F.linear(normed.float(), layer.weight, layer.bias))
    assert torch.equal(h, want_h)
