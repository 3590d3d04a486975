"""`PolicyEngine`: the data-parallel policy engine a trainer or the collector calls.

    from rollout.config import EngineConfig
    from rollout.engine import PolicyEngine
    with PolicyEngine(EngineConfig(backend="local", num_ranks=2, seed=0), policy_cfg) as engine:
        out = engine.predict(obs, mode="train", group_size=8)   # rollout.types.PolicyOutput
        engine.update_weights(state_dict, version=1)             # transactional, versioned
        engine.add_hook(before=fn, after=fn)                     # fn(WeightUpdateEvent)

`predict(obs, mode, group_size)`: obs is a raw env observation dict ("<cam>_image" (N,S,S,3)
uint8 per camera of policy.inputs.camera_map, "state" (N, state_dim) float, "prompt" list[str]
or one str). It is checked before any work (`policies.transforms.check_raw`: missing keys,
shapes, non-uint8 images, non-finite states are refused naming the key / env). The front-end
draws the initial noise (N,H,D), the SDE step noise (N,K,H,D) and the denoise indices (one
index per call for the whole batch in "sde" mode, RLinf) from its generator (seed =
rollout.engine.seed), splits the rows over the ranks (balanced; with group_size, on group
boundaries), and gathers the replies in order: outputs depend on the seed and the weights, not
on the backend or the split. mode: "train" (= policy.sampling.train_mode), "eval" (= "ode"),
"ode", "sde", "sde_all". Every output carries the weight version it was computed with and
one RankTiming per rank that had rows.

`update_weights(source, version, partial=False)`: source is a mapping name -> tensor, an
iterable of (name, tensor), `rollout.weights_ipc.IpcHandles` (tensors of another process:
CUDA IPC on one GPU, shared memory on CPU; opened once and cached) or
`rollout.weights_dist.DistBroadcast` (a torch.distributed broadcast from a trainer rank after
`join_weight_group`). Names may be ours, LeRobot's or openpi's (rollout.weights.format);
IPC handles that cannot be opened are refused like bad names (`WeightRefusedError`).
Every name, shape and dtype is validated before anything is written; an update that fails
while writing leaves the engine refusing to predict (naming the failed version) until a full
update succeeds. Versions must increase. Hooks: before-hooks run after validation and before
any write (an error there aborts cleanly); after-hooks run inside the transaction (the default
one refreshes the fast path's weight-derived tables on every rank: `refresh_fast_path`). A
broadcast refused that way (its version, a before-hook) is refused through the group too: the
trainer's `broadcast_weights` raises `WeightRefusedError` at once, the group takes the next update.

`generator` (checkpoint its state) and `reseed(seed)` control the front-end randomness.
`restart()` replaces every rank (initial weights, version 0; after weights had been pushed the
engine refuses to predict until the next full update); it is also the way back after a rank
failed or a command was cut short (Ctrl-C) while local ranks still owed replies: until then
`alive` is False and every command is refused. `close()` leaves no process or shared memory
segment behind.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policies import PolicyConfig
from policies.sampling import canonical_mode, denoise_indices
from policies.transforms import check_raw
from rollout.config import EngineConfig, WeightSyncConfig, engine_config
from rollout.engine_client import EngineClient, InprocClient, RankFailedError, dist_wait
from rollout.engine_core import PredictRequest, output_shapes
from rollout.types import PolicyOutput
from rollout.weights import (
    TensorMeta,
    WeightRefusedError,
    WeightUpdateError,
    as_tensor_source,
    bucket_layout,
    build_plan,
)


@dataclass
class WeightUpdateEvent:
    engine: PolicyEngine
    version: int  # the version being written
    previous_version: int
    partial: bool
    names: list[str]  # incoming names (empty for a broadcast: the trainer's manifest has them)


def refresh_fast_path(event: WeightUpdateEvent) -> None:
    """The default after-hook: every rank's `policy.refresh_weights()` (bf16 shadows, AdaRMS tables)."""
    event.engine.refresh_weights()


def split_rows(batch: int, num_ranks: int, group_size: int | None = None) -> list[tuple[int, int]]:
    """(start, stop) of every rank: balanced (sizes differ by at most one row, or one group),
    contiguous, in order; with `group_size`, boundaries fall between groups."""
    unit = group_size or 1
    if batch % unit:
        raise ValueError(f"batch of {batch} rows is not a whole number of groups of {unit} (group_size)")
    units = batch // unit
    bounds, start = [], 0
    for rank in range(num_ranks):
        count = units // num_ranks + (1 if rank < units % num_ranks else 0)
        bounds.append((start * unit, (start + count) * unit))
        start += count
    return bounds


def draw_noise(cfg: PolicyConfig, n: int, mode: str, generator: torch.Generator):
    """All randomness of one predict call, in a fixed order: denoise indices (N, K) (one index for
    the batch in "sde" mode), initial noise (N, H, D), step noise (N, K, H, D) unless mode is "ode"."""
    k = cfg.sampling.num_steps
    inds = denoise_indices(mode, k, n, cfg.sampling.exclude_last_step, generator, "cpu")
    noise = torch.randn((n, cfg.chunk_size, cfg.max_action_dim), generator=generator)
    step_noise = None
    if mode != "ode":
        step_noise = torch.randn((n, k, cfg.chunk_size, cfg.max_action_dim), generator=generator)
    return noise, step_noise, inds


MAX_CACHED_PLANS = 8


class PolicyEngine:
    def __init__(self, cfg: Any, policy_cfg: PolicyConfig | Mapping, weights: WeightSyncConfig | None = None):
        engine_cfg, weights_cfg = engine_config(cfg)
        self.cfg: EngineConfig = engine_cfg
        self.weights_cfg: WeightSyncConfig = weights or weights_cfg
        self._policy_cfg = policy_cfg if isinstance(policy_cfg, PolicyConfig) else PolicyConfig.from_mapping(policy_cfg)
        self.devices = engine_cfg.rank_devices()
        _check_visible(engine_cfg)
        self._generator = torch.Generator().manual_seed(engine_cfg.seed)
        self._lock = threading.RLock()
        self._before: list[Callable[[WeightUpdateEvent], None]] = []
        self._after: list[Callable[[WeightUpdateEvent], None]] = [refresh_fast_path]
        self._version = 0
        self._refusal: tuple[str, str] | None = None  # (kind, why): "weights" | "restart" | "rank"
        self._meta_model = None
        self._plans: dict[tuple, Any] = {}  # validated plans by (names, shapes, dtypes | IPC uid, partial)
        self._client: EngineClient | None = None
        self._prefix_store = None  # keep_prefixes
        self._client = self._start()

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        return self._version

    @property
    def generator(self) -> torch.Generator:
        """The front-end generator every call's noise comes from (get_state / set_state it to
        checkpoint and resume a run bit for bit)."""
        return self._generator

    @property
    def policy_config(self) -> PolicyConfig:
        return self._policy_cfg

    @property
    def num_ranks(self) -> int:
        return self.cfg.num_ranks

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError("the engine is closed")
        return self._client

    # ------------------------------------------------------------------ predict
    def keep_prefixes(self, store) -> None:
        """Predict calls with keep_prefix=True leave each row's prefix K/V (the fast path's, as its buckets hold
        them) in `store`, whose append(PrefixCache) returns each row's id there (-1: not kept); the output's
        prefix_rows says where each row went. For the trainer's consistent recompute in the same process
        (grpo.prefix_cache=engine): the in-process backend with one rank only, whose tensors that process can read."""
        self.cfg.check_keeps_prefixes("keeping the rollout's prefix K/V")
        with self._lock:
            self._prefix_store = store
            self.client.cores[0].prefix_store = store

    @property
    def prefix_store(self):
        """The store keep_prefixes attached (None: none)."""
        return self._prefix_store

    def predict(self, obs: Mapping[str, Any], mode: str = "train", group_size: int | None = None,
                keep_prefix: bool = False) -> PolicyOutput:
        n = check_raw(obs, self._policy_cfg)
        if keep_prefix and self._prefix_store is None:
            raise ValueError("predict(keep_prefix=True) needs a store: call keep_prefixes(store) first")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1):
            raise ValueError(f"group_size must be a positive integer or None, got {group_size!r}")
        bounds = split_rows(n, self.num_ranks, group_size)
        with self._lock:
            self._check_ready()
            mode = canonical_mode(mode, self._policy_cfg.sampling.train_mode)
            noise, step_noise, inds = draw_noise(self._policy_cfg, n, mode, self._generator)
            obs = self._model_keys(obs)
            requests = [
                None if start == stop else PredictRequest(
                    _rows(obs, start, stop, n), mode, noise[start:stop],
                    None if step_noise is None else step_noise[start:stop], inds[start:stop], keep_prefix)
                for start, stop in bounds
            ]
            replies = self._guard(lambda: self.client.predict(requests))
            return self._gather(n, bounds, replies, mode)

    def _model_keys(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        inputs = self._policy_cfg.inputs
        return {key: obs[key] for key in (*inputs.camera_map, inputs.state_key, inputs.prompt_key)}

    def _gather(self, n: int, bounds, replies, mode: str) -> PolicyOutput:
        shapes = output_shapes(self._policy_cfg)
        out = {name: torch.empty((n, *shape), dtype=dtype) for name, (shape, dtype) in shapes.items()}
        if any("prefix_rows" in reply.tensors for reply in replies):  # keep_prefix (one in-process rank)
            out["prefix_rows"] = torch.full((n,), -1, dtype=torch.long)
        starts = {rank: start for rank, (start, stop) in enumerate(bounds) if stop > start}
        for reply in replies:
            start = starts[reply.rank]
            for name, value in reply.tensors.items():
                out[name][start : start + value.shape[0]].copy_(torch.as_tensor(value))
        timings = [r.timing for r in sorted(replies, key=lambda r: r.rank)]
        return PolicyOutput(**out, version=self._version, mode=mode, timings=timings)

    # ------------------------------------------------------------------ weights
    def update_weights(self, source: Any, version: int, partial: bool = False) -> None:
        """Transactional weight update (see the module docstring)."""
        from rollout.weights_dist import DistBroadcast

        with self._lock:
            self._check_alive()
            try:
                event, apply = self._before_write(source, version, partial)
            except Exception as exc:  # nothing written: the engine is as it was
                if isinstance(source, DistBroadcast):
                    self._refuse_broadcast(source.src, exc)
                raise
            try:
                self._guard(apply)
                for hook in self._after:
                    hook(event)
            except WeightRefusedError:
                raise  # refused by the receivers before any write: the engine is as it was
            except BaseException as exc:
                if self._refusal is None or self._refusal[0] != "rank":
                    self._refusal = ("weights", f"weight update to version {version} failed while writing "
                                     f"({exc!r}); the ranks may hold mixed weights: a full update_weights must "
                                     f"succeed first")
                raise WeightUpdateError(f"weight update to version {version} failed: {exc}") from exc
            self._version = version
            if not partial and self._refusal is not None and self._refusal[0] in ("weights", "restart"):
                self._refusal = None

    def _before_write(self, source: Any, version: int, partial: bool) -> tuple[WeightUpdateEvent, Callable]:
        """Everything an update does before its first write: the version, the source's validated plan,
        the before-hooks (any may raise to refuse). Returns the event and the write itself."""
        from rollout.weights_dist import DistBroadcast
        from rollout.weights_ipc import IpcHandles

        if isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
            raise ValueError(f"weight version must be an int greater than the current {self._version}, "
                             f"got {version!r}")
        if isinstance(source, DistBroadcast):
            names, apply = [], lambda: self.client.apply_dist(source.src, version, partial, self._dist_options())
        elif isinstance(source, IpcHandles):
            plan = self._plan(source.metas, partial, key=(source.uid, partial))
            names, apply = [m.name for m in source.metas], lambda: self.client.apply_ipc(plan, source)
        else:
            tensors = as_tensor_source(source)
            plan = self._plan(tensors.metas, partial)
            names = tensors.names
            apply = lambda: self.client.apply_tensors(plan, tensors, self.weights_cfg.bucket_bytes)  # noqa: E731
        event = WeightUpdateEvent(self, version, self._version, partial, names)
        for hook in self._before:
            hook(event)  # nothing written yet: an error here leaves the engine as it was
        return event, apply

    def _refuse_broadcast(self, src: int, error: Exception) -> None:
        """The trainer is already sending the update `error` refuses (weights_dist.broadcast_weights) and
        waits for the receivers' agreement: they take its manifest and refuse, so it raises WeightRefusedError
        at once instead of waiting out rollout.weights.dist_timeout_s with the group left out of step. The
        caller raises `error` after; a refusal that fails too (no group joined, a rank gone) is noted on it."""
        from rollout.weights_dist import REFUSAL_COLLECTIVES

        options = {**self._dist_options(), "collectives": REFUSAL_COLLECTIVES}
        try:
            self._guard(lambda: self.client.refuse_dist(src, options))
        except Exception as failure:  # noqa: BLE001 - the caller's error is the one to raise
            error.add_note(f"refusing the trainer's broadcast failed too: {failure!r}")

    def join_weight_group(self, init_method: str, world_size: int, first_rank: int = 1) -> None:
        """The engine's receivers join a torch.distributed group with a trainer (its rank is
        usually 0): in-process one receiver (rank first_rank), otherwise one per rank process
        (ranks first_rank .. first_rank + num_ranks - 1). Blocks until every member joined."""
        with self._lock:
            self._check_alive()
            backend = self.weights_cfg.dist_backend
            if backend == "auto":
                backend = "nccl" if self.devices[0].startswith("cuda") else "gloo"
            self._guard(lambda: self.client.join_group(init_method, world_size, first_rank, backend,
                                                       self.weights_cfg.dist_timeout_s))

    def leave_weight_group(self) -> None:
        """The receivers leave the group `join_weight_group` joined (no-op where none did). The trainer leaves
        at the same time (weights_push.BroadcastPush.close): NCCL's group destroy is collective, so a trainer
        that leaves alone waits for ranks that leave only when the engine closes."""
        with self._lock:
            self._check_alive()
            self._guard(self.client.leave_group)

    def reseed(self, seed: int | None = None) -> None:
        """Restart the front-end generator (all noise and denoise indices) from `seed`
        (default rollout.engine.seed): the next calls repeat those of a fresh engine."""
        with self._lock:
            self._generator.manual_seed(self.cfg.seed if seed is None else int(seed))

    def refresh_weights(self) -> None:
        with self._lock:  # one command at a time: a local rank's pipe carries one exchange
            self._check_alive()
            self._guard(lambda: self.client.call("refresh_weights"))

    def add_hook(self, before: Callable | None = None, after: Callable | None = None) -> None:
        """Register fn(WeightUpdateEvent) to run before (after validation, before any write) or
        after (inside the transaction) every weight update."""
        with self._lock:
            if before is not None:
                self._before.append(before)
            if after is not None:
                self._after.append(after)

    def state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Rank `rank`'s parameters (our names) on the CPU (tests, checkpoints)."""
        with self._lock:
            self._check_alive()
            return self._guard(lambda: self.client.call("state_dict"))[rank]

    def _plan(self, metas, partial: bool, key: tuple | None = None):
        """The validated plan of these names/shapes/dtypes (cached: the same metadata always
        validates the same way, so a steady-state update is only the copy)."""
        key = key if key is not None else (tuple(metas), partial)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(metas, partial)
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _build_plan(self, metas, partial: bool):
        w = self.weights_cfg
        return build_plan(metas, self._meta(), w.format, partial, w.strict_dtype)

    def _meta(self):
        """Our model on the meta device (names, shapes, dtypes; no memory), built once."""
        if self._meta_model is None:
            from policies.models.pi05 import PI05Model

            with torch.device("meta"):
                self._meta_model = PI05Model(self._policy_cfg).apply_precision(self._policy_cfg.dtype)
        return self._meta_model

    def _dist_options(self) -> dict:
        """What a receiver needs for a broadcast update. dist_timeout_s bounds each collective, so
        the client's wait (`engine_client.dist_wait`) counts them: our parameters in buckets of
        rollout.weights.bucket_mb, as `weights_push.BroadcastPush` sends them."""
        w = self.weights_cfg
        return {"format": w.format, "strict_dtype": w.strict_dtype, "bucket_bytes": w.bucket_bytes,
                "timeout_s": w.dist_timeout_s, "collectives": self._broadcast_collectives}

    @functools.cached_property
    def _broadcast_collectives(self) -> int:
        """The collectives of one broadcast update (counted once: the parameters and buckets are fixed)."""
        from rollout.weights_dist import update_collectives

        metas = [TensorMeta.of(name, p) for name, p in self._meta().named_parameters()]
        return update_collectives(len(bucket_layout(metas, self.weights_cfg.bucket_bytes)))

    @property
    def broadcast_wait_s(self) -> float:
        """The longest a broadcast update may take before a rank is reported hung (a trainer pushing
        through `BroadcastPush` waits that long for the engine's side)."""
        return dist_wait(self.cfg.rank_timeout_s, self._dist_options())[0]

    # ------------------------------------------------------------------ life cycle
    def _start(self) -> EngineClient:
        from profiler.spans import ENV_GPU_TIMING, ENV_RUN_DIR

        profiler_env = {k: os.environ[k] for k in (ENV_RUN_DIR, ENV_GPU_TIMING) if k in os.environ}
        backend = self.cfg.backend
        if backend == "inproc":
            client = InprocClient(self._policy_cfg, self.devices, profiler_env)
            client.cores[0].prefix_store = self._prefix_store  # a restart keeps the attached store
            return client
        if backend == "local":
            from rollout.engine_local import LocalClient

            return LocalClient(self._policy_cfg, self.devices, self.cfg, profiler_env)
        from rollout.engine_ray import RayClient

        return RayClient(self._policy_cfg, self.devices, self.cfg, profiler_env)

    def restart(self) -> None:
        """Replace every rank (fresh processes / actors with the initial weights, version 0)."""
        with self._lock:
            pushed = self._version
            self._close_client()
            self._version, self._refusal = 0, None
            self._client = self._start()
            if pushed > 0:
                self._refusal = ("restart", f"engine restarted: the ranks hold the initial weights, not version "
                                            f"{pushed}; a full update_weights must succeed first")

    def close(self) -> None:
        with self._lock:
            self._close_client()

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @property
    def alive(self) -> bool:
        """Open, no rank failed and no command was cut short with replies owed since the last (re)start."""
        return self._client is not None and self._client.broken is None and \
            (self._refusal is None or self._refusal[0] != "rank")

    def _check_alive(self) -> None:
        if self._client is None:
            raise RuntimeError("the engine is closed")

    def _check_ready(self) -> None:
        self._check_alive()
        if self._refusal is not None:
            raise RuntimeError(f"engine refuses to predict: {self._refusal[1]}")

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run a client command; a rank that died or hung, or a command cut short (Ctrl-C) that left
        the client broken, makes the engine refuse until restart()."""
        try:
            return fn()
        except BaseException as exc:
            failed = exc if isinstance(exc, RankFailedError) else getattr(self._client, "broken", None)
            if failed is not None:
                self._refusal = ("rank", f"rank {failed.rank} failed ({failed}); call engine.restart()")
            raise

    def __enter__(self) -> PolicyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten close() must not leak processes
        try:
            self._close_client()
        except Exception:  # noqa: BLE001 - interpreter shutdown: never raise from __del__
            pass


def _check_visible(cfg: EngineConfig) -> None:
    """Every rank's device is one this machine has (placement.resolve_device's rule), before any rank starts:
    a GPU that is not there failed only inside a rank ("Torch not compiled with CUDA enabled", "invalid device
    ordinal"), after the local backend's processes had started, naming no key. Entry points without a trainer
    (evaluate, the benchmarks) build the engine without `plan_placement`. Ray is left out: its actors run on
    the cluster's GPUs, which this process need not see."""
    if cfg.backend == "ray":
        return
    from rollout.placement import resolve_rank_devices

    resolve_rank_devices(cfg, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _rows(obs: Mapping[str, Any], start: int, stop: int, n: int) -> dict[str, Any]:
    """Rows start:stop of every field (a str prompt is shared by all rows)."""
    return {k: (v if isinstance(v, str) else v[start:stop]) for k, v in obs.items()}
