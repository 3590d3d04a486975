"""The first denoise step under the prefix (policy.fast.overlap), timed against the stages in order.

    python -m experiments.profile_overlap                      # GPU: pi05, both configurations, batch 1..64
    python -m experiments.profile_overlap --policy tiny --batch-sizes 1 --iters 2 --rounds 1   # CPU smoke

Per (configuration, batch), samplers on the same inputs and noise (`--variants`):
- "off": vision, prefix and denoise graphs one after the other;
- "on": vision, then prefix + denoise as one graph with step 0 on a side stream (policies/fast/overlap.py);
- "on_nopdl": the same, step 0 without PDL and with its MLP split (the default);
- "off_late" / "on_nopdl_late": vision's graph launched only once all of the call's inputs are in
  place, as before round 15 (FastSampler.early_vision);
- "auto": the default since round 16, which up to overlap.AUTO_MAX_ROWS times both ways at the bucket's
  first call and keeps the faster (overlap.pick; its choice and timings are in `overlap`);
- "auto_nosearch" / "off_nosearch": "auto" / "off" with `policy.fast.gemm_search=off` (SigLIP's GEMMs
  through torch's cuBLASLt algorithm; round 21's search picks are in `overlap` as `vision_gemms`);
- "auto_r21attn" / "off_r21attn": "auto" / "off" with the prefix attention's batch-1 blocks and stages as
  before round 22 (TritonSplitKVAttention.PREFIX_B1_TUNING off while the bucket is built).
Each round times every variant, round-robin, so a drifting clock hits all alike:
- `call_ms`: a whole `sample_chains` call, as bench_predict times ours (CUDA events around the call,
  host work included), median of --iters;
- `graphs_ms`: the graphs after vision alone (prefix then denoise, or prefix_denoise), median of --iters;
- `breakdown`: per variant, a call cut at the images' copy / each graph / the rest of the inputs / the
  outputs' copy (`call_breakdown`).
Each variant's chains and log-probs are compared with "off"'s bit for bit (`identical`). Off CUDA
the variants run without graphs, so "on" is "off" (smoke run: the script's plumbing only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch

from experiments import bench_predict_common as common
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast import gemm_search, overlap
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.fast.triton_attention import TritonSplitKVAttention
from policies.policy import build_policy


@dataclasses.dataclass(frozen=True)
class Variant:
    """One sampler set-up: `overlap` is policy.fast.overlap; `sampler` FastSampler attributes (step0_pdl,
    overlap.py; early_vision, vision's graph before the rest of the inputs, round 15); `fast` other FastConfig
    keys; `attention` TritonSplitKVAttention class attributes set while the bucket is built, then restored."""
    overlap: str
    sampler: dict = dataclasses.field(default_factory=dict)
    fast: dict = dataclasses.field(default_factory=dict)
    attention: dict = dataclasses.field(default_factory=dict)


_ROUND21_ATTENTION = {"PREFIX_B1_TUNING": False}
VARIANTS = {"off": Variant("off"), "on": Variant("on", sampler={"step0_pdl": True}), "on_nopdl": Variant("on"),
            "off_late": Variant("off", sampler={"early_vision": False}),
            "on_nopdl_late": Variant("on", sampler={"early_vision": False}),
            "auto": Variant("auto"), "auto_nosearch": Variant("auto", fast={"gemm_search": "off"}),
            "off_nosearch": Variant("off", fast={"gemm_search": "off"}),
            "auto_r21attn": Variant("auto", attention=_ROUND21_ATTENTION),
            "off_r21attn": Variant("off", attention=_ROUND21_ATTENTION)}
DEFAULT_VARIANTS = ["off", "on_nopdl", "auto"]  # "auto" is the default since round 16 ("on_nopdl" in rounds 14-15)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="pi05", help="PolicyConfig preset")
    p.add_argument("--configurations", nargs="+", default=["phyai", "libero_rl"], choices=list(common.CONFIGURATIONS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--iters", type=int, default=10, help="timed calls per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile the host side of --iters calls of each variant (`host_profile`)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", action="store_true", help="write to benchmarks/results/")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "off" not in args.variants:
        raise ValueError(f"--variants must include 'off' (the others are compared with it), got {args.variants}")
    device, dtype = common.run_device_and_dtype()
    base = PolicyConfig.preset(args.policy)
    rows, summary = [], {}
    for name in args.configurations:
        spec = common.CONFIGURATIONS[name]
        policy = build_policy(common.configuration_policy_cfg(base, spec, dtype), device=device)
        for batch in args.batch_sizes:
            row = measure(policy, spec, batch, args, device)
            rows.append({"configuration": name, "batch": batch, **row})
            for label, ms in row["call_ms"].items():
                summary[f"{name}_b{batch}_{label}_call_ms"] = ms
            print_row(name, batch, row)
        del policy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_result("profile_overlap", {"args": vars(args), "auto_max_rows": overlap.AUTO_MAX_ROWS, "rows": rows},
                 summary, out_dir=args.out_dir, commit=args.commit)


@contextlib.contextmanager
def _class_settings(settings: dict):
    """TritonSplitKVAttention's class attributes set to `settings` inside, restored after."""
    saved = {name: getattr(TritonSplitKVAttention, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(TritonSplitKVAttention, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(TritonSplitKVAttention, name, value)


def measure(policy, spec: dict, batch: int, args, device: torch.device) -> dict:
    cfg = policy.cfg
    # the overlapped step stochastic, as in a rollout's SDE step
    call_args = common.chain_call_args(cfg, batch, spec["prompt_len"], device, stochastic_first=True)
    samplers, outputs, errors = {}, {}, {}
    for label in args.variants:
        variant = VARIANTS[label]
        fast = FastSampler(policy.model, FastConfig(enabled=True, dtype=cfg.dtype, batch_buckets=[batch],
                                                    prompt_buckets=[spec["prompt_len"]], overlap=variant.overlap,
                                                    **variant.fast))
        for name, value in variant.sampler.items():
            setattr(fast, name, value)
        call = lambda f=fast: f.sample_chains(*call_args)  # noqa: E731
        try:
            with _class_settings(variant.attention):
                outputs[label] = [t.clone() for t in call()]  # builds the bucket, captures the graphs
        except Exception as exc:  # recorded, and the other variants still run
            if label == "off":
                raise
            errors[label] = f"{type(exc).__name__}: {exc}"
            print(f"{label} failed: {errors[label]}", flush=True)
            continue
        samplers[label] = (fast, call)
    calls, graphs = {label: [] for label in samplers}, {label: [] for label in samplers}
    for _ in range(args.rounds):
        for label, (fast, call) in samplers.items():
            bucket = next(iter(fast.buckets.values()))
            after_vision = [s for s in fast.call_stages(bucket) if s != "vision"]
            replay = lambda f=fast, b=bucket, s=after_vision: [f.run_stage(b, x) for x in s]  # noqa: E731
            calls[label].append(common.timed_ms(call, device, 2, args.iters))
            graphs[label].append(common.timed_ms(replay, device, 2, args.iters))
    breakdown = {label: call_breakdown(fast, call_args, device, args.iters) for label, (fast, _) in samplers.items()}
    hosts = ({label: host_profile(fast, call_args, device, args.iters)
              for label, (fast, _) in samplers.items()} if args.host_profile else {})
    chosen = {label: {"overlap": b.overlap, "overlap_ms": b.overlap_ms,
                      "vision_gemms": gemm_search.summary(b.vision_gemms)}
              for label, (fast, _) in samplers.items() for b in fast.buckets.values()}
    identical = {label: all(torch.equal(a, b) for a, b in zip(out, outputs["off"], strict=True))
                 for label, out in outputs.items() if label != "off"}
    return {"call_ms": {k: statistics.median(v) for k, v in calls.items()}, "call_ms_rounds": calls,
            "graphs_ms": {k: statistics.median(v) for k, v in graphs.items()}, "graphs_ms_rounds": graphs,
            "breakdown": breakdown, "host_profile": hosts, "identical": identical, "overlap": chosen, "errors": errors,
            "rows": batch * cfg.chunk_size}


def host_profile(fast: FastSampler, call_args: tuple, device: torch.device, calls: int, top: int = 25) -> dict:
    """cProfile of `calls` whole calls (each followed by a synchronize, outside the profile): per function,
    calls per call and microseconds per call, the top `top` by own time and by cumulative time. Says
    which host work the GPU waits on before vision's graph (`call_breakdown`'s "images")."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(calls):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiler.enable()
        fast.sample_chains(*call_args)
        profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls_per_call": n / calls,
             "own_us": own / calls * 1e6, "cum_us": cum / calls * 1e6}
            for (file, line, name), (_, n, own, cum, _) in stats.items()]
    return {"calls": calls, "by_own": sorted(rows, key=lambda r: -r["own_us"])[:top],
            "by_cumulative": sorted(rows, key=lambda r: -r["cum_us"])[:top]}


def call_breakdown(fast: FastSampler, call_args: tuple, device: torch.device, iters: int) -> dict:
    """Where a whole call's time goes: a CUDA event at the call's start, after the bucket's choice and the
    images' copy ("images": the GPU idle until vision's graph starts), after each stage's graph, after the
    rest of the inputs ("prepare": tokens, noise, layout, done while vision runs) and after the outputs'
    copy ("end"). Per segment, the median over `iters` calls of `gpu_ms` (event to event: what the call's
    CUDA-event time adds up from, GPU idle time waiting on the host included) and `host_ms` (wall time
    for the host to get there). Off CUDA only host times."""
    cuda = device.type == "cuda"
    samples: dict[str, dict[str, list[float]]] = {}
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize(device)
        names, events, host = [], [], []

        def mark(name: str) -> None:
            if cuda:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
            names.append(name)
            host.append(time.perf_counter())

        mark("start")
        fast.sample_chains(*call_args, mark=mark)
        mark("end")
        if cuda:
            torch.cuda.synchronize(device)
        for i in range(1, len(names)):
            seg = samples.setdefault(names[i], {"gpu_ms": [], "host_ms": []})
            seg["host_ms"].append((host[i] - host[i - 1]) * 1e3)
            if cuda:
                seg["gpu_ms"].append(events[i - 1].elapsed_time(events[i]))
    return {name: {key: statistics.median(v) for key, v in seg.items() if v} for name, seg in samples.items()}


def print_row(name: str, batch: int, row: dict) -> None:
    off = row["call_ms"]["off"]
    parts = [f"{label} {ms:.3f} ({ms / off - 1:+.1%})" for label, ms in row["call_ms"].items()]
    graphs = "  ".join(f"{label} {ms:.3f}" for label, ms in row["graphs_ms"].items())
    print(f"{name} b{batch}: call ms {'  '.join(parts)} | prefix+denoise graphs ms {graphs} | "
          f"bit-identical {row['identical']} | auto chose {row['overlap'].get('auto')}", flush=True)
    for label, prof in row["host_profile"].items():
        shown = "  ".join(f"{r['function']} {r['cum_us']:.0f}" for r in prof["by_cumulative"][:12])
        print(f"    {label} host us per call, cumulative: {shown}", flush=True)
    for label, segs in row["breakdown"].items():
        shown = "  ".join(f"{seg} {v.get('gpu_ms', float('nan')):.3f}/{v['host_ms']:.3f}" for seg, v in segs.items())
        print(f"    {label} breakdown (gpu/host ms): {shown}", flush=True)


if __name__ == "__main__":
    main()
