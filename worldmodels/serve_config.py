"""Typed configuration of the world-model server (Hydra key `serve`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import check_positive_float, check_positive_int, reject_unknown_keys, to_container
from worldmodels.admission import Placement, StageSpec
from worldmodels.split import equal_split

FRAME_MODES = ("none", "last", "all")


@dataclass
class ServeConfig:
    # Devices of each ring's stages, in pipeline order: [["cuda:0"]] is one GPU; [["cuda:0", "cuda:1"]]
    # a two-stage ring; [["cpu", "cpu", "cpu"]] three virtual ranks on the CPU.
    rings: list[list[str]] = field(default_factory=lambda: [["cpu"]])
    # Blocks per stage, per ring (e.g. [[16, 14]]); None: equal counts (balanced_split gives measured ones)
    block_split: list[list[int]] | None = None
    max_streams: int = 64  # sizes each stage's KV pool (unless kv_pages_per_stage is set)
    max_batch: int = 64  # items per stage per tick; a ring admits at most this many streams (they may be in phase)
    max_inflight_chunks: int | None = None  # per stream; None: passes x stages (a full pipeline)
    kv_pages_per_stage: int | None = None
    kv_memory_gb: float | None = None  # per device: refuse to build pools larger than this
    batch_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    cuda_graphs: bool = False
    pad_to_bucket: bool = False  # the graphs' padded path without graphs (CPU tests)
    fuse_qkv: bool = True
    slo_interval_ms: float | None = None  # default per-stream output-interval SLO
    frames: str = "none"  # default per stream: decode "none", the "last" frame or "all" frames of a chunk
    record_timeline: bool = False
    tick_prior_ms: list[float] = field(default_factory=lambda: [0.0, 0.0])  # (a, b) until measured

    def __post_init__(self) -> None:
        key = "serve"
        if not self.rings or any(not ring for ring in self.rings):
            raise ValueError(f"{key}.rings must list at least one ring of at least one device, got {self.rings}")
        self.rings = [[str(d) for d in ring] for ring in self.rings]
        for name in ("max_streams", "max_batch"):
            check_positive_int(f"{key}.{name}", getattr(self, name))
        for name in ("max_inflight_chunks", "kv_pages_per_stage"):
            if getattr(self, name) is not None:
                check_positive_int(f"{key}.{name}", getattr(self, name))
        for name in ("kv_memory_gb", "slo_interval_ms"):
            if getattr(self, name) is not None:
                check_positive_float(f"{key}.{name}", getattr(self, name))
        self.batch_buckets = sorted(int(b) for b in self.batch_buckets)
        if not self.batch_buckets or self.batch_buckets[0] < 1:
            raise ValueError(f"{key}.batch_buckets must be positive sizes, got {self.batch_buckets}")
        if self.frames not in FRAME_MODES:
            raise ValueError(f"{key}.frames must be one of {list(FRAME_MODES)}, got {self.frames!r}")
        if len(self.tick_prior_ms) != 2 or min(self.tick_prior_ms) < 0:
            raise ValueError(f"{key}.tick_prior_ms must be [a, b] >= 0, got {self.tick_prior_ms}")
        if self.block_split is not None:
            if len(self.block_split) != len(self.rings):
                raise ValueError(f"{key}.block_split needs one entry per ring ({len(self.rings)}), "
                                 f"got {len(self.block_split)}")
            for g, (counts, ring) in enumerate(zip(self.block_split, self.rings, strict=True)):
                if len(counts) != len(ring) or min(counts) < 1:
                    raise ValueError(f"{key}.block_split[{g}] must give >= 1 block to each of the ring's "
                                     f"{len(ring)} stages, got {counts}")

    def placement(self, num_blocks: int) -> Placement:
        rings = []
        for g, devices in enumerate(self.rings):
            if self.block_split is None:
                if len(devices) > num_blocks:
                    raise ValueError(f"serve.rings[{g}] has {len(devices)} stages for {num_blocks} blocks")
                bounds = equal_split(num_blocks, len(devices))
            else:
                counts, start, bounds = self.block_split[g], 0, []
                for count in counts:
                    bounds.append((start, start + count))
                    start += count
            rings.append([StageSpec(d, b) for d, b in zip(devices, bounds, strict=True)])
        return Placement(rings, num_blocks)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, **overrides: Any) -> ServeConfig:
        data = dict(to_container(mapping) if mapping is not None else {})
        data.update(overrides)
        return cls(**reject_unknown_keys(cls, data, "serve", "serve config"))
