"""Warm inductor's cache for the predict benchmark's compiled LeRobot variant, compiling only.

A cold torch.compile of LeRobot's sample_actions takes ~6 minutes per graph on the H200 (PhyAI b1:
372 s), so a full `experiments.bench_predict` run cannot compile all its graphs within one device
call. This entry point reads the same config (conf/bench_predict.yaml) and compiles every
configuration x mode x batch size side by side, one worker each, with static shapes
(`bench.lerobot_compile_static`, forced on: a worker compiles one batch size, and only static graphs
are the same graphs whichever batch size a process compiled first). The timed run then finds them:

    python -m experiments.warm_lerobot_compile bench.lerobot_compile_cache_dir=.jit/inductor \
        bench.lerobot_compile_budget_s=560
    python -m experiments.bench_predict bench.lerobot_compile_cache_dir=.jit/inductor \
        bench.lerobot_compile_static=true

The JSON (runs/warm_lerobot_compile/) records each worker's build and compile time (its first call),
what a killed worker reached, and the cache's files before and after.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments import bench_predict_common as common
from experiments import bench_predict_compiled as compiled_side
from experiments.bench_predict import BenchPredictConfig, compile_jobs
from experiments.results import write_result
from policies.config import PolicyConfig

FINISH_S = 60.0  # after its last compile a worker only writes its events and exits


def warm_jobs(bench: BenchPredictConfig, base: PolicyConfig, device: torch.device) -> list[compiled_side.CompileJob]:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    configured = {}
    for name in bench.configurations:
        spec = common.CONFIGURATIONS[name]
        configured[name] = {"cfg": common.configuration_policy_cfg(base, spec, dtype), "prompt_len": spec["prompt_len"]}
    return compile_jobs(bench, configured)


def cache_files(cache: dict | None) -> int | None:
    return None if cache is None else sum(1 for p in Path(cache["dir"]).rglob("*") if p.is_file())


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_predict")
def main(cfg: DictConfig) -> None:
    bench = BenchPredictConfig(**{**OmegaConf.to_container(cfg.bench, resolve=True), "lerobot_compile_static": True})
    if not bench.lerobot_compile_cache_dir:
        raise ValueError("bench.lerobot_compile_cache_dir is null: a warm-up needs a cache directory to fill")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if bench.device == "auto" else bench.device)
    jobs = warm_jobs(bench, PolicyConfig.from_mapping(cfg.policy), device)
    outs, cache = compiled_side.run_compile_jobs(
        jobs, compile_s=bench.lerobot_compile_budget_s, timing_s_per_batch=FINISH_S, device=device,
        warmup=bench.warmup, iters=bench.iters, static=True, timed=False, cache_dir=bench.lerobot_compile_cache_dir)
    workers = [{"configuration": o["job"].configuration, "mode": o["job"].mode, "precision": o["job"].precision,
                **{k: v for k, v in o.items() if k not in ("job", "rows")}} for o in outs]
    compiled = [s for o in outs for s in o["compiled_s"].values()]
    summary = {"workers": len(outs), "ok": sum(o["status"] == "ok" for o in outs),
               "max_compile_s": max(compiled) if compiled else None, "cache_entries_before": cache["entries_before"],
               "cache_entries_after": cache_files(cache)}
    write_result("warm_lerobot_compile", {"bench": vars(bench), "compile_cache": cache, "workers": workers},
                 summary, bench.out_dir, commit=bench.commit)


if __name__ == "__main__":
    main()
