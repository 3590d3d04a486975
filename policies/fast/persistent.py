"""One persistent kernel per denoise step: the expert's 18 layers at small batch (<= 64 rows).

Why: at batch 1 the denoise loop is 10 steps x 18 layers of ~10 small dependent kernels each; every
kernel pays a launch, a ramp-up and a tail of a few microseconds (~44 us per layer-step on the H200
against ~8 us to read the layer's weights). Here one program per SM runs the whole layer stack as
phases separated by grid-wide barriers (triton_common.grid_barrier, ~1.2 us on the H200,
probe_grid_barrier_nvidia-h200_20261201-201726.json); each program pulls its weight slabs of the
coming phases into L2 ahead of time, so the weights stream while the dependent chain runs.

Phases of layer i (norm n uses the AdaRMS row `n` of the step's modulation table, [scale|shift|gate]):
  norm(2i)   h += gate(2i-1) * sum(partials) (not for i = 0); x = rms(h) * (1 + scale) + shift
  qkv        x Wqkv^T, each tile a RoPE pair of 16-column slabs (d, d + hd/2) of one head, so RoPE
             runs on the accumulators; q to a dense buffer, k / v into the layer's cache slots
  attention  split-KV flash attention over the cache rows [0, key_len) (attention.py's layout)
  merge      the splits by their log-sum-exp -> (M, H * hd)
  o          split-K partials (splits, M, D) fp32
  norm(2i+1) h += gate(2i) * sum(partials); x = rms(h) ...
  gate_up    gelu_tanh(x Wg^T) * (x Wu^T) -> (M, F)
  down       split-K partials
and after the last layer norm(2L) gives the output the action projection reads. Every sum runs in a
fixed order and every row depends only on itself (batch-invariant, as the per-kernel path).

Grid-wide barriers need every program resident: one program per SM and nothing else running.
Under the CPU interpreter (programs run one after another) the kernel runs with one program, which
walks every tile of every phase: the tests check the math that way, the GPU tests the barriers.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

LOG2_E = 1.4426950408889634
# The kernel's SKIP bits: phases (and the barriers) left out, to time the others (results garbage).
SKIP_BITS = {name: 1 << i for i, name in enumerate(
    ("norm", "qkv", "attention", "merge", "o", "gate_up", "down", "barriers"))}
MAX_ROWS = 64  # batch x chunk rows one program's row block holds


@dataclass(frozen=True)
class PersistentShape:
    """Block sizes: qkv RoPE-pair slabs of `rope_n` columns, `o_n` / `down_n` columns per o / down
    tile with K split `o_splits` / `down_splits` ways, `gu_n` GeGLU columns per tile, attention
    blocks of `att_m` packed query rows x `att_n` keys, `block_k` reduction step, `warps`, `stages`
    (Triton's pipelining depth)."""

    rope_n: int = 16
    o_n: int = 32
    o_splits: int = 4
    gu_n: int = 32
    down_n: int = 32
    down_splits: int = 4
    att_m: int = 32
    att_n: int = 64
    block_k: int = 64
    warps: int = 8  # sm_90: 255 registers, no spills (4 warps spill); one program per SM either way
    stages: int = 2
    prefetch: bool = True  # the L2 prefetch of the coming weights (CUDA only)
    programs_per_sm: int = 1  # more only where the compiled kernel fits that many per SM (checked)


def usable(rows: int, expert, shape: PersistentShape) -> str | None:
    """Why the persistent kernel cannot run `rows` rows of this expert (GemmaConfig) with these
    blocks, or None when it can."""
    head_dim, width, mlp_dim, num_heads = expert.head_dim, expert.width, expert.mlp_dim, expert.num_heads
    if rows > MAX_ROWS:
        return f"{rows} rows > {MAX_ROWS}"
    for name, value, block in (("head_dim/2", head_dim // 2, shape.rope_n), ("width", width, shape.o_n),
                               ("mlp_dim", mlp_dim, shape.gu_n), ("width", width, shape.down_n)):
        if value % block:
            return f"{name}={value} is not a multiple of {block}"
    for name, k, splits in (("heads*head_dim", num_heads * head_dim, shape.o_splits), ("width", width, 1),
                            ("mlp_dim", mlp_dim, shape.down_splits)):
        if k % (splits * shape.block_k):
            return f"{name}={k} is not a multiple of splits x block_k = {splits} x {shape.block_k}"
    if width & (width - 1) or head_dim & (head_dim - 1):
        return f"width={width} and head_dim={head_dim} must be powers of two"
    return None


# Blocks for experts smaller than pi0.5's (the tests' policies): 16-wide slabs, two K splits.
SMALL_SHAPE = PersistentShape(o_n=16, o_splits=2, gu_n=16, down_n=16, down_splits=2, att_m=16, att_n=16, block_k=16,
                              warps=4)


def shape_for(rows: int, expert) -> PersistentShape | None:
    """The default blocks, or SMALL_SHAPE's where those do not fit; None when neither does."""
    for shape in (PersistentShape(), SMALL_SHAPE):
        if usable(rows, expert, shape) is None:
            return shape
    return None


@functools.cache
def _kernel():
    from policies.fast import persistent_kernel

    return persistent_kernel.expert_step_kernel


class PersistentExpert:
    """The expert's layer stack of one denoise step as one launch, for one bucket's buffers
    (`programs`: one per SM by default; `att_splits`: the attention's KV splits, by default enough
    to fill the programs).
    `__call__(h, mod, cos, sin)`: h (M, D) the residual after the action projection (updated in
    place), mod the step's modulation rows (2L+1, 3D) fp32 -> x (M, D), the final norm's output."""

    def __init__(self, weights, cfg, k_cache: list[Tensor], v_cache: list[Tensor], slots: Tensor, rows: int,
                 batch: int, device: torch.device, shape: PersistentShape = PersistentShape(),
                 programs: int | None = None, att_splits: int | None = None):
        e = cfg.expert
        problem = usable(rows, e, shape)
        if problem is not None:
            raise ValueError(f"persistent expert kernel cannot run this bucket: {problem}")
        self.cfg, self.shape, self.rows, self.batch = e, shape, rows, batch
        self.tokens = rows // batch
        self.slots, self.k_cache = slots, k_cache
        dtype = k_cache[0].dtype
        layers = weights.expert
        for lw in layers:
            for name in ("qkv", "o", "gate_up", "down"):
                if not lw[name].weight.is_contiguous() or lw[name].weight.dtype != dtype:
                    raise ValueError(f"persistent expert kernel needs contiguous {dtype} weights, expert {name} is not")
        # the tables hold the tensors' places as element offsets from one base tensor (the kernel
        # declares them 16-byte aligned, so its loads vectorise): in-place weight updates are seen, a
        # re-assigned parameter is not (FastSampler rebuilds its weights then)
        self.base = layers[0]["qkv"].weight
        groups = [[lw[name].weight for lw in layers] for name in ("qkv", "o", "gate_up", "down")]
        self.tables = [self._offsets(ts, device) for ts in (*groups, k_cache, v_cache)]
        if programs is None:
            programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # the first launch runs one program per SM; programs_per_sm > 1 takes effect from the second,
        # once the compiled kernel's registers and shared memory say that many fit on an SM
        self.programs, self.sized = programs, shape.programs_per_sm == 1 or device.type != "cuda"
        group = e.num_heads // e.num_kv_heads
        row_blocks = math.ceil(self.tokens * group / shape.att_m)
        base = batch * e.num_kv_heads * row_blocks
        cache_rows = k_cache[0].shape[1]
        if att_splits is None:  # KV splits until the attention items fill the programs
            att_splits = max(1, min(math.ceil(cache_rows / shape.att_n), programs // base))
        self.att_splits = att_splits
        self.att_split_rows = math.ceil(math.ceil(cache_rows / self.att_splits) / shape.att_n) * shape.att_n
        z = lambda *s, dt=dtype: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.x, self.q = z(rows, e.width), z(rows, e.num_heads, e.head_dim)
        self.attn, self.act = z(rows, e.num_heads * e.head_dim), z(rows, e.mlp_dim)
        packed_parts = batch * e.num_kv_heads * self.att_splits * self.tokens * group
        self.part_o, self.part_lse = z(packed_parts, e.head_dim, dt=torch.float32), z(packed_parts, dt=torch.float32)
        self.proj_splits = max(shape.o_splits, shape.down_splits)
        self.proj = z(self.proj_splits, rows, e.width, dt=torch.float32)
        self.counter = z(1, dt=torch.int32)
        self.key_len = torch.full((batch,), cache_rows, dtype=torch.int32, device=device)

    def _offsets(self, tensors: list[Tensor], device: torch.device) -> Tensor:
        size, base = self.base.element_size(), self.base.data_ptr()
        offsets = []
        for t in tensors:
            if (t.data_ptr() - base) % 16 or t.dtype != self.base.dtype:
                raise ValueError(f"persistent expert kernel: a {t.dtype} tensor of shape {tuple(t.shape)} is not "
                                 f"16-byte aligned relative to the expert's first qkv weight")
            offsets.append((t.data_ptr() - base) // size)
        return torch.tensor(offsets, dtype=torch.int64, device=device)

    def plan(self, key_len: Tensor) -> None:
        self.key_len.copy_(key_len, non_blocking=True)

    def __call__(self, h: Tensor, mod: Tensor, cos: Tensor, sin: Tensor, skip: int = 0) -> Tensor:
        """skip: persistent_kernel's SKIP bits (profiling only)."""
        e, s = self.cfg, self.shape
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self.counter.zero_()
        compiled = _kernel()[(self.programs,)](
            self.base, *self.tables, mod, h, self.x, self.q, self.attn, self.part_o, self.part_lse, self.proj, self.act,
            cos, sin, self.slots, self.key_len, self.counter,
            self.rows, self.batch, self.tokens, self.k_cache[0].shape[1], e.rms_norm_eps,
            e.head_dim ** -0.5 * LOG2_E, self.att_splits, self.att_split_rows, e.depth,
            D=e.width, F=e.mlp_dim, H=e.num_heads, KV=e.num_kv_heads, HD=e.head_dim,
            ROPE_N=s.rope_n, O_N=s.o_n, O_SPLITS=s.o_splits, GU_N=s.gu_n, DOWN_N=s.down_n,
            DOWN_SPLITS=s.down_splits, ATT_M=s.att_m, ATT_N=s.att_n, BK=s.block_k, BM=MAX_ROWS,
            SPLITS_P2=max(2, 1 << (self.att_splits - 1).bit_length()), PROJ_SPLITS=self.proj_splits,
            PREFETCH=s.prefetch and not interpret and h.is_cuda, UPCAST=interpret, IEEE=h.dtype == torch.float32,
            SKIP=skip, num_warps=s.warps, num_stages=s.stages,
        )
        if not self.sized:
            self.programs *= min(self.shape.programs_per_sm, resident_per_sm(compiled, h.device))
            self.sized = True
        return self.x


def resident_per_sm(compiled, device: torch.device) -> int:
    """How many programs of a compiled Triton kernel an SM holds at once (registers, shared memory,
    threads): a grid of that many per SM is all resident, so grid-wide barriers cannot deadlock."""
    props = torch.cuda.get_device_properties(device)
    threads = compiled.metadata.num_warps * 32
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, compiled.n_regs * threads)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_shared = shared_per_sm // (compiled.metadata.shared + 1024) if compiled.metadata.shared else 32
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    return max(1, min(by_regs, by_shared, by_threads))
