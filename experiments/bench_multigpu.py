"""Multi-GPU benchmark (issue 13): data-parallel engine scaling, weight broadcast to every rank, and the
data-parallel actor update.

    python -m experiments.bench_multigpu                       # CPU smoke run (tiny policy, gloo, <= 2 ranks)
    python -m experiments.bench_multigpu policy=pi05 policy.fast.enabled=true bench.time_budget_s=540
                                                               # an nvidia-h200-x2/-x4/-x8 box
    python -m experiments.bench_multigpu policy=pi05 policy.fast.enabled=true bench.share_gpus=true
                                                               # one GPU: every rank count on it

Parts (bench.parts, in that order):
- "sync": the bench process is a trainer on cuda:0 and broadcasts a full pi0.5 / the expert only
  to a local-backend engine on cuda:1..M (rollout.weights_push.BroadcastPush, NCCL; gloo on CPU):
  seconds and GB/s (median of bench.sync_iters after bench.sync_warmup), the goal "full model to
  7 ranks <= 60 ms" judged on the trainer's send (until every rank wrote), the engine's side
  (with its fast-path refresh) beside it (experiments/bench_multigpu_sync.py);
- "throughput": per backend (local, ray) and rank count N (bench.ranks), an engine of N ranks on
  cuda:0..N-1 predicts bench.batch_per_rank x N rows per call: warm-up calls, then timed calls
  (wall time of `engine.predict`, and the ranks' device-synchronised PolicyOutput.timings).
  samples/s = rows / median wall; scaling efficiency = samples/s(N) / (N x samples/s(1)); the
  same observation rows for every N (LIBERO-like: 2 cameras, 8-dim state, libero_10 prompts);
- "actor": one GRPO actor update (bench.actor_rows rows the policy sampled itself) by the
  single-process actor, then by DDP / FSDP2 over K = bench.actor_ranks ranks on cuda:0..K-1
  (grpo.actor_parallel; spawned ranks, no torchrun): rows/s, efficiency, start and weight-gather
  time, and the K-rank update's difference from the single-process one
  (experiments/bench_multigpu_actor.py).
A rank count beyond the visible GPUs (or bench.max_cpu_ranks on CPU) is skipped and recorded,
unless bench.share_gpus places several ranks per GPU; a backend that cannot be imported (Ray on
the GPU box) is recorded as such; past bench.time_budget_s the remaining measurements are
recorded as skipped. NCCL settings are read from the environment and recorded, never changed.
JSON via experiments.results (`bench_multigpu_*`), last line `RESULT {...}`.
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from common.config import (
    check_choice,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    reject_unknown_keys,
)
from experiments.bench_multigpu_actor import run_actor
from experiments.bench_multigpu_sync import default_sync_receivers, goal_check, measure_sync, sync_devices
from experiments.results import write_result
from policies import PolicyConfig
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine

PARTS, BACKENDS, ACTOR_MODES = ("sync", "throughput", "actor"), ("local", "ray"), ("ddp", "fsdp2")
PROMPTS = [  # libero_10's task language
    "put both the alphabet soup and the tomato sauce in the basket",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "turn on the stove and put the moka pot on it",
    "pick up the book and place it in the back compartment of the caddy",
    "put both moka pots on the stove",
]


@dataclass
class BenchMultiGPUConfig:
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    ranks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    batch_per_rank: int = 32
    image_size: int = 224
    batches: int = 2  # distinct observation batches, cycled over the calls
    warmup: int = 3
    iters: int = 10
    mode: str = "train"
    share_gpus: bool = False  # more ranks than GPUs: rank r on cuda:(r mod #GPUs) instead of skipping
    max_cpu_ranks: int = 2  # without a GPU: larger rank counts are skipped (2 shared cores)
    torch_threads: int = 1  # torch threads per rank process
    sync_receivers: list[int] | None = None  # None: every GPU but the trainer's (CPU: max_cpu_ranks)
    sync_warmup: int = 2
    sync_iters: int = 5
    bucket_mb: float = 512.0
    dist_timeout_s: float = 300.0
    # actor part: one GRPO actor update on K data-parallel ranks (cuda:0..K-1) vs one process
    actor_ranks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    actor_modes: list[str] = field(default_factory=lambda: list(ACTOR_MODES))
    actor_rows: int = 256  # stored transitions per update (trajectories of actor_chunks rows)
    actor_chunks: int = 4  # rows per trajectory
    actor_group_size: int = 8  # trajectories per GRPO group (ranks get whole groups)
    actor_shard: str = "group"  # grpo.actor_parallel.shard
    actor_micro_batch: int = 32
    actor_update_epochs: int = 1
    actor_lr: float = 1e-4  # above the parameters' fp32 spacing, so update_rel_diff means something
    actor_iters: int = 2  # timed train calls after the first (compared with the single process)
    time_budget_s: float | None = None  # stop starting measurements past this (the JSON is still written)
    seed: int = 0
    out_dir: str | None = None
    commit: bool = False

    def __post_init__(self) -> None:
        for part in self.parts:
            check_choice("bench.parts entries", part, PARTS)
        for backend in self.backends:
            check_choice("bench.backends entries", backend, BACKENDS)
        for mode in self.actor_modes:
            check_choice("bench.actor_modes entries", mode, ACTOR_MODES)
        check_choice("bench.actor_shard", self.actor_shard, ("group", "row"))
        check_positive_float("bench.actor_lr", self.actor_lr)
        for key in ("ranks", "sync_receivers", "actor_ranks"):
            values = getattr(self, key)
            if values is not None:
                for v in values:
                    check_positive_int(f"bench.{key} entries", v)
                setattr(self, key, [int(v) for v in values])
        for key in ("batch_per_rank", "image_size", "batches", "iters", "max_cpu_ranks", "torch_threads",
                    "sync_iters", "actor_rows", "actor_chunks", "actor_group_size", "actor_micro_batch",
                    "actor_update_epochs", "actor_iters"):
            check_positive_int(f"bench.{key}", getattr(self, key))
        check_nonnegative_int("bench.warmup", self.warmup)
        check_nonnegative_int("bench.sync_warmup", self.sync_warmup)
        check_choice("bench.mode", self.mode, ("train", "eval", "ode", "sde", "sde_all"))
        check_positive_float("bench.bucket_mb", self.bucket_mb)
        check_positive_float("bench.dist_timeout_s", self.dist_timeout_s)
        if self.time_budget_s is not None:
            check_positive_float("bench.time_budget_s", self.time_budget_s)

    @staticmethod
    def from_mapping(data: Any) -> BenchMultiGPUConfig:
        return BenchMultiGPUConfig(**reject_unknown_keys(BenchMultiGPUConfig, data, "bench"))


# ---------------------------------------------------------------------- pure helpers
def throughput_devices(n: int, cuda_count: int, share_gpus: bool, max_cpu_ranks: int) -> list[str] | str:
    """The devices of N ranks, or why N ranks cannot run here."""
    if cuda_count == 0:
        if n > max_cpu_ranks:
            return f"{n} ranks > bench.max_cpu_ranks={max_cpu_ranks} (CPU smoke run)"
        return ["cpu"] * n
    if n > cuda_count and not share_gpus:
        return f"{n} ranks need {n} GPUs, {cuda_count} visible (bench.share_gpus=true puts several on one)"
    return [f"cuda:{r % cuda_count}" for r in range(n)]


def unavailable(module: str) -> str | None:
    """Why `module` cannot be imported here, or None."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the backend cannot run
        return f"{module} not importable: {exc!r}"
    return None


def add_efficiency(entries: list[dict[str, Any]]) -> None:
    """efficiency = rate(N) / (N x rate(1)) per backend, for the wall-clock and the device rates."""
    for key in ("samples_per_s", "device_samples_per_s"):
        one = {e["backend"]: e[key] for e in entries if e.get("ranks") == 1 and key in e}
        for e in entries:
            if key in e and e["backend"] in one:
                e[key.replace("samples_per_s", "efficiency")] = e[key] / (e["ranks"] * one[e["backend"]])


def observation_batches(policy_cfg: PolicyConfig, rows: int, image_size: int, count: int, seed: int) -> list[dict]:
    """LIBERO-like raw observations: every camera of the policy (uint8), the state, prompts."""
    rng = np.random.default_rng(seed)
    inputs = policy_cfg.inputs
    out = []
    for _ in range(count):
        obs = {cam: rng.integers(0, 256, (rows, image_size, image_size, 3), dtype=np.uint8)
               for cam in inputs.camera_map}
        obs[inputs.state_key] = rng.uniform(-1, 1, (rows, policy_cfg.state_dim)).astype(np.float32)
        obs[inputs.prompt_key] = [PROMPTS[i % len(PROMPTS)] for i in range(rows)]
        out.append(obs)
    return out


def first_rows(obs: dict, rows: int) -> dict:
    return {k: v[:rows] for k, v in obs.items()}


# ---------------------------------------------------------------------- throughput
def measure_throughput(bench: BenchMultiGPUConfig, policy_cfg: PolicyConfig, backend: str, devices: list[str],
                       batches: list[dict]) -> dict[str, Any]:
    n = len(devices)
    rows = bench.batch_per_rank * n
    calls = [first_rows(batches[i % len(batches)], rows) for i in range(bench.warmup + bench.iters)]
    cfg = EngineConfig(backend=backend, num_ranks=n, devices=devices, seed=bench.seed,
                       torch_threads=bench.torch_threads)
    out: dict[str, Any] = {"backend": backend, "ranks": n, "devices": devices, "rows": rows}
    start = time.perf_counter()
    with PolicyEngine(cfg, policy_cfg) as engine:
        out["engine_start_s"] = time.perf_counter() - start
        timed = []
        for i, obs in enumerate(calls):
            start = time.perf_counter()
            result = engine.predict(obs, mode=bench.mode)
            wall = time.perf_counter() - start
            if i >= bench.warmup:
                timed.append({"wall_s": wall, "predict_s": [t.predict_s for t in result.timings],
                              "preprocess_s": [t.preprocess_s for t in result.timings],
                              "total_s": [t.total_s for t in result.timings]})
    out["calls"] = timed
    out["wall_s"] = statistics.median(c["wall_s"] for c in timed)
    out["max_rank_predict_s"] = statistics.median(max(c["predict_s"]) for c in timed)
    out["max_rank_total_s"] = statistics.median(max(c["total_s"]) for c in timed)
    out["samples_per_s"] = rows / out["wall_s"]
    out["device_samples_per_s"] = rows / out["max_rank_predict_s"]
    return out


# ---------------------------------------------------------------------- the run
class Clock:
    """bench.time_budget_s: measurements start only while it lasts; the rest are recorded as skipped."""

    def __init__(self, budget_s: float | None):
        self.budget_s, self.start = budget_s, time.perf_counter()

    def over(self) -> str | None:
        elapsed = time.perf_counter() - self.start
        if self.budget_s is not None and elapsed > self.budget_s:
            return f"time budget: {elapsed:.0f} s > bench.time_budget_s={self.budget_s:g}"
        return None


def log(message: str) -> None:
    print(f"[bench_multigpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_throughput(bench: BenchMultiGPUConfig, policy_cfg: PolicyConfig, cuda_count: int, clock: Clock) -> list[dict]:
    batches = observation_batches(policy_cfg, bench.batch_per_rank * max(bench.ranks), bench.image_size,
                                  bench.batches, bench.seed)
    entries = []
    for backend in bench.backends:
        missing = unavailable("ray") if backend == "ray" else None
        for n in bench.ranks:
            devices = throughput_devices(n, cuda_count, bench.share_gpus, bench.max_cpu_ranks)
            skip = missing or (devices if isinstance(devices, str) else None) or clock.over()
            if skip:
                log(f"throughput {backend} x{n}: skipped ({skip})")
                entries.append({"backend": backend, "ranks": n, "skipped": skip})
                continue
            log(f"throughput {backend} x{n} on {devices}")
            entry = attempt(lambda: measure_throughput(bench, policy_cfg, backend, devices, batches),
                            {"backend": backend, "ranks": n, "devices": devices})
            entries.append(entry)
            if "error" not in entry:
                log(f"  {entry['samples_per_s']:.1f} samples/s (device {entry['device_samples_per_s']:.1f})")
    add_efficiency(entries)
    return entries


def run_sync(bench: BenchMultiGPUConfig, policy_cfg: PolicyConfig, cuda_count: int, clock: Clock) -> list[dict]:
    entries = []
    for m in bench.sync_receivers or default_sync_receivers(cuda_count, bench.max_cpu_ranks):
        placed = sync_devices(m, cuda_count, bench.max_cpu_ranks)
        skip = (placed if isinstance(placed, str) else None) or clock.over()
        if skip:
            log(f"sync to {m} ranks: skipped ({skip})")
            entries.append({"receivers": m, "skipped": skip})
            continue
        trainer, ranks = placed
        log(f"sync: trainer on {trainer} -> {m} ranks on {ranks}")
        entry = attempt(lambda: measure_sync(bench, policy_cfg, m, trainer, ranks, cuda_count),
                        {"receivers": m, "trainer_device": trainer, "devices": ranks})
        entries.append(entry)
        if cuda_count:
            torch.cuda.empty_cache()  # the trainer's copy of the weights leaves cuda:0 to the engine ranks
        if "error" not in entry:
            entry["goal_full_7_ranks_le_60ms"] = goal_check(entry, policy_cfg.name)
            log(f"  full {entry['full']['send_s'] * 1e3:.1f} ms ({entry['full']['gbps']:.1f} GB/s), "
                f"expert {entry['expert']['send_s'] * 1e3:.1f} ms")
    return entries


def attempt(measure: Callable[[], dict], about: dict[str, Any]) -> dict[str, Any]:
    """One measurement; a failure is recorded with its traceback and the run goes on (the bench
    exits non-zero at the end), so one broken configuration does not lose the others' numbers."""
    try:
        return measure()
    except Exception:  # noqa: BLE001 - recorded, reported, and the exit status says so
        error = traceback.format_exc()
        log(f"  failed: {error.strip().splitlines()[-1]}")
        return {**about, "error": error[-4000:]}


def summarise(results: dict[str, Any], policy_cfg: PolicyConfig) -> dict[str, Any]:
    s: dict[str, Any] = {"policy": policy_cfg.name, "cuda_count": results["cuda_count"]}
    for e in results.get("throughput", []):
        tag = f"{e['backend']}_{e['ranks']}"
        if "skipped" in e or "error" in e:
            s[f"samples_per_s_{tag}"] = None
            continue
        s[f"samples_per_s_{tag}"] = e["samples_per_s"]
        s[f"efficiency_{tag}"] = e.get("efficiency")
        s[f"device_efficiency_{tag}"] = e.get("device_efficiency")
    for e in results.get("sync", []):
        if "skipped" in e or "error" in e:
            continue
        for which in ("full", "expert"):
            s[f"sync_{e['receivers']}_{which}_s"] = e[which]["send_s"]
            s[f"sync_{e['receivers']}_{which}_gbps"] = e[which]["gbps"]
            s[f"sync_{e['receivers']}_{which}_engine_s"] = e[which]["engine_s"]
        if e.get("goal_full_7_ranks_le_60ms") is not None:
            s["goal_full_7_ranks_le_60ms"] = e["goal_full_7_ranks_le_60ms"]
    for e in results.get("actor", []):
        tag = f"{e['mode']}_{e['ranks']}"
        s[f"actor_rows_per_s_{tag}"] = e.get("rows_per_s")
        for key in ("efficiency", "grad_norm_rel_diff", "update_rel_diff", "update_rel_l2", "update_disagree_frac",
                    "gather_s"):
            if key in e:
                s[f"actor_{key}_{tag}"] = e[key]
    return s


def run(bench: BenchMultiGPUConfig, policy_cfg: PolicyConfig) -> dict[str, Any]:
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0:
        torch.set_num_threads(1)  # CPU ranks share the cores with this process
    results: dict[str, Any] = {"cuda_count": cuda_count,
                               "gpus": [torch.cuda.get_device_name(i) for i in range(cuda_count)],
                               "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    clock = Clock(bench.time_budget_s)
    runners = {"sync": run_sync, "throughput": run_throughput, "actor": run_actor}
    for part in bench.parts:
        results[part] = runners[part](bench, policy_cfg, cuda_count, clock)
    results["elapsed_s"] = time.perf_counter() - clock.start
    return results


def _not_measured(entry: dict[str, Any]) -> str:
    """Why an entry has no numbers: its skip reason or its error's last line."""
    if "skipped" in entry:
        return f"skipped ({entry['skipped']})"
    return "failed: " + entry["error"].strip().splitlines()[-1]


def print_table(results: dict[str, Any]) -> None:
    for e in results.get("throughput", []):
        if "skipped" in e or "error" in e:
            why = _not_measured(e)
            print(f"{e['backend']:>6} x{e['ranks']}: {why}")
        else:
            eff = e.get("efficiency")
            print(f"{e['backend']:>6} x{e['ranks']}: {e['samples_per_s']:8.1f} samples/s, efficiency "
                  f"{'-' if eff is None else f'{eff:.2f}'} (device {e.get('device_efficiency', 0):.2f})")
    for e in results.get("actor", []):
        if "skipped" in e or "error" in e:
            why = _not_measured(e)
            print(f"actor {e['mode']} x{e['ranks']}: {why}")
        else:
            print(f"actor {e['mode']} x{e['ranks']}: {e['rows_per_s']:8.1f} rows/s, efficiency "
                  f"{e.get('efficiency', float('nan')):.2f}, gather {e['gather_s'] * 1e3:.1f} ms, grad norm / update "
                  f"rel diff {e.get('grad_norm_rel_diff', 0.0):.1e} / {e.get('update_rel_diff', 0.0):.1e}, update "
                  f"rel L2 {e.get('update_rel_l2', 0.0):.1e}, elements stepping apart "
                  f"{e.get('update_disagree_frac', 0.0):.1e}")
    for e in results.get("sync", []):
        if "skipped" in e or "error" in e:
            why = _not_measured(e)
            print(f"sync to {e['receivers']}: {why}")
        else:
            print(f"sync to {e['receivers']} ({e['dist_backend']}): full {e['full']['send_s'] * 1e3:.2f} ms "
                  f"{e['full']['gbps']:.1f} GB/s, expert {e['expert']['send_s'] * 1e3:.2f} ms")


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_multigpu")
def main(cfg: DictConfig) -> None:
    bench = BenchMultiGPUConfig.from_mapping(OmegaConf.to_container(cfg.bench, resolve=True))
    policy_cfg = PolicyConfig.from_mapping(cfg.policy)
    results = run(bench, policy_cfg)
    report(bench, policy_cfg, results)
    failed = [e for part in PARTS for e in results.get(part, []) if "error" in e]
    if failed:
        raise SystemExit(f"{len(failed)} measurement(s) failed (their tracebacks are in the JSON)")


def report(bench: BenchMultiGPUConfig, policy_cfg: PolicyConfig, results: dict[str, Any]) -> Path:
    print_table(results)
    payload = {"bench": asdict(bench), "policy": policy_cfg.to_dict(), "results": results}
    return write_result("bench_multigpu", payload, summarise(results, policy_cfg), bench.out_dir, commit=bench.commit)


if __name__ == "__main__":
    main()
