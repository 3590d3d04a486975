"""The data-parallel actor as the trainer sees it: rank 0 in this process, ranks 1..K-1 spawned.

    plan, placement = plan_actor_for_run(exp_cfg, placement, cuda_count)   # checked before any process
    actor = build_actor(policy, grpo_cfg, plan, group_size)   # Actor (mode none) or ActorGroup
    metrics = actor.train(samples)          # every rank updates on its share, metrics reduced
    named = actor.weights_for_push(full)    # rank 0's full weights (FSDP2: all-gathered)
    actor.close()

`ActorGroup` keeps `Actor`'s interface (train, weights_for_push, sync_loaded_state, close,
generator, optimizer, updates), so the trainer's loop is the same; `Actor` is its in-process twin.
No torchrun: worker ranks are torch.multiprocessing spawn processes (`worker_main`, an explicit
command loop) that build the policy from the trainer's config on their device, join the group
(the process's default torch.distributed group, TCP rendezvous on 127.0.0.1) and receive rank 0's
weights by broadcast. A step's rows reach them through the command pipe (tensors in shared memory).

Rank 0's part of each collective command runs in a helper thread while this thread watches the
workers: a worker's error (its traceback) or death is raised at once, naming the rank, instead
of rank 0 waiting in a collective until grpo.actor_parallel.dist_timeout_s. After a failure the
group is broken (collectives cannot be resumed): later calls refuse, close() stops the workers.

Checkpoints: with DDP every rank holds the full weights and optimiser state, so rank 0's are
the checkpoint (the single-process format) and `sync_loaded_state` re-broadcasts them after a
resume. FSDP2 shards the optimiser state: checkpoints are refused (config-time check).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch import Tensor

from common.processes import finish_within, send_quietly, start_with_pipe, stop_processes
from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.distributed import ActorPlan, RankSpec, cpu_state, init_group, leave_group, plan_actor, shard_rows
from grpo.samples import Samples

logger = logging.getLogger(__name__)
CLOSE_GRACE_S = 10.0
ERROR_GRACE_S = 5.0  # after rank 0 failed: how long to wait for a worker's (usually root-cause) error


class ActorRankError(RuntimeError):
    """A worker rank failed or died; the message names the rank and carries its traceback."""


def check_actor_config(cfg: Any) -> None:
    """What grpo.actor_parallel refuses whatever the machine, for an ExperimentConfig: its
    check_cross_group runs this before the run directory exists (plan_actor_for_run again, for a
    Trainer built directly)."""
    mode = cfg.grpo.actor_parallel.mode
    if mode == "fsdp2":
        if cfg.run.checkpoint_every or cfg.run.resume:
            raise ValueError(f"grpo.actor_parallel.mode=fsdp2 shards the optimiser state and cannot write or resume "
                             f"checkpoints yet (run.checkpoint_every={cfg.run.checkpoint_every}, "
                             f"run.resume={cfg.run.resume!r}): set run.checkpoint_every=0 (and no run.resume), "
                             f"or use mode=ddp")
        if cfg.policy.fast.enabled and cfg.policy.fast.consistent_recompute:
            raise ValueError("grpo.actor_parallel.mode=fsdp2 with policy.fast.consistent_recompute: the fast path's "
                             "bf16 weight shadows need the full parameters; use mode=ddp")
    # an explicit broadcast either gets a broadcast placement (refused below) or is refused by the placement
    if mode != "none" and cfg.rollout.weights.transport == "broadcast":
        raise ValueError(f"rollout.weights.transport=broadcast with grpo.actor_parallel.mode={mode}: both need this "
                         "process's default torch.distributed group; use rollout.weights.transport=tensors (or auto)")


def plan_actor_for_run(cfg: Any, placement: Any, cuda_count: int) -> tuple[ActorPlan, Any]:
    """The actor's ranks for an ExperimentConfig, checked before any process starts, and the weight
    placement it allows. The actor group is the process's default torch.distributed group, which the
    broadcast weight push (rollout/weights_push.py) also needs: with several actor ranks, "auto"
    falls back to the tensors transport and an explicit broadcast is refused."""
    check_actor_config(cfg)
    plan = plan_actor(cfg.grpo.actor_parallel, placement.trainer_device, cuda_count)
    if plan.mode == "none":
        return plan, placement
    if placement.transport == "broadcast":  # "auto" chose it: the tensors transport instead
        placement = dataclasses.replace(placement, transport="tensors", dist_backend=None,
                                        why="tensors: the actor group holds the process's torch.distributed group")
    return plan, placement


def build_actor(policy, cfg: GRPOConfig, plan: ActorPlan, group_size: int | None = None,
                show_progress: bool = True) -> Actor | ActorGroup:
    """The single-process Actor for mode "none", else an ActorGroup over plan.devices."""
    if plan.mode == "none":
        return Actor(policy, cfg, show_progress=show_progress)
    return ActorGroup(policy, cfg, plan, group_size)


@dataclass
class _Worker:
    rank: int
    device: str
    process: Any
    conn: Any


class ActorGroup:
    def __init__(self, policy, cfg: GRPOConfig, plan: ActorPlan, group_size: int | None = None):
        from rollout.weights_push import free_port

        pcfg = cfg.actor_parallel
        self.cfg, self.plan, self.policy = cfg, plan, policy
        self.group_size = group_size if pcfg.shard == "group" else None
        self.world = len(plan.devices)
        self.workers: list[_Worker] = []
        self.local = None
        self.broken: str | None = None
        self.joined = False
        self._thread: threading.Thread | None = None  # rank 0's part of the latest command
        init_method = f"tcp://127.0.0.1:{free_port()}"
        specs = [RankSpec(r, self.world, d, plan.backend, init_method, pcfg.dist_timeout_s, plan.mode,
                          pcfg.reshard_after_forward) for r, d in enumerate(plan.devices)]
        threads = pcfg.torch_threads
        ctx = tmp.get_context("spawn")
        try:
            for spec in specs[1:]:
                process, conn = start_with_pipe(
                    ctx, worker_main, (spec, policy.cfg, cfg, threads), f"vla-actor-rank-{spec.rank}",
                    lambda exc, spec=spec: ActorRankError(f"actor rank {spec.rank} ({spec.device}) could not "
                                                          f"start its process: {exc!r}"))
                self.workers.append(_Worker(spec.rank, spec.device, process, conn))
            self._together(lambda: self._start_local(specs[0]), {}, "start", pcfg.start_timeout_s, expect="ready")
        except BaseException:
            self.close()
            raise

    def _start_local(self, spec: RankSpec) -> None:
        from grpo.actor_parallel import DistributedActor

        init_group(spec)
        self.joined = True
        self.local = DistributedActor(self.policy, self.cfg, spec)

    # ----- the trainer's interface -----
    @property
    def generator(self) -> torch.Generator:
        return self.local.generator

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.local.optimizer

    @property
    def updates(self) -> int:
        return self.local.updates

    @updates.setter
    def updates(self, value: int) -> None:
        self.local.updates = value

    def train(self, samples: Samples) -> dict[str, float]:
        from grpo.actor_parallel import split_batch

        if len(samples) == 0:
            return {"train/rows": 0, "train/optimizer_steps": 0}
        owner = shard_rows(samples.trajectory, self.world, self.group_size)
        # the single-process actor's draws, in its order: the generator state stays checkpoint-compatible
        orders = [torch.randperm(len(samples), generator=self.local.generator) for _ in range(self.cfg.update_epochs)]
        batches = split_batch(samples, owner, self.world, orders)
        metrics, _ = self._together(lambda: self.local.train(batches[0]),
                                    {w.rank: ("train", batches[w.rank]) for w in self.workers}, "train")
        return metrics

    def weights_for_push(self, full: bool) -> dict[str, Tensor]:
        if self.plan.mode == "ddp":  # rank 0 holds every parameter in full
            return self.local.weights_for_push(full)
        named, _ = self._together(lambda: self.local.weights_for_push(full),
                                  {w.rank: ("weights", full) for w in self.workers}, "gathering the weights")
        return named

    def sync_loaded_state(self) -> None:
        """Rank 0 loaded a checkpoint: broadcast its weights, send its optimiser state."""
        if self.plan.mode != "ddp":
            raise RuntimeError(f"grpo.actor_parallel.mode={self.plan.mode} cannot resume from a checkpoint")
        state = cpu_state(self.local.optimizer.state_dict())
        self._together(lambda: self.local.receive_state(None),
                       {w.rank: ("load", state) for w in self.workers}, "loading the checkpoint")

    # ----- messaging -----
    def _together(self, local_fn, messages: dict[int, tuple], what: str, timeout_s: float | None = None,
                   expect: str = "ok") -> tuple[Any, dict[int, Any]]:
        """Send each worker its command, run rank 0's part in a helper thread, wait for everyone."""
        if self.broken is not None:
            raise RuntimeError(f"the actor group is broken since {self.broken}; restart the run")
        for rank, message in messages.items():
            w = self.workers[rank - 1]
            try:
                w.conn.send(message)
            except (OSError, EOFError) as exc:
                self.broken = what
                raise ActorRankError(f"actor rank {rank} ({w.device}) cannot take {what}: its pipe is closed "
                                     f"(alive: {w.process.is_alive()}, exit code {w.process.exitcode})") from exc
        box: dict[str, Any] = {}
        device = self.plan.devices[0]

        def rank0() -> None:
            try:
                if device.startswith("cuda"):
                    torch.cuda.set_device(torch.device(device))  # the current device is per thread
                box["value"] = local_fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=rank0, name=f"actor-rank0-{what}", daemon=True)
        self._thread = thread
        thread.start()
        try:
            replies = self._collect(thread, box, what, timeout_s, expect)
        except BaseException:
            self.broken = what
            raise
        thread.join()
        if "error" in box:
            self.broken = what
            raise box["error"]
        return box.get("value"), replies

    def _collect(self, thread: threading.Thread, box: dict, what: str, timeout_s: float | None,
                 expect: str) -> dict[int, Any]:
        """Every worker's reply. While rank 0's part runs there is no deadline (its collectives time
        out on their own), except for the start; once it finished, the workers get `timeout_s`
        (default: the dist timeout), or ERROR_GRACE_S to report the root cause if rank 0 failed."""
        pending = {w.rank: w for w in self.workers}
        replies: dict[int, Any] = {}
        timeout_s = timeout_s or self.cfg.actor_parallel.dist_timeout_s
        start, rank0_done = time.monotonic(), None
        while True:
            for rank, w in list(pending.items()):
                if w.conn.poll():
                    try:
                        kind, payload = w.conn.recv()
                    except (EOFError, OSError) as exc:  # a closed pipe: the process is (nearly) gone
                        w.process.join(1.0)
                        raise ActorRankError(f"actor rank {rank} ({w.device}, pid {w.process.pid}) closed its pipe "
                                             f"during {what} (exit code {w.process.exitcode})") from exc
                    del pending[rank]
                    if kind != expect:
                        raise ActorRankError(f"actor rank {rank} ({w.device}) failed in {what}:\n{payload}")
                    replies[rank] = payload
                elif not w.process.is_alive():
                    raise ActorRankError(f"actor rank {rank} ({w.device}, pid {w.process.pid}) died during {what} "
                                         f"(exit code {w.process.exitcode})")
            running = thread.is_alive()
            if not pending and not running:
                return replies
            now = time.monotonic()
            if not running:
                rank0_done = rank0_done or now
                if now - rank0_done > (ERROR_GRACE_S if "error" in box else timeout_s):
                    if "error" in box:
                        raise box["error"]
                    w = next(iter(pending.values()))
                    raise ActorRankError(f"actor rank {w.rank} ({w.device}) did not answer {what} within "
                                         f"{timeout_s:.0f} s of rank 0")
            elif expect == "ready" and now - start > timeout_s:
                raise ActorRankError(f"the actor group did not start within {timeout_s:.0f} s (grpo.actor_parallel."
                                     f"start_timeout_s); still waiting for ranks {sorted(pending)}")
            waitables = [w.conn for w in pending.values()] + [w.process.sentinel for w in pending.values()]
            if waitables:
                mp_connection.wait(waitables, timeout=0.2)
            else:
                thread.join(0.2)

    def close(self) -> None:
        """Stop every worker (close command, then terminate, then kill) and leave the group. A healthy group is
        left by every rank at once: each worker destroys it on its close command while rank 0 does here, since
        NCCL's destroy is collective (a rank 0 that left only after the workers had exited would have them wait
        in their destroy until they were killed). A broken group's ranks may sit in a collective: no close
        request, straight to the deadline, and rank 0 leaves alone."""
        handles = [(w.process, w.conn) for w in self.workers]
        stuck = self._thread is not None and self._thread.is_alive()  # rank 0 in a collective: no leave here
        together = self.joined and not stuck and self.broken is None
        if together:
            for process, conn in handles:
                if process.is_alive():
                    send_quietly(conn, ("close", None))
            if not finish_within(leave_group, CLOSE_GRACE_S, "actor-group-leave"):
                logger.warning("actor group: rank 0 did not finish leaving the group within %.0f s (a worker did "
                               "not leave with it)", CLOSE_GRACE_S)
        stop_processes(handles, CLOSE_GRACE_S, ask=self.broken is None and not together)
        self.workers = []
        if self.joined and not stuck and not together:
            leave_group()
        self.joined = False


# ---------------------------------------------------------------------- worker ranks
def worker_main(conn: Any, spec: RankSpec, policy_cfg: Any, cfg: GRPOConfig, torch_threads: int | None) -> None:
    """Rank 1..K-1: build the policy, join, then serve commands until "close" or an error.

    Commands: ("train", RankBatch) -> metrics; ("weights", full) -> None (takes part in the
    gather); ("load", optimizer_state) -> None (takes rank 0's weights and state); ("close", None).
    After an error the rank answers ("error", traceback) and exits: its collectives are out of step.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how ranks stop
    clean = False
    actor = None
    try:
        threads = torch_threads or (1 if spec.device == "cpu" else None)
        if threads:
            torch.set_num_threads(threads)
        init_group(spec)
        from grpo.actor_parallel import DistributedActor
        from policies import build_policy

        actor = DistributedActor(build_policy(policy_cfg, spec.device), cfg, spec)
        conn.send(("ready", {"rank": spec.rank, "device": spec.device, "pid": os.getpid()}))
        clean = _serve(conn, actor)
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the parent went away: nobody to answer
    except BaseException:
        where = f"actor rank {spec.rank} (pid {os.getpid()}, {spec.device})"
        send_quietly(conn, ("error", f"{where}:\n{traceback.format_exc()}"))
    finally:
        # The DDP wrapper's reducer holds gloo work objects: freed after the group is destroyed (or at interpreter
        # exit), their destructors can abort the process ("terminate called without an active exception", once in
        # CI). So the actor goes first, collected now, then the rank leaves the group.
        actor = None
        gc.collect()
        try:
            if clean:
                leave_group()
        finally:
            conn.close()


def _serve(conn: Any, actor) -> bool:
    """The command loop; True after a clean "close"."""
    while True:
        command, payload = conn.recv()
        if command == "close":
            conn.send(("ok", None))
            return True
        if command == "train":
            reply = actor.train(payload)
        elif command == "weights":
            actor.weights_for_push(payload)
            reply = None  # rank 0 keeps the gathered weights
        elif command == "load":
            actor.receive_state(payload)
            reply = None
        else:
            raise ValueError(f"unknown actor command {command!r}")
        conn.send(("ok", reply))
