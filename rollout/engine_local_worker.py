"""The rank process of the local backend: an explicit command loop around one `EngineCore`.

Runs in a spawned process. It builds the core (policy on its device), answers ("ready", info),
then serves commands until "close" or until the parent goes away. Observations arrive and
outputs leave through shared-memory blocks the parent owns (attached here by name, re-attached
when the parent grows them); only short command tuples and prompt strings travel through the
pipe. Every command is answered with ("ok", payload), ("refused", traceback) for a weight
update refused before any write, or ("error", traceback). Resources are released in `finally`.

Commands (parent -> rank):
  ("predict", PredictCommand)      rows in the request block -> outputs in the reply block
  ("stage", (block_name, metas, plan))  begin a staged weight update (buckets in `block_name`)
  ("bucket", Bucket)               write the bucket's tensors (now in the staging block)
  ("ipc_open", (handles, plan))    open (cached) a producer's IPC handles, no copy (a failure: "refused")
  ("ipc", uid)                     copy from the handle set ipc_open opened
  ("join", (init, world, rank, backend, timeout_s))   join a torch.distributed weight group
  ("dist", (src, version, partial, options))          receive one broadcast update
  ("dist_refuse", src)             refuse the broadcast update src is sending (the engine refused it)
  ("leave", None)                  leave the weight group (with the trainer: NCCL's destroy is collective)
  ("call", (method, args))         any EngineCore method (refresh_weights, state_dict, info)
  ("close", None)
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from common.processes import send_quietly


@dataclass
class PredictCommand:
    rows: int
    mode: str
    prompt: Any  # list[str] for the rows, or one str
    request: tuple[str, list]  # (block name, specs) of the current request block
    reply: tuple[str, list]  # (block name, specs) of the current reply block
    array_keys: list[str]  # observation keys held in the request block
    stochastic: bool  # step noise present


def rank_main(conn: Any, rank: int, device: str, policy_cfg: Any, profiler_env: dict, torch_threads: int | None,
              log_level: int = logging.WARNING):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how ranks shut down
    server = None
    try:
        # a spawned process starts with logging unconfigured: the parent's level, to the stderr it inherited
        logging.basicConfig(level=log_level, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s: %(message)s")
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        from rollout.engine_client import make_timeline
        from rollout.engine_core import EngineCore

        timeline = make_timeline(rank, profiler_env, "engine_rank")
        server = _Server(EngineCore(policy_cfg, rank, device, timeline, owns_timeline=True))
        conn.send(("ready", server.core.info()))
        server.loop(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the parent went away: nobody to answer
    except BaseException:
        where = f"rank {rank} (pid {os.getpid()}, {device})"
        send_quietly(conn, ("error", f"{where} failed to start:\n" + traceback.format_exc()))
    finally:
        try:
            if server is not None:
                server.close()
        finally:
            conn.close()


class _Server:
    def __init__(self, core):
        from rollout.weights_ipc import RankIpc

        self.core = core
        self.request = self.reply = self.staging = None  # (SharedBlock, views)
        self.update = None  # (metas, plan, params) of the staged update in progress
        self.ipc_side = RankIpc()  # the handle set the last ipc_open opened
        self.receiver = None

    def loop(self, conn: Any) -> None:
        from rollout.weights import WeightRefusedError

        while True:
            command, payload = conn.recv()
            if command == "close":
                conn.send(("ok", None))
                return
            try:
                reply = getattr(self, f"do_{command}")(payload)
            except WeightRefusedError:
                conn.send(("refused", traceback.format_exc()))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", reply))

    # ------------------------------------------------------------------ predict
    def do_predict(self, cmd: PredictCommand):
        from rollout.engine_core import PredictRequest

        self.request = _attach(self.request, *cmd.request)
        self.reply = _attach(self.reply, *cmd.reply)
        views, b = self.request[1], cmd.rows
        obs = {key: views[key][:b] for key in cmd.array_keys}
        obs[self.core.cfg.inputs.prompt_key] = cmd.prompt
        request = PredictRequest(
            obs=obs, mode=cmd.mode, noise=torch.from_numpy(views["__noise__"][:b]),
            step_noise=torch.from_numpy(views["__step_noise__"][:b]) if cmd.stochastic else None,
            denoise_inds=torch.from_numpy(views["__denoise_inds__"][:b]),
        )
        result = self.core.predict(request)
        out = self.reply[1]
        for name, value in result.tensors.items():
            out[name][:b] = value.numpy()
        return result.timing

    # ------------------------------------------------------------------ weights
    def do_stage(self, payload) -> None:
        name, metas, plan = payload
        if self.staging is None or self.staging[0].name != name:
            from rollout.shm import SharedBlock

            if self.staging is not None:
                self.staging[0].close()
            block = SharedBlock.attach(name)
            self.staging = (block, torch.frombuffer(block.buf, dtype=torch.uint8))
        self.update = (metas, plan)

    def do_bucket(self, bucket) -> None:
        from rollout.weights import bucket_views, write_bucket

        metas, plan = self.update
        write_bucket(self.core._params, plan, bucket, bucket_views(self.staging[1], metas, bucket))
        self.core._sync()

    def do_ipc_open(self, payload) -> None:
        self.ipc_side.open(*payload)  # WeightRefusedError when it cannot: answered "refused"

    def do_ipc(self, uid: str) -> None:
        self.ipc_side.apply(self.core, uid)

    def do_join(self, payload) -> None:
        from rollout.weights_dist import WeightReceiver

        init_method, world_size, rank, backend, timeout_s = payload
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver.join(init_method, world_size, rank, backend, timeout_s, self.core.device)

    def do_leave(self, payload) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()

    def do_dist(self, payload) -> None:
        if self.receiver is None:
            raise RuntimeError("no weight group joined: call engine.join_weight_group(...) first")
        src, version, partial, options = payload
        with self.core.timeline.span("weight_sync/apply", rank=self.core.rank, source="broadcast"):
            self.receiver.receive([self.core.policy.model], src, version, partial, options)

    def do_dist_refuse(self, src: int) -> None:
        if self.receiver is None:
            raise RuntimeError("no weight group joined: call engine.join_weight_group(...) first")
        self.receiver.refuse(src)

    def do_call(self, payload):
        method, args = payload
        return getattr(self.core, method)(*args)

    def close(self) -> None:
        from rollout.weights_ipc import close_handles

        try:
            if self.receiver is not None:
                self.receiver.close()
            close_handles()
            self.core.close()
        finally:
            for held in (self.request, self.reply, self.staging):
                if held is not None:
                    held[0].close()


def _attach(held, name: str, specs: list):
    """The parent's block `name` (every command names it; mapped again only when it changed)."""
    from rollout.shm import ALIGN, Layout, SharedBlock

    if held is not None and held[0].name == name:
        return held
    if held is not None:
        held[0].close()
    block = SharedBlock.attach(name)
    return block, Layout(specs, ALIGN).views(block.buf)
