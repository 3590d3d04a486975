"""Configuration of the fast inference path (Hydra key `policy.fast`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from common.config import check_bool, check_int_list, check_list, is_int

ATTENTION_CHOICES = ("auto", "sdpa", "flashinfer", "triton")
# Backends whose result for one sample depends only on that sample (for a fixed bucket shape):
# flashinfer's plan splits the KV by every sample's length, and "auto" picks by timing, which can
# differ between the rollout's and the trainer's processes.
BATCH_INVARIANT_ATTENTION = ("sdpa", "triton")
FAST_DTYPES = ("bfloat16", "float32")
PRECISIONS = ("bf16", "fp8")
GEMM_CHOICES = ("auto", "cublas", "skinny")  # policies/fast/skinny.py
GEGLU_CHOICES = ("auto", "cublas", "fused")  # policies/fast/geglu_gemm.py
PDL_CHOICES = ("auto", "off", "on", "early")  # policies/fast/pdl.py
MLP_CHOICES = ("auto", "split", "fused")  # policies/fast/fused_mlp.py
OVERLAP_CHOICES = ("auto", "off", "on")  # policies/fast/overlap.py
SEARCH_CHOICES = ("auto", "off")  # policies/fast/gemm_search.py
# The math the consistent recompute's backward differentiates (policies/fast/autograd.py, reference_precision)
RECOMPUTE_BACKWARDS = ("fp32", "tf32", "bf16")
# How that backward's reference velocity is built (policies/fast/autograd.py, reference_velocity): plain PyTorch, or
# through torch.compile with inductor (fused kernels) or aot_eager (traced, not fused: to tell a trace from a kernel)
RECOMPUTE_COMPILES = ("off", "inductor", "aot_eager")
# policy.fast overrides for a plain-path copy of a config (a trainer, a baseline): the keys that need the fast path
# set back too, so that the copy validates whatever the original had
FAST_OFF = {"enabled": False, "consistent_recompute": False, "recompute_backward": "fp32", "recompute_graph": False,
            "recompute_compile": "off"}
# GEMM groups precision "fp8" can run in FP8 (policies/fast/weights.py maps them to projections)
FP8_GEMM_GROUPS = ("vision_attention", "vision_mlp", "vision_projector", "prefix_qkv", "prefix_o",
                   "prefix_gate_up", "prefix_down")
# The default: the prefix's MLP only. Measured on the H200 (profile_stages_nvidia-h200_20261201-155330):
# FP8 in the prefix's qkv/o projections gained no time and doubled the actions' error; the vision
# tower in FP8 was slower than in bf16 (K = 1152 GEMMs: the quantisation costs more than it saves)
# and the largest error source.
DEFAULT_FP8_GEMMS = ("prefix_gate_up", "prefix_down")


def triton_interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, the CPU tests): no inline
    PTX, no PDL, and bf16 dots upcast to fp32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_cache_dir() -> Path | None:
    """Where Triton keeps compiled kernels, as Triton itself resolves it ($TRITON_CACHE_DIR, else
    $TRITON_HOME/.triton/cache or ~/.triton/cache); None without triton. A bucket's first call on an empty
    cache spends most of its time compiling (probe_first_call: ~15 of 17.6 s at PhyAI batch 1 on the H200)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return Path(knobs.cache.dir)


@dataclass
class FastConfig:
    """enabled: use the fast path for `Policy.sample` (CUDA graphs need a CUDA device).
    batch_buckets: graph batch sizes; a batch runs in the smallest bucket that holds it (no
    padding of small batches to the maximum); larger batches are split.
    prompt_buckets: prompt lengths the (trimmed) tokenized prompt is padded to.
    attention: "auto" checks SDPA, flashinfer and the Triton split-KV kernel against fp32
    attention per shape and keeps the fastest correct one; or a backend name to force it.
    consistent_recompute: `Policy.log_prob` recomputes through the fast path's kernels at the
    rollout's bucket shapes (policies/fast/recompute.py), reproducing the rollout's log-probs bit
    for bit; needs `enabled` and a batch-invariant `attention` ("sdpa" or "triton").
    recompute_backward: with consistent_recompute, the precision of the plain model's velocity that
    its backward re-runs and differentiates (the log-probs, ratios and clipping are the forward's,
    bit for bit, whichever is chosen; only the gradients' rounding changes): "fp32" (the reference
    math in fp32, matmuls as the process sets them, torch's default IEEE), "tf32" (fp32 with TF32
    matmuls), "bf16" (under bf16 autocast; the flow log-density on top in fp32).
    recompute_graph: with consistent_recompute on CUDA with cuda_graphs, that backward's reference call (the plain
    model's velocity, the flow log-density and their gradients) is captured as one CUDA graph per input shape and
    replayed (policies/fast/reference_graph.py): the same kernels, without their Python launches, which bounded it
    (round 49: 55 ms of host time a call against 7 ms of kernels). Each shape's graph keeps its memory: at most
    reference_graph.CAPACITY shapes are kept, and a call with fewer rows replays a kept graph that holds them,
    padded (GRPO with one pinned bucket and a fixed micro-batch captures one: its tails replay it).
    recompute_compile: with consistent_recompute, that reference velocity through torch.compile: "inductor" fuses
    its element-wise work (norms, RoPE, GeGLU, residuals and their backward) into fewer kernels, compiled once per
    process at a shape's first call (pi0.5 on an H100, round 65: ~65 s cold, ~16 s from a warm compile cache, for
    an update 5-7% faster after); with recompute_graph the compiled kernels are what the graph captures. Its
    gradients round differently from plain PyTorch's (inductor keeps bf16 intermediates in fp32 inside a fused
    kernel). "aot_eager" traces without fusing (the same kernels as "off"). Default "off".
    precision: "bf16" runs every GEMM in `dtype`; "fp8" runs the GEMMs of `fp8_gemms` in FP8 e4m3
    (per-channel weight and per-token activation scales, policies/fast/fp8.py), the expert always
    in `dtype`; needs dtype "bfloat16".
    fp8_gemms: with precision "fp8", the GEMM groups that run in FP8 (FP8_GEMM_GROUPS; default the
    prefix's MLP, DEFAULT_FP8_GEMMS); the others stay in `dtype`.
    gemm: the expert's projections in the denoise loop: "skinny" runs them through split-K Triton
    kernels that stream the weights at the memory bound for few rows (policies/fast/skinny.py),
    "cublas" through F.linear, "auto" skinny on CUDA up to skinny.AUTO_MAX_ROWS rows (batch x chunk).
    pdl: programmatic dependent launch of the denoise graph's Triton kernels (policies/fast/pdl.py):
    "off", "on", "early", or "auto" ("on" on Hopper and later with CUDA graphs, up to pdl.AUTO_MAX_ROWS
    denoise rows: batch x chunk).
    geglu: the prefix's bf16 gate/up projection and GeGLU: "fused" as one Triton GEMM that writes
    only the activation (policies/fast/geglu_gemm.py), "cublas" as cuBLAS + a GeGLU kernel, "auto"
    fused on CUDA from geglu_gemm.AUTO_MIN_ROWS prefix rows (batch x tokens) up. An FP8 gate/up
    projection always runs through cuBLAS.
    mlp: the expert's gate/up + GeGLU and down projections in the denoise loop: "split" as two skinny
    kernels, "fused" as one launch joined by per-slice arrival counters (policies/fast/fused_mlp.py)
    wherever both run skinny tiles that fit it (elsewhere split), "auto" fused there with PDL on at
    fused_mlp.AUTO_ROWS rows (batch x chunk), where it was measured faster, unless down's tile preloads
    its weights (skinny.SkinnyTile.preload; the tuned tiles do at 1-64 rows, which split then won).
    overlap: the prefix and the denoise loop as one CUDA graph whose first denoise step runs on a
    second stream, each expert layer waiting only for that prefix layer's K/V (policies/fast/overlap.py):
    "on", "off", or "auto" (off above overlap.AUTO_MAX_ROWS denoise rows, batch x chunk; up to it both
    ways are timed at a bucket's first call and the faster kept, overlap.pick). Needs CUDA graphs; the
    numerics do not change.
    gemm_search: SigLIP's bias GEMMs (qkv, o, fc2, projector) through the cuBLASLt algorithm timed
    fastest at a bucket's first use among those that compute torch's output bit for bit
    (policies/fast/gemm_search.py): "auto" on CUDA up to gemm_search.AUTO_MAX_ROWS image rows, "off"
    never. The numerics do not change.
    compile_workers: processes that compile a new bucket's Triton kernels in parallel before their first
    launch (policies/fast/precompile.py): -1 = min(precompile.AUTO_MAX_WORKERS, CPUs - 1), 0 = off (each
    kernel compiles in-process at its first launch, one after another). Only kernels missing from Triton's
    on-disk cache are compiled; the numerics do not change.
    tuning_cache: where a bucket's timed choices (attention backend, SigLIP's cuBLASLt algorithms, the
    overlap order) and its kernel list are kept for the next process (policies/fast/tuning.py): "auto"
    ($VLA_ROLLOUT_TUNING_DIR, else `vla_rollout_tuning` beside Triton's cache directory), "off", or a
    directory. A kept choice is re-checked where correctness depends on it; it changes time only."""

    enabled: bool = False
    cuda_graphs: bool = True
    dtype: str = "bfloat16"
    attention: str = "auto"
    batch_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    prompt_buckets: list[int] = field(default_factory=lambda: [32, 48, 64, 128, 200])
    attention_profile_path: str | None = None
    consistent_recompute: bool = False
    recompute_backward: str = "fp32"
    recompute_graph: bool = False
    recompute_compile: str = "off"
    precision: str = "bf16"
    gemm: str = "auto"
    pdl: str = "auto"
    geglu: str = "auto"
    mlp: str = "auto"
    overlap: str = "auto"
    gemm_search: str = "auto"
    fp8_gemms: list[str] = field(default_factory=lambda: list(DEFAULT_FP8_GEMMS))
    compile_workers: int = -1
    tuning_cache: str = "auto"

    def __post_init__(self) -> None:
        self.validate("policy.fast")

    @property
    def pins_one_bucket(self) -> bool:
        """One batch and one prompt bucket: every row's bucket is known without the rollout's record (what a
        consistent recompute without `fast_buckets` needs)."""
        return len(self.batch_buckets) == 1 and len(self.prompt_buckets) == 1

    def validate(self, key: str) -> None:
        # a quoted "false" from a YAML file or a dict is truthy: it would turn the fast path on
        for name in ("enabled", "cuda_graphs", "consistent_recompute", "recompute_graph"):
            check_bool(f"{key}.{name}", getattr(self, name))
        for name in ("batch_buckets", "prompt_buckets", "fp8_gemms"):  # a bare value would be iterated, or fail unnamed
            check_list(f"{key}.{name}", getattr(self, name))
        if self.dtype not in FAST_DTYPES:
            raise ValueError(f"{key}.dtype must be one of {FAST_DTYPES}, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{key}.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "fp8" and self.dtype != "bfloat16":
            raise ValueError(f"{key}.precision=fp8 needs {key}.dtype=bfloat16 (FP8 GEMMs write bf16), "
                             f"got {key}.dtype={self.dtype!r}")
        unknown = [g for g in self.fp8_gemms if g not in FP8_GEMM_GROUPS]
        if unknown or len(set(self.fp8_gemms)) != len(self.fp8_gemms):
            raise ValueError(f"{key}.fp8_gemms must hold distinct groups of {FP8_GEMM_GROUPS}, "
                             f"got {list(self.fp8_gemms)}")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"{key}.gemm must be one of {GEMM_CHOICES}, got {self.gemm!r}")
        if self.geglu not in GEGLU_CHOICES:
            raise ValueError(f"{key}.geglu must be one of {GEGLU_CHOICES}, got {self.geglu!r}")
        if self.mlp not in MLP_CHOICES:
            raise ValueError(f"{key}.mlp must be one of {MLP_CHOICES}, got {self.mlp!r}")
        if self.gemm_search not in SEARCH_CHOICES:
            raise ValueError(f"{key}.gemm_search must be one of {SEARCH_CHOICES}, got {self.gemm_search!r}")
        if self.overlap not in OVERLAP_CHOICES:
            raise ValueError(f"{key}.overlap must be one of {OVERLAP_CHOICES}, got {self.overlap!r}")
        if self.pdl not in PDL_CHOICES:
            raise ValueError(f"{key}.pdl must be one of {PDL_CHOICES}, got {self.pdl!r}")
        workers = self.compile_workers
        if not is_int(workers) or workers < -1:
            raise ValueError(f"{key}.compile_workers must be -1 (auto), 0 (off) or a number of processes, "
                             f"got {self.compile_workers!r}")
        if not isinstance(self.tuning_cache, str) or not self.tuning_cache.strip():
            raise ValueError(f"{key}.tuning_cache must be 'auto', 'off' or a directory, got {self.tuning_cache!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"{key}.attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        for name in ("batch_buckets", "prompt_buckets"):
            values = check_int_list(f"{key}.{name}", getattr(self, name), 1)
            if values != sorted(set(values)):
                raise ValueError(f"{key}.{name} must be strictly increasing, got {values}")
        for name, choices, what in (("recompute_backward", RECOMPUTE_BACKWARDS, "changes the consistent recompute's "
                                     "backward only"),
                                    ("recompute_compile", RECOMPUTE_COMPILES, "compiles the consistent recompute's "
                                     "backward")):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{key}.{name} must be one of {choices}, got {value!r}")
            if value != choices[0] and not self.consistent_recompute:  # the first choice is the default
                raise ValueError(f"{key}.{name}={value!r} {what}: it needs {key}.consistent_recompute=true")
        if self.recompute_graph and not (self.consistent_recompute and self.cuda_graphs):
            raise ValueError(f"{key}.recompute_graph=true captures the consistent recompute's backward as CUDA graphs: "
                             f"it needs {key}.consistent_recompute=true and {key}.cuda_graphs=true")
        if self.consistent_recompute:
            if not self.enabled:
                raise ValueError(f"{key}.consistent_recompute needs {key}.enabled=true (it reproduces the fast-path "
                                 f"rollout; the plain path's recompute is already the default log_prob)")
            if self.attention not in BATCH_INVARIANT_ATTENTION:
                raise ValueError(f"{key}.attention must be one of {BATCH_INVARIANT_ATTENTION} with "
                                 f"{key}.consistent_recompute=true (batch-invariant), got {self.attention!r}")
