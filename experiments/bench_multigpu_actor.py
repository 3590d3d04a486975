"""bench_multigpu's actor part: one GRPO actor update on K data-parallel ranks vs one process.

The bench's own process is rank 0 (a trainer: fp32 master weights, bf16 autocast on GPU) on
cuda:0; ranks 1..K-1 are spawned on cuda:1..K-1 (grpo/actor_group.py; CPU: gloo ranks). The
rows are the policy's own train-mode samples of LIBERO-like observations (experiments.
bench_multigpu.observation_batches), grouped as trajectories of bench.actor_chunks chunks in
groups of bench.actor_group_size, with random advantages. Per configuration (mode "none" for
K = 1, then bench.actor_modes x bench.actor_ranks):
- start_s: spawning the workers, building their policies, broadcasting rank 0's weights, wrapping;
- first_s, then (after one more untimed call) train_s = median of bench.actor_iters more `train(samples)` calls
  (rows/s from it);
- gather_s: the weights the push needs on rank 0 after an update (`weights_for_push(False)`:
  free for DDP, an all-gather of the trainable parameters for FSDP2);
- against the single-process update from the same initial weights on this device (bf16 autocast
  on GPU, so not bit-equal): grad_norm_rel_diff, the first call's global gradient norm (before
  clipping; a wrong sum/average or row weighting shows here), and the first call's change of the
  trainable parameters against the single process's (update_agreement: the max and L2 relative
  differences and the fraction of elements stepping apart; AdamW's first step moves each element by
  about +-lr, so these check the gradient's signs);
- rank 0's peak GPU memory. Efficiency = rows/s(K) / (K x rows/s(single process)).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from grpo.actor_group import build_actor
from grpo.config import GRPOConfig
from grpo.distributed import plan_actor
from grpo.samples import Samples
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy


def actor_devices(k: int, cuda_count: int, max_cpu_ranks: int) -> list[str] | str:
    """cuda:0..K-1 (CPU: K gloo ranks), or why K ranks cannot run here."""
    if cuda_count == 0:
        if k > max_cpu_ranks:
            return f"{k} ranks > bench.max_cpu_ranks={max_cpu_ranks} (CPU smoke run)"
        return ["cpu"] * k
    if k > cuda_count:
        return f"{k} actor ranks need {k} GPUs, {cuda_count} visible"
    return [f"cuda:{r}" for r in range(k)]


@torch.no_grad()
def synthetic_samples(policy, batches: list[dict], rows: int, chunks: int, micro: int, seed: int) -> Samples:
    """`rows` stored transitions sampled by `policy` in train mode: trajectory t = row // chunks,
    one N(0, 1) advantage per trajectory (CPU tensors, as the collector stores them)."""
    from experiments.bench_multigpu import first_rows

    inputs = policy.cfg.inputs
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    parts = []
    for start in range(0, rows, micro):
        n = min(micro, rows - start)
        raw = first_rows(batches[(start // micro) % len(batches)], n)
        batch = policy.make_batch(raw)
        out = policy.sample(batch, mode="train", generator=gen)
        zeros = torch.zeros(n, dtype=torch.int64)  # per-row structure: set over all rows below
        parts.append(Samples(
            images={k: torch.from_numpy(raw[k]) for k in inputs.camera_map},
            states=torch.from_numpy(raw[inputs.state_key]), tokens=batch.tokenized_prompt.long().cpu(),
            token_mask=batch.tokenized_prompt_mask.bool().cpu(), chains=out.chains.float().cpu(),
            denoise_inds=out.denoise_inds.long().cpu(), rollout_logprob=out.chunk_logprob.float().cpu(),
            versions=zeros, trajectory=zeros, chunk=zeros, advantages=torch.zeros(n), trajectory_length=zeros))
    samples = Samples.concat(parts)
    trajectory = torch.arange(rows) // chunks
    samples.trajectory, samples.chunk = trajectory, torch.arange(rows) % chunks
    advantage = torch.randn(int(trajectory.max()) + 1, generator=torch.Generator().manual_seed(seed))
    samples.advantages = advantage[trajectory]
    samples.trajectory_length = torch.bincount(trajectory)[trajectory]
    return samples


def grpo_config(bench: Any, mode: str, k: int) -> GRPOConfig:
    parallel = {} if mode == "none" else {"mode": mode, "world_size": k, "torch_threads": bench.torch_threads,
                                          "dist_timeout_s": bench.dist_timeout_s, "shard": bench.actor_shard}
    return GRPOConfig(micro_batch=bench.actor_micro_batch, update_epochs=bench.actor_update_epochs, lr=bench.actor_lr,
                      seed=bench.seed, actor_parallel=parallel)


def trainable_cpu(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu().clone() for n, t in named.items()}


def measure_actor(bench: Any, policy_cfg: PolicyConfig, mode: str, devices: list[str], samples: Samples,
                  initial: dict[str, torch.Tensor], single: dict[str, Any] | None) -> dict[str, Any]:
    cfg = grpo_config(bench, mode, len(devices))
    plan = plan_actor(cfg.actor_parallel, devices[0], torch.cuda.device_count() if torch.cuda.is_available() else 0)
    policy = build_policy(trainer_policy_config(policy_cfg), devices[0])
    out: dict[str, Any] = {"mode": mode, "ranks": len(devices), "devices": devices, "backend": plan.backend,
                           "rows": len(samples)}
    if devices[0].startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(devices[0])
    start = time.perf_counter()
    actor = build_actor(policy, cfg, plan, bench.actor_group_size, show_progress=False)
    try:
        out["start_s"] = time.perf_counter() - start
        out["first_s"], metrics = timed(lambda: actor.train(samples), devices[0])
        out["gather_s"], pushed = timed(lambda: actor.weights_for_push(False), devices[0])
        delta = {n: t.detach().float().cpu() - initial[n] for n, t in pushed.items()}
        out["grad_norm"] = metrics["train/grad_norm"]
        if single is not None:
            out.update(update_agreement(delta, single["_delta"]))
            out["grad_norm_rel_diff"] = abs(out["grad_norm"] - single["grad_norm"]) / single["grad_norm"]
        # one more call first, untimed: DDP rebuilds its gradient buckets once, at the first forward after the first
        # synchronised backward, which the first call runs only on its last micro-batch (no_sync before it)
        actor.train(samples)
        times = [timed(lambda: actor.train(samples), devices[0])[0] for _ in range(bench.actor_iters)]
    finally:
        actor.close()
    out["train_times"] = times
    out["train_s"] = statistics.median(times)
    out["rows_per_s"] = len(samples) * bench.actor_update_epochs / out["train_s"]
    if devices[0].startswith("cuda"):
        out["rank0_peak_gib"] = torch.cuda.max_memory_allocated(devices[0]) / 2**30
    out["_delta"] = delta  # the single-process run's is the others' reference (not in the JSON)
    return out


def update_agreement(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far the K-rank update `delta` is from the single-process one `ref` (name -> change of each trainable
    parameter): update_rel_diff = max |delta - ref| / max |ref| (one element decides it); update_rel_l2 =
    ||delta - ref|| / ||ref|| over all elements; update_disagree_frac = the fraction of elements whose two changes
    differ by more than half the largest single-process step. AdamW's first step moves each element by about +-lr
    whatever its gradient's size, so an element whose gradient is at bf16 noise level may step the other way in
    one run (a difference of 2 lr: the max metric reads ~1-2 on the GPU); a wrong split of the rows or a wrong
    reduction turns many gradients, so the fraction is the telling number there."""
    scale = max(float(d.abs().max()) for d in ref.values())
    diff_max, diff_sq, ref_sq, disagree, count = 0.0, 0.0, 0.0, 0, 0
    for name, r in ref.items():
        d = delta[name] - r
        diff_max = max(diff_max, float(d.abs().max()))
        diff_sq += float(d.double().square().sum())
        ref_sq += float(r.double().square().sum())
        disagree += int((d.abs() > scale / 2).sum())
        count += r.numel()
    return {"update_rel_diff": diff_max / scale, "update_rel_l2": (diff_sq / ref_sq) ** 0.5,
            "update_disagree_frac": disagree / count}


def timed(fn, device: str) -> tuple[float, Any]:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, value


def actor_inputs(bench: Any, policy_cfg: PolicyConfig, device: str) -> dict[str, Any]:
    """The policy's own samples of LIBERO-like observations and its initial trainable weights (CPU)."""
    from experiments.bench_multigpu import observation_batches

    policy = build_policy(trainer_policy_config(policy_cfg), device)
    batches = observation_batches(policy_cfg, bench.actor_micro_batch, bench.image_size, bench.batches, bench.seed)
    samples = synthetic_samples(policy, batches, bench.actor_rows, bench.actor_chunks, bench.actor_micro_batch,
                                bench.seed)
    initial = trainable_cpu({n: p for n, p in policy.model.named_parameters() if p.requires_grad})
    return {"samples": samples, "initial": initial}


def run_actor(bench: Any, policy_cfg: PolicyConfig, cuda_count: int, clock: Any) -> list[dict]:
    from experiments.bench_multigpu import attempt, log

    first = actor_devices(1, cuda_count, bench.max_cpu_ranks)[0]
    # the rows every configuration trains on; a failure here is the part's recorded result (raised, it lost
    # the sync and throughput parts measured before it: no JSON was written)
    setup = attempt(lambda: actor_inputs(bench, policy_cfg, first), {"mode": "none", "ranks": 1, "devices": [first]})
    if "error" in setup:
        return [setup]
    samples, initial = setup["samples"], setup["initial"]
    configs = [("none", 1)] + [(m, k) for m in bench.actor_modes for k in bench.actor_ranks if k > 1]
    entries, single = [], None
    for mode, k in configs:
        devices = actor_devices(k, cuda_count, bench.max_cpu_ranks)
        skip = (devices if isinstance(devices, str) else None) or clock.over()
        if skip:
            log(f"actor {mode} x{k}: skipped ({skip})")
            entries.append({"mode": mode, "ranks": k, "skipped": skip})
            continue
        log(f"actor {mode} x{k} on {devices}: {len(samples)} rows")
        entry = attempt(lambda: measure_actor(bench, policy_cfg, mode, devices, samples, initial, single),
                        {"mode": mode, "ranks": k, "devices": devices})
        if mode == "none" and "error" not in entry:
            single = dict(entry)
        entry.pop("_delta", None)
        entries.append(entry)
        if cuda_count:
            torch.cuda.empty_cache()
        if "error" not in entry:
            log(f"  {entry['rows_per_s']:.1f} rows/s, start {entry['start_s']:.1f} s, gather {entry['gather_s']:.3f} s"
                + (f", grad norm rel diff {entry['grad_norm_rel_diff']:.1e}, update rel diff max "
                   f"{entry['update_rel_diff']:.1e} / L2 {entry['update_rel_l2']:.1e}, elements stepping apart "
                   f"{entry['update_disagree_frac']:.1e}" if "update_rel_diff" in entry else ""))
    for e in entries:
        if single is not None and "rows_per_s" in e:
            e["efficiency"] = e["rows_per_s"] / (e["ranks"] * single["rows_per_s"])
    return entries
