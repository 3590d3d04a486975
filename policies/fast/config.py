"""Configuration of the fast inference path (Hydra key `policy.fast`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

ATTENTION_CHOICES = ("auto", "sdpa", "flashinfer", "triton")
FAST_DTYPES = ("bfloat16", "float32")


@dataclass
class FastConfig:
    """enabled: use the fast path for `Policy.sample` (CUDA graphs need a CUDA device).
    batch_buckets: graph batch sizes; a batch runs in the smallest bucket that holds it (no
    padding of small batches to the maximum); larger batches are split.
    prompt_buckets: prompt lengths the (trimmed) tokenized prompt is padded to.
    attention: "auto" checks SDPA, flashinfer and the Triton split-KV kernel against fp32
    attention per shape and keeps the fastest correct one; or a backend name to force it."""

    enabled: bool = False
    cuda_graphs: bool = True
    dtype: str = "bfloat16"
    attention: str = "auto"
    batch_buckets: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    prompt_buckets: List[int] = field(default_factory=lambda: [32, 64, 128, 200])
    attention_profile_path: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate("policy.fast")

    def validate(self, key: str) -> None:
        if self.dtype not in FAST_DTYPES:
            raise ValueError(f"{key}.dtype must be one of {FAST_DTYPES}, got {self.dtype!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"{key}.attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        for name in ("batch_buckets", "prompt_buckets"):
            values = list(getattr(self, name))
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{key}.{name} must be a non-empty list of positive ints, got {values}")
            if values != sorted(set(values)):
                raise ValueError(f"{key}.{name} must be strictly increasing, got {values}")
