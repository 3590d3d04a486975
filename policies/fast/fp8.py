"""FP8 (e4m3) GEMMs for the fast path's vision tower and prefix (`policy.fast.precision: fp8`).

Why only there: at large batch the bf16 prefix runs near the card's bf16 GEMM ceiling, and the
H200 runs FP8 GEMMs at about twice that rate; the expert's sampling math (denoise loop, flow
update, log-probs) stays in bf16/fp32, so the rollout's log-probs move only through the prefix
K/V the expert attends to.

Scheme (what `torch._scaled_mm`'s row-wise mode computes, on CUDA and on CPU):
- weights: one scale per output channel, s_w[n] = max_k |W[n, k]| / 448, Q_w = fp8(W / s_w), where W
  is the weight rounded to bf16 (the fast dtype's value, whatever the model's parameter dtype);
- activations: one scale per token (row), computed on the fly from the row's absolute maximum,
  s_x[m] = max_k |x[m, k]| / 448, Q_x = fp8(x / s_x);
- y = (Q_x Q_w^T) * s_x s_w^T + bias, accumulated in fp32, written in bf16.
448 is e4m3's largest finite value; values are clamped to it before the cast (PyTorch turns an
out-of-range e4m3 cast into NaN, and fp32 rounding of x / s_x can land a hair above 448).
Accumulation: `use_fast_accum=False` (Hopper's fast FP8 accumulation drops low-order bits over
long reductions; Gemma's down projection reduces over 16384).

The activation quantisation can absorb the activation before it: `act` = "gelu_tanh" (SigLIP's
fc2 input) or "gelu_tanh_mul" (GeGLU: gelu_tanh(gate) * up over a fused gate/up projection, the
Gemma down projection's input), so the bf16 activation tensor is never written. On CUDA this is
one Triton kernel per GEMM input (`quantize_rows_triton`, a row's absolute max then the scaled
cast, from registers in one read for rows up to 16384 wide); elsewhere the PyTorch twin
(`quantize_rows_reference`). The Triton kernel is tested on the GPU only: Triton 3.9's CPU
interpreter rounds e4m3 casts wrongly when the mantissa carries into the exponent (126.2 -> 64
instead of 128, measured here).

`project(x, lw)` and `mlp(x, up, down, act)` are what the runner calls: FP8 where the LinearW
carries an `Fp8Weight`, else exactly the bf16 calls the fast path made before FP8 existed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from policies.fast import kernels as K

C = None  # policies.fast.triton_common once a kernel factory ran (triton is imported on first use only)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row gets this amax: its scale stays finite and its values 0
ACTIVATIONS = ("none", "gelu_tanh", "gelu_tanh_mul")
ALIGN = 16  # _scaled_mm needs K and N divisible by 16
ONE_PASS_MAX_WIDTH = 16384  # rows up to this wide are quantised from registers in one read (Gemma's GeGLU)
WEIGHT_DTYPE = torch.bfloat16  # weights are quantised from their value in the fast dtype (fp8 needs bfloat16)


@dataclass
class Fp8Weight:
    """FP8 shadow of one (N, K) weight: `qweight` (N, K) e4m3 and `scale` (N,) fp32, so that
    weight ~ qweight * scale[:, None]. Both buffers keep their storage for the shadow's lifetime
    (CUDA graphs captured on them stay valid); `requantize_` rewrites them in place.
    `source` is the model's parameter; `version` its `_version` when last quantised."""

    qweight: Tensor
    scale: Tensor
    source: Tensor
    version: int


def supported(weight: Tensor) -> bool:
    """Whether `_scaled_mm` takes this (N, K) weight (both dims divisible by 16)."""
    return weight.dim() == 2 and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0


# ----------------------------------------------------------------------------- weights


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) -> (qweight (N, K) e4m3, scale (N,) fp32), one scale per output channel, of the weight
    as the fast path holds it: rounded to WEIGHT_DTYPE first. Why: the GRPO trainer's fast path
    (policy.fast.consistent_recompute) quantises its fp32 master weights, the engine its bf16 model's;
    from fp32 their per-channel scales and e4m3 values differed (a ~1e-2 nats recompute gap), from the
    bf16 rounding both hold they are bit-identical. fp8 needs policy.fast.dtype=bfloat16 (config.py)."""
    w = weight.detach().to(WEIGHT_DTYPE).float()
    scale = w.abs().amax(dim=1).clamp_min(MIN_AMAX) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def make_fp8_weight(param: Tensor) -> Fp8Weight:
    qweight, scale = quantize_weight(param)
    return Fp8Weight(qweight, scale, param, param._version)


@torch.no_grad()
def requantize_(w: Fp8Weight) -> None:
    """Re-quantise `w.source` into w's existing buffers (in place: no graph re-capture)."""
    qweight, scale = quantize_weight(w.source)
    w.qweight.copy_(qweight)
    w.scale.copy_(scale)
    w.version = w.source._version


def dequantize_weight(w: Fp8Weight) -> Tensor:
    return w.qweight.float() * w.scale[:, None]


# ----------------------------------------------------------------------------- activations


def activate(x: Tensor, act: str) -> Tensor:
    """act(x) in fp32: "none", "gelu_tanh", or "gelu_tanh_mul" (x = [gate | up] on the last dim)."""
    x = x.float()
    if act == "none":
        return x
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu_tanh_mul":
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")


def quantize_rows_reference(x: Tensor, act: str = "none") -> tuple[Tensor, Tensor]:
    """x (M, K') -> (q (M, K) e4m3, scale (M, 1) fp32) of act(x), one scale per row."""
    v = activate(x, act)
    # amax times the fp32 reciprocal of 448 (what PyTorch's CUDA division by a Python scalar does,
    # and what the Triton kernel does), then a multiply by the row's IEEE reciprocal scale (an IEEE
    # division per element kept the kernel instruction-bound on GeGLU rows: 0.84 ms against 0.59 with
    # the multiply at PhyAI b32, profile_stages_nvidia-h200_20261201-180100.json)
    scale = v.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX) * (1.0 / FP8_MAX)
    return (v * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale


@functools.cache
def _quantize_kernel():
    """Compiled on first use, so CPU-only runs never import triton."""
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, width, x_row_stride, ACT: tl.constexpr, BLOCK: tl.constexpr,
                             ONE_PASS: tl.constexpr):
        # One program per row: the row's absolute max of act(x), then act(x) / scale cast to e4m3.
        # ONE_PASS (BLOCK >= width): the activated row stays in registers between the two steps, so
        # x is read once (the H200 profile_stages run: the two-pass version of the GeGLU input took
        # as long as a third of the FP8 GEMMs at batch 32). Else two passes over BLOCK-wide slices,
        # the second mostly from L2. ACT: 0 none, 1 gelu_tanh, 2 gelu_tanh(gate) * up with up
        # `width` columns on.
        row = tl.program_id(0).to(tl.int64)
        src = x_ptr + row * x_row_stride
        dst = q_ptr + row * width
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = cols < width
            v = C.load_activated(src, cols, mask, width, ACT)
            scale = C.fp8_row_scale(tl.abs(v))
            tl.store(s_ptr + row, scale)
            tl.store(dst + cols, C.to_fp8(v, scale, q_ptr), mask=mask)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(C.load_activated(src, cols, cols < width, width, ACT)))
            scale = C.fp8_row_scale(amax)
            tl.store(s_ptr + row, scale)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < width
                tl.store(dst + cols, C.to_fp8(C.load_activated(src, cols, mask, width, ACT), scale, q_ptr), mask=mask)

    return quantize_rows_kernel


def quantize_rows_triton(x: Tensor, act: str = "none", num_warps: int | None = None,
                         one_pass: bool | None = None) -> tuple[Tensor, Tensor]:
    """The one-kernel version of `quantize_rows_reference` (x: 2-D, unit column stride).
    num_warps / one_pass override the defaults (experiments/profile_stages.py --quant-sweep)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")
    rows, cols = x.shape
    width = cols // 2 if act == "gelu_tanh_mul" else cols
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    whole = 1 << max(4, (width - 1).bit_length())  # the row's width rounded up to a power of two
    one_pass = whole <= ONE_PASS_MAX_WIDTH if one_pass is None else one_pass
    block = whole if one_pass else 2048
    # one pass: ~32 activated values per thread (16384 columns: 16 warps); two passes: 2048-wide slices
    warps = num_warps or (min(16, max(4, block // 1024)) if one_pass else 8)
    _quantize_kernel()[(rows,)](x, q, scale, width, x.stride(0), ACT=ACTIVATIONS.index(act), BLOCK=block,
                                ONE_PASS=one_pass, num_warps=warps)
    return q, scale


def quantize_rows(x: Tensor, act: str = "none") -> tuple[Tensor, Tensor]:
    """Per-row e4m3 quantisation of act(x) for x (M, K'): Triton on CUDA, PyTorch elsewhere."""
    if x.is_cuda:
        return quantize_rows_triton(x if x.stride(-1) == 1 else x.contiguous(), act)
    return quantize_rows_reference(x, act)


# ----------------------------------------------------------------------------- GEMMs


def scaled_linear(q: Tensor, scale: Tensor, w: Fp8Weight, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """(q * scale) @ (w.qweight * w.scale)^T + bias through `torch._scaled_mm` (fp32 accumulation)."""
    fused = bias is not None and _bias_fusable(q.device, out_dtype)
    out = torch._scaled_mm(q, w.qweight.t(), scale, w.scale.view(1, -1), bias=bias if fused else None,
                           out_dtype=out_dtype, use_fast_accum=False)
    return out if bias is None or fused else out + bias


@functools.cache
def _bias_fusable(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether this build's row-wise `_scaled_mm` takes a bias on `device` (probed once, on a tiny
    GEMM, before any graph capture: the fast path's stages run once eagerly first)."""
    q = torch.zeros(16, 16, dtype=FP8, device=device)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(q, q.t(), ones, ones.t(), bias=torch.zeros(16, dtype=out_dtype, device=device),
                         out_dtype=out_dtype, use_fast_accum=False)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def scaled_linear_reference(q: Tensor, scale: Tensor, w: Fp8Weight, bias: Tensor | None) -> Tensor:
    """What `scaled_linear` computes, dequantised and multiplied in fp32 (the test reference)."""
    out = dequantize_rows(q, scale) @ dequantize_weight(w).t()
    return out + bias.float() if bias is not None else out


def fp8_linear(x: Tensor, w: Fp8Weight, bias: Tensor | None, act: str = "none") -> Tensor:
    """F.linear(act(x), W, bias) with act(x) quantised per token and W per channel; x's dtype out."""
    shape = x.shape
    q, scale = quantize_rows(x.reshape(-1, shape[-1]), act)
    out = scaled_linear(q, scale, w, bias.to(x.dtype) if bias is not None else None, x.dtype)
    return out.view(*shape[:-1], out.shape[-1])


# ----------------------------------------------------------------------------- runner dispatch


def project(x: Tensor, lw, act: str = "none") -> Tensor:
    """linear(act(x)) for a weights.LinearW: FP8 when it carries an `fp8` shadow, else F.linear."""
    if lw.fp8 is not None:
        return fp8_linear(x, lw.fp8, lw.bias, act)
    return F.linear(activated(x, act), lw.weight, lw.bias)


def activated(x: Tensor, act: str) -> Tensor:
    """act(x) in x's dtype, as the bf16 projections apply it (the GeGLU through the Triton kernel);
    `activate` is the fp32 reference of the quantisation."""
    if act == "gelu_tanh_mul":
        return K.gelu_tanh_mul(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return x


def mlp(x: Tensor, up, down, act: str) -> Tensor:
    """down(act(up(x))): SigLIP's MLP (act "gelu_tanh") or Gemma's GeGLU ("gelu_tanh_mul").
    In bf16 these are the calls the fast path always made (SigLIP's GELU in fc1's cuBLASLt
    epilogue); in FP8 the activation moves into the down projection's input quantisation. (The
    prefix's GeGLU MLP goes through `project` twice in runner.py, its down adding into the residual.)"""
    if up.fp8 is None and down.fp8 is None and act == "gelu_tanh":
        return F.linear(K.linear_gelu_tanh(x, up.weight, up.bias), down.weight, down.bias)
    return project(project(x, up), down, act)
