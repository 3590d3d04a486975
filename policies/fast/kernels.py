"""Fused element-wise kernels for the fast path (Triton on CUDA; plain PyTorch elsewhere).

Why: at batch 1 the denoise loop is launch-bound (18 layers x 10 steps), and a plain PyTorch
RMSNorm is 6-8 kernels. Each function here is one kernel on CUDA:
- `add_rms_norm`: h <- h + y * gate (optional), then out = rms(h) * (1 + scale) + shift, with
  per-row (AdaRMS) or shared (Gemma RMSNorm) scale/shift. Residual stream in the activation
  dtype (as LeRobot's bf16 residual adds), normalisation in fp32.
- `rope_scatter_qkv`: split a fused QKV projection, apply RoPE to q and k, write q to a dense
  buffer and k, v into per-sample KV-cache slots (the prefix/suffix layout of `attention.py`).
- `gelu_tanh_mul`: GeGLU's gelu_tanh(gate) * up over a fused gate/up projection.
- `add_layer_norm`: SigLIP's residual add + LayerNorm in one pass (same kernel, LayerNorm mode).
- `linear_gelu_tanh`: SigLIP's fc1 with the GELU in cuBLASLt's epilogue on CUDA.
- `flow_step`: one ODE/SDE denoise update with its log-density (RLinf's flow-SDE, policies.flow).
Each has a `*_reference` twin in plain PyTorch: the CPU path, and what the tests compare the
Triton kernels against (on CPU through TRITON_INTERPRET=1).
`add_rms_norm_partials` and `rope_scatter_qkv` also take the skinny GEMMs' fp32 split-K partials
(skinny.py) and add them up first, in split order. The kernels of the denoise graph take a PDL
mode (pdl.py): they wait for their predecessor before their first activation read.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from policies import flow
from policies.fast.pdl import launch_kwargs

# rope_scatter_qkv's programs: one token and one head each up to ROPE_TOKENS_PER_PROGRAM_FROM tokens
# (latency), ROPE_TOKENS_PER_PROGRAM tokens and one head above, and those tokens with all their heads
# from ROPE_ALL_HEADS_FROM tokens. H200, profile_stages_nvidia-h200_20261201-180641.json: all heads
# per program took the prefix's scatter from 2.52 to 1.53 ms at PhyAI b32 (30976 tokens) and from
# 2.94 to 1.79 at LIBERO b64, but slowed the denoise loop's (1600 and 640 tokens: 200 and 80
# programs) from 0.94 to 1.09 ms and 0.22 to 0.36.
ROPE_TOKENS_PER_PROGRAM, ROPE_TOKENS_PER_PROGRAM_FROM, ROPE_ALL_HEADS_FROM = 8, 256, 4096
C = None  # policies.fast.triton_common once a kernel factory ran (triton is imported on first use only)

# ----------------------------------------------------------------------------- references


def add_rms_norm_reference(
    h: Tensor, y: Tensor | None, gate: Tensor | None, scale: Tensor, shift: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """h (N, W); y (N, W) or None; gate/scale/shift (N, W) or (W,) -> (new h, normed), h's dtype."""
    if y is not None:
        update = y.float() * gate.float() if gate is not None else y.float()
        h = (h.float() + update).to(h.dtype)
    x = h.float()
    normed = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * (1.0 + scale.float())
    if shift is not None:
        normed = normed + shift.float()
    return h, normed.to(h.dtype)


def add_layer_norm_reference(
    h: Tensor, y: Tensor | None, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """SigLIP's pre-norm residual step: h <- h + y (in h's dtype), then LayerNorm(h) in fp32."""
    if y is not None:
        h = (h.float() + y.float()).to(h.dtype)
    normed = torch.nn.functional.layer_norm(h.float(), (h.shape[-1],), weight.float(), bias.float(), eps)
    return h, normed.to(h.dtype)


def rope_scatter_qkv_reference(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
    q_out: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
) -> None:
    """qkv (B, T, (H + 2 KV) hd); cos/sin (B, T, hd); q_out (B, T, H, hd);
    k_cache/v_cache (B, S, KV, hd); slots (B, T) int: cache row of each token."""
    b, t, _ = qkv.shape
    hd = cos.shape[-1]
    q, k, v = qkv.split((num_heads * hd, num_kv_heads * hd, num_kv_heads * hd), dim=-1)
    q = q.view(b, t, num_heads, hd).float()
    k = k.view(b, t, num_kv_heads, hd).float()
    c, s = cos.float()[:, :, None, :], sin.float()[:, :, None, :]

    def rot(x: Tensor) -> Tensor:
        half = hd // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    q_out.copy_((q * c + rot(q) * s).to(q_out.dtype))
    rows = torch.arange(b, device=qkv.device)[:, None].expand(b, t)
    k_cache[rows, slots.long()] = (k * c + rot(k) * s).to(k_cache.dtype)
    v_cache[rows, slots.long()] = v.view(b, t, num_kv_heads, hd).to(v_cache.dtype)


def gelu_tanh_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate.float(), approximate="tanh") * up.float()).to(gate_up.dtype)


def flow_step_reference(chains: Tensor, v: Tensor, step_noise: Tensor, stochastic: Tensor, logp: Tensor,
                        k: int, t: float, delta: float, sigma: float, dt: float) -> None:
    """One denoise update, in place: chains[:, k+1] from chains[:, k] and the velocity v (B, H, D):
    RLinf's flow-SDE step where stochastic[:, k], else the Euler step x + dt v; logp[:, k] gets the
    Gaussian log-density of a stochastic step (0 on deterministic ones). fp32, as policies.flow."""
    x = chains[:, k]
    as_t = lambda value: torch.tensor(value, dtype=x.dtype, device=x.device)  # noqa: E731
    mean, std = flow.sde_step_mean_std(x, v, as_t(t), as_t(delta), as_t(sigma))
    chosen = stochastic[:, k, None, None]
    x_next = torch.where(chosen, mean + std * step_noise[:, k], flow.euler_step(x, v, dt))
    chains[:, k + 1].copy_(x_next)
    logp[:, k].copy_(torch.where(chosen, flow.gaussian_log_prob(x_next, mean, std), torch.zeros_like(x_next)))


# ----------------------------------------------------------------------------- triton


@functools.cache
def _triton_kernels():
    """Compile-on-import of the Triton kernels, deferred so CPU-only runs never import triton."""
    global C  # the kernels' shared device functions: a module global, which the interpreter also sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def add_norm_kernel(
        h_ptr, y_ptr, gate_ptr, scale_ptr, shift_ptr, out_ptr, width, eps,
        gate_row_stride, scale_row_stride, shift_row_stride, y_split_stride, Y_SPLITS: tl.constexpr,
        HAS_Y: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr, LAYER_NORM: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        C.pdl_enter(PDL)  # pdl.py: wait for the predecessor before the first activation read
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        if HAS_Y:
            h = C.residual_update(h_ptr, y_ptr, gate_ptr, row, cols, mask, width, gate_row_stride, y_split_stride,
                                  Y_SPLITS, HAS_GATE)
        else:
            h = tl.load(h_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        normed = C.norm_row(h, mask, width, eps, scale_ptr + row * scale_row_stride + cols,
                            shift_ptr + row * shift_row_stride + cols, HAS_SHIFT, LAYER_NORM)
        tl.store(out_ptr + row * width + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_scatter_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
        num_tokens, tokens_per_sample, cache_rows, split_stride, SPLITS: tl.constexpr,
        H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr,
        ALL_HEADS: tl.constexpr, PDL: tl.constexpr,
    ):
        C.pdl_enter(PDL)  # pdl.py: wait for the predecessor before the first activation read
        # One program per TOKENS tokens and one head (0..H-1 q heads, then KV k heads, then KV v
        # heads), or with ALL_HEADS every head of its tokens, the RoPE tables read once for all of
        # them (the prefix: per-head programs re-read cos/sin for each of its 10 heads, twice the
        # bytes of the projection itself, and ran at ~half the copy bandwidth on the H200).
        token = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None]  # flat (b * T + t), (TOKENS, 1)
        ok = token < num_tokens
        d = tl.arange(0, HALF)[None, :]
        slot = tl.load(slot_ptr + token, mask=ok, other=0).to(tl.int64)
        cache_row = (token // tokens_per_sample).to(tl.int64) * cache_rows + slot
        trig = token.to(tl.int64) * HD
        c1 = tl.load(cos_ptr + trig + d, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + trig + HALF + d, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + trig + d, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + trig + HALF + d, mask=ok, other=0.0).to(tl.float32)
        if ALL_HEADS:
            for head in tl.static_range(H + 2 * KV):
                C.rope_one_head(qkv_ptr, q_ptr, k_ptr, v_ptr, token, ok, d, head, cache_row, c1, c2, s1, s2,
                                split_stride, SPLITS, H, KV, HD, HALF)
        else:
            C.rope_one_head(qkv_ptr, q_ptr, k_ptr, v_ptr, token, ok, d, tl.program_id(1), cache_row, c1, c2, s1,
                            s2, split_stride, SPLITS, H, KV, HD, HALF)

    @triton.jit
    def gelu_tanh_mul_kernel(gu_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        g = tl.load(gu_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
        out = C.gelu_tanh(g) * u
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def flow_step_kernel(chains_ptr, v_ptr, noise_ptr, stoch_ptr, logp_ptr, k, num_steps, width,
                         t, delta, sigma, dt, BLOCK: tl.constexpr, PDL: tl.constexpr):
        C.pdl_enter(PDL)  # pdl.py: wait for the predecessor (the velocity) before the first read
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < width
        src = chains_ptr + (b * (num_steps + 1) + k) * width + i
        x = tl.load(src, mask=m, other=0.0)
        v = tl.load(v_ptr + b * width + i, mask=m, other=0.0)
        eps = tl.load(noise_ptr + (b * num_steps + k) * width + i, mask=m, other=0.0)
        chosen = tl.load(stoch_ptr + b * num_steps + k) != 0
        x0 = x - v * t
        x1 = x + v * (1 - t)
        mean = x0 * (1 - (t - delta)) + x1 * (t - delta - sigma * sigma * delta / (2 * t))
        std = tl.sqrt(delta) * sigma
        x_next = tl.where(chosen, mean + std * eps, x + dt * v)
        safe = tl.where(chosen, std, 1.0)
        z = (x_next - mean) / safe
        logp = tl.where(chosen, -tl.log(safe) - 0.9189385332046727 - 0.5 * z * z, 0.0)
        tl.store(src + width, x_next, mask=m)
        tl.store(logp_ptr + (b * num_steps + k) * width + i, logp, mask=m)

    return add_norm_kernel, rope_scatter_kernel, gelu_tanh_mul_kernel, flow_step_kernel


def triton_usable(t: Tensor) -> bool:
    """Dispatch to Triton for CUDA tensors only. (The `*_triton` functions also run on CPU
    tensors under TRITON_INTERPRET=1; the tests call them directly that way.)"""
    return t.is_cuda


def row_stride(t: Tensor | None) -> int:
    return 0 if t is None or t.dim() == 1 else t.stride(0)


def row_block(n: int) -> int:
    """The power-of-two block (>= 16) that holds n row elements in one program."""
    return 1 << max(4, math.ceil(math.log2(n)))


def _norm_warps(width: int, y_splits: int) -> int:
    """8 warps for wide rows, and for split-K partials: then each thread holds one 16-byte vector per
    partial and ptxas issues all of them before the first add (compiled for sm_90 at width 1024: 8 of
    8 in flight, against ~6 with 4 warps)."""
    return 8 if width >= 2048 or y_splits > 1 else 4


def _add_norm_triton(h, y, gate, scale, shift, eps, layer_norm: bool, y_splits: int = 1,
                     pdl: int = 0) -> tuple[Tensor, Tensor]:
    kernel = _triton_kernels()[0]
    width = h.shape[-1]
    rows = h.numel() // width
    out = torch.empty_like(h)
    block = row_block(width)
    kernel[(rows,)](
        h, y if y is not None else h, gate if gate is not None else h, scale,
        shift if shift is not None else scale, out, width, eps,
        row_stride(gate), row_stride(scale), row_stride(shift), rows * width, Y_SPLITS=y_splits,
        HAS_Y=y is not None, HAS_GATE=gate is not None, HAS_SHIFT=shift is not None, LAYER_NORM=layer_norm,
        BLOCK=block, PDL=pdl, num_warps=_norm_warps(width, y_splits), **launch_kwargs(pdl),
    )
    return h, out


def add_rms_norm_triton(
    h: Tensor, y: Tensor | None, gate: Tensor | None, scale: Tensor, shift: Tensor | None, eps: float,
) -> tuple[Tensor, Tensor]:
    """In place on h (when y is given). Rows are the leading dims flattened; (W,) params are shared."""
    return _add_norm_triton(h, y, gate, scale, shift, eps, layer_norm=False)


def add_layer_norm_triton(
    h: Tensor, y: Tensor | None, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """In place on h (when y is given): h += y; returns (h, LayerNorm(h))."""
    return _add_norm_triton(h, y, None, weight, bias, eps, layer_norm=True)


def rope_scatter_qkv_triton(
    qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
    q_out: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, pdl: int = 0,
) -> None:
    kernel = _triton_kernels()[1]
    b, t = cos.shape[:2]
    hd = cos.shape[-1]
    splits = qkv.shape[0] if qkv.dim() == 4 else 1  # (splits, B, T, width) fp32 partials (skinny.py)
    tokens = 1 if b * t <= ROPE_TOKENS_PER_PROGRAM_FROM else ROPE_TOKENS_PER_PROGRAM
    all_heads = b * t >= ROPE_ALL_HEADS_FROM
    kernel[(math.ceil(b * t / tokens), 1 if all_heads else num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, q_out, k_cache, v_cache, slots, b * t, t, k_cache.shape[1], b * t * qkv.shape[-1],
        SPLITS=splits, H=num_heads, KV=num_kv_heads, HD=hd, HALF=hd // 2, TOKENS=tokens, ALL_HEADS=all_heads, PDL=pdl,
        num_warps=1 if tokens == 1 else 4, **launch_kwargs(pdl),
    )


def gelu_tanh_mul_triton(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    kernel = _triton_kernels()[2]
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * width)
    out = gate_up.new_empty(*gate_up.shape[:-1], width) if out is None else out
    block = 1024
    kernel[(rows, math.ceil(width / block))](gate_up, out, width, BLOCK=block, num_warps=4)
    return out


def flow_step_triton(chains, v, step_noise, stochastic, logp, k, t, delta, sigma, dt, pdl: int = 0) -> None:
    kernel = _triton_kernels()[3]
    batch, steps_plus_one = chains.shape[:2]
    width = chains[0, 0].numel()
    block = 1024
    kernel[(batch, math.ceil(width / block))](
        chains, v, step_noise, stochastic, logp, k, steps_plus_one - 1, width, t, delta, sigma, dt,
        BLOCK=block, PDL=pdl, num_warps=4, **launch_kwargs(pdl),
    )


# ----------------------------------------------------------------------------- dispatch


def add_rms_norm(h, y, gate, scale, shift, eps, pdl: int = 0):
    if triton_usable(h) and h.is_contiguous():
        return _add_norm_triton(h, y, gate, scale, shift, eps, layer_norm=False, pdl=pdl)
    new_h, normed = add_rms_norm_reference(h, y, gate, scale, shift, eps)
    if y is not None:
        h.copy_(new_h)
    return h, normed


def add_layer_norm(h, y, weight, bias, eps):
    if triton_usable(h) and h.is_contiguous():
        return add_layer_norm_triton(h, y, weight, bias, eps)
    new_h, normed = add_layer_norm_reference(h, y, weight, bias, eps)
    if y is not None:
        h.copy_(new_h)
    return h, normed


def linear_gelu_tanh(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """gelu_tanh(x W^T + b); on CUDA the GELU runs in cuBLASLt's GEMM epilogue (one kernel)."""
    if x.is_cuda:
        shape = x.shape
        out = torch._addmm_activation(bias, x.reshape(-1, shape[-1]), weight.t(), use_gelu=True)
        return out.view(*shape[:-1], -1)
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")


def rope_scatter_qkv(qkv, cos, sin, num_heads, num_kv_heads, q_out, k_cache, v_cache, slots, pdl: int = 0):
    """qkv (B, T, width), or (splits, B, T, width) fp32 split-K partials (skinny.py) summed first.
    pdl: pdl.py's mode code (CUDA only)."""
    if triton_usable(qkv) and qkv.is_contiguous():
        return rope_scatter_qkv_triton(qkv, cos, sin, num_heads, num_kv_heads, q_out, k_cache, v_cache, slots, pdl)
    if qkv.dim() == 4:
        qkv = sum_partials(qkv)
    return rope_scatter_qkv_reference(qkv, cos, sin, num_heads, num_kv_heads, q_out, k_cache, v_cache, slots)


def add_rms_norm_partials(h, partials, gate, scale, shift, eps, pdl: int = 0):
    """add_rms_norm with y given as (splits, rows, W) fp32 split-K partials (skinny.py), summed in
    split order in fp32 (not rounded to h's dtype before the gate, unlike a GEMM's bf16 output)."""
    if triton_usable(h) and h.is_contiguous() and partials.is_contiguous():
        return _add_norm_triton(h, partials, gate, scale, shift, eps, layer_norm=False, y_splits=partials.shape[0],
                                pdl=pdl)
    return add_rms_norm(h, sum_partials(partials), gate, scale, shift, eps)


def sum_partials(partials: Tensor) -> Tensor:
    """(splits, ...) fp32 -> (...) fp32, added in split order (the kernels' order)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    if triton_usable(gate_up) and gate_up.is_contiguous():
        return gelu_tanh_mul_triton(gate_up)
    return gelu_tanh_mul_reference(gate_up)


def flow_step(chains, v, step_noise, stochastic, logp, k, t, delta, sigma, dt, pdl: int = 0) -> None:
    """pdl: pdl.py's mode code (CUDA only; the bits do not depend on it)."""
    if triton_usable(chains) and chains.is_contiguous() and v.is_contiguous():
        return flow_step_triton(chains, v, step_noise, stochastic, logp, k, t, delta, sigma, dt, pdl)
    return flow_step_reference(chains, v, step_noise, stochastic, logp, k, t, delta, sigma, dt)
