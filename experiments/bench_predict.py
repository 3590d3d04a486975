"""Predict benchmark: our fast path (bf16 and FP8) vs LeRobot 0.6.1's PI05 in every variant, one run.

    python -m experiments.bench_predict                      # GPU: pi05, both configurations, B = 1, 32, 64
    python -m experiments.bench_predict bench.full_sweep=true   # B = 1, 2, 4, ..., 64
    python -m experiments.bench_predict policy=tiny bench.batch_sizes=[1,4] bench.gap_batch=4   # CPU smoke (fp32)

For each configuration (PhyAI's: 3 cameras, 200-token prompt, chunk 50, 10 steps; LIBERO RL:
2 cameras, 48-token prompt, chunk 10, 4 steps): LeRobot's PI05Pytorch with random weights
(AdaRMS randomised so the time conditioning matters), our model loaded from its state dict
through our LeRobot loader, then per batch size every side on the same inputs and noise:
- ours: the fast path in bf16 ("ours") and with FP8 vision/prefix GEMMs ("ours_fp8");
- LeRobot "shipped" (its bf16 mode: SigLIP fp32), "bf16" (every weight bf16) and, after all
  configurations, "compiled_<mode>" (its compile_model option, in a worker process killed at a
  deadline: experiments/bench_predict_compiled.py; they compile side by side, then time one at a time;
  `bench.lerobot_compile_shapes`: torch's dynamic-batch recompile, a static graph per batch size, or both).
Every side gets the same warm-up and timed iterations (CUDA-event medians); speed-ups are quoted
against the fastest LeRobot variant at that batch size; memory is each side's weights plus
everything its measurement added (peak allocated, peak reserved, resident incl. CUDA graph
pools); actions are compared for the same noise (parity against our plain path; FP8 vs bf16). At
`bench.gap_batch` the FP8 and bf16 rollouts' log-prob gap to the trainer's plain-path recompute is
measured (none, with the reason recorded, if it is not among `bench.batch_sizes` or `bench.gap_calls=0`).
Our sides run the run's `policy.fast` settings with the bench's dtype, attention, precision and a
one-entry batch bucket; each records the FastConfig it measured ("fast").
`bench.time_budget_s` bounds the run: a measurement that would overrun it is skipped and recorded.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from common.config import is_int
from common.devices import auto_device
from experiments import bench_predict_common as common
from experiments import bench_predict_compiled as compiled_side
from experiments import bench_predict_lerobot as lerobot_side
from experiments import bench_predict_ours as ours_side
from experiments.bench_predict_common import timed_ms  # noqa: F401 - scripts/gpu_smoke.py imports it from here
from experiments.bench_predict_lerobot import build_lerobot  # noqa: F401 - so does bench_rollout_baseline
from experiments.bench_predict_ours import footprint, roofline_ceilings
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast.fp8 import FP8
from policies.lerobot_bridge import relative_l2
from profiler.ceilings import measure_ceilings as profiler_ceilings
from profiler.export_png import plot_stage_roofline
from profiler.roofline import StageMeasurement, stage_roofline

FULL_SWEEP = [1, 2, 4, 8, 16, 32, 64]
MIN_COMPILE_S = 30.0  # a compile attempt with less time than this is skipped (recorded), not started
# a compiled worker's timing phase per batch size: reserved from the budget, then its kill (~7 s used on the H200)
TIMING_S_PER_BATCH = 20.0
COMPILE_SHAPES = ("dynamic", "static")


@dataclass
class BenchPredictConfig:
    configurations: list[str] = field(default_factory=lambda: ["phyai", "libero_rl"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 32, 64])
    full_sweep: bool = False  # batch sizes 1, 2, 4, ..., 64 instead of batch_sizes
    warmup: int = 2
    iters: int = 5
    precisions: list[str] = field(default_factory=lambda: ["bf16", "fp8"])
    lerobot: bool = True
    lerobot_variants: list[str] = field(default_factory=lambda: list(lerobot_side.EAGER_VARIANTS))
    lerobot_compile_modes: list[str] = field(default_factory=lambda: ["reduce-overhead"])
    lerobot_compile_precision: str = "bf16"
    lerobot_compile_budget_s: float = 180.0
    lerobot_compile_cache_dir: str | None = None  # inductor's cache for the compiled variant (None: its default)
    # "dynamic": torch's default (a batch size after the first recompiles with a symbolic batch, as LeRobot ships);
    # "static": automatic dynamic shapes off, a static graph per batch size (variant name ..._static)
    lerobot_compile_shapes: list[str] = field(default_factory=lambda: ["dynamic"])
    # compile workers alive at once (0: all); each holds a LeRobot copy (9-14 GB on the H200), so a smaller card
    # runs them in waves, each compiled and timed before the next (the waves share lerobot_compile_budget_s)
    lerobot_compile_parallel: int = 0
    time_budget_s: float = 420.0
    gap_batch: int = 32  # not among batch_sizes: no gap measured, the reason recorded (gap_skipped)
    gap_calls: int = 4  # 0: no gap measured (recorded)
    clip: float = 0.2
    attention: str = "auto"
    device: str = "auto"
    out_dir: str | None = None  # None: experiments.results decides (runs/bench_predict/)
    commit: bool = False  # write the JSON to benchmarks/results/ (a result to commit)

    def __post_init__(self):
        if self.full_sweep:
            self.batch_sizes = list(FULL_SWEEP)
        unknown = [c for c in self.configurations if c not in common.CONFIGURATIONS]
        if unknown:
            raise ValueError(f"bench.configurations has unknown {unknown}; choose from {list(common.CONFIGURATIONS)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"bench.batch_sizes must be positive, got {self.batch_sizes}")
        if self.warmup < 1 or self.iters < 1:
            raise ValueError(f"bench.warmup and bench.iters must be >= 1, got {self.warmup}, {self.iters}")
        if "bf16" not in self.precisions or not set(self.precisions) <= {"bf16", "fp8"}:
            raise ValueError(f"bench.precisions must contain 'bf16' (the baseline) and only 'bf16'/'fp8', "
                             f"got {self.precisions}")
        if not set(self.lerobot_variants) <= set(lerobot_side.EAGER_VARIANTS):
            raise ValueError(f"bench.lerobot_variants must be among {lerobot_side.EAGER_VARIANTS}, "
                             f"got {self.lerobot_variants}")
        if self.lerobot_compile_precision not in ("shipped", "bf16"):
            raise ValueError(f"bench.lerobot_compile_precision must be 'shipped' or 'bf16', "
                             f"got {self.lerobot_compile_precision!r}")
        if not self.lerobot_compile_shapes or not set(self.lerobot_compile_shapes) <= set(COMPILE_SHAPES):
            raise ValueError(f"bench.lerobot_compile_shapes must list one or both of {list(COMPILE_SHAPES)}, "
                             f"got {self.lerobot_compile_shapes}")
        if self.lerobot_compile_parallel < 0:
            raise ValueError(f"bench.lerobot_compile_parallel must be >= 0 (0: every worker at once), "
                             f"got {self.lerobot_compile_parallel}")
        if self.time_budget_s <= 0 or self.lerobot_compile_budget_s <= 0:
            raise ValueError(f"bench.time_budget_s and bench.lerobot_compile_budget_s must be > 0, got "
                             f"{self.time_budget_s}, {self.lerobot_compile_budget_s}")
        cache = self.lerobot_compile_cache_dir
        if cache is not None and (not isinstance(cache, str) or not cache.strip()
                                  or (Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir())):
            # checked here: the compiled variant runs last, and a bad directory there would lose the whole run
            raise ValueError(f"bench.lerobot_compile_cache_dir must be a directory (or null for inductor's "
                             f"default), got {cache!r}")
        if not 0 < self.clip < 1:
            raise ValueError(f"bench.clip must be in (0, 1), got {self.clip}")
        if not is_int(self.gap_batch) or self.gap_batch < 1:
            raise ValueError(f"bench.gap_batch must be a positive batch size (the gap is measured when it is one of "
                             f"bench.batch_sizes={self.batch_sizes}), got {self.gap_batch!r}")
        if not is_int(self.gap_calls) or self.gap_calls < 0:
            raise ValueError(f"bench.gap_calls must be a number of rollout calls >= 0 (0: no gap), "
                             f"got {self.gap_calls!r}")

    def gap_skipped(self) -> str | None:
        """Why no log-prob gap is measured, None when it is. A bench.gap_batch outside bench.batch_sizes is
        not refused: the README's device commands use one (gap_batch=64 with batch_sizes [1, 32]) to spend
        the budget on timing; the reason goes into the JSON instead of the gap silently missing."""
        if self.gap_calls == 0:
            return "bench.gap_calls=0"
        if self.gap_batch not in self.batch_sizes:
            return f"bench.gap_batch={self.gap_batch} is not among bench.batch_sizes={self.batch_sizes}"
        return None


def measure_ceilings(device: torch.device) -> dict:
    """Dense GEMM rate (bf16 on GPU; FP8 too) and device copy bandwidth (bytes read + written), measured now."""
    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    measured = profiler_ceilings(str(device), dtype=dtype, matmul_n=8192 if cuda else 1024,
                                 copy_mb=4096 if cuda else 256, repeats=10)
    out = {"matmul_tflops": measured.peak_flops / 1e12, "copy_tb_s": measured.peak_bytes_per_s / 1e12,
           "dtype": dtype, "source": measured.source}
    if cuda:
        out["fp8_matmul_tflops"] = fp8_matmul_tflops(device)
    return out


def fp8_matmul_tflops(device: torch.device, n: int = 8192) -> float | str:
    """Best of 10 row-wise-scaled e4m3 GEMMs (torch._scaled_mm, bf16 out), or the error it raised."""
    try:
        a, b = (torch.randn(n, n, device=device).to(FP8) for _ in range(2))
        sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
        ms = min(timed_ms(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16), device, 3, 1)
                 for _ in range(10))
        return 2.0 * n**3 / (ms / 1e3) / 1e12
    except Exception as exc:  # noqa: BLE001 - recorded: the FP8 side then fails the same way
        return f"{type(exc).__name__}: {exc}"[:300]


# --------------------------------------------------------------------------- one configuration


def build_lerobot_variants(cfg: PolicyConfig, bench: BenchPredictConfig, device: torch.device, result: dict):
    """{variant: (core, weights MiB)} for the eager variants, and the shipped core (ours loads its weights)."""
    info = result["lerobot"]
    if not bench.lerobot:
        info["status"] = "disabled (bench.lerobot=false)"
        return {}, None
    mark = common.memory_mark(device)
    core = lerobot_side.build_lerobot(cfg, device, seed=1)
    if core is None:
        info["status"] = "not importable here (LeRobot 0.6.1 needs Python >= 3.12 and its wheels)"
        return {}, None
    built = common.memory_since(mark, device)
    info["status"], info["checksum"] = "ok", lerobot_side.weights_checksum(core)
    variants = {"lerobot_shipped": (core, built["resident_mib"] if built else lerobot_side.param_mib(core))}
    result["weights_mib"]["lerobot_shipped"] = lerobot_side.param_mib(core)
    return variants, core


def add_bf16_variant(variants: dict, core, cfg: PolicyConfig, bench: BenchPredictConfig, device, result) -> None:
    if "bf16" not in bench.lerobot_variants or core is None:
        return
    if cfg.dtype != "bfloat16":
        result["lerobot"]["lerobot_bf16"] = f"skipped: the run is {cfg.dtype} (LeRobot already runs every weight so)"
        return
    mark = common.memory_mark(device)
    clone = lerobot_side.bf16_copy(core)
    built = common.memory_since(mark, device)
    variants["lerobot_bf16"] = (clone, built["resident_mib"] if built else lerobot_side.param_mib(clone))
    result["weights_mib"]["lerobot_bf16"] = lerobot_side.param_mib(clone)


def configuration_cfg(name: str, base: PolicyConfig, device: torch.device) -> PolicyConfig:
    """One configuration's policy: bf16 on a GPU, fp32 elsewhere (the CPU smoke runs). The warm-up
    (`warm_lerobot_compile`) builds its jobs' policies here too, so it compiles this run's graphs."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return common.configuration_policy_cfg(base, common.CONFIGURATIONS[name], dtype)


def bench_configuration(name: str, base: PolicyConfig, bench: BenchPredictConfig, device: torch.device,
                        ceilings: dict, budget: common.Budget) -> tuple[dict, dict]:
    spec = common.CONFIGURATIONS[name]
    cfg = configuration_cfg(name, base, device)
    dtype = cfg.dtype
    # "policy": the run's config; each of our sides records the FastConfig it measured ("fast")
    result = {"spec": spec, "policy": cfg.to_dict(), "dtype": dtype, "rows": [], "lerobot": {}, "weights_mib": {},
              "reference": "plain path (policy.fast.enabled=false): the parity's actions, the gap's recompute"}
    if bench.gap_skipped():
        result["logprob_gap"] = {"skipped": f"{bench.gap_skipped()}: no log-prob gap measured"}
    variants, core = build_lerobot_variants(cfg, bench, device, result)
    mark = common.memory_mark(device)
    policy = ours_side.ours_policy(core, ours_side.reference_cfg(cfg), device)
    built = common.memory_since(mark, device)
    ours_weights = built["resident_mib"] if built else lerobot_side.param_mib(policy.model)
    result["weights_mib"]["ours"] = lerobot_side.param_mib(policy.model)
    add_bf16_variant(variants, core, cfg, bench, device, result)
    if "shipped" not in bench.lerobot_variants:
        variants.pop("lerobot_shipped", None)
    sides = {"ours": ours_weights, "ours_fp8": ours_weights, **{v: w for v, (_, w) in variants.items()}}
    for batch in tqdm(bench.batch_sizes, desc=f"{name} batch sizes"):
        row = {"batch": batch, "sides": {}}
        inputs, noise = common.make_inputs(cfg, batch, spec["prompt_len"], device, seed=batch)
        measure_our_sides(row, policy, bench, spec, inputs, noise, device, budget, ceilings)
        for variant, (lerobot_core, _) in variants.items():
            row["sides"][variant] = guarded(lambda c=lerobot_core, v=variant: lerobot_side.measure_lerobot(
                c, inputs, noise, cfg.sampling.num_steps, device, bench.warmup, bench.iters, budget, f"{v} b={batch}"))
        for side, measured in row["sides"].items():
            if "memory_delta" in measured:
                measured["memory"] = footprint(sides[side], measured.pop("memory_delta"))
        if batch == min(bench.batch_sizes) and "actions" in row["sides"]["ours"]:
            # the plain path whatever policy.fast.enabled says (reference_cfg): never fast vs fast
            reference = policy.sample(inputs, mode="ode", noise=noise).model_actions.float().cpu()
            result["parity_fast_vs_our_reference_rel_l2"] = relative_l2(row["sides"]["ours"]["actions"], reference)
        result["rows"].append(row)
        tqdm.write(f"{name} b={batch}: " + ", ".join(f"{s} {m['ms']:.1f} ms" if "ms" in m else f"{s} -"
                                                      for s, m in row["sides"].items()))
    pending = {"cfg": cfg, "prompt_len": spec["prompt_len"], "lerobot": core is not None,
               "checksum": result["lerobot"].get("checksum")}
    variants = core = policy = None  # free the GPU memory before the next configuration  # noqa: F841
    common.memory_mark(device)
    return result, pending


def measure_our_sides(row: dict, policy, bench: BenchPredictConfig, spec: dict, inputs, noise, device, budget,
                      ceilings) -> None:
    batch, chosen = row["batch"], None
    for precision in bench.precisions:
        side = "ours" if precision == "bf16" else "ours_fp8"
        gap_calls = bench.gap_calls if batch == bench.gap_batch else 0
        row["sides"][side] = guarded(lambda p=precision, c=chosen, g=gap_calls: ours_side.measure_ours(
            policy, p, batch, spec["prompt_len"], inputs, noise, device, bench, budget, ceilings, c, g))
        chosen = row["sides"][side].get("attention") if precision == "bf16" else chosen


def guarded(measure) -> dict:
    """Run one side's measurement; a budget skip or an error is recorded and the run goes on."""
    try:
        return measure()
    except common.BudgetExceeded as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one GPU call must bring back everything else it measured
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:1000], "traceback": traceback.format_exc()[-3000:]}


# --------------------------------------------------------------------------- compiled LeRobot, last


def run_compile_variants(results: dict, pending: dict, bench: BenchPredictConfig, budget: common.Budget,
                         device: torch.device) -> None:
    """LeRobot's compile option for every configuration and mode (`bench_predict_compiled`): the
    workers compile side by side until the time left less their timing shares (at most
    bench.lerobot_compile_budget_s), then time one at a time; merged into the rows."""
    jobs = compile_jobs(bench, {name: pending[name] for name in results if pending[name]["lerobot"]})
    if not jobs:
        return
    workers = compiled_side.split_jobs(jobs)
    compile_s = min(bench.lerobot_compile_budget_s,
                    budget.left() - TIMING_S_PER_BATCH * sum(len(w.batches) for w in workers))
    cache = None
    if compile_s < MIN_COMPILE_S:
        outs = [compiled_side.skipped_result(w, f"{compile_s:.0f} s of the time budget left to compile")
                for w in workers]
    else:
        waves = f" in waves of {bench.lerobot_compile_parallel}" if 0 < bench.lerobot_compile_parallel < len(workers) \
            else ""
        print(f"LeRobot compile_model=True: {len(workers)} worker(s) compiling side by side{waves} (killed after "
              f"{compile_s:.0f} s of compiling), then time one at a time ({TIMING_S_PER_BATCH:.0f} s a batch size "
              f"at most)")
        outs, cache = compiled_side.run_compile_jobs(
            jobs, compile_s=compile_s, timing_s_per_batch=TIMING_S_PER_BATCH, device=device, warmup=bench.warmup,
            iters=bench.iters, cache_dir=bench.lerobot_compile_cache_dir, parallel=bench.lerobot_compile_parallel)
    for job in jobs:
        out = compiled_side.merge_results([o for o in outs if o["job"].same_variant(job)])
        out.update(compile_mode=job.mode, precision=job.precision, static=job.static,
                   compile_budget_s=compile_s, compile_cache=cache)
        record_compiled(results[job.configuration], job.variant, out)


def compile_jobs(bench: BenchPredictConfig, configured: dict[str, dict]) -> list[compiled_side.CompileJob]:
    """One compile job per configuration x mode x shapes, at every batch size. `configured`: {name: {"cfg",
    "prompt_len", "checksum" (optional: the parent's LeRobot weights, checked by the worker)}}. The
    warm-up (`warm_lerobot_compile`) builds its jobs here too, so it compiles the graphs this run asks for."""
    return [compiled_side.CompileJob(name, c["cfg"], mode, compile_precision(bench, c["cfg"]), list(bench.batch_sizes),
                                     c["prompt_len"], c.get("checksum"), static=shapes == "static")
            for name, c in configured.items() for mode in bench.lerobot_compile_modes
            for shapes in bench.lerobot_compile_shapes]


def compile_precision(bench: BenchPredictConfig, cfg: PolicyConfig) -> str:
    # all-bf16 weights only where the run is bf16 (as the eager "bf16" variant)
    return bench.lerobot_compile_precision if cfg.dtype == "bfloat16" else "shipped"


def record_compiled(result: dict, variant: str, out: dict) -> None:
    """One compiled variant's outcome into a configuration's record, its timed batch sizes into the rows."""
    rows = out.pop("rows")
    result["lerobot"][variant] = out
    built = out.get("built") or {}
    weights = built.get("resident_mib") or built.get("weights_mib")
    for row in result["rows"]:
        measured = rows.get(row["batch"])
        if measured is None:
            row["sides"][variant] = {"skipped": f"{out['status']}: {out['message']}"}
            continue
        measured["memory"] = footprint(weights, measured.pop("memory_delta", None))
        row["sides"][variant] = measured


def finalize(result: dict) -> None:
    """Per row: the fastest LeRobot variant, speed-ups against it, parity, FP8 vs bf16; drops actions."""
    for row in result["rows"]:
        sides, batch = row["sides"], row["batch"]
        ours, fp8 = sides.get("ours", {}), sides.get("ours_fp8", {})
        lerobot_ms = {v: s["ms"] for v, s in sides.items() if v.startswith("lerobot_") and "ms" in s}
        if "ms" in ours:
            row.update(ours_ms=ours["ms"], ours_samples_per_s=batch / ours["ms"] * 1e3, stages=ours["stages"])
        if "ms" in fp8:
            row.update(fp8_ms=fp8["ms"], fp8_samples_per_s=batch / fp8["ms"] * 1e3)
            if "ms" in ours:
                row["fp8_speedup_vs_bf16"] = ours["ms"] / fp8["ms"]
                row["fp8_rel_l2"] = relative_l2(fp8["actions"], ours["actions"])
        if lerobot_ms:
            best = min(lerobot_ms, key=lerobot_ms.get)
            row.update(lerobot_best_variant=best, lerobot_ms=lerobot_ms[best],
                       lerobot_samples_per_s=batch / lerobot_ms[best] * 1e3)
            if "ms" in ours:
                row["speedup"] = lerobot_ms[best] / ours["ms"]
                row["speedup_by_variant"] = {v: ms / ours["ms"] for v, ms in lerobot_ms.items()}
                row["parity_rel_l2"] = {v: relative_l2(ours["actions"], sides[v]["actions"]) for v in lerobot_ms}
            if "ms" in fp8:
                row["fp8_speedup"] = lerobot_ms[best] / fp8["ms"]
        for measured in sides.values():
            measured.pop("actions", None)


# --------------------------------------------------------------------------- summary and table


def summarise(results: dict, budget: common.Budget) -> dict:
    summary = {}
    phyai = results.get("phyai")
    if phyai:
        rows = {r["batch"]: r for r in phyai["rows"]}
        for b, key, metric in ((1, "b1_ms", "ms"), (32, "b32_sps", "samples_per_s")):
            row = rows.get(b, {})
            for side in ("ours", "lerobot", "fp8"):
                if f"{side}_{metric}" in row:
                    summary[f"{side}_{key}"] = row[f"{side}_{metric}"]
            if "speedup" in row:
                summary[f"speedup_b{b}"] = row["speedup"]
                summary[f"lerobot_variant_b{b}"] = row["lerobot_best_variant"]
            # the "fastest LeRobot variant" is the fastest of those measured: say which were not
            sides = row.get("sides", {})
            unmeasured = sorted(v for v, m in sides.items() if v.startswith("lerobot_") and "ms" not in m)
            if unmeasured:
                summary[f"lerobot_unmeasured_b{b}"] = unmeasured
        best32 = rows.get(32, {}).get("lerobot_best_variant")
        if best32 and "parity_rel_l2" in rows[32]:
            summary["parity_rel_l2"] = rows[32]["parity_rel_l2"][best32]
        memory = rows.get(32, {}).get("sides", {})
        for side, key in (("ours", "ours"), ("ours_fp8", "fp8"), (best32, "lerobot")):
            if side and (memory.get(side) or {}).get("memory"):
                summary[f"{key}_b32_peak_reserved_gib"] = memory[side]["memory"]["peak_reserved_mib"] / 1024
    libero = results.get("libero_rl")
    if libero:
        for side, prefix in (("ours", "libero"), ("fp8", "fp8_libero")):
            timed = [r for r in libero["rows"] if f"{side}_samples_per_s" in r]
            if timed:
                best = max(timed, key=lambda r: r[f"{side}_samples_per_s"])
                summary[f"{prefix}_best_sps"] = best[f"{side}_samples_per_s"]
                summary[f"{prefix}_best_batch"] = best["batch"]
                if side == "ours" and "parity_rel_l2" in best:
                    summary["libero_parity_rel_l2"] = best["parity_rel_l2"][best["lerobot_best_variant"]]
        for side, prefix in (("ours_fp8", "fp8"), ("ours", "bf16")):
            gaps = [r["sides"][side]["logprob_gap"] for r in libero["rows"]
                    if "mean_nats" in r["sides"].get(side, {}).get("logprob_gap", {})]
            if gaps:
                summary[f"{prefix}_logprob_gap_mean"] = gaps[0]["mean_nats"]
                summary[f"{prefix}_logprob_gap_max"] = gaps[0]["max_nats"]
                summary[f"{prefix}_clip_fraction"] = gaps[0]["clip_fraction"]
    fp8_rel = [r["fp8_rel_l2"] for res in results.values() for r in res["rows"] if "fp8_rel_l2" in r]
    if fp8_rel:
        summary["fp8_rel_l2"] = max(fp8_rel)  # worst batch size over both configurations
    summary["skipped_or_failed"] = sum(1 for res in results.values() for r in res["rows"]
                                       for m in r["sides"].values() if "ms" not in m)
    summary["time_used_s"] = budget.elapsed()
    return summary


def print_table(results: dict) -> None:
    for name, result in results.items():
        compiled = {v: f"{o['status']} {o.get('message', '')}".strip() for v, o in result["lerobot"].items()
                    if isinstance(o, dict)}
        print(f"\n{name} ({result['dtype']}): LeRobot {result['lerobot'].get('status')}; compiled: {compiled}")
        print(f"{'B':>4} {'ours ms':>9} {'ours/s':>8} {'fp8 ms':>8} {'fp8/s':>8} {'LeRobot ms':>11} {'x':>6} "
              f"{'x fp8':>6}  fastest LeRobot; vision/prefix/denoise ms (MFU)")
        for r in result["rows"]:
            def num(key, fmt):
                return format(r[key], fmt) if key in r else format("-", fmt.split(".")[0].rstrip("f") + "s")
            st = " ".join(f"{v['ms']:.2f}({v['mfu']:.0%})" for v in r.get("stages", {}).values())
            print(f"{r['batch']:4d} {num('ours_ms', '9.2f')} {num('ours_samples_per_s', '8.1f')} "
                  f"{num('fp8_ms', '8.2f')} {num('fp8_samples_per_s', '8.1f')} {num('lerobot_ms', '11.1f')} "
                  f"{num('speedup', '6.1f')} {num('fp8_speedup', '6.1f')}  {r.get('lerobot_best_variant', '-')}; {st}")


def plot_stage_rooflines(record: dict, out_dir: str | Path, batches=(1, 32)) -> list[Path]:
    """One stage-roofline PNG per configuration and batch size, from a bench_predict record."""
    ceilings = roofline_ceilings(record["ceilings"])
    paths = []
    for name, result in record["configurations"].items():
        for row in result["rows"]:
            if row["batch"] not in batches or "stages" not in row:
                continue
            stages = [StageMeasurement(f"{stage} (b={row['batch']})", v["gflop"] * 1e9, v["gbytes"] * 1e9,
                                       v["ms"] / 1e3)
                      for stage, v in row["stages"].items()]
            path = Path(out_dir) / f"stage_roofline_{name}_b{row['batch']}.png"
            paths.append(plot_stage_roofline(stage_roofline(stages, ceilings), ceilings, path))
    return paths


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_predict")
def main(cfg: DictConfig) -> None:
    bench = BenchPredictConfig(**OmegaConf.to_container(cfg.bench, resolve=True))
    budget = common.Budget(bench.time_budget_s)
    base = PolicyConfig.from_mapping(cfg.policy)
    device = auto_device(bench.device)
    if bench.gap_skipped():
        print(f"{bench.gap_skipped()}: no log-prob gap measured (recorded)")
    ceilings = measure_ceilings(device)
    print(f"device {device}; ceilings {ceilings}")
    results, pending = {}, {}
    for name in bench.configurations:
        results[name], pending[name] = bench_configuration(name, base, bench, device, ceilings, budget)
    run_compile_variants(results, pending, bench, budget, device)
    for result in results.values():
        finalize(result)
    print_table(results)
    payload = {"bench": asdict(bench), "ceilings": ceilings, "configurations": results}
    write_result("bench_predict", payload, summarise(results, budget), bench.out_dir, commit=bench.commit,
                 device=device)


if __name__ == "__main__":
    main()
