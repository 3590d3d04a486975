"""Our side of the predict benchmark: the fast path in bf16 and in FP8 at one batch size.

Each (precision, batch size) gets a fresh FastSampler (one bucket), so its memory is measured
like LeRobot's: everything its build and calls add (shadow weights, FP8 weights, bucket buffers,
the CUDA graphs' private pool) on top of the model's weights. The FP8 sampler reuses the bf16
sampler's attention choices for the same shapes, so the two differ only in their GEMMs.

The log-prob gap (`rollout_gap`): train-mode rollouts (flow-SDE at one denoise step per call,
the same step for the whole batch, RLinf's recipe) through the fast path, then the trainer's
recompute of the same transitions: `Policy.log_prob` on the plain path (bf16 weights, the
rollout's chains and denoise_inds) at learning rate 0. Per chunk: |recompute - rollout| in
nats, and the share of ratios exp(recompute - rollout) outside [1 - clip, 1 + clip].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from experiments import bench_predict_common as common
from policies import flops, sampling
from policies.config import PolicyConfig
from policies.fast import geglu_gemm, gemm_search
from policies.fast.attention import AttentionSelector
from policies.fast.config import FAST_OFF, FastConfig
from policies.fast.runner import STAGES, FastSampler
from policies.lerobot_bridge import load_lerobot_into_ours
from policies.models.pi05 import PI05Model
from policies.policy import Policy, build_policy
from profiler.roofline import Ceilings, StageMeasurement, stage_roofline


def ours_policy(core, cfg: PolicyConfig, device: torch.device) -> Policy:
    """Our policy with LeRobot's weights (the core's state dict through our LeRobot loader), or
    random weights where LeRobot is missing."""
    if core is None:
        return build_policy(cfg, device=device)
    with torch.device(device):
        model = PI05Model(cfg)
    load_lerobot_into_ours(model, core).raise_if_incomplete()
    model.apply_precision(cfg.dtype).to(device)
    return Policy(cfg, model)


@dataclass
class SameChoiceSelector(AttentionSelector):
    """Builds the backend another selector chose for the same shape (measuring where it has none)."""

    chosen: dict = field(default_factory=dict)

    def build(self, stage, batch, queries, rows, heads, kv_heads, head_dim, dtype, device, key_len):
        name = self.chosen.get(f"{stage}/b{batch}/q{queries}/s{rows}")
        if name is None:
            return super().build(stage, batch, queries, rows, heads, kv_heads, head_dim, dtype, device, key_len)
        backend = self.candidates(batch, queries, rows, heads, kv_heads, head_dim, dtype, device, stage)[name]()
        return self._record(f"{stage}/b{batch}/q{queries}/s{rows}", backend, {}, {}, "same as the bf16 sampler")


def reference_cfg(cfg: PolicyConfig) -> PolicyConfig:
    """The config of the policy the samplers are built over, with its own fast path off: its `sample` (the
    parity reference) and `log_prob` (the gap's recompute) run the plain path even when the run sets
    policy.fast.enabled=true (else the parity was fast vs fast); policy.fast's other settings stay for
    `fast_config`."""
    return cfg.replace(fast=FAST_OFF)


def fast_config(base: FastConfig, precision: str, dtype: str, attention: str, batch: int) -> FastConfig:
    """One side's sampler: the run's policy.fast settings (gemm, mlp, overlap, fp8_gemms, ...) with the
    bench's dtype, attention, precision and a one-entry batch bucket. No consistent recompute: the gap is
    measured against the trainer's plain-path recompute (and that flag needs a batch-invariant attention)."""
    # FP8 GEMMs write bf16: the FP8 side is bf16 elsewhere even on a float32 (CPU smoke) run.
    return dataclasses.replace(base, enabled=True, dtype="bfloat16" if precision == "fp8" else dtype,
                               attention=attention, batch_buckets=[batch], precision=precision,
                               consistent_recompute=False)


def measure_ours(policy: Policy, precision: str, batch: int, prompt_len: int, inputs, noise, device: torch.device,
                 bench, budget: common.Budget, ceilings: dict, chosen: dict | None, gap_calls: int = 0) -> dict:
    """Timing, memory beyond the model's weights, stage breakdown, actions (ODE, fp32, CPU), the
    attention choices, and (gap_calls > 0) the rollout/recompute log-prob gap, for one sampler."""
    cfg = policy.cfg
    steps = cfg.sampling.num_steps
    mark = common.memory_mark(device)
    fast_cfg = fast_config(cfg.fast, precision, cfg.dtype, bench.attention, batch)
    fast = FastSampler(policy.model, fast_cfg)
    if chosen:
        fast.selector = SameChoiceSelector(chosen=chosen)
    stoch = torch.zeros(batch, steps, dtype=torch.bool, device=device)
    timing = common.time_calls(lambda: fast.sample_chains(inputs, noise, None, stoch), device, bench.warmup,
                               bench.iters, budget, f"ours {precision} b={batch}")
    row = {"ms": timing["ms"], "first_call_s": timing["first_call_s"], "ms_all": timing["ms_all"],
           "actions": timing["output"][0][:, -1].float().cpu(), "fp8_gemms": len(fast.w.fp8_weights),
           "fast": dataclasses.asdict(fast_cfg)}  # the settings measured (the JSON's "policy" is the run's config)
    row["stages"] = stage_breakdown(fast, cfg, inputs, noise, stoch, device, bench, ceilings)
    row["memory_delta"] = common.memory_since(mark, device)  # before the gap: its plain-path recompute is the trainer's
    row["attention"] = {k: v["chosen"] for k, v in fast.selector.records.items()}
    bucket = next(iter(fast.buckets.values()))
    row["geglu_tile"] = geglu_gemm.tile_label(bucket.geglu_tile)
    row["call_stages"] = list(fast.call_stages(bucket))  # with policy.fast.overlap: vision, prefix_denoise
    row["overlap_ms"] = bucket.overlap_ms  # overlap "auto": the two ways' replay medians at the first call
    row["vision_gemms"] = gemm_search.summary(bucket.vision_gemms)  # gemm_search "auto": the algorithms kept
    if gap_calls:
        try:  # rollouts plus plain-path recomputes: a few times the sampler's call each
            budget.require(gap_calls * 4 * timing["ms"] / 1e3, f"log-prob gap {precision} b={batch}")
            row["logprob_gap"] = rollout_gap(policy, fast, batch, prompt_len, device, gap_calls, bench.clip)
        except common.BudgetExceeded as exc:
            row["logprob_gap"] = {"skipped": str(exc)}
    return row


def stage_breakdown(fast: FastSampler, cfg: PolicyConfig, inputs, noise, stoch, device, bench, ceilings) -> dict:
    """Each stage replayed alone (CUDA graph) against its analytic FLOPs and bytes (bf16 ceilings)."""
    bucket = fast.prepare(inputs, noise, None, stoch)
    costs = flops.stage_costs(cfg.replace(dtype="bfloat16") if device.type == "cuda" else cfg, batch=bucket.batch,
                              prompt_len=bucket.prompt_len, modulation_precomputed=True)
    cost_of = {"vision": costs["vision"], "prefix": costs["prefix"], "denoise": costs["expert_total"]}
    measured = []
    for stage in STAGES:
        ms = common.timed_ms(lambda stage=stage: fast.run_stage(bucket, stage), device, bench.warmup, bench.iters)
        measured.append(StageMeasurement(stage, cost_of[stage].flops, cost_of[stage].bytes, ms / 1e3))
    points = stage_roofline(measured, roofline_ceilings(ceilings))
    return {p.name: {"ms": p.time_s * 1e3, "gflop": p.flops / 1e9, "gbytes": p.bytes / 1e9,
                     "tflops": p.achieved_flops / 1e12, "intensity": p.intensity, "mfu": p.mfu,
                     "roof_fraction": p.roof_fraction, "bound": p.bound} for p in points}


def roofline_ceilings(ceilings: dict) -> Ceilings:
    return Ceilings(ceilings["matmul_tflops"] * 1e12, ceilings["copy_tb_s"] * 1e12,
                    source=f"measured {ceilings['dtype']} GEMM + device copy")


# --------------------------------------------------------------------------- log-prob gap


def gap_metrics(recompute: torch.Tensor, rollout: torch.Tensor, clip: float) -> dict:
    """Chunk log-probs (N,) of the same transitions: mean and max |recompute - rollout| (nats) and
    the share of ratios exp(recompute - rollout) outside [1 - clip, 1 + clip] (clipped at lr 0)."""
    diff = (recompute.double() - rollout.double()).cpu()
    ratio = diff.exp()
    outside = (ratio < 1 - clip) | (ratio > 1 + clip)
    return {"mean_nats": float(diff.abs().mean()), "max_nats": float(diff.abs().max()),
            "clip_fraction": float(outside.double().mean()), "chunks": int(diff.numel()), "clip": clip}


@torch.no_grad()
def rollout_gap(policy: Policy, fast: FastSampler, batch: int, prompt_len: int, device: torch.device, calls: int,
                clip: float) -> dict:
    """`calls` train-mode rollouts of `batch` (stochastic step k = call mod K, seeded inputs and
    noise), each re-scored by the plain-path recompute."""
    cfg = policy.cfg
    steps = cfg.sampling.num_steps
    recomputed, rolled = [], []
    for call in range(calls):
        inputs, noise = common.make_inputs(cfg, batch, prompt_len, device, seed=10_000 + call)
        g = torch.Generator().manual_seed(20_000 + call)
        step_noise = torch.randn(batch, steps, cfg.chunk_size, cfg.max_action_dim, generator=g).to(device)
        inds = torch.full((batch, steps), call % steps, device=device)
        chains, step_lp = fast.sample_chains(inputs, noise, step_noise, inds == torch.arange(steps, device=device))
        lp = sampling.reduce_logprobs("sde", step_lp, chains, inds, cfg.logprob_chunk, cfg.action_dim)
        rolled.append(lp.flatten(1).sum(dim=1))
        recomputed.append(policy.log_prob(inputs, chains, inds, mode="sde", consistent=False).chunk_logprob)
    metrics = gap_metrics(torch.cat(recomputed), torch.cat(rolled), clip)
    metrics.update(batch=batch, calls=calls, steps_used=sorted({c % steps for c in range(calls)}))
    return metrics


def footprint(weights_mib: float | None, delta: dict | None) -> dict | None:
    """A side's memory at one batch size: its weights plus what the measurement added."""
    if delta is None or weights_mib is None:
        return None
    return {"weights_mib": weights_mib, **{k: weights_mib + v for k, v in delta.items()}}


def samples_per_s(batch: int, ms: float) -> float:
    return batch / ms * 1e3 if ms and not math.isnan(ms) else float("nan")
