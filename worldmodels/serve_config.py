"""Typed configuration of the world-model server (Hydra key `serve`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from common.config import (
    check_bool,
    check_int_list,
    check_positive_finite,
    check_positive_int,
    is_int,
    is_list,
    is_number,
    reject_unknown_keys,
    to_container,
)
from common.devices import visible_cuda_index
from worldmodels.admission import Placement, StageSpec
from worldmodels.split import equal_split

FRAME_MODES = ("none", "last", "all")


def device_key(device: str | torch.device) -> str:
    """"cuda" and "cuda:0" (the current device) name the same GPU: one model copy per GPU, and admission sums
    the stages of one GPU together (it counted "cuda" and "cuda:0" as two devices, admitting twice the load)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return str(device)


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
        self._check_rings(key)
        for name in ("cuda_graphs", "pad_to_bucket", "fuse_qkv", "record_timeline"):
            check_bool(f"{key}.{name}", getattr(self, name))  # a quoted "false" turned graphs on
        for name in ("max_streams", "max_batch"):
            check_positive_int(f"{key}.{name}", getattr(self, name))
        for name in ("max_inflight_chunks", "kv_pages_per_stage"):
            if getattr(self, name) is not None:
                check_positive_int(f"{key}.{name}", getattr(self, name))
        for name in ("kv_memory_gb", "slo_interval_ms"):
            if getattr(self, name) is not None:
                check_positive_finite(f"{key}.{name}", getattr(self, name))
        self.batch_buckets = sorted(check_int_list(f"{key}.batch_buckets", self.batch_buckets, 1))
        if self.frames not in FRAME_MODES:
            raise ValueError(f"{key}.frames must be one of {list(FRAME_MODES)}, got {self.frames!r}")
        if not is_list(self.tick_prior_ms) or len(self.tick_prior_ms) != 2 or not all(
                is_number(v) and 0 <= v < math.inf for v in self.tick_prior_ms):
            raise ValueError(f"{key}.tick_prior_ms must be [a, b], finite numbers >= 0, got {self.tick_prior_ms!r}")
        if self.block_split is not None:
            if not is_list(self.block_split) or not all(
                    is_list(counts) and all(is_int(c) for c in counts) for counts in self.block_split):
                raise ValueError(f"{key}.block_split must list, per ring, the blocks of each stage (e.g. [[16, 14]]), "
                                 f"got {self.block_split!r}")
            if len(self.block_split) != len(self.rings):
                raise ValueError(f"{key}.block_split needs one entry per ring ({len(self.rings)}), "
                                 f"got {len(self.block_split)}")
            for g, (counts, ring) in enumerate(zip(self.block_split, self.rings, strict=True)):
                if len(counts) != len(ring) or min(counts) < 1:
                    raise ValueError(f"{key}.block_split[{g}] must give >= 1 block to each of the ring's "
                                     f"{len(ring)} stages, got {counts}")

    def _check_rings(self, key: str) -> None:
        """A list of rings, each a list of device names torch parses: a bare ["cpu"] would be split into the
        devices "c", "p", "u", and an unknown name would fail only when the server builds its pools."""
        if not is_list(self.rings) or not self.rings or not all(is_list(ring) and ring for ring in self.rings):
            raise ValueError(f"{key}.rings must list at least one ring, each a list of at least one device "
                             f"(e.g. [[cuda:0]]), got {self.rings!r}")
        for g, ring in enumerate(self.rings):
            for s, device in enumerate(ring):
                try:
                    if not isinstance(device, (str, torch.device)):
                        raise TypeError(type(device).__name__)
                    torch.device(device)
                except (RuntimeError, TypeError) as error:
                    raise ValueError(f"{key}.rings[{g}][{s}] must be a device name (cpu, cuda:0, ...), "
                                     f"got {device!r}") from error
        self.rings = [[str(d) for d in ring] for ring in self.rings]

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
            rings.append([StageSpec(device_key(d), b) for d, b in zip(devices, bounds, strict=True)])
        return Placement(rings, num_blocks)

    def check_visible(self, cuda_count: int) -> None:
        """Each ring's GPUs against this machine's before anything is built: serve.rings=[[cuda:1]] on one GPU
        failed in the model copy with torch's "invalid device ordinal", naming no key. The rule is
        common.devices.visible_cuda_index, the trainer's and the engine's (rollout.placement.resolve_device)."""
        for g, ring in enumerate(self.rings):
            for s, device in enumerate(ring):
                visible_cuda_index(f"serve.rings[{g}][{s}]", device, cuda_count)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, **overrides: Any) -> ServeConfig:
        data = dict(to_container(mapping) if mapping is not None else {})
        data.update(overrides)
        return cls(**reject_unknown_keys(cls, data, "serve", "serve config"))
