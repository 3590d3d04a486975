"""bench_multigpu's weight-sync part: a trainer's weights broadcast to every engine rank.

The bench's own process is the trainer: it holds a full set of weights (the policy's dtypes, a
different seed from the engine's) on its device (cuda:0; CPU: the same code over gloo) and pushes
them with `rollout.weights_push.BroadcastPush`, the GRPO trainer's transport, to a local-backend
engine whose M ranks sit on cuda:1..M. Each update: the full model, or the action expert only
(`rollout.weights.expert_names`, partial). Per update three clocks: the trainer's send (from the
manifest to the last all-reduce, i.e. until every rank has written: `send_s`), the engine's
update_weights (plus its after-hook, the fast path's refresh: `engine_s`) and the push as a whole.
The first push of a group also sets up the communicators: reported apart (`first_*`). After each
kind, every rank's parameters are checked against the trainer's by exact bit checksums.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from policies import PolicyConfig
from rollout.config import EngineConfig, RolloutConfig, WeightSyncConfig
from rollout.engine import PolicyEngine
from rollout.engine_core import bit_checksum
from rollout.placement import plan_placement
from rollout.weights import bucket_layout, expert_names
from rollout.weights_push import BroadcastPush

GOAL_FULL_S, GOAL_RECEIVERS = 0.060, 7  # issue 13: the full pi0.5 to 7 ranks in <= 60 ms


def sync_devices(receivers: int, cuda_count: int, max_cpu_ranks: int) -> tuple[str, list[str]] | str:
    """(trainer device, rank devices), or why this many receivers cannot run here."""
    if cuda_count == 0:
        if receivers > max_cpu_ranks:
            return f"{receivers} receivers > bench.max_cpu_ranks={max_cpu_ranks} (CPU smoke run)"
        return "cpu", ["cpu"] * receivers
    if receivers + 1 > cuda_count:
        return (f"{receivers} receivers + the trainer need {receivers + 1} GPUs (NCCL: one per member), "
                f"{cuda_count} visible")
    return "cuda:0", [f"cuda:{1 + r}" for r in range(receivers)]


def default_sync_receivers(cuda_count: int, max_cpu_ranks: int) -> list[int]:
    """Every GPU but the trainer's (one GPU: [1], recorded as skipped); CPU: bench.max_cpu_ranks."""
    return [max(cuda_count - 1, 1)] if cuda_count else [max_cpu_ranks]


def trainer_weights(policy_cfg: PolicyConfig, device: str, seed: int) -> dict[str, torch.Tensor]:
    """A full set of weights in the engine's dtypes on `device` (random init, another seed)."""
    from policies.models.pi05 import PI05Model

    with torch.device(device):
        model = PI05Model(policy_cfg)
    model.init_weights(seed, policy_cfg.init_scale)
    model.apply_precision(policy_cfg.dtype).to(device)
    return {n: p.detach() for n, p in model.named_parameters()}


def measure_sync(bench: Any, policy_cfg: PolicyConfig, receivers: int, trainer: str, ranks: list[str],
                 cuda_count: int) -> dict[str, Any]:
    weights_cfg = WeightSyncConfig(bucket_mb=bench.bucket_mb, dist_timeout_s=bench.dist_timeout_s,
                                   transport="broadcast")
    rollout = RolloutConfig(engine=EngineConfig(backend="local", num_ranks=receivers, devices=ranks, seed=bench.seed,
                                                torch_threads=bench.torch_threads), weights=weights_cfg)
    placement = plan_placement(trainer, "bench trainer", rollout, cuda_count)
    full = trainer_weights(policy_cfg, trainer, policy_cfg.seed + 1)
    expert = expert_names_of(policy_cfg)
    sources = {"full": full, "expert": {n: full[n] + 1 for n in expert}}  # the expert update changes values
    out: dict[str, Any] = {"receivers": receivers, "trainer_device": trainer, "devices": ranks,
                           "dist_backend": placement.dist_backend, "bucket_mb": bench.bucket_mb}
    start = time.perf_counter()
    with PolicyEngine(rollout, policy_cfg) as engine:
        out["engine_start_s"] = time.perf_counter() - start
        start = time.perf_counter()
        pusher = BroadcastPush(engine, placement, weights_cfg)
        out["join_s"] = time.perf_counter() - start
        try:
            expected = {n: bit_checksum(t) for n, t in full.items()}
            for which, source in sources.items():
                out[which] = push_repeatedly(pusher, engine, source, which, bench)
                expected.update({n: bit_checksum(t) for n, t in source.items()})
                out[which]["ranks_equal_trainer"] = check_ranks(engine, expected)
        finally:
            pusher.close()
    return out


def expert_names_of(policy_cfg: PolicyConfig) -> list[str]:
    from policies.models.pi05 import PI05Model

    with torch.device("meta"):
        return expert_names(PI05Model(policy_cfg))


def push_repeatedly(pusher: BroadcastPush, engine: PolicyEngine, source: dict, which: str, bench: Any) -> dict:
    clocks: dict[str, list[float]] = {"send_s": [], "engine_s": [], "total_s": []}
    first = None
    for i in tqdm(range(bench.sync_warmup + bench.sync_iters), desc=f"broadcast {which}", leave=False):
        timing = pusher.push(source, engine.version + 1, partial=which == "expert")
        if i == 0:
            first = timing
        if i >= bench.sync_warmup:
            for key in clocks:
                clocks[key].append(getattr(timing, key))
    nbytes = sum(t.numel() * t.element_size() for t in source.values())
    from rollout.weights import TensorMeta

    buckets = len(bucket_layout([TensorMeta.of(n, t) for n, t in source.items()], int(bench.bucket_mb * 2**20)))
    out = {"tensors": len(source), "bytes": nbytes, "buckets": buckets, **{f"{k}_times": v for k, v in clocks.items()},
           "first_send_s": first.send_s, "first_total_s": first.total_s}
    for key, values in clocks.items():
        out[key] = statistics.median(values)
    out["gbps"] = nbytes / out["send_s"] / 1e9
    return out


def check_ranks(engine: PolicyEngine, expected: dict[str, int]) -> bool:
    """Every rank's parameters equal the trainer's bit for bit (exact checksums); raises otherwise."""
    for rank, sums in enumerate(engine.client.call("checksums", list(expected))):
        bad = [n for n, v in expected.items() if sums[n] != v]
        if bad:
            raise AssertionError(f"after the broadcast, rank {rank} differs from the trainer in {len(bad)} "
                                 f"parameters, e.g. {bad[:3]}")
    return True


def goal_check(entry: dict[str, Any], policy_name: str) -> bool | None:
    """The issue's goal (full pi0.5 to 7 ranks in <= 60 ms, NCCL); None where it does not apply."""
    if policy_name != "pi05" or entry.get("dist_backend") != "nccl" or entry.get("receivers") != GOAL_RECEIVERS:
        return None
    return entry["full"]["send_s"] <= GOAL_FULL_S
