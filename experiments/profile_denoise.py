"""Where the denoise loop's time goes, and which expert GEMM kernel to use at few rows.

    python -m experiments.profile_denoise [--sweep]        # GPU: pi05, PhyAI (chunk 50) and LIBERO (chunk 10)
    python -m experiments.profile_denoise --policy tiny --sweep --rows 16 --sweep-limit 2 --variants \
        cublas/sdpa/off skinny/sdpa/off --batch-sizes 1      # CPU smoke (Triton interpreter)

One run, one JSON (runs/profile_denoise/, or --out-dir):
1. `denoise`: per configuration and batch size, the denoise stage's CUDA-graph replay time (median
   of `--iters`) with the expert's projections through cuBLAS (`policy.fast.gemm=cublas`) and
   through the skinny split-K kernels (`gemm=skinny`), and how far the two samplers' chains differ.
2. `kernels`: the same stage run eagerly under torch.profiler, device time per kernel name
   (summed over the 10 x 18 layer-steps) for both GEMM choices: what is left to fuse.
3. `gemm_sweep`: each expert projection shape at each row count, cuBLAS (F.linear) against every
   skinny tile candidate, timed as 20 back-to-back calls captured in one CUDA graph (what the
   denoise graph sees), with the bandwidth each reaches reading the weight once.
The best tile per (N, K, GeGLU) at <= 64 rows is what skinny.TUNED should hold; where a tile set
(variant "skinny@<set>/...", timed inside the denoise graph) wins at some rows, skinny.TUNED_BY_ROWS.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict
from dataclasses import replace

import torch

if not torch.cuda.is_available():  # the CPU smoke run's skinny kernels go through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.nn.functional as F  # noqa: E402

from experiments import bench_predict_common as common
from experiments.profile_denoise_attention import attention_sweep, graph_time_us
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast import kernels as K
from policies.fast import skinny
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.fast.triton_attention import TritonSplitKVAttention
from policies.lerobot_bridge import relative_l2
from policies.policy import build_policy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="pi05", help="PolicyConfig preset")
    p.add_argument("--configurations", nargs="+", default=["phyai", "libero_rl"], choices=list(common.CONFIGURATIONS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2])
    p.add_argument("--sweep-rows", type=int, default=50, help="row count (batch x chunk) of the full tile sweep")
    p.add_argument("--rows", nargs="+", type=int, default=[10, 20, 100, 160, 320, 640],
                   help="other row counts: cuBLAS against the sweep's best --top tiles")
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--sweep-limit", type=int, default=0, help="at most this many tile candidates per shape (0: all)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant's denoise graph this many times, round-robin (ms: the median)")
    p.add_argument("--variants", nargs="+", default=["cublas/sdpa/off", "cublas/triton/off", "skinny/triton/off",
                                                     "skinny/triton/on", "skinny/triton/early", "auto/auto/auto"],
                   help="gemm[@tile set]/attention/pdl[/mlp] settings of policy.fast to time (the first is the "
                        "chains' reference)")
    p.add_argument("--breakdown", nargs="*", default=["cublas/sdpa", "skinny/triton"],
                   help="gemm/attention settings profiled kernel by kernel (eager)")
    p.add_argument("--graph-timeline", nargs="*", default=None, metavar="VARIANT",
                   help="also profile one replay of the denoise graph at batch 1, with the default settings (no "
                        "value) or each given variant's: per kernel name its device time inside the graph, and the "
                        "replay's span, idle gaps and overlap")
    p.add_argument("--sweep", action="store_true", help="also sweep the skinny tiles of every expert projection")
    p.add_argument("--attention-sweep", action="store_true",
                   help="also sweep SDPA and the Triton attention's blocks (b = --batch-sizes)")
    p.add_argument("--attention-stages", nargs="+", default=["expert"], choices=["expert", "prefix"],
                   help="attention shapes the sweep times: the expert's (chunk queries) and/or the prefix's")
    p.add_argument("--attention-tma", action="store_true",
                   help="the attention sweep also times the TMA kernel with every block setting it can run (one KV "
                        "head, no KV split)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", action="store_true", help="write to benchmarks/results/")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = common.run_device_and_dtype()
    base = PolicyConfig.preset(args.policy)
    record = {"args": vars(args), "denoise": [], "kernels": {}, "gemm_sweep": [], "attention_sweep": {}}
    shapes = None
    for name in args.configurations:
        spec = common.CONFIGURATIONS[name]
        cfg = common.configuration_policy_cfg(base, spec, dtype)
        policy = build_policy(cfg, device=device)
        shapes = expert_shapes(policy)
        for batch in args.batch_sizes:
            variants = profile_stage(policy, spec, batch, device, args)
            record["denoise"].append({"configuration": name, "batch": batch, "rows": batch * spec["chunk_size"],
                                      "variants": variants})
            for variant, v in variants.items():
                if "error" in v:
                    continue
                print(f"{name} b={batch} {variant:24s} denoise {v['ms']:.3f} ms  attention {v['attention']}  "
                      f"rel {v['chains_rel_l2_vs_first']:.1e}  pdl-bits-equal {v.get('bit_equal_to_pdl_off', '-')}",
                      flush=True)
        if device.type == "cuda":
            record["kernels"][name] = {v: kernel_breakdown(policy, spec, v, device) for v in args.breakdown}
        if args.graph_timeline is not None and device.type == "cuda":
            for variant in args.graph_timeline or [None]:  # keyed by configuration, then "<configuration> <variant>"
                key = name if variant is None else f"{name} {variant}"
                timeline = record.setdefault("graph_timeline", {})[key] = graph_timeline(policy, spec, device, variant)
                roles = "  ".join(f"{r} {v['mean_chain_us']:.2f}" for r, v in timeline.get("by_role", {}).items())
                print(f"{key} b=1 graph replay {timeline.get('span_us', 0):.0f} us; per call on the critical path "
                      f"(us): {roles}", flush=True)
        if args.attention_sweep:
            record["attention_sweep"][name] = attention_sweep(policy.cfg, spec, device, args)
        del policy
        torch.cuda.empty_cache() if device.type == "cuda" else None
    summary = {f"{r['configuration']}_b{r['batch']}_{variant}_ms": v.get("ms") for r in record["denoise"]
               for variant, v in r["variants"].items()}
    if args.sweep:
        record["gemm_sweep"] = sweep(shapes, args, device)
        summary["best_tiles"] = best_tiles(record["gemm_sweep"], max_rows=64)
    write_result("profile_denoise", record, summary, out_dir=args.out_dir, commit=args.commit)


def expert_shapes(policy) -> dict[str, tuple[int, int, bool]]:
    layer = policy.model.expert.layers[0]
    mods = {"qkv": layer.qkv, "o": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down}
    return {name: (*m.weight.shape, name == "gate_up") for name, m in mods.items()}


def _sampler(policy, batch: int, prompt_len: int, graphs: bool = True, **fast) -> FastSampler:
    return FastSampler(policy.model, FastConfig(enabled=True, dtype=policy.cfg.dtype, batch_buckets=[batch],
                                                prompt_buckets=[prompt_len], cuda_graphs=graphs, **fast))


# Alternative skinny.TUNED sets (variant "skinny@<name>/..."), timed inside the whole denoise graph
# (the tile sweep times each projection alone, with its weights hot in L2 between repeats):
# - s4, s2: fewer K splits leave less for the consuming kernels (add_rms_norm, rope_scatter) to add up,
#   at some cost in the GEMM itself;
# - one projection each with more programs (narrower slabs), more K per load, or a deeper pipeline.
T = skinny.SkinnyTile
TILE_SETS = {
    "s4": {"qkv": T(32, 64, 2), "o": T(32, 64, 4), "gate_up": T(32, 64, 1), "down": T(32, 64, 4)},
    "s2": {"qkv": T(16, 64, 2), "o": T(16, 64, 2), "gate_up": T(32, 64, 1), "down": T(16, 128, 2)},
    "gu16": {"gate_up": T(16, 64, 1)},
    "gu16k128": {"gate_up": T(16, 128, 1)},
    "gu32k128": {"gate_up": T(32, 128, 1)},
    "gu32st6": {"gate_up": T(32, 64, 1, stages=6)},
    "qkv32": {"qkv": T(32, 64, 4)},
    "o32": {"o": T(32, 64, 8)},
    "down32": {"down": T(32, 64, 8)},
    "down16s": {"down": T(64, 64, 16)},
    "s4gu": {"qkv": T(32, 64, 2), "o": T(32, 64, 4), "gate_up": T(32, 128, 1), "down": T(32, 64, 4)},
    "s4gu16": {"qkv": T(32, 64, 2), "o": T(32, 64, 4), "gate_up": T(16, 128, 1), "down": T(32, 64, 4)},
    "gu32k256": {"gate_up": T(32, 256, 1, stages=2)},  # 4 stages need 256 KB of shared memory
    # gate_up's PDL prefetch (16.8 MB) while the norm before it runs: none, or the first half of each slab
    "gu16k128np": {"gate_up": T(16, 128, 1, prefetch=0)},
    "gu16k128half": {"gate_up": T(16, 128, 1, prefetch=2)},
    "gu16k128pf": {"gate_up": T(16, 128, 1)},  # with its prefetch: the 50-row tile before round 10
    "gu32np": {"gate_up": T(32, 64, 1, prefetch=0)},
    "gu32k128np": {"gate_up": T(32, 128, 1, prefetch=0)},
    # the other projections' TUNED tiles without their PDL prefetch (not yet timed): down's 8.4 MB runs
    # while gate_up streams its own 16.8 MB, qkv's 5.2 MB during the norm before it, o's 4.2 MB during merge
    "qkvnp": {"qkv": T(64, 64, 4, prefetch=0)},
    "onp": {"o": T(64, 64, 8, prefetch=0)},
    "downnp": {"down": T(64, 64, 8, prefetch=0)},
    "allnp": {"qkv": T(64, 64, 4, prefetch=0), "o": T(64, 64, 8, prefetch=0),
              "gate_up": T(16, 128, 1, prefetch=0), "down": T(64, 64, 8, prefetch=0)},
    # round 11: `down` and `o` with fewer K splits (less for the norm after them to add up), timed with
    # round 10's 50-row gate_up tile, after which `down`'s share of the critical path grew
    "down_s4": {"down": T(64, 64, 4)},
    "o_s4": {"o": T(64, 64, 4)},
    "down32_s4": {"down": T(32, 64, 4)},
    # after o_s4 won at 50 rows: the split count of qkv and o around it
    "qkv_s2": {"qkv": T(64, 64, 2)},
    "qkv_s8": {"qkv": T(64, 64, 8)},
    "qkv32_s2": {"qkv": T(32, 64, 2)},
    "o_s2": {"o": T(64, 64, 2)},
    "o32_s4": {"o": T(32, 64, 4)},
    "o_s4k128": {"o": T(64, 128, 4)},
    # round 12: round 11's two 50-row tiles together at the other row counts (PhyAI b2: 100 rows)
    "qkv_s2_o_s4": {"qkv": T(64, 64, 2), "o": T(64, 64, 4)},
    # round 17: SkinnyTile.preload (each program's whole weight slab loaded before the PDL wait, then one
    # dot), the 50-row tiles' shapes, with 4 or 8 warps; gate_up and down share warps when the MLP is fused
    "pre_o": {"o": T(64, 64, 4, preload=True)},
    "pre_o_w8": {"o": T(64, 64, 4, warps=8, preload=True)},
    "pre_qkv": {"qkv": T(64, 64, 2, preload=True)},
    "pre_qkv_o": {"qkv": T(64, 64, 2, preload=True), "o": T(64, 64, 4, preload=True)},
    "pre_qkv_o_w8": {"qkv": T(64, 64, 2, warps=8, preload=True), "o": T(64, 64, 4, warps=8, preload=True)},
    "pre_down": {"down": T(64, 64, 8, preload=True), "gate_up": T(16, 128, 1, prefetch=0)},
    "pre_down_w8": {"down": T(64, 64, 8, warps=8, preload=True), "gate_up": T(16, 128, 1, warps=8, prefetch=0)},
    "pre_mlp_w8": {"down": T(64, 64, 8, warps=8, preload=True), "gate_up": T(16, 128, 1, warps=8, preload=True)},
    "pre_3": {"qkv": T(64, 64, 2, preload=True), "o": T(64, 64, 4, preload=True), "down": T(64, 64, 8, preload=True),
              "gate_up": T(16, 128, 1, prefetch=0)},
    "pre_down_only": {"down": T(64, 64, 8, preload=True)},
    # the other projections preloaded at TUNED's splits (the 10-32-row tiles' K slices)
    "pre_qkv_s4": {"qkv": T(64, 64, 4, preload=True)},
    "pre_o_s8": {"o": T(64, 64, 8, preload=True)},
    # round 18: down preloaded with 4 K splits, 32 wide (the norm after it adds 4 partials, not 8; the weight
    # and x slabs of 1024 columns fill the 192 KB a preloaded tile may use at 64 rows)
    "pre_down_s4n32": {"down": T(32, 64, 4, preload=True)},
    "pre_down_s4n32_w8": {"down": T(32, 64, 4, warps=8, preload=True)},
    # round 19: the 33-128-row qkv and o tiles with less of their PDL weight prefetch (the norm before qkv takes
    # 2.6 us of PhyAI b1's critical path against 1.75 for the same kernel before gate_up, whose prefetch is off)
    "qkv_s2np": {"qkv": T(64, 64, 2, prefetch=0)},
    "qkv_s2half": {"qkv": T(64, 64, 2, prefetch=2)},
    "qkv_s2quarter": {"qkv": T(64, 64, 2, prefetch=4)},
    "o_s4np": {"o": T(64, 64, 4, prefetch=0)},
    "o_s4half": {"o": T(64, 64, 4, prefetch=2)},
    # and TUNED's gate_up / down tiles (65-128 rows) with a quarter of theirs (gu32np / downnp: none); round 20
    # took both at 65-128 rows (mlp_pf4, skinny.TUNED_BY_ROWS); gu_pf4 alone was within the spread at 80 rows
    "gu_pf4": {"gate_up": T(32, 64, 1, prefetch=4)},
    "down_pf4": {"down": T(64, 64, 8, prefetch=4)},
    "mlp_pf4": {"gate_up": T(32, 64, 1, prefetch=4), "down": T(64, 64, 8, prefetch=4)},
    "down_pf8": {"down": T(64, 64, 8, prefetch=8)},  # an eighth (prefetch=8: the first 1/8 of each slab)
    "pre_all_w8": {"qkv": T(64, 64, 2, warps=8, preload=True), "o": T(64, 64, 4, warps=8, preload=True),
                   "down": T(64, 64, 8, warps=8, preload=True), "gate_up": T(16, 128, 1, warps=8, preload=True)},
}


def tuned_for(policy, tile_set: str | None) -> tuple[dict, dict]:
    """(skinny.TUNED, skinny.TUNED_BY_ROWS) with `tile_set`'s tiles for this policy's expert shapes, at
    every row count: the row table loses the shapes the set names (None: both unchanged)."""
    if tile_set is None:
        return dict(skinny.TUNED), dict(skinny.TUNED_BY_ROWS)
    if tile_set.startswith("nopreload"):  # "nopreload[_<projection>]": the tuned tiles, SkinnyTile.preload off
        return _without_preload(policy, tile_set.partition("_")[2] or None)
    if tile_set not in TILE_SETS:
        raise ValueError(f"unknown tile set {tile_set!r}; known: {sorted(TILE_SETS)}")
    shapes = expert_shapes(policy)
    overrides = {shapes[name]: tile for name, tile in TILE_SETS[tile_set].items()}
    by_rows = {shape: rows for shape, rows in skinny.TUNED_BY_ROWS.items() if shape not in overrides}
    return {**skinny.TUNED, **overrides}, by_rows


def _without_preload(policy, projection: str | None) -> tuple[dict, dict]:
    """(skinny.TUNED, skinny.TUNED_BY_ROWS) with SkinnyTile.preload off for `projection`'s tiles (None: all)."""
    shapes = expert_shapes(policy)
    if projection is not None and projection not in shapes:
        raise ValueError(f"unknown projection {projection!r} in tile set nopreload_{projection}; "
                         f"known: {sorted(shapes)}")

    def strip(shape, tile):
        return replace(tile, preload=False) if projection is None or shape == shapes[projection] else tile

    by_rows = {shape: tuple((a, b, strip(shape, t)) for a, b, t in rows)
               for shape, rows in skinny.TUNED_BY_ROWS.items()}
    return {shape: strip(shape, t) for shape, t in skinny.TUNED.items()}, by_rows


def profile_stage(policy, spec: dict, batch: int, device, args) -> dict:
    """Denoise-stage replay time of every variant on the same inputs; chains against the first
    variant's, and whether variants that differ only in PDL give identical bits (they must). With
    --rounds N every variant's graph is timed N times, round-robin (differences of ~1% between tiles
    need several placements to tell from the drift between timings); `ms` is the median of rounds."""
    inputs, noise = common.make_inputs(policy.cfg, batch, spec["prompt_len"], device, seed=batch)
    stoch = torch.zeros(batch, policy.cfg.sampling.num_steps, dtype=torch.bool, device=device)
    samplers, chains, failed = {}, {}, {}
    for variant in args.variants:
        try:
            samplers[variant], chains[variant] = _variant_sampler(policy, variant, batch, spec, inputs, noise, stoch)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run (e.g. out of shared memory) is recorded
            failed[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{variant}: failed at batch {batch}: {failed[variant]['error']}", flush=True)
    if args.variants[0] in failed:
        raise RuntimeError(f"the reference variant {args.variants[0]!r} failed: {failed[args.variants[0]]['error']}")
    buckets = {variant: next(iter(fast.buckets.values())) for variant, fast in samplers.items()}
    rounds: dict[str, list[float]] = {variant: [] for variant in samplers}
    for _ in range(args.rounds):
        for variant, fast in samplers.items():
            rounds[variant].append(common.timed_ms(lambda f=fast, b=buckets[variant]: f.run_stage(b, "denoise"),
                                                   device, 3, args.iters))
    out = {}
    for variant, fast in samplers.items():
        bucket = buckets[variant]
        out[variant] = {"ms": statistics.median(rounds[variant]), "ms_rounds": rounds[variant], "pdl_code": fast.pdl,
                        "attention": getattr(bucket.expert_attn, "name", "?"),
                        "attention_layout": attention_layout(bucket.expert_attn),
                        "tiles": {k: None if t is None else vars(t) for k, t in bucket.tiles.items()},
                        "chains_rel_l2_vs_first": relative_l2(chains[variant], chains[args.variants[0]])}
    for variant in samplers:  # PDL must not change a bit: against the same variant with PDL off
        twin = variant.rsplit("/", 1)[0] + "/off"
        if twin in chains and twin != variant and VARIANT_FIELDS[variant.count("/")] == "pdl":
            out[variant]["bit_equal_to_pdl_off"] = bool(torch.equal(chains[variant], chains[twin]))
    return {variant: out[variant] if variant in out else failed[variant] for variant in args.variants}


VARIANT_FIELDS = ("gemm", "attention", "pdl", "mlp")


def attention_layout(backend) -> dict | None:
    """The Triton attention's blocks, warps and KV splits (None for another backend)."""
    names = ("BLOCK_M", "BLOCK_N", "WARPS", "STAGES", "num_splits", "split_rows", "tma")
    return {name: getattr(backend, name) for name in names} if getattr(backend, "name", "") == "triton" else None


def _variant_sampler(policy, variant: str, batch: int, spec: dict, inputs, noise, stoch, graphs: bool = True):
    """A sampler with the variant's settings ("gemm[@tile set]/attention/pdl[/mlp]", mlp default "auto")
    that has run one call (its bucket built with the tile set's tiles, graphs captured when `graphs`), and
    that call's last chain state."""
    gemm, attention, pdl_mode, *mlp = variant.split("/")
    gemm, _, tile_set = gemm.partition("@")
    attention, _, attention_set = attention.partition("@")
    saved = skinny.TUNED, skinny.TUNED_BY_ROWS, TritonSplitKVAttention.EXPERT_OPTIONS
    skinny.TUNED, skinny.TUNED_BY_ROWS = tuned_for(policy, tile_set or None)
    TritonSplitKVAttention.EXPERT_OPTIONS = expert_attention_options(attention_set)
    try:
        fast = _sampler(policy, batch, spec["prompt_len"], graphs=graphs, gemm=gemm, attention=attention,
                        pdl=pdl_mode, mlp=mlp[0] if mlp else "auto")
        return fast, fast.sample_chains(inputs, noise, None, stoch)[0][:, -1].float().cpu()
    finally:
        skinny.TUNED, skinny.TUNED_BY_ROWS, TritonSplitKVAttention.EXPERT_OPTIONS = saved


ATTENTION_OPTION_KEYS = {"w": "warps", "m": "block_m", "n": "block_n", "s": "stages", "t": "target_blocks",
                         "x": "tma"}


def expert_attention_options(attention_set: str) -> dict:
    """The expert's Triton attention options of an attention setting's "@<options>" part: "_"-separated
    "w<warps>", "m<block_m>", "n<block_n>", "s<stages>", "t<target blocks>" (the KV split count follows:
    a target the row blocks fill alone means no split) and "x0" / "x1" (the TMA kernel off / on), the
    arguments of TritonSplitKVAttention; "" keeps the class's defaults."""
    options = dict(TritonSplitKVAttention.EXPERT_OPTIONS)
    for token in filter(None, attention_set.split("_")):
        key, value = token[:1], token[1:]
        if key in ATTENTION_OPTION_KEYS and value.isdigit() and (key != "x" or value in ("0", "1")):
            options[ATTENTION_OPTION_KEYS[key]] = bool(int(value)) if key == "x" else int(value)
        else:
            raise ValueError(f"unknown attention option {token!r} in {attention_set!r}: use w<warps>, "
                             f"m<block_m>, n<block_n>, s<stages>, t<target blocks> or x0/x1, joined by '_'")
    return options


def _batch1_bucket(policy, spec: dict, device, variant: str = "auto/auto/auto", graphs: bool = True):
    """A batch-1 sampler with `variant`'s settings (_variant_sampler's) that has run one call (graphs
    captured when `graphs`), and its bucket."""
    inputs, noise = common.make_inputs(policy.cfg, 1, spec["prompt_len"], device, seed=1)
    stoch = torch.zeros(1, policy.cfg.sampling.num_steps, dtype=torch.bool, device=device)
    fast = _variant_sampler(policy, variant, 1, spec, inputs, noise, stoch, graphs)[0]
    return fast, next(iter(fast.buckets.values()))


def kernel_breakdown(policy, spec: dict, variant: str, device) -> dict:
    """Device time per kernel name of one eager denoise stage (no graphs), largest first."""
    gemm, attention = variant.split("/")[:2]
    fast, bucket = _batch1_bucket(policy, spec, device, f"{gemm}/{attention}/auto", graphs=False)
    return common.kernel_table(lambda: fast.run_stage(bucket, "denoise"), device, top=25)


def graph_timeline(policy, spec: dict, device, variant: str | None = None) -> dict:
    """One replay of the denoise graph at batch 1 (the default settings', or `variant`'s) under
    torch.profiler, per kernel name: its share of the replay's critical path (`chain_us`) and its device
    time from launch to end (`us`: with PDL a kernel launches early and waits, so these overlap); and the
    replay's span, the time no kernel ran, and the overlap."""
    from torch.profiler import ProfilerActivity, profile

    fast, bucket = _batch1_bucket(policy, spec, device, variant or "auto/auto/auto")
    for _ in range(3):
        fast.run_stage(bucket, "denoise")
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fast.run_stage(bucket, "denoise")
        torch.cuda.synchronize(device)
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA"]
    if not spans:
        return {"kernels": 0, "note": "the profiler recorded no kernel inside the graph replay"}
    return timeline_summary(spans)


def timeline_summary(spans: list[tuple[float, float, str]], top: int = 15) -> dict:
    """(start, end, kernel name) spans of one replay -> per name its share of the critical path
    (`chain_us`: a kernel waits for its predecessor, so what it adds is how far its end lies past
    every earlier kernel's end; time it spent launched early and waiting is not counted) and its
    device time (`us`); the span, the time no kernel ran, the overlap (busy time beyond the span),
    and the repeated kernels' shares per role (`by_role`, chain_by_role)."""
    spans = sorted(spans)
    chains, idle = critical_path_shares(spans)
    per_name: dict[str, list[float]] = defaultdict(list)
    chain: dict[str, float] = defaultdict(float)
    for (start, end, name), share in zip(spans, chains, strict=True):
        per_name[name].append(end - start)
        chain[name] += share
    span = max(end for _, end, _ in spans) - spans[0][0]
    busy = sum(end - start for start, end, _ in spans)
    rows = sorted(((n, sum(v), len(v)) for n, v in per_name.items()), key=lambda r: -chain[r[0]])
    return {"kernels": len(spans), "span_us": span, "idle_us": idle, "overlap_us": busy - (span - idle),
            "top": [{"kernel": n[:140], "chain_us": chain[n], "us": us, "calls": c, "mean_chain_us": chain[n] / c,
                     "mean_us": us / c} for n, us, c in rows[:top]],
            "by_role": chain_by_role([name for _, _, name in spans], chains)}


def critical_path_shares(spans: list[tuple[float, float, str]]) -> tuple[list[float], float]:
    """Spans sorted by start -> each one's share of the critical path (how far its end lies past every
    earlier end) and the time no kernel ran."""
    shares, idle, reach = [], 0.0, spans[0][0]
    for start, end, _ in spans:
        idle += max(0.0, start - reach)
        shares.append(max(0.0, end - max(reach, start)))
        reach = max(reach, end)
    return shares, idle


# The expert layer-step's skinny projections, in launch order; an AdaRMS norm is named by the
# projection it feeds (the skinny call after it).
SKINNY_ROLES = ("qkv", "o", "gate_up", "down")


def chain_by_role(names: list[str], shares: list[float]) -> dict:
    """Mean critical-path share per role of the layer-step's repeated kernels, from kernel names in
    launch order: the skinny_kernel calls are projections SKINNY_ROLES in turn, a fused_mlp_kernel is
    `gate_up+down` (the next skinny call is a qkv again), a rope_scatter_kernel `rope`, and an
    add_norm_kernel is `norm_before_<role>` of the next projection. Empty without skinny calls."""
    roles: list[str | None] = [None] * len(names)
    pending, position = [], 0
    for i, name in enumerate(names):
        if name == "rope_scatter_kernel":
            roles[i] = "rope"
        elif name in ("skinny_kernel", "fused_mlp_kernel"):
            if name == "fused_mlp_kernel":
                roles[i], position = "gate_up+down", 0
            else:
                roles[i] = SKINNY_ROLES[position % len(SKINNY_ROLES)]
                position += 1
            for j in pending:
                roles[j] = f"norm_before_{roles[i]}"
            pending = []
        elif name == "add_norm_kernel":
            pending.append(i)
    per_role: dict[str, list[float]] = defaultdict(list)
    for role, share in zip(roles, shares, strict=True):
        if role is not None:
            per_role[role].append(share)
    return {role: {"calls": len(v), "mean_chain_us": sum(v) / len(v)} for role, v in per_role.items()}


def sweep(shapes: dict, args, device) -> list[dict]:
    """Every candidate tile at --sweep-rows rows; at the other row counts the --top best of those."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for name, (n, k, gelu_mul) in shapes.items():
        weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        tiles = skinny.candidates(args.sweep_rows, n, k, gelu_mul)[: args.sweep_limit or None]
        entry = time_shape(name, weight, gelu_mul, args.sweep_rows, tiles, args, device)
        out.append(entry)
        ranked = sorted((c for c in entry["candidates"] if "us" in c), key=lambda c: c["us"])[: args.top]
        for rows in args.rows:
            top = [skinny.SkinnyTile(**{**c["tile"], "block_m": skinny.rows_block(rows)}) for c in ranked]
            top = [t for t in top if t.fits(rows, n, k, gelu_mul) is None]
            out.append(time_shape(name, weight, gelu_mul, rows, top, args, device))
    return out


def time_shape(name: str, weight, gelu_mul: bool, rows: int, tiles: list, args, device) -> dict:
    n, k = weight.shape
    x = torch.randn(rows, k, device=device, dtype=weight.dtype)
    ref = (K.gelu_tanh_mul(F.linear(x, weight)) if gelu_mul else F.linear(x, weight)).float()
    entry = {"projection": name, "n": n, "k": k, "gelu_mul": gelu_mul, "rows": rows,
             "weight_mb": weight.numel() * weight.element_size() / 1e6, "candidates": []}
    cublas = (lambda: K.gelu_tanh_mul(F.linear(x, weight))) if gelu_mul else (lambda: F.linear(x, weight))
    entry["cublas_us"] = graph_time_us(cublas, device, args.iters)
    for tile in tiles:
        try:
            got = skinny.skinny_linear(x, weight, tile, gelu_mul=gelu_mul)
            got = got.float() if gelu_mul else K.sum_partials(got)
            us = graph_time_us(lambda t=tile: skinny.skinny_linear(x, weight, t, gelu_mul=gelu_mul), device,
                               args.iters)
            entry["candidates"].append({"tile": vars(tile), "us": us, "rel_l2": relative_l2(got, ref),
                                        "gb_s": entry["weight_mb"] / us * 1e3})
        except Exception as exc:  # a tile the compiler refuses (shared memory, ...) is recorded, not fatal
            entry["candidates"].append({"tile": vars(tile), "error": f"{type(exc).__name__}: {exc}"[:300]})
    timed = [c for c in entry["candidates"] if "us" in c]
    entry["cublas_gb_s"] = entry["weight_mb"] / entry["cublas_us"] * 1e3
    if timed:
        entry["best"] = min(timed, key=lambda c: c["us"])
        entry["speedup_vs_cublas"] = entry["cublas_us"] / entry["best"]["us"]
    best = entry.get("best", {})
    print(f"{name} ({n}x{k}) rows {rows}: cublas {entry['cublas_us']:.1f} us, best skinny "
          f"{best.get('us', float('nan')):.1f} us {best.get('tile')}", flush=True)
    return entry


def best_tiles(entries: list[dict], max_rows: int) -> dict:
    """Per projection, the tile with the lowest total time over the swept row counts <= max_rows."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in entries:
        if e["rows"] > max_rows:
            continue
        for c in e["candidates"]:
            if "us" in c:
                key = {k: v for k, v in c["tile"].items() if k != "block_m"}
                totals[e["projection"]][repr(sorted(key.items()))] += c["us"]
    return {proj: min(t.items(), key=lambda kv: kv[1])[0] for proj, t in totals.items()}


if __name__ == "__main__":
    main()
