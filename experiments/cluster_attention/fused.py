"""A probe, not a production path: the expert's attention + KV-split merge + o projection as one
thread-block-cluster kernel (kernel.cu; timed by experiments/probe_cluster_attention.py).

Why: at batch 1 the denoise loop is a chain of small dependent kernels, each with a fixed cost of
~2-3 us, and the split-KV attention, its merge and the o projection were three of them (~12.4 us of
a ~34 us PhyAI b1 layer-step, docs/predict.md). kernel.cu runs them as one launch: a cluster of
SPLITS CTAs per (sample, head), each CTA one slice of the keys; the slices are merged through
distributed shared memory (no global round trip, no merge launch) and each CTA projects the merged
head output onto its share of the o columns. The output is the o projection split over heads,
(heads, B*T, width) fp32 partials, which the fast path's residual + AdaRMS kernel would sum like the
skinny o kernel's split-K partials. Measured slower than the three kernels it replaces (round 20 in
docs/predict.md), so the fast sampler does not use it.

CUDA only (sm_90+: clusters, distributed shared memory, PDL); compiled at run time by NVRTC
(torch.cuda._compile_kernel) per shape and launched with cuLaunchKernelEx on torch's current stream,
so CUDA graphs capture it. `reference` is the same computation in plain PyTorch (tests).
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from experiments import cuda_source

SOURCE = Path(__file__).with_name("kernel.cu")
LOG2_E = 1.4426950408889634
SMEM_LIMIT = 227 * 1024
# CUDA driver enums (cuda.h)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
N_STAMPS = 10  # the kernel's N_STAMPS


@dataclass(frozen=True)
class ClusterShape:
    """Compile-time shape: `rows` query rows per (sample, head) (the chunk), `slots` cache rows per
    sample, `splits` CTAs per cluster (key slices; 16 needs the non-portable cluster size)."""

    rows: int
    slots: int
    heads: int = 8
    head_dim: int = 256
    width: int = 1024
    splits: int = 16
    stamps: bool = False  # per-CTA phase clocks into ClusterAttentionO.stamps (probe_cluster_attention.py)
    roll_k: bool = False  # the kernel's loops over K not unrolled (ROLL_K: a smaller kernel)

    @property
    def rows_pad(self) -> int:
        return 16 * -(-self.rows // 16)

    @property
    def keys(self) -> int:
        """Keys per CTA: the slice length for the longest key run (slots), in 16s."""
        per_split = -(-self.slots // self.splits)
        return 16 * -(-per_split // 16)

    @property
    def ncols(self) -> int:
        return self.width // self.splits

    @property
    def threads(self) -> int:
        """One warp per 16 query rows, at least 4 (the kernel's WARPS)."""
        mma_warps = self.rows_pad // 16
        return mma_warps * -(-4 // mma_warps) * 32

    def _tile_bytes(self, rows: int) -> int:
        return rows * (self.head_dim + 8) * 2  # bf16 rows with the kernel's 8-element pad (HDP)

    def _layout_problem(self, late: bool) -> str | None:
        """Why a shared-memory layout does not fit: early (W_o's slice in its own tile, copied before the
        PDL wait; O over Q + K; the merged output over V) or late (W_o over K once S is computed; O
        over V; the merged output over Q)."""
        o_bytes = self.rows_pad * (self.head_dim + 4) * 4
        if late:
            fits = ((self.ncols <= self.keys, f"{self.ncols} o columns do not fit over {self.keys} keys"),
                    (o_bytes <= self._tile_bytes(self.keys), "the fp32 O partial does not fit over the V tile"))
        else:
            fits = ((o_bytes <= self._tile_bytes(self.rows_pad + self.keys),
                     "the fp32 O partial does not fit over the Q and K tiles"),
                    (self.rows_pad <= self.keys, "the merged A tile does not fit over the V tile"))
        fits += ((self.smem_bytes(late) <= SMEM_LIMIT,
                  f"{self.smem_bytes(late)} bytes of shared memory (limit {SMEM_LIMIT})"),)
        return next((why for ok, why in fits if not ok), None)

    @property
    def late_w(self) -> bool:
        """The late layout, where only it fits (the early one prefetches W_o into shared memory)."""
        return self._layout_problem(False) is not None and self._layout_problem(True) is None

    def smem_bytes(self, late: bool | None = None) -> int:
        late = self.late_w if late is None else late
        tiles = self._tile_bytes(self.rows_pad + 2 * self.keys + (0 if late else self.ncols))
        return tiles + (2 + 3 * self.splits) * self.rows_pad * 4  # m, l; merge weights, every peer's m and l

    def problem(self) -> str | None:
        """Why the kernel cannot run this shape, or None."""
        if not 1 <= self.splits <= 16:
            return f"{self.splits} CTAs per cluster (1-16)"
        checks = (
            (self.rows_pad <= 64, f"{self.rows} query rows (at most 64: one warp per 16)"),
            (self.head_dim % 64 == 0 and self.head_dim % (4 * self.splits) == 0,
             f"head_dim {self.head_dim} must split into {self.splits} slices of 4-column groups"),
            (self.width % (8 * self.splits) == 0, f"width {self.width} must split into {self.splits} x 8 columns"),
            (self.keys <= 128, f"{self.keys} keys a CTA (at most 128: S stays in registers)"),
        )
        problem = next((why for ok, why in checks if not ok), None)
        if problem is None and self._layout_problem(False) and self._layout_problem(True):
            problem = f"neither shared-memory layout fits: {self._layout_problem(False)}; {self._layout_problem(True)}"
        return problem

    def defines(self) -> str:
        values = dict(HD=self.head_dim, ROWS_PAD=self.rows_pad, KEYS=self.keys, SPLITS=self.splits,
                      NCOLS=self.ncols, HEADS=self.heads, WIDTH=self.width, QW=self.heads * self.head_dim,
                      STAMPS=int(self.stamps), LATE_W=int(self.late_w), ROLL_K=int(self.roll_k))
        return "".join(f"#define {k} {v}\n" for k, v in values.items())


def supported(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(torch.cuda, "_compile_kernel"))


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUDA driver error {err}")


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _compiled(shape: ClusterShape, device_index: int):
    """The kernel compiled for `shape` on this device, with its shared memory and cluster size allowed."""
    from torch.cuda._utils import _get_gpu_runtime_library

    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(cuda_source.with_common(SOURCE, shape.defines()), "cluster_attention_o",
                                            nvcc_options=["-std=c++17"])
    lib = _get_gpu_runtime_library()
    _check(lib.cuFuncSetAttribute(kernel.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shape.smem_bytes()),
           "cuFuncSetAttribute(max dynamic shared memory)")
    if shape.splits > 8:
        _check(lib.cuFuncSetAttribute(kernel.func, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
               "cuFuncSetAttribute(non-portable cluster size)")
    return kernel, lib


class ClusterAttentionO:
    """The fused attention + merge + o projection for one bucket (`plan(key_len)` as the attention
    backends; `__call__(q, k_cache, v_cache, w_o)` -> (heads, B*T, width) fp32 partials)."""

    name = "cluster"

    def __init__(self, batch: int, shape: ClusterShape, device: torch.device, pdl: bool = False):
        problem = shape.problem()
        if problem is not None:
            raise ValueError(f"cluster attention cannot run {shape}: {problem}")
        self.batch, self.shape, self.device, self.pdl = batch, shape, device, pdl
        self.key_len = torch.full((batch,), shape.slots, dtype=torch.int32, device=device)
        self.out = torch.empty(shape.heads, batch * shape.rows, shape.width, dtype=torch.float32, device=device)
        # (CTAs, 10): clock64 after each of the 8 phases, then globaltimer (ns) at the start and the end
        self.stamps = (torch.zeros(batch * shape.heads * shape.splits, N_STAMPS, dtype=torch.int64, device=device)
                       if shape.stamps else None)
        self.kernel, self.lib = _compiled(shape, device.index or 0)

    def plan(self, key_len: Tensor) -> None:
        if int(key_len.max()) > self.shape.slots:
            raise ValueError(f"key lengths {key_len.tolist()} exceed the cache's {self.shape.slots} rows")
        self.key_len.copy_(key_len, non_blocking=True)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, w_o: Tensor) -> Tensor:
        s = self.shape
        b, hd = self.batch, s.head_dim
        expected = {"q": ((b, s.rows, s.heads, hd), q), "k_cache": ((b, s.slots, 1, hd), k_cache),
                    "v_cache": ((b, s.slots, 1, hd), v_cache), "w_o": ((s.width, s.heads * hd), w_o)}
        for name, (want, x) in expected.items():
            if tuple(x.shape) != want or not x.is_contiguous() or x.dtype != torch.bfloat16:
                raise ValueError(f"cluster attention: {name} must be a contiguous bf16 {want}, "
                                 f"got {tuple(x.shape)} {x.dtype}")
        self._launch(q, k_cache, v_cache, w_o)
        return self.out

    def _launch(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, w_o: Tensor) -> None:
        s = self.shape
        ptrs = [ctypes.c_void_p(x.data_ptr()) for x in (q, k_cache, v_cache, w_o, self.key_len, self.out)]
        scalars = [ctypes.c_int(s.rows), ctypes.c_int(s.slots), ctypes.c_float(s.head_dim ** -0.5 * LOG2_E)]
        stamps = ctypes.c_void_p(self.stamps.data_ptr() if self.stamps is not None else 0)
        args = ptrs + scalars + [stamps]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        attrs = (_LaunchAttribute * 2)()
        attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = s.splits, 1, 1
        attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[1].value[0] = 1
        config = self.launch_config(attrs, 2 if self.pdl else 1)
        _check(self.lib.cuLaunchKernelEx(ctypes.byref(config), self.kernel.func, params, None), "cuLaunchKernelEx")

    def launch_config(self, attrs, num_attrs: int) -> _LaunchConfig:
        s, config = self.shape, _LaunchConfig()
        config.grid[:] = (s.splits, s.heads, self.batch)
        config.block[:] = (s.threads, 1, 1)
        config.smem = s.smem_bytes()
        config.stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        config.attrs = attrs
        config.num_attrs = num_attrs
        return config

    def max_active_clusters(self) -> int:
        """How many of this launch's clusters the GPU holds at once (cuOccupancyMaxActiveClusters)."""
        attrs = (_LaunchAttribute * 1)()
        attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = self.shape.splits, 1, 1
        count = ctypes.c_int()
        _check(self.lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), self.kernel.func,
                                                     ctypes.byref(self.launch_config(attrs, 1))),
               "cuOccupancyMaxActiveClusters")
        return count.value


def reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, w_o: Tensor, key_len: Tensor) -> Tensor:
    """Plain PyTorch (fp32) of what the kernel computes: masked attention per (sample, head), the head
    output rounded to bf16 as the kernel's merged tile is, then each head's share of the o projection:
    (heads, B*T, width) partials whose sum over heads is the o projection."""
    b, t, heads, hd = q.shape
    keys = torch.arange(k_cache.shape[1], device=q.device)
    mask = (keys[None, :] < key_len[:, None].to(q.device))[:, None, None, :]
    scores = torch.einsum("bthd,bsd->bhts", q.float(), k_cache[:, :, 0].float()) / math.sqrt(hd)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    heads_out = torch.einsum("bhts,bsd->bthd", probs, v_cache[:, :, 0].float()).to(torch.bfloat16).float()
    w = w_o.float().view(w_o.shape[0], heads, hd)
    return torch.einsum("bthd,nhd->hbtn", heads_out, w).reshape(heads, b * t, w_o.shape[0])
