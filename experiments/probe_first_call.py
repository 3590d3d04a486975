"""How long a bucket's first call takes, and how much of it is Triton compiling (a probe).

    python -m experiments.probe_first_call                 # GPU: pi05, both configurations, batch 1
    python -m experiments.probe_first_call --policy tiny   # CPU smoke (no Triton: the plumbing only)

A FastSampler's first call at a new bucket builds it: Triton kernels compile (or load from Triton's cache),
CUDA graphs are captured, SigLIP's GEMM algorithms are searched (policy.fast.gemm_search) and
`overlap: auto` times both orders. Each case runs in a fresh process, one after the other, on a Triton cache
directory that starts empty ("serial" for the first case, "shared" for the others), and a tuning cache
(policies/fast/tuning.py: the timed choices and kernel lists kept between processes) of its own or shared:
- "cold_serial": the cache empty, every kernel compiled in-process as its launch reaches it
  (`compile_workers: 0`, what rounds up to 23 paid);
- "cold_torch" (only with --cases): the cache empty, compile workers that import torch (round 24's);
- "cold": the default sampler with both caches empty (what a fresh machine pays): the compile workers
  (policies/fast/precompile.py, imports without torch since round 25) build the kernels in parallel first;
- "warm_untuned": the Triton cache filled by "cold", a tuning cache empty: the choices timed again and the
  stages traced (what every process paid before the tuning cache);
- "warm": both caches filled by "cold" (what a new process on the same machine pays);
- "warm_nosearch": warm Triton cache, its own empty tuning cache, gemm_search and overlap off.
Per case and configuration: the policy's build time, the first call's wall time (`first_call_s`), the
median of the next calls (`ms`), the kernels the workers compiled, the timed choices made here or kept,
and the Triton cache's file count before and after. cold - warm_untuned is the compile cost; warm_untuned -
warm what the tuning cache saves.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiments import bench_predict_common as common
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast import precompile, tuning
from policies.fast.config import FastConfig, triton_cache_dir
from policies.fast.runner import FastSampler
from policies.policy import build_policy

# case -> (FastConfig overrides, Triton cache directory name, tuning cache directory name,
# precompile.WORKERS_IMPORT_TORCH)
CASES = {"cold_serial": ({"compile_workers": 0}, "serial", "serial", False), "cold_torch": ({}, "torch", "torch", True),
         "cold": ({}, "shared", "shared", False), "warm_untuned": ({}, "shared", "untuned", False),
         "warm": ({}, "shared", "shared", False),
         "warm_nosearch": ({"gemm_search": "off", "overlap": "off"}, "shared", "nosearch", False)}
DEFAULT_CASES = ["cold_serial", "cold", "warm_untuned", "warm", "warm_nosearch"]
CHILD_MARK = "PROBE_FIRST_CALL "
PROFILE_TOP = 40


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="pi05", help="PolicyConfig preset")
    p.add_argument("--configurations", nargs="+", default=["phyai", "libero_rl"], choices=list(common.CONFIGURATIONS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=10, help="calls timed after the first")
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES), help="in this order")
    p.add_argument("--profile-cases", nargs="*", default=[], choices=list(CASES),
                   help="cases whose first call runs under cProfile (the top functions by cumulative time go to the "
                        "JSON's `profile`; the profiler's overhead inflates that call's time)")
    p.add_argument("--child", choices=list(CASES), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", action="store_true", help="write to benchmarks/results/")
    return p.parse_args(argv)


def cache_files(cache_dir: Path | None) -> int:
    return sum(1 for p in cache_dir.rglob("*") if p.is_file()) if cache_dir and cache_dir.exists() else 0


def compile_listener(log: list):
    """Triton's compilation listener (None without triton): every in-process compile as (kernel, cache hit,
    seconds), a cache hit's seconds being its lookup and load."""
    try:
        from triton import knobs
    except ImportError:
        return None

    def listen(*, src, cache_hit, times, **_):
        us = times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results
        log.append((src.name, bool(cache_hit), us / 1e6))

    knobs.compilation.listener = listen
    return listen


def compile_summary(log: list) -> dict:
    """The first call's in-process compiles: misses (compiled here) and hits (loaded from the cache)."""
    misses = sorted((entry for entry in log if not entry[1]), key=lambda e: -e[2])
    hits = [entry for entry in log if entry[1]]
    return {"misses": len(misses), "miss_s": sum(e[2] for e in misses), "hits": len(hits),
            "hit_s": sum(e[2] for e in hits), "slowest_misses": [[e[0], round(e[2], 3)] for e in misses[:5]]}


def profiled_first_call(fn, profile: cProfile.Profile):
    """`fn` with its first call under `profile`."""
    calls = []

    def call():
        calls.append(1)
        if len(calls) > 1:
            return fn()
        profile.enable()
        try:
            return fn()
        finally:
            profile.disable()

    return call


def profile_top(profile: cProfile.Profile, top: int = PROFILE_TOP) -> list:
    """[function, cumulative s, own s, calls] of the `top` functions by cumulative time."""
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:top]
    return [[f"{Path(file).name}:{line}({name})", round(cum, 4), round(own, 4), calls]
            for (file, line, name), (_, calls, own, cum, _) in rows]


def run_case(case: str, args) -> dict:
    """In this process: per configuration, build the policy and a sampler, time its first call and the next."""
    device, dtype = common.run_device_and_dtype()
    precompile.WORKERS_IMPORT_TORCH = CASES[case][3]
    cache_dir = triton_cache_dir()
    compiles: list = []
    compile_listener(compiles)
    base = PolicyConfig.preset(args.policy)
    rows = {}
    for name in args.configurations:
        spec = common.CONFIGURATIONS[name]
        t0 = time.perf_counter()
        policy = build_policy(common.configuration_policy_cfg(base, spec, dtype), device=device)
        build_s = time.perf_counter() - t0
        fast = FastSampler(policy.model, FastConfig(enabled=True, dtype=policy.cfg.dtype, batch_buckets=[args.batch],
                                                    prompt_buckets=[spec["prompt_len"]], **CASES[case][0]))
        call_args = common.chain_call_args(policy.cfg, args.batch, spec["prompt_len"], device, stochastic_first=True)
        files_before = cache_files(cache_dir)
        compiles.clear()
        stats_before = dict(fast.precompiler.stats)  # the process's samplers share the workers and their stats
        call = lambda f=fast: f.sample_chains(*call_args)  # noqa: E731
        profile = cProfile.Profile() if case in args.profile_cases else None
        timing = common.time_calls(profiled_first_call(call, profile) if profile else call, device, 2, args.iters)
        report = fast.bucket_report()[0]
        rows[name] = {"policy_build_s": build_s, "first_call_s": timing["first_call_s"], "ms": timing["ms"],
                      "bucket_first_call_s": report["first_call_s"], "compile_workers": fast.precompiler.workers,
                      "precompiled_kernels": report["precompiled_kernels"], "tuned": report["tuned"],
                      "tuning_hits": {k: v["hits"] for k, v in fast.tuning.stats.items()},
                      "precompile": {k: v - stats_before[k] for k, v in fast.precompiler.stats.items()},
                      "in_process_compiles": compile_summary(compiles),
                      "triton_cache_files_before": files_before, "triton_cache_files_after": cache_files(cache_dir)}
        if profile is not None:
            rows[name]["profile"] = profile_top(profile)
        del policy, fast
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_child(case: str, args, cache_dir: str, tuning_dir: str) -> dict:
    """`case` in a fresh process on Triton cache `cache_dir` and tuning cache `tuning_dir`; its rows come back
    as one marked stdout line."""
    cmd = [sys.executable, "-m", "experiments.probe_first_call", "--child", case, "--policy", args.policy,
           "--batch", str(args.batch), "--iters", str(args.iters), "--configurations", *args.configurations,
           "--profile-cases", *args.profile_cases]
    t0 = time.perf_counter()
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, tuning.ENV_DIR: tuning_dir}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(CHILD_MARK)]
    return {"process_s": time.perf_counter() - t0, "rows": json.loads(line[len(CHILD_MARK):])}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(CHILD_MARK + json.dumps(run_case(args.child, args)), flush=True)
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="triton_caches_") as caches:
        for case in args.cases:
            _, cache, tuned, _ = CASES[case]
            results[case] = run_child(case, args, os.path.join(caches, cache), os.path.join(caches, f"tuning_{tuned}"))
            shown = "  ".join(f"{name} first {r['first_call_s']:.2f} s ({r['precompiled_kernels']} kernels by "
                              f"{r['compile_workers']} workers), then {r['ms']:.2f} ms, cache files "
                              f"{r['triton_cache_files_before']} -> {r['triton_cache_files_after']}"
                              for name, r in results[case]["rows"].items())
            print(f"{case}: process {results[case]['process_s']:.1f} s | {shown}", flush=True)
    summary = {f"{case}_{name}_first_call_s": r["first_call_s"]
               for case, res in results.items() for name, r in res["rows"].items()}
    cases = {case: {"overrides": CASES[case][0], "cache": CASES[case][1], "tuning_cache": CASES[case][2],
                    "workers_import_torch": CASES[case][3]} for case in args.cases}
    write_result("probe_first_call", {"args": vars(args), "cases": cases, "results": results}, summary,
                 out_dir=args.out_dir, commit=args.commit)


if __name__ == "__main__":
    main()
