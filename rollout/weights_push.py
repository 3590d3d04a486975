"""A trainer's side of weight sync: push its parameters into a `PolicyEngine`, by the placement's transport.

    placement = plan_placement(trainer_device, "run.device", rollout_cfg, torch.cuda.device_count())
    pusher = make_pusher(engine, placement, rollout_cfg.weights)
    timing = pusher.push(named_tensors, version=step, partial=not full)   # PushTiming
    pusher.close()

- `TensorPush` ("tensors"): `engine.update_weights(named, version, partial)`.
- `BroadcastPush` ("broadcast"): at construction this process joins a torch.distributed group as
  rank 0 with the engine's ranks (1..N); each push runs `weights_dist.broadcast_weights` here
  while the engine takes the update (`DistBroadcast(src=0)`) in a helper thread: both sides are
  collectives and must run at the same time. The trainer's timing ends when every receiver has
  written (the protocol's last all-reduce); the engine's also covers its after-hooks (the fast
  path's refresh).
When the ranks are other processes, floating tensors are cast to the engine's parameter dtypes
first (the fp32 masters of a bf16 engine travel as bf16: half the bytes, and the same rounding as
the receiver's own copy). An update the engine refuses (its version, a before-hook) is refused
through the group, so the trainer raises WeightRefusedError at once (rollout.weights_dist); an
engine that dies before it joins the collective leaves the trainer waiting up to
rollout.weights.dist_timeout_s. The version is also checked here first. The group is the
process's default one: a trainer that already uses torch.distributed (DDP) cannot use this
transport yet.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from common.processes import finish_within
from policies import PolicyConfig
from rollout.config import WeightSyncConfig
from rollout.placement import Placement

logger = logging.getLogger(__name__)


@dataclass
class PushTiming:
    total_s: float  # the whole push, as the caller waited for it
    send_s: float | None = None  # broadcast: trainer side, until every receiver wrote (None for tensors)
    engine_s: float | None = None  # broadcast: the engine's update_weights incl. its after-hooks


def engine_param_dtypes(policy_cfg: PolicyConfig) -> dict[str, torch.dtype]:
    """Our parameter name -> the engine's dtype for it (a meta-device model: no memory)."""
    from policies.models.pi05 import PI05Model

    with torch.device("meta"):
        model = PI05Model(policy_cfg).apply_precision(policy_cfg.dtype)
    return {name: p.dtype for name, p in model.named_parameters()}


def cast_to(named: Mapping[str, Tensor], dtypes: Mapping[str, torch.dtype] | None) -> dict[str, Tensor]:
    """Floating tensors in the dtypes the receiver stores (unknown names and other dtypes as they are)."""
    if dtypes is None:
        return dict(named)
    out = {}
    for name, t in named.items():
        want = dtypes.get(name)
        out[name] = t.to(want) if want is not None and t.is_floating_point() and t.dtype != want else t
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorPush:
    transport = "tensors"

    def __init__(self, engine: Any, dtypes: Mapping[str, torch.dtype] | None = None):
        self.engine, self.dtypes = engine, dtypes

    def push(self, named: Mapping[str, Tensor], version: int, partial: bool = False) -> PushTiming:
        start = time.perf_counter()
        self.engine.update_weights(cast_to(named, self.dtypes), version, partial=partial)
        return PushTiming(time.perf_counter() - start)

    def close(self) -> None:
        pass


class BroadcastPush:
    transport = "broadcast"

    def __init__(self, engine: Any, placement: Placement, weights: WeightSyncConfig,
                 dtypes: Mapping[str, torch.dtype] | None = None, init_method: str | None = None):
        from rollout.weights_dist import join_trainer, leave

        self.engine, self.dtypes = engine, dtypes
        self.bucket_bytes, self.timeout_s = weights.bucket_bytes, weights.dist_timeout_s
        self.backend = placement.dist_backend
        self.joined = False
        if placement.dist_backend == "nccl":
            torch.cuda.set_device(torch.device(placement.trainer_device))  # the trainer's buffers go there
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        world = engine.num_ranks + 1
        try:
            together(lambda: join_trainer(init_method, world, placement.dist_backend, 0, self.timeout_s),
                     lambda: engine.join_weight_group(init_method, world, first_rank=1), self._join_timeout(),
                     "joining the weight group")
        except BaseException:
            leave()  # this side may have joined while the engine's did not
            raise
        self.joined = True

    def _join_timeout(self) -> float:
        return max(self.engine.cfg.rank_timeout_s, self.timeout_s + 30) + 30

    def push(self, named: Mapping[str, Tensor], version: int, partial: bool = False) -> PushTiming:
        from rollout.weights_dist import DistBroadcast, broadcast_weights

        if isinstance(version, bool) or not isinstance(version, int) or version <= self.engine.version:
            raise ValueError(f"weight version must be an int greater than the engine's {self.engine.version}, "
                             f"got {version!r}")
        tensors = cast_to(named, self.dtypes)
        start = time.perf_counter()
        # the engine may wait dist_timeout_s for each collective of the update, not just once
        timeout_s = max(self._join_timeout(), self.engine.broadcast_wait_s + 30)
        send_s, engine_s = together(
            lambda: broadcast_weights(tensors, version, self.bucket_bytes),
            lambda: self.engine.update_weights(DistBroadcast(src=0), version, partial=partial),
            timeout_s, f"weight update to version {version}")
        return PushTiming(time.perf_counter() - start, send_s, engine_s)

    def close(self) -> None:
        """Leave the weight group together with the engine's receivers. NCCL's group destroy is collective
        (ncclCommDestroy): a trainer that left alone would wait for ranks that leave only when the engine
        closes, which its owner does after this (a hang on two H200s, round 27). Where the engine cannot
        leave (closed, a rank gone), the trainer leaves alone only over gloo, whose destroy is local; an NCCL
        group is then left to the process's exit, with a warning."""
        from rollout.weights_dist import leave

        if not self.joined:
            return
        self.joined = False
        if self.engine.alive:
            timeout_s = self._join_timeout()

            def trainer_leaves() -> None:
                if not finish_within(leave, timeout_s, "weight-group-leave"):
                    logger.warning("weight group: the trainer's destroy did not finish within %.0f s", timeout_s)

            try:
                together(trainer_leaves, self.engine.leave_weight_group, timeout_s, "leaving the weight group")
                return
            except Exception as exc:  # noqa: BLE001 - closing: reported, not raised
                logger.warning("weight group: the engine could not leave it (%s)", exc)
        if self.backend == "nccl":
            if self.engine.alive:  # the trainer's bounded destroy already ran beside the failed engine side
                logger.warning("weight group: the engine's ranks did not leave with the trainer, whose own destroy "
                               "was tried beside them; what remains of the NCCL group is left to the process's exit")
            else:
                logger.warning("weight group: the engine is closed, its ranks never left; the trainer's NCCL group "
                               "is left to the process's exit (a destroy now would wait for them)")
            return
        leave()


def together(trainer_fn: Callable[[], Any], engine_fn: Callable[[], Any], timeout_s: float,
             what: str) -> tuple[float, float]:
    """Run engine_fn in a helper thread while trainer_fn runs here; (trainer_s, engine_s). The
    engine's error wins (it names the rank and the refused tensor); the trainer's is chained."""
    box: dict[str, Any] = {}

    def engine_side() -> None:
        start = time.perf_counter()
        try:
            engine_fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            box["error"] = exc
        box["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=engine_side, name="weight-push-engine", daemon=True)
    thread.start()
    trainer_error, start = None, time.perf_counter()
    try:
        trainer_fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after the engine side is known
        trainer_error = exc
    trainer_s = time.perf_counter() - start
    thread.join(timeout_s)
    if thread.is_alive():
        raise RuntimeError(f"the engine did not finish {what} within {timeout_s:.0f} s") from trainer_error
    if "error" in box:
        raise box["error"] from trainer_error
    if trainer_error is not None:
        raise trainer_error
    return trainer_s, box["seconds"]


def make_pusher(engine: Any, placement: Placement, weights: WeightSyncConfig) -> TensorPush | BroadcastPush:
    """The placement's transport; tensors are cast to the engine's dtypes when the ranks are processes."""
    dtypes = None if engine.cfg.backend == "inproc" else engine_param_dtypes(engine.policy_config)
    if placement.transport == "broadcast":
        return BroadcastPush(engine, placement, weights, dtypes)
    return TensorPush(engine, dtypes)
