"""How the engine front-end reaches its ranks: the client interface and its in-process twin.

`EngineClient` is what `PolicyEngine` (rollout/engine.py) talks to; a client owns `num_ranks`
`EngineCore`s (rollout/engine_core.py), wherever they live:
- `InprocClient` (here): every core in the caller's process, run one after another;
- `LocalClient` (engine_local.py): one spawned process per rank, shared-memory transport;
- `RayClient` (engine_ray.py): one Ray actor per rank.
Every method is called with the engine's lock held (one command at a time). Errors of a rank
are raised as `RankError` naming the rank; a rank that died or stopped answering raises
`RankFailedError` (the engine then refuses to work until `restart()`). A client that can no
longer be trusted (a command cut short with replies still owed) sets `broken`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from policies import PolicyConfig
from rollout.engine_core import EngineCore, PredictRequest, RankReply
from rollout.weights import TensorSource, WeightPlan


class RankError(RuntimeError):
    """A rank raised an exception (its traceback is in the message)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class RankFailedError(RankError):
    """A rank process died or did not answer within rollout.engine.rank_timeout_s."""


class EngineClient(ABC):
    num_ranks: int
    devices: list[str]
    # set once the client cannot be trusted any more (engine_local.py: a command cut short while replies
    # were owed); every later command raises a RankFailedError naming it, only restart() helps
    broken: RankFailedError | None = None

    @abstractmethod
    def predict(self, requests: Sequence[PredictRequest | None]) -> list[RankReply]:
        """One request per rank (None: the rank has no rows) -> replies of the ranks with rows, in rank order."""

    @abstractmethod
    def apply_tensors(self, plan: WeightPlan, source: TensorSource, bucket_bytes: int) -> None:
        """Write in-process tensors into every rank (staged in buckets across process boundaries)."""

    @abstractmethod
    def apply_ipc(self, plan: WeightPlan, handles: Any) -> None:
        """Every rank opens (once, cached) the producer's IPC handles and copies from them."""

    @abstractmethod
    def join_group(self, init_method: str, world_size: int, first_rank: int, backend: str, timeout_s: float) -> None:
        """The ranks' receivers join a torch.distributed group (weights_dist.py)."""

    @abstractmethod
    def leave_group(self) -> None:
        """The ranks' receivers leave the weight group (no-op where none joined). With NCCL every member must
        destroy its group at the same time as the trainer (ncclCommDestroy is collective): see
        weights_push.BroadcastPush.close."""

    @abstractmethod
    def apply_dist(self, src: int, version: int, partial: bool, options: dict) -> None:
        """Every receiver takes one broadcast update from the group's `src`."""

    @abstractmethod
    def refuse_dist(self, src: int, options: dict) -> None:
        """Every receiver refuses the broadcast update `src` is sending (`WeightReceiver.refuse`): the
        trainer raises WeightRefusedError and nothing is written."""

    @abstractmethod
    def call(self, method: str, *args: Any) -> list[Any]:
        """Run an `EngineCore` method on every rank; results in rank order."""

    @abstractmethod
    def close(self) -> None:
        """Stop every rank and release every resource (idempotent)."""


def join_wait(rank_timeout_s: float, dist_timeout_s: float) -> tuple[float, str]:
    """How long a client waits for its ranks to join the weight group, and the key that bounds it
    (named by a timeout): the rendezvous may take dist_timeout_s, and 30 s more to build the group."""
    if dist_timeout_s + 30 > rank_timeout_s:
        return dist_timeout_s + 30, "rollout.weights.dist_timeout_s + 30 s"
    return rank_timeout_s, "rollout.engine.rank_timeout_s"


def dist_wait(rank_timeout_s: float, options: dict) -> tuple[float, str]:
    """How long a client waits for one broadcast update (`PolicyEngine._dist_options`), and the keys that
    bound it: every collective of the update may wait up to rollout.weights.dist_timeout_s (a trainer
    that starts sending late, a slow bucket), the rank's own work up to rollout.engine.rank_timeout_s."""
    n = options["collectives"]
    return (rank_timeout_s + n * options["timeout_s"],
            f"rollout.engine.rank_timeout_s + {n} collectives x rollout.weights.dist_timeout_s")


def make_timeline(rank: int, profiler_env: dict[str, str] | None, worker: str):
    """A rank's timeline: its own trace file when the parent's profiler is on, else the null one."""
    from profiler import timeline_from_environ

    return timeline_from_environ(rank, worker, environ=profiler_env or {})


class InprocClient(EngineClient):
    """Every rank's core in this process (tests, debugging, the default on one device)."""

    def __init__(self, policy_cfg: PolicyConfig, devices: list[str], profiler_env: dict[str, str] | None):
        from profiler import NULL_TIMELINE, get_timeline

        self.num_ranks, self.devices = len(devices), list(devices)
        self.cores: list[EngineCore] = []
        self._receiver = None
        self._ipc_uids: set[str] = set()  # handle sets opened here: close() releases their mappings
        for rank, device in enumerate(devices):
            own = make_timeline(rank, profiler_env, "engine_inproc")
            timeline = own if own is not NULL_TIMELINE else get_timeline()
            self.cores.append(EngineCore(policy_cfg, rank, device, timeline, owns_timeline=own is not NULL_TIMELINE))

    def predict(self, requests: Sequence[PredictRequest | None]) -> list[RankReply]:
        replies = []
        for core, request in zip(self.cores, requests):
            if request is None:
                continue
            try:
                replies.append(core.predict(request))
            except Exception as exc:
                raise RankError(core.rank, f"rank {core.rank} failed in predict: {exc!r}") from exc
        return replies

    def apply_tensors(self, plan: WeightPlan, source: TensorSource, bucket_bytes: int) -> None:
        for core in self.cores:  # in-process: straight from the source tensors, no staging
            core.apply(plan, source.tensors)

    def apply_ipc(self, plan: WeightPlan, handles: Any) -> None:
        from rollout.weights_ipc import open_handles

        tensors = open_handles(handles)  # before any copy: handles that cannot be opened are a refusal
        self._ipc_uids.add(handles.uid)
        for core in self.cores:
            core.apply(plan, tensors, cache_key=handles.uid)

    def join_group(self, init_method: str, world_size: int, first_rank: int, backend: str, timeout_s: float) -> None:
        from rollout.weights_dist import WeightReceiver

        if self._receiver is not None:
            self._receiver.close()
        self._receiver = WeightReceiver.join(init_method, world_size, first_rank, backend, timeout_s,
                                             self.cores[0].device)

    def leave_group(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    def apply_dist(self, src: int, version: int, partial: bool, options: dict) -> None:
        if self._receiver is None:
            raise RuntimeError("no weight group joined: call engine.join_weight_group(...) first")
        self._receiver.receive([c.policy.model for c in self.cores], src, version, partial, options)

    def refuse_dist(self, src: int, options: dict) -> None:
        if self._receiver is None:
            raise RuntimeError("no weight group joined: call engine.join_weight_group(...) first")
        self._receiver.refuse(src)

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(core, method)(*args) for core in self.cores]

    def close(self) -> None:
        from rollout.weights_ipc import close_handles

        cores, self.cores = self.cores, []
        uids, self._ipc_uids = self._ipc_uids, set()
        try:
            if self._receiver is not None:
                self._receiver.close()
                self._receiver = None
        finally:
            try:
                for core in cores:
                    core.close()  # drops the copy programs' views first, so the mappings can go now
            finally:
                for uid in uids:  # the producer's segment (CUDA: its memory) stays mapped otherwise
                    close_handles(uid)
