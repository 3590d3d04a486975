"""L2 prefetch of the expert's weights inside the denoise loop (`policy.fast.prefetch`).

Why: at batch 1 the expert's four projections read their weights from HBM once per layer-step
(34.6 MB in pi0.5, ~8 us at the H200's bandwidth) but took ~23 us of the ~44 us layer-step
(profile_denoise's kernel table: 720 skinny launches, 4.1 of 7.9 ms), while the RoPE, attention
and norm kernels between them (~15-18 us) read almost nothing from HBM. So those kernels also pull
the weights of a projection further ahead into L2 (50 MB on the H200): before its own work, each
program issues `prefetch.global.L2` for its share of the 128-byte lines of one weight tensor and
moves on (fire and forget: nothing waits for a prefetch and nothing is written), and the
projection then reads its weights from L2. The skinny kernels' own PDL prefetch (skinny.py) only
reaches as far back as its one predecessor.

The plan, per expert layer i (which kernel pulls which weight, PhyAI/pi0.5 sizes):
    rope_scatter after qkv_i      -> o_i        (4.2 MB)
    attention (split-KV kernel)   -> gate_up_i  (16.8 MB)
    add_norm after o_i            -> down_i     (8.4 MB)
    add_norm after down_i         -> qkv_i+1    (5.2 MB; the last layer: layer 0's, the next step's)
so at most ~35 MB of weights are pulled and not yet read. Numerics never change (GPU test:
bit-identical chains with and without). The kernels take the target as (pointer, line count) and
a PREFETCH constexpr, so with prefetch off they compile exactly as before.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from policies.fast.config import PREFETCH_CHOICES

LINE_BYTES = 128
SLOTS = ("rope", "attention", "post_o_norm", "post_down_norm")  # the kernels of a layer that prefetch


def supported(device: torch.device) -> bool:
    """Compiled Triton on a CUDA device (the interpreter has no inline PTX)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def enabled(mode: str, device: torch.device, skinny_gemms: bool) -> bool:
    """Whether a bucket's denoise loop prefetches: mode "on" (where supported), or "auto" where the
    expert's projections run through the skinny kernels (skinny.py: up to AUTO_MAX_ROWS rows), whose
    time is the weight reads; above that cuBLAS's GEMMs are compute-heavier."""
    if mode not in PREFETCH_CHOICES:
        raise ValueError(f"policy.fast.prefetch must be one of {PREFETCH_CHOICES}, got {mode!r}")
    if mode == "off" or not supported(device):
        return False
    return mode == "on" or skinny_gemms


def plan(layers: list[dict], attention_prefetches: bool = True) -> list[dict[str, Tensor]]:
    """Per expert layer (`layers`: FastWeights.expert, name -> LinearW), slot -> the weight its kernel
    pulls into L2 (the module docstring's plan). Without `attention_prefetches` (a backend that
    takes no target) the attention slot is left out."""
    out = []
    for i, layer in enumerate(layers):
        targets = {"rope": layer["o"].weight, "attention": layer["gate_up"].weight,
                   "post_o_norm": layer["down"].weight, "post_down_norm": layers[(i + 1) % len(layers)]["qkv"].weight}
        if not attention_prefetches:
            del targets["attention"]
        out.append(targets)
    return out


def kernel_args(target: Tensor | None, fallback: Tensor) -> tuple[Tensor, int, bool]:
    """A kernel's (pointer, 128-byte line count, PREFETCH constexpr) for `target`; with None a
    pointer the kernel never reads (`fallback`), 0 lines and PREFETCH off."""
    if target is None:
        return fallback, 0, False
    if not target.is_contiguous():
        raise ValueError(f"an L2 prefetch target must be contiguous, got shape {tuple(target.shape)} with "
                         f"strides {target.stride()}")
    return target, target.numel() * target.element_size() // LINE_BYTES, True
