"""The Ray backend: one Ray actor per rank (num_gpus=1 on a GPU of its own), for several hosts.

Each actor (`RankActor`) holds an `EngineCore`. Observation rows travel as numpy arrays
through Ray's object store (zero-copy reads on the actor's host), outputs come back as numpy.
Without rollout.engine.ray_address a local Ray is started (`ray.init(num_cpus=...,
include_dashboard=False)`) and shut down again by `close()`; with an address the engine only
adds its actors to that cluster. Ranks sharing one GPU ask for a fraction of it. Inside an
actor Ray exposes its GPU as cuda:0. A rank whose actor died is reported at once
(`RayActorError`), one that does not answer within rank_timeout_s after it, both as
`RankFailedError` naming the rank. Weight buckets are put into the object store once and read
by every actor.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from policies import PolicyConfig
from rollout.config import EngineConfig
from rollout.engine_client import EngineClient, RankError, RankFailedError, dist_wait, join_wait
from rollout.engine_core import PredictRequest, RankReply
from rollout.weights import TensorSource, WeightPlan, WeightRefusedError, bucket_layout, pack_bucket


class RankActor:
    """One rank inside a Ray actor process (the same command set as the local backend's rank)."""

    def __init__(self, policy_cfg: PolicyConfig, rank: int, device: str, profiler_env: dict,
                 torch_threads: int | None):
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if device.startswith("cuda"):
            device = "cuda:0"  # Ray makes the actor's GPU the only visible one
        from rollout.engine_client import make_timeline
        from rollout.engine_core import EngineCore
        from rollout.weights_ipc import RankIpc

        self.core = EngineCore(policy_cfg, rank, device, make_timeline(rank, profiler_env, "engine_ray"),
                               owns_timeline=True)
        self.update = None
        self.ipc_side = RankIpc()  # the handle set the last ipc_open opened
        self.receiver = None

    def info(self) -> dict:
        return self.core.info()

    def predict(self, request: PredictRequest) -> tuple[dict[str, np.ndarray], Any]:
        reply = self.core.predict(request)
        return {k: v.numpy() for k, v in reply.tensors.items()}, reply.timing

    def stage(self, metas, plan) -> None:
        self.update = (metas, plan)

    def bucket(self, bucket, data: np.ndarray) -> None:
        from rollout.weights import bucket_views, write_bucket

        metas, plan = self.update
        write_bucket(self.core._params, plan, bucket, bucket_views(torch.from_numpy(data), metas, bucket))
        self.core._sync()

    def ipc_open(self, handles, plan) -> None:
        self.ipc_side.open(handles, plan)  # WeightRefusedError when it cannot

    def ipc(self, uid: str) -> None:
        self.ipc_side.apply(self.core, uid)

    def join(self, init_method: str, world_size: int, rank: int, backend: str, timeout_s: float) -> None:
        from rollout.weights_dist import WeightReceiver

        self.receiver = WeightReceiver.join(init_method, world_size, rank, backend, timeout_s, self.core.device)

    def leave(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()

    def dist(self, src: int, version: int, partial: bool, options: dict) -> None:
        if self.receiver is None:
            raise RuntimeError("no weight group joined: call engine.join_weight_group(...) first")
        with self.core.timeline.span("weight_sync/apply", rank=self.core.rank, source="broadcast"):
            self.receiver.receive([self.core.policy.model], src, version, partial, options)

    def refuse_dist(self, src: int) -> None:
        if self.receiver is None:
            raise RuntimeError("no weight group joined: call engine.join_weight_group(...) first")
        self.receiver.refuse(src)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.core, method)(*args)

    def close(self) -> None:
        from rollout.weights_ipc import close_handles

        if self.receiver is not None:
            self.receiver.close()
        close_handles()
        self.core.close()


class RayClient(EngineClient):
    def __init__(self, policy_cfg: PolicyConfig, devices: list[str], cfg: EngineConfig, profiler_env: dict):
        import ray

        self.num_ranks, self.devices, self.cfg = len(devices), list(devices), cfg
        self._owns_ray = False
        if not ray.is_initialized():
            if cfg.ray_address is not None:
                ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(num_cpus=cfg.ray_num_cpus, include_dashboard=False, log_to_driver=True)
                self._owns_ray = True
        self.actors: list[Any] = []
        self._ipc_uid: str | None = None
        try:
            sharing = Counter(devices)
            remote = ray.remote(RankActor)
            for rank, device in enumerate(devices):
                gpus = 1.0 / sharing[device] if device.startswith("cuda") else 0
                self.actors.append(remote.options(num_gpus=gpus, num_cpus=cfg.ray_actor_cpus,
                                                  name=None, max_restarts=0).remote(
                    policy_cfg, rank, device, profiler_env, cfg.torch_threads))
            self.info = self._all(lambda r, a: a.info.remote(), "start", cfg.start_timeout_s,
                                  key="rollout.engine.start_timeout_s")
        except BaseException:
            self.close()
            raise

    def _all(self, submit: Callable[[int, Any], Any], what: str, timeout_s: float | None = None,
             ranks: Sequence[int] | None = None, key: str = "rollout.engine.rank_timeout_s") -> list:
        """submit(rank, actor) -> ref for each rank; wait for every answer (bounded); Ray's errors
        become rank errors."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ranks = list(range(self.num_ranks)) if ranks is None else list(ranks)
        refs = {r: submit(r, self.actors[r]) for r in ranks}
        timeout_s = timeout_s or self.cfg.rank_timeout_s
        deadline, results, errors = time.monotonic() + timeout_s, {}, []
        pending = dict(refs)
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                r = min(pending)
                raise RankFailedError(r, f"engine rank {r} (Ray actor, {self.devices[r]}) did not answer within "
                                         f"{timeout_s:.0f} s during {what} ({key})")
            r = next(k for k, v in pending.items() if v == ready[0])
            del pending[r]
            try:
                results[r] = ray.get(ready[0])
            except RayActorError as exc:
                raise RankFailedError(r, f"engine rank {r} (Ray actor, {self.devices[r]}) died during {what}: "
                                         f"{exc}") from exc
            except RayTaskError as exc:
                errors.append((r, exc))
        if errors:
            r, exc = min(errors, key=lambda e: e[0])
            cause = getattr(exc, "cause", None)
            if isinstance(cause, WeightRefusedError):
                raise WeightRefusedError(f"rank {r} refused the weight update: {cause}") from exc
            raise RankError(r, f"rank {r} ({self.devices[r]}) failed in {what}:\n{exc}") from exc
        return [results[r] for r in ranks]

    def predict(self, requests: Sequence[PredictRequest | None]) -> list[RankReply]:
        ranks = [r for r, q in enumerate(requests) if q is not None]
        for r in ranks:
            requests[r].obs = {k: (v if isinstance(v, (str, list)) else np.asarray(v))
                               for k, v in requests[r].obs.items()}
        outs = self._all(lambda r, a: a.predict.remote(requests[r]), "predict", ranks=ranks)
        return [RankReply(r, {k: _readonly_tensor(v) for k, v in out[0].items()}, out[1])
                for r, out in zip(ranks, outs)]

    def apply_tensors(self, plan: WeightPlan, source: TensorSource, bucket_bytes: int) -> None:
        import ray

        metas = source.metas
        self._all(lambda r, a: a.stage.remote(metas, plan), "weight update")
        buckets = bucket_layout(metas, bucket_bytes)
        buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
        for bucket in buckets:
            pack_bucket(buffer, source.tensors, metas, bucket)
            ref = ray.put(buffer[: bucket.nbytes].numpy())
            self._all(lambda r, a: a.bucket.remote(bucket, ref), "weight update")

    def apply_ipc(self, plan: WeightPlan, handles: Any) -> None:
        if self._ipc_uid != handles.uid:  # every rank opens before any copies: one that cannot refuses
            self._ipc_uid = None
            self._all(lambda r, a: a.ipc_open.remote(handles, plan), "opening the IPC handles")
            self._ipc_uid = handles.uid
        self._all(lambda r, a: a.ipc.remote(handles.uid), "weight update (IPC)")

    def join_group(self, init_method: str, world_size: int, first_rank: int, backend: str, timeout_s: float) -> None:
        wait_s, key = join_wait(self.cfg.rank_timeout_s, timeout_s)
        self._all(lambda r, a: a.join.remote(init_method, world_size, first_rank + r, backend, timeout_s),
                  "joining the weight group", wait_s, key=key)

    def leave_group(self) -> None:
        self._all(lambda r, a: a.leave.remote(), "leaving the weight group", max(self.cfg.rank_timeout_s, 60))

    def apply_dist(self, src: int, version: int, partial: bool, options: dict) -> None:
        wait_s, key = dist_wait(self.cfg.rank_timeout_s, options)
        self._all(lambda r, a: a.dist.remote(src, version, partial, options), "weight update (broadcast)",
                  wait_s, key=key)

    def refuse_dist(self, src: int, options: dict) -> None:
        wait_s, key = dist_wait(self.cfg.rank_timeout_s, options)
        self._all(lambda r, a: a.refuse_dist.remote(src), "refusing a weight update (broadcast)", wait_s, key=key)

    def call(self, method: str, *args: Any) -> list[Any]:
        return self._all(lambda r, a: a.call.remote(method, *args), method)

    def close(self) -> None:
        import ray

        actors, self.actors = self.actors, []
        if ray.is_initialized():
            for actor in actors:
                try:
                    ray.get(actor.close.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - a dead or hung actor is killed below anyway
                    pass
                ray.kill(actor)
            if self._owns_ray:
                ray.shutdown()
        self._owns_ray = False


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over an object-store array; the front-end only copies out of it."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
