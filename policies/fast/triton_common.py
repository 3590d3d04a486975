"""Triton device functions shared by the fast path's kernels (kernels.py, skinny.py, fp8.py,
triton_attention.py). Imported only inside their kernel factories, so CPU-only runs never import
triton; under TRITON_INTERPRET=1 they run in the interpreter like the kernels that call them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_trigger_early(PDL: tl.constexpr):
    """pdl.py's mode 2 ("early"): let the dependent kernel launch right at this kernel's start."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the predecessor has completed and its writes are visible (call before the first
    activation read or any write); mode 1 ("on") then lets the dependent kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel with nothing to do before its wait: trigger (mode 2), wait, trigger (mode 1)."""
    pdl_trigger_early(PDL)
    pdl_wait(PDL)


@triton.jit
def gelu_tanh(x):
    """gelu_tanh(x) in fp32, tanh as 2 / (1 + e^-2u) - 1 with u clamped to +-15 (tanh is +-1 there
    in fp32; the clamp keeps exp finite)."""
    inner = tl.minimum(tl.maximum(0.7978845608028654 * (x + 0.044715 * x * x * x), -15.0), 15.0)
    return 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))


@triton.jit
def load_activated(src, cols, mask, width, ACT: tl.constexpr):
    """fp8.py's activation of one block of a row, in fp32: ACT 0 x, 1 gelu_tanh(x), 2 gelu_tanh(gate)
    * up with the up half `width` columns after the gate."""
    v = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT != 0:
        v = gelu_tanh(v)
    if ACT == 2:
        v = v * tl.load(src + width + cols, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def fp8_row_scale(abs_values):
    """fp8.py's per-row scale: amax * fp32(1/448), as quantize_rows_reference (bit-equal scales)."""
    return tl.maximum(tl.max(abs_values, axis=0), 1e-12) * (1.0 / 448.0)


@triton.jit
def to_fp8(v, scale, q_ptr):
    """v / scale clamped to e4m3's range and cast to q_ptr's element type, with an IEEE division
    per element (Triton's `/` is approximate), as quantize_rows_reference."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
    return q.to(q_ptr.dtype.element_ty)
