"""Weight updates broadcast from a trainer rank over torch.distributed (NCCL on GPUs, gloo on CPU).

A trainer process and the engine's receivers (one per rank process; one for all cores in the
in-process backend) join one group. One update, in protocol order:
1. the trainer broadcasts a manifest: version, names, shapes, dtypes, the bucket layout (a trainer
   that cannot build it, e.g. a value that is no tensor, sends its error instead: every receiver
   refuses at once, `WeightRefusedError`, and nothing else follows);
2. every receiver validates it against its model (`rollout.weights.build_plan`: names in any of
   our layouts, shapes, dtypes, full coverage unless partial) and all members agree through an
   all-reduce (MIN) of an "accepted" flag: a refusal anywhere stops everyone before any byte
   is sent (`WeightRefusedError`, the engine is untouched);
3. the trainer broadcasts the buckets (one flat uint8 buffer each, tensors never split); each
   receiver writes every bucket's tensors into its parameters as planned;
4. a final all-reduce (MIN) of a "written" flag: the trainer learns that every receiver holds
   the new weights. A failure during 3-4 (a member died, a timeout) raises on every survivor;
   the engine then refuses to predict until a full update succeeds.
An update the engine refuses before taking it (a version not above its own, a before-hook that raises)
still takes steps 1-2: every receiver reads the manifest and agrees False (`WeightReceiver.refuse`), so
the trainer raises `WeightRefusedError` at once and the group is in step for the next update.

    # trainer (rank 0)                            # engine side
    group = join_trainer(init, world, backend)     engine.join_weight_group(init, world, first_rank=1)
    broadcast_weights(named, version, bucket_mb)   engine.update_weights(DistBroadcast(src=0), version)
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rollout.weights import (
    TensorMeta,
    WeightRefusedError,
    as_tensor_source,
    bucket_layout,
    bucket_views,
    build_plan,
    pack_bucket,
    synchronize,
    write_bucket,
)


@dataclass(frozen=True)
class DistBroadcast:
    """Engine-side source: take the next broadcast update from group rank `src` (the trainer)."""

    src: int = 0


def _init(init_method: str, world_size: int, rank: int, backend: str, timeout_s: float) -> None:
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s))


def join_trainer(init_method: str, world_size: int, backend: str = "gloo", rank: int = 0,
                 timeout_s: float = 300.0) -> None:
    """The trainer's side of the rendezvous (blocks until every member joined)."""
    _init(init_method, world_size, rank, backend, timeout_s)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def update_collectives(num_buckets: int) -> int:
    """The collectives of one update, each bounded by the group's timeout (rollout.weights.dist_timeout_s):
    the manifest (broadcast_object_list: its size, then its bytes), the two agreements, one per bucket."""
    return 4 + num_buckets


REFUSAL_COLLECTIVES = 3  # a refused update (WeightReceiver.refuse): the manifest's two, the first agreement


def _agree(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_weights(named: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], version: int,
                      bucket_bytes: int = 512 * 2**20, src: int = 0,
                      on_bucket: Callable[[int, int], None] | None = None) -> None:
    """Trainer side of one update (see the module docstring). Raises WeightRefusedError when a
    receiver refused the manifest (nothing was sent then). `on_bucket(i, total)` runs after
    bucket i was sent (progress bars)."""
    try:
        source = as_tensor_source(named)
        metas = source.metas
        buckets = bucket_layout(metas, bucket_bytes)
        manifest = {"version": int(version), "metas": [(m.name, m.shape, str(m.dtype)) for m in metas],
                    "bucket_bytes": int(bucket_bytes)}
    except Exception as exc:
        # the receivers already wait for a manifest: without one they would wait dist_timeout_s and
        # then refuse to predict as if a write had failed; this one makes them refuse by name at once
        dist.broadcast_object_list([{"version": repr(version), "error": f"{type(exc).__name__}: {exc}"}], src=src)
        raise
    dist.broadcast_object_list([manifest], src=src)
    device = _device()
    if not _agree(True, device):
        raise WeightRefusedError(f"an engine receiver refused weight version {version} (see its error)")
    buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device=device)
    for i, bucket in enumerate(buckets):
        pack_bucket(buffer, source.tensors, metas, bucket)
        dist.broadcast(buffer[: bucket.nbytes], src=src)
        if on_bucket is not None:
            on_bucket(i, len(buckets))
    if not _agree(True, device):
        raise RuntimeError(f"an engine receiver failed to write weight version {version}")


class WeightReceiver:
    """Engine side: one member of the group that writes every update into `models`."""

    def __init__(self, device: torch.device):
        self.device = device

    @classmethod
    def join(cls, init_method: str, world_size: int, rank: int, backend: str, timeout_s: float,
             model_device: torch.device) -> WeightReceiver:
        if backend == "nccl":
            torch.cuda.set_device(model_device)
        _init(init_method, world_size, rank, backend, timeout_s)
        return cls(model_device if backend == "nccl" else torch.device("cpu"))

    def receive(self, models: Sequence[nn.Module], src: int, version: int, partial: bool, options: dict) -> None:
        manifest = _manifest(src)
        if "error" in manifest:  # the trainer failed before sending anything (and skips the agreements too)
            raise WeightRefusedError(f"the trainer could not send weight version {manifest['version']}: "
                                     f"{manifest['error']}")
        metas = [TensorMeta(n, tuple(s), getattr(torch, d.split(".")[-1])) for n, s, d in manifest["metas"]]
        try:
            if manifest["version"] != version:
                raise WeightRefusedError(f"the trainer sent weight version {manifest['version']}, the engine "
                                         f"expected {version}")
            plan = build_plan(metas, models[0], options.get("format", "auto"), partial,
                              options.get("strict_dtype", False))
        except WeightRefusedError:
            _agree(False, self.device)
            raise
        if not _agree(True, self.device):
            raise WeightRefusedError(f"another member refused weight version {version}")
        self._receive_buckets(models, metas, plan, manifest["bucket_bytes"], src)
        if not _agree(True, self.device):
            raise RuntimeError(f"another receiver failed to write weight version {version}")

    def _receive_buckets(self, models, metas, plan, bucket_bytes: int, src: int) -> None:
        buckets = bucket_layout(metas, bucket_bytes)
        buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device=self.device)
        params = [dict(m.named_parameters()) for m in models]
        for bucket in buckets:
            dist.broadcast(buffer[: bucket.nbytes], src=src)
            views = bucket_views(buffer, metas, bucket)
            for model_params in params:
                write_bucket(model_params, plan, bucket, views)
        for m in models:
            synchronize(next(m.parameters()).device)

    def refuse(self, src: int) -> None:
        """Take part in an update the engine refused before receiving it (its version, a before-hook): the
        trainer already sent the manifest and waits in the first agreement, which only this receiver's
        refusal ends at once; without it the trainer would wait out the group's timeout and the next
        update would find the group out of step. The engine raises its own error afterwards."""
        if "error" not in _manifest(src):  # a trainer that could not send skips the agreements: nothing to end
            _agree(False, self.device)

    def close(self) -> None:
        leave()


def _manifest(src: int) -> dict:
    """The update's manifest, broadcast by the trainer (step 1 of the module docstring)."""
    holder = [None]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
