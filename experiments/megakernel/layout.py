"""Host side of the megakernel probe (layer_chain.cu): its tile shapes, the swizzled layouts its
bulk copies read, and a plain PyTorch reference of the chain it computes. Pure PyTorch, so the
layouts are tested on CPU (tests/experiments/test_megakernel_layout.py); only the kernel needs a GPU.

Layouts (16-byte units of 8 bf16; unit u of row r is stored at unit u ^ (r & 7), which makes the
kernel's 32-bit fragment loads bank-conflict-free without padding, so one bulk copy fills a tile):
- a weight (N, K) -> tiles t = n_tile * splits + split, each (tn, K / splits) swizzled, contiguous;
- gate_up (2F, K) is first interleaved (gate_0, up_0, gate_1, ...) so one thread holds both halves
  of a GeGLU pair;
- an activation (M, K) -> chunks of 64 columns, each (64 rows, 64) swizzled; rows >= M are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("layer_chain.cu")
ROWS = 64  # the kernel's mma rows (four m16 tiles)
CHUNK = 64  # activation columns per chunk
UNIT = 8  # bf16 elements per 16-byte swizzle unit
THREADS = 256
PHASES = ("qkv", "attention_stand_in", "o", "norm_mlp", "gate_up", "down", "norm_attn")


@dataclass(frozen=True)
class PhaseTiles:
    """One GEMM phase of the kernel: N columns in tiles of `tn`, K in `splits` slices."""

    name: str
    n: int
    k: int
    tn: int
    splits: int

    @property
    def tiles(self) -> int:
        return (self.n // self.tn) * self.splits

    @property
    def k_split(self) -> int:
        return self.k // self.splits

    @property
    def tile_bytes(self) -> int:
        return self.tn * self.k_split * 2


@dataclass(frozen=True)
class ChainShape:
    """pi0.5's action expert (Gemma 300M): the constants compiled into layer_chain.cu."""

    width: int = 1024
    q_width: int = 2048  # 8 heads x 256
    qkv: int = 2560  # q + one k head + one v head
    mlp: int = 4096

    def phases(self) -> tuple[PhaseTiles, ...]:
        return (
            PhaseTiles("qkv", self.qkv, self.width, 80, 4),
            PhaseTiles("o", self.width, self.q_width, 64, 8),
            PhaseTiles("gate_up", 2 * self.mlp, self.width, 64, 1),
            PhaseTiles("down", self.width, self.mlp, 64, 8),
        )

    def tiles(self) -> int:
        """CTAs that own a tile of every GEMM phase (layer_chain.cu's TILES: each phase has this many)."""
        return max(p.tiles for p in self.phases())

    def smem_bytes(self) -> int:
        by_name = {p.name: p.tile_bytes for p in self.phases()}
        buf_a = max(by_name["qkv"], by_name["gate_up"])
        buf_b = max(by_name["o"], by_name["down"])
        return buf_a + buf_b + 4 * ROWS * CHUNK * 2


def swizzle_rows(block: torch.Tensor) -> torch.Tensor:
    """(rows, K) -> the same rows with 16-byte unit u moved to u ^ (row & 7). An involution."""
    rows, k = block.shape
    if k % (UNIT * 8):
        raise ValueError(f"swizzled rows need a multiple of {UNIT * 8} columns, got {k}")
    units = block.reshape(rows, k // UNIT, UNIT)
    row = torch.arange(rows, device=block.device).unsqueeze(1)
    src = torch.arange(k // UNIT, device=block.device).unsqueeze(0) ^ (row & 7)
    return units[row, src].reshape(rows, k)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """(2F, K) [gate; up] -> rows gate_0, up_0, gate_1, up_1, ..."""
    f = w.shape[0] // 2
    return torch.stack((w[:f], w[f:]), dim=1).reshape(2 * f, w.shape[1])


def pack_weight(w: torch.Tensor, phase: PhaseTiles) -> torch.Tensor:
    """(N, K) -> (tiles, tn, K / splits) swizzled tiles in the kernel's order, flattened."""
    if tuple(w.shape) != (phase.n, phase.k):
        raise ValueError(f"{phase.name}: weight shape {tuple(w.shape)}, expected {(phase.n, phase.k)}")
    if phase.name == "gate_up":
        w = interleave_gate_up(w)
    tiles = []
    for n_tile in range(phase.n // phase.tn):
        for split in range(phase.splits):
            block = w[n_tile * phase.tn:(n_tile + 1) * phase.tn, split * phase.k_split:(split + 1) * phase.k_split]
            tiles.append(swizzle_rows(block))
    return torch.stack(tiles).reshape(-1)


def pack_activation(x: torch.Tensor) -> torch.Tensor:
    """(M <= 64, K) -> (K / 64, 64, 64) chunk-major, each chunk swizzled; rows >= M zero."""
    m, k = x.shape
    if m > ROWS or k % CHUNK:
        raise ValueError(f"activation {tuple(x.shape)}: at most {ROWS} rows and a multiple of {CHUNK} columns")
    padded = x.new_zeros(ROWS, k)
    padded[:m] = x
    chunks = padded.reshape(ROWS, k // CHUNK, CHUNK).transpose(0, 1)
    return torch.stack([swizzle_rows(c) for c in chunks])


def unpack_activation(packed: torch.Tensor, m: int) -> torch.Tensor:
    chunks = torch.stack([swizzle_rows(c) for c in packed])  # swizzling twice is the identity
    return chunks.transpose(0, 1).reshape(ROWS, -1)[:m]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def ada_rms(h: torch.Tensor, mod: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """mod (3, D): scale, shift (gate unused here)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1 + mod[0]) + mod[1]


def reference_chain(xa: torch.Tensor, h: torch.Tensor, weights: list[dict[str, torch.Tensor]], mod: torch.Tensor,
                    q_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What layer_chain.cu computes, in fp32 with bf16 roundings where the kernel stores bf16.
    xa (M, D) bf16, h (M, D) fp32, weights[layer] = {qkv, o, gate_up, down} bf16, mod (L, 2, 3, D).
    Returns the last layer's (xa, h)."""
    h = h.float().clone()
    for layer, w in enumerate(weights):
        q = xa.float() @ w["qkv"].float().T
        att = q[:, :q_width].to(torch.bfloat16)
        o = att.float() @ w["o"].float().T
        h = h + mod[layer, 0, 2] * o
        xm = ada_rms(h, mod[layer, 0]).to(torch.bfloat16)
        gu = xm.float() @ w["gate_up"].float().T
        f = gu.shape[1] // 2
        g = (gelu_tanh(gu[:, :f]) * gu[:, f:]).to(torch.bfloat16)
        d = g.float() @ w["down"].float().T
        h = h + mod[layer, 1, 2] * d
        xa = ada_rms(h, mod[layer, 1]).to(torch.bfloat16)
    return xa, h
