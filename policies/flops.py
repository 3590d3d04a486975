"""Analytic FLOP and byte counts per stage (vision, prefix, expert step) for the roofline.

A pure function of the config, batch size, prompt length and camera count. FLOPs count each
multiply-add as 2 over the GEMMs (projections, MLPs, patch embedding, the action/time
projections) and the two attention matmuls (QK^T and PV); norms, softmax, RoPE and activations
are left out (< 1%). Bytes are the unavoidable HBM traffic: every weight read once per stage
call, the GEMM inputs/outputs read/written once, the prefix K/V written by the prefix stage and
read by every expert step. A fused kernel can beat the activation part; never the weight part.

Stages as the model runs them (`PI05Model`):
- vision: SigLIP over B * cameras images + the projector (masked cameras still run, as LeRobot).
- prefix: the Gemma prefix over cameras * patches + prompt tokens; the last layer only projects
  K/V (`compute_prefix_cache`), so `full_last_layer=True` gives LeRobot's count instead.
- expert_step: one denoise step (H action tokens attending to prefix + own K/V), including the
  AdaRMS modulation GEMMs unless `modulation_precomputed` (the table is per t, not per sample).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.config import GemmaConfig, PolicyConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class StageCost:
    flops: float
    weight_bytes: float
    activation_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def scaled(self, n: float) -> StageCost:
        return StageCost(self.flops * n, self.weight_bytes * n, self.activation_bytes * n)

    def __add__(self, other: StageCost) -> StageCost:
        return StageCost(
            self.flops + other.flops,
            self.weight_bytes + other.weight_bytes,
            self.activation_bytes + other.activation_bytes,
        )


def _gemm(m: float, k: float, n: float, w_bytes: int, a_bytes: int) -> StageCost:
    """(m x k) @ (k x n): 2mkn FLOPs, k*n weights, m*k in + m*n out activations."""
    return StageCost(2.0 * m * k * n, float(k * n * w_bytes), float((m * k + m * n) * a_bytes))


def _attention(
    batch: float, q_len: float, kv_len: float, heads: int, kv_heads: int, hd: int, a_bytes: int
) -> StageCost:
    """QK^T and PV FLOPs; Q/O and K/V read/written once."""
    flops = 2 * 2.0 * batch * heads * q_len * kv_len * hd
    io = batch * (2 * heads * q_len * hd + 2 * kv_heads * kv_len * hd) * a_bytes
    return StageCost(flops, 0.0, float(io))


def vision_cost(cfg: PolicyConfig, batch: int, num_cameras: int | None = None) -> StageCost:
    v = cfg.vision
    images = batch * (num_cameras if num_cameras is not None else len(cfg.cameras))
    n = v.num_patches
    w_bytes = a_bytes = 4  # LeRobot and we keep the whole vision path in fp32
    tokens = images * n
    cost = _gemm(tokens, 3 * v.patch_size**2, v.width, w_bytes, a_bytes)
    per_layer = (
        _gemm(tokens, v.width, 3 * v.width, w_bytes, a_bytes)
        + _attention(images, n, n, v.num_heads, v.num_heads, v.width // v.num_heads, a_bytes)
        + _gemm(tokens, v.width, v.width, w_bytes, a_bytes)
        + _gemm(tokens, v.width, v.mlp_dim, w_bytes, a_bytes)
        + _gemm(tokens, v.mlp_dim, v.width, w_bytes, a_bytes)
    )
    return (
        cost
        + per_layer.scaled(v.depth)
        + _gemm(tokens, v.width, cfg.prefix.width, w_bytes, a_bytes)
    )


def _gemma_layer(
    g: GemmaConfig,
    batch: int,
    q_len: int,
    kv_len: int,
    w_bytes: int,
    a_bytes: int,
    full: bool = True,
) -> StageCost:
    m = batch * q_len
    kv_cols = 2 * g.num_kv_heads * g.head_dim
    if not full:  # K/V projection only
        return _gemm(m, g.width, kv_cols, w_bytes, a_bytes)
    return (
        _gemm(m, g.width, g.num_heads * g.head_dim + kv_cols, w_bytes, a_bytes)
        + _attention(batch, q_len, kv_len, g.num_heads, g.num_kv_heads, g.head_dim, a_bytes)
        + _gemm(m, g.num_heads * g.head_dim, g.width, w_bytes, a_bytes)
        + _gemm(m, g.width, 2 * g.mlp_dim, w_bytes, a_bytes)
        + _gemm(m, g.mlp_dim, g.width, w_bytes, a_bytes)
    )


def prefix_len(
    cfg: PolicyConfig, prompt_len: int | None = None, num_cameras: int | None = None
) -> int:
    cams = num_cameras if num_cameras is not None else len(cfg.cameras)
    return cams * cfg.vision.num_patches + (
        prompt_len if prompt_len is not None else cfg.max_token_len
    )


def prefix_cost(
    cfg: PolicyConfig,
    batch: int,
    prompt_len: int | None = None,
    num_cameras: int | None = None,
    full_last_layer: bool = False,
) -> StageCost:
    g, b = cfg.prefix, DTYPE_BYTES[cfg.dtype]
    p = prefix_len(cfg, prompt_len, num_cameras)
    embed = StageCost(0.0, 0.0, float(batch * p * g.width * b))  # token gather + image tokens in
    layers = _gemma_layer(g, batch, p, p, b, b).scaled(g.depth - 1)
    last = _gemma_layer(g, batch, p, p, b, b, full=full_last_layer)
    return embed + layers + last


def expert_step_cost(
    cfg: PolicyConfig,
    batch: int,
    prompt_len: int | None = None,
    num_cameras: int | None = None,
    modulation_precomputed: bool = False,
) -> StageCost:
    g, b, h = cfg.expert, DTYPE_BYTES[cfg.dtype], cfg.chunk_size
    kv = prefix_len(cfg, prompt_len, num_cameras) + h
    cost = _gemm(batch * h, cfg.max_action_dim, g.width, 4, 4) + _gemm(
        batch * h, g.width, cfg.max_action_dim, 4, 4
    )
    cost = cost + _gemma_layer(g, batch, h, kv, b, b).scaled(g.depth)
    if (
        not modulation_precomputed
    ):  # time MLP (2 GEMMs) + (2L+1) AdaRMS dense GEMMs, one row per sample
        cost = (
            cost
            + _gemm(batch, g.width, g.width, 4, 4).scaled(2)
            + _gemm(batch, g.width, 3 * g.width, 4, 4).scaled(2 * g.depth + 1)
        )
    return cost


def stage_costs(
    cfg: PolicyConfig,
    batch: int = 1,
    prompt_len: int | None = None,
    num_cameras: int | None = None,
    *,
    full_last_layer: bool = False,
    modulation_precomputed: bool = False,
) -> dict[str, StageCost]:
    """{"vision", "prefix", "expert_step", "expert_total", "total"} for one `sample` call. The two
    options are named parameters: a misspelt one raises instead of silently counting the default."""
    vision = vision_cost(cfg, batch, num_cameras)
    prefix = prefix_cost(cfg, batch, prompt_len, num_cameras, full_last_layer)
    step = expert_step_cost(cfg, batch, prompt_len, num_cameras, modulation_precomputed)
    expert = step.scaled(cfg.sampling.num_steps)
    return {
        "vision": vision,
        "prefix": prefix,
        "expert_step": step,
        "expert_total": expert,
        "total": vision + prefix + expert,
    }
