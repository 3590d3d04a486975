"""The expert's fp32 action projections fused with the norms beside them: one kernel each on CUDA.

Why: each denoise step starts with action_in_proj (fp32, the 32 action dims -> the expert width)
and the first AdaRMS norm, and ends with the last AdaRMS norm and action_out_proj (fp32, the width
-> 32 dims). Through cuBLAS and PyTorch these were ~10 small launches per step, none of them
chained by PDL (pdl.py): at PhyAI batch 1 about 80 us of each ~790 us step on the H200 (the graph
timeline of profile_denoise_nvidia-h200_20261202-031734.json: sgemm_largek alone 15 us per call,
and 380 us of the denoise graph idle between launches). Both projections are tiny per row (a
32 x width fp32 matrix, 128 KB), so one program per row does projection and norm:
- `action_in_norm`: h = (x W_in^T + b_in) rounded to the activation dtype, normed = AdaRMS(h);
- `add_norm_action_out`: h += y * gate (y: the last down projection, or its split-K partials),
  then v = AdaRMS(h), rounded to the activation dtype as the plain path's `normed` is, times
  W_out^T plus b_out, in fp32 (LeRobot keeps action_out_proj in fp32).
A row's result depends only on that row (the consistent recompute's batch invariance). The
`*_reference` twins are the plain-PyTorch path the fast sampler ran before: the CPU path, and what
the tests compare the kernels against (on CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from policies.fast import kernels as K
from policies.fast.pdl import launch_kwargs

C = None  # policies.fast.triton_common once the kernel factory ran (triton is imported on first use only)
# The kernels hold the whole projection weight in registers, loaded before their PDL wait (during the
# predecessor: each denoise step streams ~620 MB of expert weights through the 50 MB L2, so these
# 128 KB are likely evicted between steps); up to MAX_TILE elements, 128 fp32 registers a thread
# at MAX_WARPS warps (the expert's 1024 x 32), else the reference path runs.
MAX_TILE, MAX_WARPS = 32768, 8


def _warps(block: int) -> int:
    """No more threads than row elements: on the H200 (Triton 3.6) add_norm_action_out gave wrong
    projections, erratically, at width 48 (a 64-wide row over 128 or 256 threads, each element held
    by several threads), right ones at 1024, in every formulation tried."""
    return max(1, min(MAX_WARPS, block // 32))


def action_in_norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, scale: Tensor,
                             shift: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """x (B, T, D) fp32 -> (h, normed), each (B*T, W) in `dtype`: h = x W^T + b in fp32 then rounded,
    normed = h * rstd * (1 + scale) + shift."""
    b, t, _ = x.shape
    h = F.linear(x, weight, bias).to(dtype).reshape(b * t, -1)
    return K.add_rms_norm_reference(h, None, None, scale, shift, eps)


def add_norm_action_out_reference(h: Tensor, y: Tensor, gate: Tensor | None, scale: Tensor, shift: Tensor | None,
                                  eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    """h (N, W), updated in place; y (N, W), or (splits, N, W) fp32 partials summed in split order ->
    v (N, D) fp32 = normed.float() W^T + b, normed in h's dtype (kernels.add_rms_norm_reference)."""
    new_h, normed = K.add_rms_norm_reference(h, K.sum_partials(y) if y.dim() == 3 else y, gate, scale, shift, eps)
    h.copy_(new_h)
    return F.linear(normed.float(), weight.float(), None if bias is None else bias.float())


@functools.cache
def _kernels():
    """Compiled on first use, so CPU-only runs never import triton."""
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def action_in_norm_kernel(
        x_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, h_ptr, out_ptr, tokens, x_batch_stride, width, eps,
        scale_row_stride, shift_row_stride, D: tl.constexpr, D_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_SHIFT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        d = tl.arange(0, D_BLOCK)
        d_ok = d < D
        # the weights need nothing from the predecessor: in registers before the wait (see the module doc)
        C.pdl_trigger_early(PDL)
        w, bias = C.load_linear(w_ptr, b_ptr, cols, mask, d, d_ok, D, HAS_BIAS)
        C.pdl_wait(PDL)  # the predecessor (the last flow step) is done: x is written
        x_row = x_ptr + (row // tokens) * x_batch_stride + (row % tokens) * D  # x: a (B, T, D) view of the chains
        x = tl.load(x_row + d, mask=d_ok, other=0.0).to(tl.float32)
        h = C.apply_linear(w, bias, x).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * width + cols, h, mask=mask)
        normed = C.norm_row(h.to(tl.float32), mask, width, eps, scale_ptr + row * scale_row_stride + cols,
                            shift_ptr + row * shift_row_stride + cols, HAS_SHIFT, False)
        tl.store(out_ptr + row * width + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def add_norm_action_out_kernel(
        h_ptr, y_ptr, gate_ptr, scale_ptr, shift_ptr, w_ptr, b_ptr, v_ptr, width, eps,
        gate_row_stride, scale_row_stride, shift_row_stride, y_split_stride, Y_SPLITS: tl.constexpr,
        HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_BIAS: tl.constexpr, N_OUT: tl.constexpr,
        N_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        n = tl.arange(0, N_BLOCK)
        n_ok = n < N_OUT
        C.pdl_trigger_early(PDL)  # the weights in registers before the wait, as action_in_norm_kernel
        w, bias = C.load_linear(w_ptr, b_ptr, n, n_ok, cols, mask, width, HAS_BIAS)
        C.pdl_wait(PDL)  # the predecessor is done: its activations are visible
        h = C.residual_update(h_ptr, y_ptr, gate_ptr, row, cols, mask, width, gate_row_stride, y_split_stride,
                              Y_SPLITS, HAS_GATE)
        normed = C.norm_row(h, mask, width, eps, scale_ptr + row * scale_row_stride + cols,
                            shift_ptr + row * shift_row_stride + cols, HAS_SHIFT, False)
        x = normed.to(h_ptr.dtype.element_ty).to(tl.float32)  # the plain path's `normed.float()`
        v = C.apply_linear(w, bias, x)
        tl.store(v_ptr + row * N_OUT + n, v, mask=n_ok)

    return action_in_norm_kernel, add_norm_action_out_kernel


def action_in_norm_triton(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, scale: Tensor,
                          shift: Tensor | None, eps: float, pdl: int = 0) -> tuple[Tensor, Tensor]:
    b, t, d = x.shape
    width = weight.shape[0]
    h = torch.empty(b * t, width, dtype=dtype, device=x.device)
    out = torch.empty_like(h)
    _kernels()[0][(b * t,)](
        x, weight, bias if bias is not None else weight, scale, shift if shift is not None else scale, h, out,
        t, x.stride(0), width, eps, K.row_stride(scale), K.row_stride(shift), D=d, D_BLOCK=K.row_block(d),
        HAS_BIAS=bias is not None, HAS_SHIFT=shift is not None, BLOCK=K.row_block(width),
        PDL=pdl, num_warps=_warps(K.row_block(width)), **launch_kwargs(pdl),
    )
    return h, out


def add_norm_action_out_triton(h: Tensor, y: Tensor, gate: Tensor | None, scale: Tensor, shift: Tensor | None,
                               eps: float, weight: Tensor, bias: Tensor | None, pdl: int = 0) -> Tensor:
    rows, width = h.shape
    n_out = weight.shape[0]
    v = torch.empty(rows, n_out, dtype=torch.float32, device=h.device)
    splits = y.shape[0] if y.dim() == 3 else 1
    _kernels()[1][(rows,)](
        h, y, gate if gate is not None else h, scale, shift if shift is not None else scale, weight,
        bias if bias is not None else weight, v, width, eps, K.row_stride(gate), K.row_stride(scale),
        K.row_stride(shift), rows * width, Y_SPLITS=splits, HAS_GATE=gate is not None, HAS_SHIFT=shift is not None,
        HAS_BIAS=bias is not None, N_OUT=n_out, N_BLOCK=K.row_block(n_out), BLOCK=K.row_block(width), PDL=pdl,
        num_warps=_warps(K.row_block(width)), **launch_kwargs(pdl),
    )
    return v


def _contiguous(*tensors: Tensor | None) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)


def _fits(weight: Tensor) -> bool:
    """The (padded) weight tile fits the kernels' registers (MAX_TILE)."""
    return K.row_block(weight.shape[0]) * K.row_block(weight.shape[1]) <= MAX_TILE


def action_in_norm(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, scale: Tensor,
                   shift: Tensor | None, eps: float, pdl: int = 0) -> tuple[Tensor, Tensor]:
    """x (B, T, D) fp32 (rows of D contiguous within a sample: chains[:, k]) -> (h, normed) (B*T, W) in
    `dtype`. pdl: pdl.py's mode code (CUDA only)."""
    rows_packed = x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if K.triton_usable(x) and rows_packed and _contiguous(weight, bias, scale, shift) and _fits(weight):
        return action_in_norm_triton(x, weight, bias, dtype, scale, shift, eps, pdl)
    return action_in_norm_reference(x, weight, bias, dtype, scale, shift, eps)


def add_norm_action_out(h: Tensor, y: Tensor, gate: Tensor | None, scale: Tensor, shift: Tensor | None, eps: float,
                        weight: Tensor, bias: Tensor | None, pdl: int = 0) -> Tensor:
    """h (N, W) += y * gate in place (y (N, W), or (splits, N, W) fp32 split-K partials), then
    v (N, D) fp32 = AdaRMS(h) W^T + b. pdl: pdl.py's mode code (CUDA only)."""
    if K.triton_usable(h) and _contiguous(h, y, gate, scale, shift, weight, bias) and _fits(weight):
        return add_norm_action_out_triton(h, y, gate, scale, shift, eps, weight, bias, pdl)
    return add_norm_action_out_reference(h, y, gate, scale, shift, eps, weight, bias)
