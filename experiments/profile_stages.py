"""Where each fast-path stage's time goes at large batch: kernel by kernel, bf16 against FP8.

    python -m experiments.profile_stages                       # GPU: pi05, PhyAI b32 and LIBERO b64
    python -m experiments.profile_stages --policy tiny --batch-sizes 2 --iters 2   # CPU smoke

profile_denoise looks at the denoise loop at batch 1; this looks at every stage (vision, prefix,
denoise) at the batch sizes the throughput goals are set at, in bf16 and in FP8 with several sets of
FP8 GEMM groups (policy.fast.fp8_gemms). One run, one JSON (runs/profile_stages/, or --out-dir),
per (configuration, batch, run):
1. `stage_ms`: each stage's CUDA-graph replay time (median of --iters), as bench_predict times them;
2. `actions_rel_l2_vs_bf16` (FP8 runs): the actions' relative L2 distance from the bf16 run's, same
   inputs and noise: what each FP8 set costs in accuracy;
3. `kernels` (runs in --kernels-for): each stage run eagerly under torch.profiler, device time per
   kernel name summed over the stage, largest first, with its share: what is left to fuse.
"""

from __future__ import annotations

import argparse

import torch

from experiments import bench_predict_common as common
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast import geglu_gemm
from policies.fast.config import FP8_GEMM_GROUPS, FastConfig
from policies.fast.runner import STAGES, FastSampler
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy

DEFAULT_BATCHES = {"phyai": 32, "libero_rl": 64}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="pi05", help="PolicyConfig preset")
    p.add_argument("--configurations", nargs="+", default=["phyai", "libero_rl"], choices=list(common.CONFIGURATIONS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None,
                   help="batch sizes for every configuration (default: PhyAI 32, LIBERO 64)")
    p.add_argument("--fp8-sets", nargs="*", default=["all=" + ",".join(FP8_GEMM_GROUPS)],
                   help="FP8 runs as name=group,group,... (policy.fast.fp8_gemms); each is timed and its "
                        "actions compared with the bf16 run's")
    p.add_argument("--kernels-for", nargs="*", default=["bf16", "fp8:all"],
                   help="runs (bf16, fp8:<name>) also profiled kernel by kernel")
    p.add_argument("--quant-sweep", action="store_true",
                   help="also time the FP8 row quantisation kernel's settings on the prefix's GeGLU rows")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=20, help="kernels kept per stage")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", action="store_true", help="write to benchmarks/results/")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = common.run_device_and_dtype()
    base = PolicyConfig.preset(args.policy)
    record, summary = {"args": vars(args), "runs": []}, {}
    for name in args.configurations:
        spec = common.CONFIGURATIONS[name]
        policy = build_policy(common.configuration_policy_cfg(base, spec, dtype), device=device)
        for batch in args.batch_sizes or [DEFAULT_BATCHES[name]]:
            reference = None
            for label, fast in run_settings(args, dtype):
                run = profile(policy, spec, batch, fast, label in args.kernels_for, args, device)
                actions = run.pop("actions")
                if reference is None:
                    reference = actions
                else:
                    run["actions_rel_l2_vs_bf16"] = relative_l2(actions, reference)
                record["runs"].append({"configuration": name, "batch": batch, "run": label, "fast": fast, **run})
                key = f"{name}_b{batch}_{label}"
                summary.update({f"{key}_{stage}_ms": ms for stage, ms in run["stage_ms"].items()})
                if "actions_rel_l2_vs_bf16" in run:
                    summary[f"{key}_rel_l2"] = run["actions_rel_l2_vs_bf16"]
                print_run(key, run)
        del policy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.quant_sweep and device.type == "cuda":
        record["quant_sweep"] = quant_sweep(base, args)
    write_result("profile_stages", record, summary, out_dir=args.out_dir, commit=args.commit)


def quant_sweep(base: PolicyConfig, args) -> list[dict]:
    """fp8.quantize_rows_triton on the prefix's GeGLU input (tokens x 2 * mlp_dim, act gelu_tanh_mul)
    and its MLP input (tokens x width) at each configuration's batch: one and two passes, warps."""
    from policies.fast import fp8
    from policies.fast.attention import graph_call_ms

    out = []
    for name in args.configurations:
        spec = common.CONFIGURATIONS[name]
        for batch in args.batch_sizes or [DEFAULT_BATCHES[name]]:
            tokens = batch * (spec["cameras"] * base.vision.num_patches + spec["prompt_len"])
            for act, width in (("gelu_tanh_mul", 2 * base.prefix.mlp_dim), ("none", base.prefix.width)):
                x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
                for one_pass, warps in ((False, 8), (True, 4), (True, 8), (True, 16), (True, 32)):
                    call = lambda x=x, a=act, w=warps, o=one_pass: fp8.quantize_rows_triton(x, a, w, o)  # noqa: E731
                    ms = graph_call_ms(call, calls=5, replays=5)
                    gbytes = (x.numel() * 2 + x.numel() // (2 if act == "gelu_tanh_mul" else 1)) / 1e9
                    out.append({"configuration": name, "batch": batch, "act": act, "rows": tokens, "width": width,
                                "one_pass": one_pass, "warps": warps, "ms": ms, "tb_s": gbytes / ms})
                    print(f"quant {name} b{batch} {act:14s} one_pass={one_pass!s:5s} warps={warps:2d}: "
                          f"{ms:.3f} ms {gbytes / ms:.2f} TB/s", flush=True)
                del x
    return out


def run_settings(args, dtype: str) -> list[tuple[str, dict]]:
    """(label, policy.fast overrides): bf16 first (the accuracy reference), then each FP8 set.
    FP8 needs bf16 (policy.fast.precision's rule): the CPU smoke run (fp32) runs bf16 only."""
    settings = [("bf16", {"precision": "bf16"})]
    for spec in args.fp8_sets if dtype == "bfloat16" else []:
        name, sep, groups = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--fp8-sets entries are name=group,group,...; got {spec!r}")
        settings.append((f"fp8:{name}", {"precision": "fp8", "fp8_gemms": [g for g in groups.split(",") if g]}))
    return settings


def profile(policy, spec: dict, batch: int, fast_overrides: dict, kernels: bool, args, device) -> dict:
    """Graph replay time per stage, the actions (same inputs and noise for every run), and with
    `kernels` an eager per-kernel profile of each stage."""
    inputs, noise, step_noise, stoch = common.chain_call_args(policy.cfg, batch, spec["prompt_len"], device,
                                                              stochastic_first=False)
    out = {"stage_ms": {}, "kernels": {}}
    for graphs in (True, False) if kernels else (True,):
        fast = FastSampler(policy.model, FastConfig(
            enabled=True, dtype=policy.cfg.dtype, batch_buckets=[batch], prompt_buckets=[spec["prompt_len"]],
            cuda_graphs=graphs, **fast_overrides))
        chains, _ = fast.sample_chains(inputs, noise, step_noise, stoch)  # builds the bucket, captures graphs
        out.setdefault("actions", chains[:, -1].float().cpu())
        bucket = next(iter(fast.buckets.values()))
        for stage in STAGES:
            run_stage = lambda f=fast, b=bucket, s=stage: f.run_stage(b, s)  # noqa: E731
            if graphs:
                out["stage_ms"][stage] = common.timed_ms(run_stage, device, 2, args.iters)
            else:
                out["kernels"][stage] = common.kernel_table(run_stage, device, args.top)
        out.setdefault("attention", {"prefix": getattr(bucket.prefix_attn, "name", "?"),
                                     "expert": getattr(bucket.expert_attn, "name", "?")})
        out.setdefault("geglu_tile", geglu_gemm.tile_label(bucket.geglu_tile))
        del fast, bucket
    return out


def print_run(key: str, run: dict) -> None:
    stages = "  ".join(f"{s} {ms:.2f}" for s, ms in run["stage_ms"].items())
    rel = f"  actions rel L2 vs bf16 {run['actions_rel_l2_vs_bf16']:.2e}" if "actions_rel_l2_vs_bf16" in run else ""
    print(f"\n{key}: graph replay ms: {stages}  attention {run['attention']}{rel}", flush=True)
    for stage, table in run["kernels"].items():
        print(f"  {stage}: {table['kernel_ms_total']:.2f} ms of kernels in {table['launches']} launches")
        for row in table["top"][:8]:
            print(f"    {row['ms']:8.3f} ms {row['share']:6.1%} x{row['calls']:<5d} {row['kernel'][:90]}")


if __name__ == "__main__":
    main()
