"""The local backend: one spawned torch.multiprocessing process per rank, shared-memory transport.

Each rank runs `engine_local_worker.rank_main` (a command loop around an `EngineCore`; several
ranks may share one device). Per rank the parent owns two shared-memory blocks: the request
block (the rank's observation rows, noise, step noise, denoise indices) and the reply block
(every `PolicyOutput` field); they are grown (re-created, the rank re-attaches) when a call
needs more rows or other shapes. Only command tuples and prompt strings go through the pipes,
never an image. Weight updates from in-process tensors are staged through one shared block,
bucket by bucket (`rollout.weights.bucket_layout`), every rank copying each bucket in place.

The parent waits on every rank's pipe and process sentinel: a rank that dies is reported at
once, one that does not answer within rollout.engine.rank_timeout_s after the deadline, both
as `RankFailedError` naming the rank. A command cut short while replies are still owed (Ctrl-C,
a failed rank, any exception in the parent) leaves those replies in the pipes, where the next
command would read them as its own: the client is then `broken` and every later command raises
`RankFailedError` until `restart()`. Every predict command names the rank's current blocks, so
a rank never keeps a block the parent replaced. `close()` (also run on garbage collection and at
exit) stops every process (close command, then terminate, then kill) and unlinks every block.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp

from common.processes import start_with_pipe, stop_processes
from policies import PolicyConfig
from rollout.config import EngineConfig
from rollout.engine_client import EngineClient, RankError, RankFailedError, dist_wait, join_wait
from rollout.engine_core import PredictRequest, RankReply, output_shapes
from rollout.engine_local_worker import PredictCommand, rank_main
from rollout.shm import ALIGN, ArraySpec, Layout, SharedBlock
from rollout.weights import TensorSource, WeightPlan, WeightRefusedError, bucket_layout, pack_bucket

CLOSE_GRACE_S = 10.0
MAX_WAIT_S = 3600.0  # one wait() at most (poll takes int32 milliseconds); the deadline loop waits again
RANK_TIMEOUT_KEY = "rollout.engine.rank_timeout_s"
STAGING_WHAT = "the weight staging block (one bucket; a smaller rollout.weights.bucket_mb needs less)"


@dataclass
class _Block:
    block: SharedBlock
    specs: list[ArraySpec]
    views: dict[str, np.ndarray]
    capacity: int


@dataclass
class RankHandle:
    rank: int
    device: str
    process: Any
    conn: Any
    request: _Block | None = None
    reply: _Block | None = None
    ipc_uid: str | None = None
    blocks: list[SharedBlock] = field(default_factory=list)  # every block this rank may hold


class LocalClient(EngineClient):
    def __init__(self, policy_cfg: PolicyConfig, devices: list[str], cfg: EngineConfig, profiler_env: dict):
        self.num_ranks, self.devices, self.cfg, self.policy_cfg = len(devices), list(devices), cfg, policy_cfg
        self._ctx = tmp.get_context(cfg.start_method)
        self._ranks: list[RankHandle] = []
        self._staging: list[SharedBlock] = []  # [] or [the staging block]
        self._finalizer = weakref.finalize(self, _shutdown, self._ranks, self._staging)
        self.broken: RankFailedError | None = None
        try:
            for rank, device in enumerate(devices):
                self._ranks.append(self._spawn(rank, device, profiler_env))
            self.info = self._collect({h.rank: h for h in self._ranks}, "start", cfg.start_timeout_s,
                                      "rollout.engine.start_timeout_s", "ready")
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int, device: str, profiler_env: dict) -> RankHandle:
        process, conn = start_with_pipe(
            self._ctx, rank_main, (rank, device, self.policy_cfg, profiler_env, self.cfg.torch_threads,
                                   logging.getLogger().getEffectiveLevel()), f"vla-engine-rank-{rank}",
            lambda exc: RankFailedError(rank, f"engine rank {rank} ({device}) could not start its process "
                                              f"(start_method {self.cfg.start_method}): {exc!r}"))
        return RankHandle(rank, device, process, conn)

    # ------------------------------------------------------------------ messaging
    def _exchange(self, messages: dict[int, tuple], what: str, timeout_s: float | None = None,
                  key: str = RANK_TIMEOUT_KEY) -> dict[int, Any]:
        if self.broken is not None:
            raise RankFailedError(self.broken.rank, f"{self.broken}: the pipes may hold its stale reply, the "
                                                    f"client is unusable; call engine.restart()")
        pending: dict[int, RankHandle] = {}
        try:
            for r, message in messages.items():
                h = pending[r] = self._ranks[r]  # owed from the first byte: a send cut short garbles the pipe
                try:
                    h.conn.send(message)
                except (OSError, EOFError) as exc:
                    raise self._failure(h, what, "its pipe is closed") from exc
            return self._collect(pending, what, timeout_s or self.cfg.rank_timeout_s, key)
        except BaseException as exc:
            if pending:
                self._break(pending, what, exc)
            raise

    def _break(self, pending: dict[int, RankHandle], what: str, exc: BaseException) -> None:
        """Replies still owed stay in the pipes, where the next command would read them as its own
        (silently wrong outputs): refuse every later command; restart() replaces the ranks."""
        self.broken = self._failure(pending[min(pending)], what, f"still owed its reply to a command cut short "
                                                                 f"({exc!r})")

    def _collect(self, pending: dict[int, RankHandle], what: str, timeout_s: float, key: str = RANK_TIMEOUT_KEY,
                 ok: str = "ok") -> dict[int, Any]:
        """Every pending rank's answer, each taken out of `pending` when read (what is left there
        after an exception is still owed); raises the first rank's error after all answered."""
        deadline = time.monotonic() + timeout_s
        results, errors = {}, []
        while pending:
            remaining = deadline - time.monotonic()
            waitables = [h.conn for h in pending.values()] + [h.process.sentinel for h in pending.values()]
            ready = mp_connection.wait(waitables, timeout=min(max(remaining, 0), MAX_WAIT_S))
            if not ready and remaining <= 0:
                h = next(iter(pending.values()))
                raise self._failure(h, what, f"did not answer within {timeout_s:.0f} s ({key})")
            for r, h in list(pending.items()):
                if h.conn.poll():
                    try:
                        kind, payload = h.conn.recv()
                    except (EOFError, OSError) as exc:
                        h.process.join(1.0)  # a closed pipe usually means the process is gone
                        how = "closed its pipe" if h.process.is_alive() else f"died (exit code {h.process.exitcode})"
                        raise self._failure(h, what, how) from exc
                    del pending[r]
                    if kind == ok:
                        results[r] = payload
                    else:
                        errors.append((r, kind, payload))
                elif not h.process.is_alive():
                    raise self._failure(h, what, f"died (exit code {h.process.exitcode})")
        if errors:
            r, kind, payload = min(errors)
            if kind == "refused":
                raise WeightRefusedError(f"rank {r} refused the weight update:\n{payload}")
            if what == "start":
                raise RankFailedError(r, f"rank {r} failed to start:\n{payload}")
            raise RankError(r, f"rank {r} ({self._ranks[r].device}) failed in {what}:\n{payload}")
        return results

    def _failure(self, h: RankHandle, what: str, how: str) -> RankFailedError:
        pid = getattr(h.process, "pid", None)
        return RankFailedError(h.rank, f"engine rank {h.rank} (pid {pid}, {h.device}) {how} during {what}")

    # ------------------------------------------------------------------ predict
    def predict(self, requests: Sequence[PredictRequest | None]) -> list[RankReply]:
        messages = {}
        for h, request in zip(self._ranks, requests):
            if request is not None:
                messages[h.rank] = ("predict", self._stage_request(h, request))
        timings = self._exchange(messages, "predict")
        replies = []
        for r in sorted(timings):
            rows = requests[r].rows
            tensors = {name: torch.from_numpy(view[:rows]) for name, view in self._ranks[r].reply.views.items()}
            replies.append(RankReply(r, tensors, timings[r]))
        return replies

    def _stage_request(self, h: RankHandle, request: PredictRequest) -> PredictCommand:
        b, prompt_key = request.rows, self.policy_cfg.inputs.prompt_key
        arrays = {k: _numpy(v) for k, v in request.obs.items() if k != prompt_key}
        arrays["__noise__"] = request.noise.numpy()
        arrays["__denoise_inds__"] = request.denoise_inds.numpy()
        rows = {k: (v.shape[1:], v.dtype.str) for k, v in arrays.items()}
        cfg = self.policy_cfg  # the step noise always has room, so train/eval calls share one block
        rows["__step_noise__"] = ((cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim), "<f4")
        if request.step_noise is not None:
            arrays["__step_noise__"] = request.step_noise.numpy()
        self._ensure(h, "request", rows, b)
        reply_rows = {n: (s, str(d).replace("torch.", "")) for n, (s, d) in output_shapes(self.policy_cfg).items()}
        self._ensure(h, "reply", reply_rows, b)
        for k, v in arrays.items():
            h.request.views[k][:b] = v
        prompt = request.obs[prompt_key]
        # the current blocks every time (a few hundred bytes): a block replaced while an earlier call was
        # cut short, before its command went out, is still announced; the rank re-attaches only on a new name
        return PredictCommand(
            rows=b, mode=request.mode, prompt=prompt if isinstance(prompt, str) else list(prompt),
            request=(h.request.block.name, h.request.specs), reply=(h.reply.block.name, h.reply.specs),
            array_keys=[k for k in arrays if not k.startswith("__")], stochastic=request.step_noise is not None)

    def _ensure(self, h: RankHandle, which: str, rows: dict[str, tuple], b: int) -> None:
        """Make the rank's block hold `b` rows of these per-row shapes (re-made when it does not)."""
        current: _Block | None = getattr(h, which)
        if current is not None and current.capacity >= b and \
                {s.name: (tuple(s.shape[1:]), np.dtype(s.dtype).str) for s in current.specs} == \
                {k: (tuple(shape), np.dtype(dtype).str) for k, (shape, dtype) in rows.items()}:
            return
        capacity = max(b, current.capacity if current is not None else 0)
        specs = [ArraySpec(k, (capacity, *shape), np.dtype(dtype).str) for k, (shape, dtype) in rows.items()]
        layout = Layout(specs, ALIGN)
        block = SharedBlock.create(layout.nbytes, f"engine rank {h.rank}'s {which} block ({capacity} rows; fewer "
                                                  f"rows per call or more ranks need less)")
        h.blocks.append(block)  # owned (unlinked by close()) before anything else can be cut short
        setattr(h, which, _Block(block, specs, layout.views(block.buf), capacity))
        if current is not None:  # the rank re-attaches by name with the next command; ours goes now
            h.blocks.remove(current.block)
            current.block.close()

    # ------------------------------------------------------------------ weights
    def apply_tensors(self, plan: WeightPlan, source: TensorSource, bucket_bytes: int) -> None:
        metas = source.metas
        buckets = bucket_layout(metas, bucket_bytes)
        size = max(b.nbytes for b in buckets)
        if not self._staging or self._staging[0].size < size:
            old, self._staging[:] = list(self._staging), [SharedBlock.create(size, STAGING_WHAT)]
            for block in old:  # after the swap: an interrupt never leaves a closed block in use
                block.close()
        block = self._staging[0]
        flat = torch.frombuffer(block.buf, dtype=torch.uint8)
        everyone = lambda cmd, payload: {h.rank: (cmd, payload) for h in self._ranks}  # noqa: E731
        self._exchange(everyone("stage", (block.name, metas, plan)), "weight update")
        for bucket in buckets:
            pack_bucket(flat, source.tensors, metas, bucket)
            self._exchange(everyone("bucket", bucket), "weight update")

    def apply_ipc(self, plan: WeightPlan, handles: Any) -> None:
        fresh = {h.rank: ("ipc_open", (handles, plan)) for h in self._ranks if h.ipc_uid != handles.uid}
        if fresh:  # every rank opens before any copies: one that cannot refuses, and nothing was written anywhere
            for r in fresh:
                self._ranks[r].ipc_uid = None  # a rank that opened before another refused holds the new set
            self._exchange(fresh, "opening the IPC handles")
            for r in fresh:
                self._ranks[r].ipc_uid = handles.uid
        self._exchange({h.rank: ("ipc", handles.uid) for h in self._ranks}, "weight update (IPC)")

    def join_group(self, init_method: str, world_size: int, first_rank: int, backend: str, timeout_s: float) -> None:
        messages = {h.rank: ("join", (init_method, world_size, first_rank + h.rank, backend, timeout_s))
                    for h in self._ranks}
        self._exchange(messages, "joining the weight group", *join_wait(self.cfg.rank_timeout_s, timeout_s))

    def leave_group(self) -> None:
        self._exchange({h.rank: ("leave", None) for h in self._ranks}, "leaving the weight group",
                       max(self.cfg.rank_timeout_s, 60))

    def apply_dist(self, src: int, version: int, partial: bool, options: dict) -> None:
        messages = {h.rank: ("dist", (src, version, partial, options)) for h in self._ranks}
        self._exchange(messages, "weight update (broadcast)", *dist_wait(self.cfg.rank_timeout_s, options))

    def refuse_dist(self, src: int, options: dict) -> None:
        self._exchange({h.rank: ("dist_refuse", src) for h in self._ranks}, "refusing a weight update (broadcast)",
                       *dist_wait(self.cfg.rank_timeout_s, options))

    def call(self, method: str, *args: Any) -> list[Any]:
        results = self._exchange({h.rank: ("call", (method, args)) for h in self._ranks}, method)
        return [results[r] for r in sorted(results)]

    @property
    def segment_names(self) -> list[str]:
        """Every shared-memory segment this client owns now (request/reply blocks, staging)."""
        return [b.name for h in self._ranks for b in h.blocks] + [b.name for b in self._staging]

    @property
    def pids(self) -> list[int]:
        return [h.process.pid for h in self._ranks]

    def close(self) -> None:
        self._finalizer()


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16 (check_raw and inproc take it); float32 is exact
            value = value.float()
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _shutdown(ranks: list[RankHandle], staging: list[SharedBlock]) -> None:
    """Stop every rank process and unlink every block (runs once: close(), GC or exit)."""
    stop_processes([(h.process, h.conn) for h in ranks], CLOSE_GRACE_S)
    for h in ranks:
        for block in h.blocks:
            block.close()
        h.blocks.clear()
    for block in staging:
        block.close()
    staging.clear()
    ranks.clear()
