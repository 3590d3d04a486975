"""Where one GRPO actor update's time goes: the old-log-prob pass, the update epochs, and the ops inside.

    python -m experiments.profile_actor                                  # CPU smoke: tiny policy, 16 rows
    python -m experiments.profile_actor --policy pi05 --rows 256 --micro-batch 32 --commit   # a GPU run

The rows are real: the engine (rollout.engine.PolicyEngine, the fast path on CUDA) predicts `rows` random
LIBERO-like observations (two cameras in the preset's camera slots, as `+experiment=libero10_pi05` runs) in
train mode after the trainer's fp32 weights were pushed into it, as in training (experiments.logprob_gap
builds them the same way); their advantages are random normals, so every backward carries a gradient.
For each `--prefix-cache` setting (and backward variant), after one untimed update of the same rows in that setting
(its warm-up: its graphs captured, its kernels compiled), a fresh
`grpo.actor.Actor` (the trainer's class, unchanged) runs, `--repeats` times (default 3; a fresh actor from the
engine's weights each time; the JSON keeps each run's seconds and the medians: round 64 saw one eager update take
0.955 s and then 1.351 s in two runs of one tree), timed with the device synchronised:
- `recompute`: the no-grad old-log-prob pass alone;
- `train`: a whole update (old-log-prob pass + `--epochs` epochs, one optimiser step an epoch);
and the peak device memory over the runs. A setting that runs out of device memory is recorded as such.
Then one more update of one epoch runs under torch.profiler. The policy's stages are labelled
(`Policy.inputs`, vision, the prefix stack, the expert's velocity, the prefix store), and the JSON keeps each
label's CPU and device time, the device time of the top ops and of the top kernels by name, and the device's busy
time against the wall time (a low share means the update waits on the host, not on the GPU).
`--consistent`: the trainer re-scores through the fast path (policy.fast.consistent_recompute, pinned to --batch rows
and --prompt-bucket tokens, `--attention` sdpa (the default) or triton, the fast command's; also on the CPU, through
the kernels' PyTorch twins), labelled by its own stages (the fast path's vision/prefix graphs, the kept prefix
restored into a bucket, the expert step's graphed forward and the plain fp32 reference its backward re-runs).
`--prefix-cache engine` (with `--consistent`): the engine keeps each row's prefix K/V as it predicts them
(PolicyEngine.keep_prefixes, grpo.prefix_cache=engine), and both the timed pass and the update read them.
`--recompute-backward fp32 bf16 ...` (with `--consistent`): every `--prefix-cache` setting is timed under each
policy.fast.recompute_backward (keys `SETTING/MODE`), and one micro-batch's gradients under each mode are compared
with the fp32 backward's (`gradient_errors`: relative L2 per parameter, worst and median, and of all of them
together). `--host-profile`: one more update of one epoch under experiments.host_profile (this repository's Python
functions by cProfile, and on CUDA every call site that waited for the GPU, counted), kept as `host_profile`.
`--recompute-graph off on` / `--recompute-compile off inductor` (with `--consistent`): each backward is also timed
captured as CUDA graphs and/or with its reference velocity compiled (policy.fast.recompute_graph / recompute_compile;
keys `SETTING/graph`, `SETTING/inductor`; a compiled setting's untimed warm-up update compiles it). `--precision fp8`:
the engine's fast path and the consistent recompute run their FP8 GEMMs (policy.fast.precision). JSON
`profile_actor_*` via experiments.results.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from common.devices import auto_device
from experiments.host_profile import host_profile
from experiments.logprob_gap import policy_config, rollout_rows
from experiments.results import write_result
from grpo.actor import Actor, gap_metrics
from grpo.config import SPILL_READS, GRPOConfig
from grpo.distributed import full_parameters
from grpo.prefix_store import RowPrefixes
from grpo.samples import Samples
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy
from policies.fast import recompute
from policies.fast.autograd import CallRun, ChunkRun
from policies.fast.config import BATCH_INVARIANT_ATTENTION, PRECISIONS, RECOMPUTE_BACKWARDS, RECOMPUTE_COMPILES
from policies.fast.runner import FastSampler
from policies.lerobot_bridge import relative_l2
from policies.models.pi05 import PI05Model
from policies.policy import Policy
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine

# (class, method, label): the stages whose time the profile sums
STAGES: list[tuple[type, str, str]] = [
    (Policy, "inputs", "stage/inputs"),
    (PI05Model, "embed_prefix", "stage/vision_and_embed"),
    (PI05Model, "compute_prefix_cache", "stage/prefix_stack"),
    (PI05Model, "velocity", "stage/expert_velocity"),
    (RowPrefixes, "add", "stage/prefix_store_add"),
    (RowPrefixes, "gather", "stage/prefix_store_gather"),
    # the consistent recompute (--consistent)
    (FastSampler, "run_stage", "stage/fast_graph_stage"),
    (recompute, "_restore", "stage/consistent_prefix_restore"),
    (ChunkRun, "forward", "stage/consistent_chunk_forward"),
    (CallRun, "reference", "stage/consistent_backward_reference"),
]


@contextlib.contextmanager
def labelled_stages() -> Iterator[None]:
    """Wrap each stage's method in a profiler label for the duration (restored after)."""
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in STAGES]

    def wrap(method: Callable, label: str) -> Callable:
        @functools.wraps(method)
        def labelled(*args, **kwargs):
            with torch.profiler.record_function(label):
                return method(*args, **kwargs)
        return labelled

    try:
        for (cls, name, label), (_, _, method) in zip(STAGES, originals):
            setattr(cls, name, wrap(method, label))
        yield
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)


def synchronised_seconds(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@contextlib.contextmanager
def weights_restored(policy) -> Iterator[None]:
    """The trained weights put back afterwards: every setting's update starts from the weights the engine
    predicted the rows with (else a later setting's gap to the engine measures the earlier updates). Kept in host
    memory, outside the setting's peak device memory."""
    saved = [p.detach().to("cpu", copy=True) for p in policy.trainable_parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(policy.trainable_parameters(), saved, strict=True):
                param.copy_(value)


def make_actor(policy, args: argparse.Namespace, prefix_cache: str, epochs: int,
               engine_store: RowPrefixes | None = None) -> Actor:
    spills = prefix_cache in ("device", "engine")  # the settings grpo.prefix_cache_spill_gib applies to
    cfg = GRPOConfig(micro_batch=args.micro_batch, update_epochs=epochs, prefix_cache=prefix_cache,
                     prefix_cache_gib=None if prefix_cache == "off" else args.prefix_cache_gib,
                     prefix_cache_spill_gib=args.prefix_cache_spill_gib if spills else None,
                     prefix_cache_spill_read=args.prefix_cache_spill_read, filter_groups=False, seed=args.seed)
    actor = Actor(policy, cfg, show_progress=False)
    actor.engine_prefixes = engine_store  # read under prefix_cache "engine" only
    return actor


def time_setting(policy, rows: Samples, args: argparse.Namespace, prefix_cache: str,
                 device: torch.device, engine_store: RowPrefixes | None = None) -> dict:
    """The setting's update timed --repeats times after one untimed run of it, each from the engine's weights with a
    fresh actor (no optimiser state carried over): the medians, each run's seconds, the first timed run's gap to the
    engine, and the warm-up's seconds (`warmup_train_s`: captures and compiles included)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    recomputes, trains, old, metrics = [], [], [], {}
    # one more run first, untimed: the setting's own warm-up. Its first update captures its graphs (a captured
    # backward: 3.44 s against 0.25 s for the next in round 67, where a lone graphed variant had no warm-up and
    # --repeats 2 timed the capture) and meets its own shapes (a kept prefix skips vision and the prefix stack)
    for run in range(1 + args.repeats):
        if run == 1:
            counted = policy.reference_graph_counts()  # the timed runs' captures and padded replays from here
        actor = make_actor(policy, args, prefix_cache, args.epochs, engine_store)
        try:
            with weights_restored(policy):
                # "engine": the pass reads the engine's kept prefix, as the update's own pass does
                keep = engine_store.view(rows.prefix_row) if prefix_cache == "engine" else None
                recomputes.append(synchronised_seconds(device, lambda: old.append(actor.recompute(rows, keep=keep))))
                trains.append(synchronised_seconds(device, lambda: metrics.update(actor.train(rows))))
        except torch.OutOfMemoryError as error:
            return {"out_of_memory": str(error).splitlines()[0]}
        finally:
            actor.optimizer.zero_grad(set_to_none=True)
    warmup_train_s = trains[0]
    recomputes, trains, old = recomputes[1:], trains[1:], old[1:]  # without the warm-up
    recompute_s, train_s = statistics.median(recomputes), statistics.median(trains)
    out = {"recompute_s": recompute_s, "train_s": train_s, "recompute_s_runs": recomputes, "train_s_runs": trains,
           "warmup_train_s": warmup_train_s,
           "epoch_s_estimate": (train_s - recompute_s) / args.epochs,
           "recompute_ms_per_row": 1e3 * recompute_s / len(rows),
           # the engine's log-probs against this recompute's, before any update (grpo.actor.gap_metrics)
           **gap_metrics(old[0], rows.rollout_logprob, 0.2, 0.2)}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        # reserved: with it the pools of captured graphs (policy.fast.recompute_graph), which hold their activations
        # outside any tensor allocation, so peak_memory_gib leaves them out (the pools of an earlier variant's
        # captures too: they stay with the sampler)
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    # a capture in a timed run is in its seconds (~0.6 s each for 128 rows in round 68, before a micro-batch with
    # fewer rows replayed the full shape's graph padded)
    out["timed_reference_captures"], out["timed_padded_replays"] = (
        after - before for after, before in zip(policy.reference_graph_counts(), counted, strict=True))
    out["prefix_cache_rows"] = metrics.get("train/prefix_cache_rows")
    out["prefix_cache_spilled_rows"] = metrics.get("train/prefix_cache_spilled_rows")
    print(f"prefix_cache={prefix_cache}: recompute {recompute_s:.2f} s, train {train_s:.2f} s "
          f"({args.epochs} epochs), ~{out['epoch_s_estimate']:.2f} s an epoch, "
          f"gap to the engine {out['rollout/logprob_gap']:.4f} nats"
          + ("" if out["prefix_cache_rows"] is None else f", {out['prefix_cache_rows']} rows kept"))
    return out


def event_device_us(event, own: bool) -> float:
    """An averaged event's device time (torch renamed cuda_* to device_*)."""
    name = "self_device_time_total" if own else "device_time_total"
    legacy = "self_cuda_time_total" if own else "cuda_time_total"
    return float(getattr(event, name, getattr(event, legacy, 0.0)))


def stage_times(events) -> dict[str, dict]:
    """Each label's host time and the device time of the kernels launched under it (its CPU event), and, on CUDA,
    its range on the GPU timeline (a second event of the same name, idle gaps and graph replays included; it has no
    host time: read alone, it would report every stage at 0 s of CPU, as round 49's first GPU profile did)."""
    stages: dict[str, dict] = {}
    for e in events:
        if not e.key.startswith("stage/"):
            continue
        stage = stages.setdefault(e.key, {})
        if e.device_type == torch.autograd.DeviceType.CPU:
            stage.update(cpu_s=e.cpu_time_total / 1e6, device_s=event_device_us(e, own=False) / 1e6, calls=e.count)
        else:
            stage["device_span_s"] = event_device_us(e, own=False) / 1e6
    return stages


@contextlib.contextmanager
def recompute_backward(policy, mode: str, graph: bool = False, compile_backend: str = "off") -> Iterator[None]:
    """The policy's consistent recompute with its backward in `mode` (policy.fast.recompute_backward), captured as
    CUDA graphs where `graph` (policy.fast.recompute_graph), its reference velocity built by `compile_backend`
    (policy.fast.recompute_compile), meanwhile."""
    before = policy.cfg
    policy.cfg = before.replace(fast={"recompute_backward": mode, "recompute_graph": graph,
                                      "recompute_compile": compile_backend})
    try:
        yield
    finally:
        policy.cfg = before


def gradient_errors(policy, rows: Samples, args: argparse.Namespace, modes: list[str]) -> dict:
    """One micro-batch's gradients (the surrogate's direction at ratio 1: advantage-weighted chunk log-probs) under each
    backward mode against the fp32 backward's: relative L2 per trainable parameter (worst, median) and overall."""
    actor = make_actor(policy, args, "off", 1)
    micro = rows.select(torch.arange(min(args.micro_batch, len(rows))))
    grads = {}
    for mode in ["fp32", *[m for m in modes if m != "fp32"]]:
        policy.model.zero_grad(set_to_none=True)
        with recompute_backward(policy, mode):
            logp = actor.chunk_logprob(policy, micro)
            (logp * micro.advantages.to(logp.device)).sum().backward()
        grads[mode] = {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    out = {}
    want = grads.pop("fp32")

    def flat(grad: dict) -> torch.Tensor:  # every parameter's gradient in one vector, in one order
        return torch.cat([grad[n].flatten() for n in want])

    for mode, got in grads.items():
        per = {n: relative_l2(got[n], w) for n, w in want.items()}
        worst = max(per, key=per.get)
        every = relative_l2(flat(got), flat(want))
        out[mode] = {"rows": len(micro), "params": len(per), "worst_rel_l2": per[worst], "worst_param": worst,
                     "median_rel_l2": sorted(per.values())[len(per) // 2], "all_rel_l2": every}
        print(f"gradients, {mode} backward vs fp32 ({len(micro)} rows): all {out[mode]['all_rel_l2']:.2e}, "
              f"worst {per[worst]:.2e} ({worst}), median {out[mode]['median_rel_l2']:.2e}")
    return out


def profile_update(policy, rows: Samples, args: argparse.Namespace, device: torch.device,
                   engine_store: RowPrefixes | None = None) -> dict:
    actor = make_actor(policy, args, args.profile_prefix_cache, 1, engine_store)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with weights_restored(policy), labelled_stages(), torch.profiler.profile(activities=activities) as prof:
        wall_s = synchronised_seconds(device, lambda: actor.train(rows))
    events = prof.key_averages()
    stages = stage_times(events)
    # kernels are events of their own (device_type CUDA), and so are the labels' ranges on the GPU timeline
    # (left out: they span kernels already counted); host ops own the kernels they launched
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("stage/")]
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.key.startswith("stage/")]
    busy_s = sum(event_device_us(e, own=True) for e in kernels) / 1e6
    top = sorted(ops, key=lambda e: event_device_us(e, own=True) if device.type == "cuda" else e.self_cpu_time_total,
                 reverse=True)[: args.top]
    top_ops = [{"op": e.key, "calls": e.count, "self_device_s": event_device_us(e, own=True) / 1e6,
                "self_cpu_s": e.self_cpu_time_total / 1e6} for e in top]
    # the kernels by name: inside a replayed CUDA graph or a compiled function the ops above hide which kernels ran
    top_kernels = [{"kernel": e.key, "calls": e.count, "device_s": event_device_us(e, own=True) / 1e6}
                   for e in sorted(kernels, key=lambda e: event_device_us(e, own=True), reverse=True)[: args.top]]
    print(f"profiled update (1 epoch, prefix_cache={args.profile_prefix_cache}): wall {wall_s:.2f} s, "
          f"device busy {busy_s:.2f} s")
    for label, value in sorted(stages.items()):
        span = "" if "device_span_s" not in value else f"  span on the device {value['device_span_s']:8.3f} s"
        print(f"  {label:40s} cpu {value.get('cpu_s', 0.0):8.3f} s  kernels {value.get('device_s', 0.0):8.3f} s"
              f"{span}  calls {value.get('calls', 0)}")
    for op in top_ops[:15]:
        print(f"  {op['op'][:60]:60s} device {op['self_device_s']:8.3f} s  cpu {op['self_cpu_s']:8.3f} s")
    return {"wall_s": wall_s, "device_busy_s": busy_s, "stages": stages, "top_ops": top_ops,
            "top_kernels": top_kernels, "prefix_cache": args.profile_prefix_cache}


def host_profile_update(policy, rows: Samples, args: argparse.Namespace, device: torch.device,
                        engine_store: RowPrefixes | None = None) -> dict:
    """One more update like profile_update's, under experiments.host_profile: the Python functions' host time and
    the call sites that waited for the GPU."""
    actor = make_actor(policy, args, args.profile_prefix_cache, 1, engine_store)
    with weights_restored(policy):
        report = host_profile(lambda: actor.train(rows), device, args.top)
    print(f"host profile (1 epoch, prefix_cache={args.profile_prefix_cache}): wall {report['wall_s']:.2f} s under "
          f"cProfile, {report['sync_count']} waits for the GPU")
    for row in report["functions"][:20]:
        print(f"  {row['function'][:80]:80s} calls {row['calls']:6d}  own {row['own_s']:7.3f} s  "
              f"cumulative {row['cumulative_s']:7.3f} s")
    for row in report["syncs"][:15]:
        print(f"  {row['count']:5d} x {row['site'][:150]}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="tiny", choices=["tiny", "pi05_small", "pi05"])
    parser.add_argument("--rows", type=int, default=16, help="rows of the update (a multiple of --batch)")
    parser.add_argument("--batch", type=int, default=8, help="rows per engine predict call")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2, help="update epochs of the timed updates")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed updates per setting, each from the engine's weights (the JSON has their medians)")
    caches = ["off", "host", "device", "engine"]  # engine: the engine keeps the rows' prefix (needs --consistent)
    parser.add_argument("--prefix-cache", nargs="+", default=["off", "host"], choices=caches,
                        help="grpo.prefix_cache settings to time, in order")
    parser.add_argument("--profile-prefix-cache", default="off", choices=caches)
    parser.add_argument("--prefix-cache-gib", type=float, default=None,
                        help="grpo.prefix_cache_gib of the kept settings (default: every row kept)")
    parser.add_argument("--prefix-cache-spill-gib", type=float, default=None,
                        help="with --prefix-cache-gib: grpo.prefix_cache_spill_gib of the device and engine settings")
    parser.add_argument("--prefix-cache-spill-read", default="auto", choices=SPILL_READS,
                        help="grpo.prefix_cache_spill_read: how the spilled rows are read (copy: CPU gather; mapped: "
                             "the GPU reads the page-locked memory; auto, the default: mapped on CUDA)")
    parser.add_argument("--frozen-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="policy.frozen_dtype of the trainer (auto: unset, fp32 like the trained weights)")
    parser.add_argument("--consistent", action="store_true",
                        help="the trainer's recompute through the fast path (policy.fast.consistent_recompute)")
    parser.add_argument("--prompt-bucket", type=int, default=128, help="with --consistent: the pinned prompt bucket")
    parser.add_argument("--attention", default="sdpa", choices=list(BATCH_INVARIANT_ATTENTION),
                        help="with --consistent: policy.fast.attention of the engine and the recompute (the README's "
                             "fast command runs triton)")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS),
                        help="policy.fast.precision of the engine's fast path and the consistent recompute")
    parser.add_argument("--recompute-backward", nargs="+", default=["fp32"], choices=RECOMPUTE_BACKWARDS,
                        help="with --consistent: policy.fast.recompute_backward settings to time, in order")
    parser.add_argument("--profile-recompute-backward", default="fp32", choices=RECOMPUTE_BACKWARDS)
    parser.add_argument("--recompute-graph", nargs="+", default=["off"], choices=["off", "on"],
                        help="with --consistent: policy.fast.recompute_graph settings to time with each backward, in "
                             "order (on: the backward's reference call replayed as a CUDA graph)")
    parser.add_argument("--profile-recompute-graph", default="off", choices=["off", "on"])
    parser.add_argument("--recompute-compile", nargs="+", default=["off"], choices=list(RECOMPUTE_COMPILES),
                        help="with --consistent: policy.fast.recompute_compile settings to time with each backward and "
                             "graph setting, in order (inductor: the backward's reference velocity through "
                             "torch.compile; its first update compiles, untimed)")
    parser.add_argument("--profile-recompute-compile", default="off", choices=list(RECOMPUTE_COMPILES))
    parser.add_argument("--top", type=int, default=40, help="ops kept in the JSON, by device time")
    parser.add_argument("--host-profile", action="store_true",
                        help="one more update under cProfile and CUDA's sync watch (experiments.host_profile)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--commit", action="store_true", help="write the JSON to benchmarks/results/")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for name in ("rows", "batch", "micro_batch", "epochs", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rows % args.batch:
        parser.error(f"--rows {args.rows} must be a multiple of --batch {args.batch}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if len(set(args.prefix_cache)) != len(args.prefix_cache):
        parser.error(f"--prefix-cache names a setting twice: {args.prefix_cache}")
    if len(set(args.recompute_backward)) != len(args.recompute_backward):
        parser.error(f"--recompute-backward names a setting twice: {args.recompute_backward}")
    if {*args.recompute_graph, args.profile_recompute_graph} != {"off"} and not args.consistent:
        parser.error("--recompute-graph on needs --consistent (it captures the consistent recompute's backward)")
    if len(set(args.recompute_graph)) != len(args.recompute_graph):
        parser.error(f"--recompute-graph names a setting twice: {args.recompute_graph}")
    if {*args.recompute_compile, args.profile_recompute_compile} != {"off"} and not args.consistent:
        parser.error("--recompute-compile other than off needs --consistent (it compiles the consistent recompute's "
                     "backward)")
    if len(set(args.recompute_compile)) != len(args.recompute_compile):
        parser.error(f"--recompute-compile names a setting twice: {args.recompute_compile}")
    if {*args.recompute_backward, args.profile_recompute_backward} != {"fp32"} and not args.consistent:
        parser.error("--recompute-backward other than fp32 needs --consistent (the consistent recompute's backward)")
    keep_engine = "engine" in (*args.prefix_cache, args.profile_prefix_cache)
    if keep_engine and not args.consistent:
        parser.error("--prefix-cache engine needs --consistent (the trainer restores the engine's fast-path K/V)")

    if args.attention != "sdpa" and not args.consistent:
        parser.error(f"--attention {args.attention} picks the consistent recompute's attention: add --consistent")
    if args.prefix_cache_spill_gib is not None and args.prefix_cache_gib is None:
        parser.error("--prefix-cache-spill-gib keeps the rows past --prefix-cache-gib in host memory: set that cap")
    device = auto_device(args.device)
    cuda = device.type == "cuda"
    if args.precision != "bf16" and not (args.consistent or cuda):
        parser.error(f"--precision {args.precision} needs the engine's fast path: --consistent, or a CUDA device")
    # the LIBERO RL configuration of logprob_gap: chunk 10, 4 steps, noise 0.5, fast path on CUDA, no pinning
    shape = argparse.Namespace(policy=args.policy, chunk=10, steps=4, fast="on" if args.consistent else "auto",
                               consistent="on" if args.consistent else "off", batch=args.batch,
                               prompt_bucket=args.prompt_bucket, precision=args.precision)
    cfg = policy_config(shape, cuda)
    if args.consistent:
        cfg = cfg.replace(fast={"attention": args.attention})
    if args.policy != "tiny":  # the GRPO recipe's camera slots (libero10_pi05: the preset's three, one empty)
        cfg = cfg.replace(cameras=PolicyConfig.preset(args.policy).cameras)
    overrides = {"train_expert_only": True}
    if args.frozen_dtype != "auto":  # "auto" sets nothing (so the script also runs on trees without the key)
        overrides["frozen_dtype"] = args.frozen_dtype
    policy = build_policy(trainer_policy_config(cfg.replace(**overrides)), device)
    engine = PolicyEngine(EngineConfig(devices=str(device), seed=args.seed), cfg)
    # "engine": the engine keeps the rows' prefix K/V as it predicts them (its store outlives it)
    # its cap, --prefix-cache-gib, is the engine's (the trainer's grpo.prefix_cache_gib under grpo.prefix_cache=engine)
    engine_cfg = GRPOConfig(prefix_cache="engine", prefix_cache_gib=args.prefix_cache_gib,
                            prefix_cache_spill_gib=args.prefix_cache_spill_gib)
    store = RowPrefixes("device", rows=args.rows, budget_bytes=engine_cfg.prefix_cache_bytes, setting="engine",
                        spill_bytes=engine_cfg.prefix_cache_spill_bytes,
                        spill_read=args.prefix_cache_spill_read) if keep_engine else None
    try:
        engine.update_weights(full_parameters(policy.model, full=True), version=1)
        if store is not None:
            engine.keep_prefixes(store)
        rows = rollout_rows(engine, cfg, args.batch, args.rows // args.batch, args.seed, keep_prefix=store is not None)
    finally:
        engine.close()
    rows.advantages = torch.randn(len(rows), generator=torch.Generator().manual_seed(args.seed))
    modes = args.recompute_backward
    variants = [(mode, graph == "on", backend) for mode in modes for graph in args.recompute_graph
                for backend in args.recompute_compile]
    timed = {}
    for mode, graph, backend in variants:
        with recompute_backward(policy, mode, graph, backend):
            # time_setting warms each setting up with one whole untimed run of it: a mode's first update pays for new
            # kernels (round 52's first run timed bf16 without one, 1.08 s against fp32's 0.89, where the GRPO step
            # had it 27% faster), a captured backward for its capture, a compiled one for its compile; with one
            # micro-batch's forward as warm-up, the first setting's old-log-prob pass once took 2.27 s on the H200
            # against 1.06 s for the next setting's (round 47)
            for setting in args.prefix_cache:
                print(f"recompute_backward={mode}{' graphed' if graph else ''}"
                      f"{f' compiled by {backend}' if backend != 'off' else ''}:", end=" ")
                label = setting if len(modes) == 1 else f"{setting}/{mode}"
                label += "/graph" if graph and len(args.recompute_graph) > 1 else ""
                label += f"/{backend}" if backend != "off" else ""
                timed[label] = time_setting(policy, rows, args, setting, device, store)
    with recompute_backward(policy, args.profile_recompute_backward, args.profile_recompute_graph == "on",
                            args.profile_recompute_compile):
        # the profiled settings may be none of the timed ones: their captures and compiles stay out of the profile
        with weights_restored(policy):
            make_actor(policy, args, args.profile_prefix_cache, 1, store).train(rows)
        profile = profile_update(policy, rows, args, device, store)
        host = host_profile_update(policy, rows, args, device, store) if args.host_profile else None
    errors = gradient_errors(policy, rows, args, modes) if len(set(modes) | {"fp32"}) > 1 else {}
    summary = {"policy": args.policy, "frozen_dtype": getattr(policy.cfg, "frozen_dtype", None), "rows": len(rows),
               "micro_batch": args.micro_batch, "epochs": args.epochs, "consistent": args.consistent,
               **{f"{k}_train_s": v.get("train_s") for k, v in timed.items()},
               **{f"{k}_recompute_s": v.get("recompute_s") for k, v in timed.items()},
               "profiled_wall_s": profile["wall_s"], "profiled_device_busy_s": profile["device_busy_s"],
               **{f"grad_{mode}_all_rel_l2": e["all_rel_l2"] for mode, e in errors.items()}}
    if host is not None:
        summary["host_profiled_wall_s"], summary["host_sync_count"] = host["wall_s"], host["sync_count"]
    payload = {"config": {**vars(args), "policy_cfg": cfg.to_dict()}, "timed": timed, "profile": profile,
               "gradient_errors": errors, "host_profile": host}
    write_result("profile_actor", payload, summary, out_dir=args.out, commit=args.commit, device=device)


if __name__ == "__main__":
    main()
