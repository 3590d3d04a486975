"""Warm inductor's cache for the predict benchmark's compiled LeRobot variant, compiling only.

A cold torch.compile of LeRobot's sample_actions takes ~6 minutes per graph on the H200 (PhyAI b1:
372 s), so a full `experiments.bench_predict` run cannot compile all its graphs within one device
call. This entry point reads the same config (conf/bench_predict.yaml) and runs the bench's own
compile jobs (`bench_predict.compile_jobs`) side by side, compiling only: a static graph per
configuration x mode x batch size in a worker each, and for torch's dynamic shapes two workers per
configuration x mode side by side: the first batch size, and the second with the inputs' batch dimension
marked dynamic, which compiles the graph the bench's worker recompiles after its first size
(`bench_predict_compiled.split_jobs`; in the bench the recompile only follows the first size in one
process, and at PhyAI the two in a row take longer than a device call). The timed run then finds them:

    python -m experiments.warm_lerobot_compile bench.lerobot_compile_cache_dir=.jit/inductor \
        bench.lerobot_compile_budget_s=560 bench.lerobot_compile_shapes=[static]
    python -m experiments.bench_predict bench.lerobot_compile_cache_dir=.jit/inductor \
        bench.lerobot_compile_shapes=[static]

The JSON (runs/warm_lerobot_compile/) records each worker's build and compile time (its first call),
inductor's cache hits and misses in it (`cache_counts`), what a killed worker reached, and the cache's
files before and after. A worker killed before its graph finished leaves little of use in the cache
(round 33: 916 files from three killed PhyAI compiles, and the next cold compile took 413 s).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from common.devices import auto_device
from experiments import bench_predict_common as common
from experiments import bench_predict_compiled as compiled_side
from experiments.bench_predict import BenchPredictConfig, compile_jobs, configuration_cfg
from experiments.results import write_result
from policies.config import PolicyConfig

FINISH_S = 60.0  # after its last compile a worker only writes its events and exits


def warm_jobs(bench: BenchPredictConfig, base: PolicyConfig, device: torch.device) -> list[compiled_side.CompileJob]:
    configured = {name: {"cfg": configuration_cfg(name, base, device),
                         "prompt_len": common.CONFIGURATIONS[name]["prompt_len"]} for name in bench.configurations}
    return compile_jobs(bench, configured)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_predict")
def main(cfg: DictConfig) -> None:
    bench = BenchPredictConfig(**OmegaConf.to_container(cfg.bench, resolve=True))
    if not bench.lerobot_compile_cache_dir:
        raise ValueError("bench.lerobot_compile_cache_dir is null: a warm-up needs a cache directory to fill")
    device = auto_device(bench.device)
    jobs = warm_jobs(bench, PolicyConfig.from_mapping(cfg.policy), device)
    outs, cache = compiled_side.run_compile_jobs(
        jobs, compile_s=bench.lerobot_compile_budget_s, timing_s_per_batch=FINISH_S, device=device,
        warmup=bench.warmup, iters=bench.iters, timed=False, cache_dir=bench.lerobot_compile_cache_dir,
        parallel=bench.lerobot_compile_parallel)
    workers = [{"configuration": o["job"].configuration, "variant": o["job"].variant, "precision": o["job"].precision,
                "symbolic_batch": o["job"].symbolic_batch,
                **{k: v for k, v in o.items() if k not in ("job", "rows")}} for o in outs]
    compiled = [s for o in outs for s in o["compiled_s"].values()]
    summary = {"workers": len(outs), "ok": sum(o["status"] == "ok" for o in outs),
               "max_compile_s": max(compiled) if compiled else None, "cache_entries_before": cache["entries_before"],
               "cache_entries_after": compiled_side.count_files(Path(cache["dir"]))}
    write_result("warm_lerobot_compile", {"bench": vars(bench), "compile_cache": cache, "workers": workers},
                 summary, bench.out_dir, commit=bench.commit)


if __name__ == "__main__":
    main()
