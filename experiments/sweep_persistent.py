"""Where the persistent expert kernel's time goes, and which blocks to give it, on pi0.5's expert.

    python -m experiments.sweep_persistent                   # GPU: PhyAI b1 (50 rows) and LIBERO b1 (10)

The kernel (policies/fast/persistent.py) alone, on random bf16 weights of pi0.5's expert shape
(18 layers, width 1024, 8 x 256 heads) and a prefix cache of the configuration's length: one
denoise step per launch, timed as 10 launches in one CUDA graph (what the denoise graph holds).
Rows of the JSON:
- `phases`: the default blocks with all phases but one left out (persistent.SKIP_BITS), barriers
  only, and nothing left out: the per-step cost of each phase;
- `shapes`: the whole kernel with other blocks / warps / pipelining / no prefetch.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from experiments import bench_predict_common as common
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast import persistent
from policies.fast.weights import LinearW

SHAPES = {
    "default": {},
    "warps4": {"warps": 4},
    "bk128": {"block_k": 128},
    "bk256": {"block_k": 256},
    "stages3": {"stages": 3},
    "stages4": {"stages": 4},
    "bk128_stages3": {"block_k": 128, "stages": 3},
    "bk128_stages4": {"block_k": 128, "stages": 4},
    "no_prefetch": {"prefetch": False},
    "wide_tiles": {"o_n": 64, "o_splits": 8, "gu_n": 64, "down_n": 64, "down_splits": 8},
    "att_m64": {"att_m": 64},
    # second round, around the first round's best (stages 4)
    "stages4_warps4": {"stages": 4, "warps": 4},
    "stages4_no_prefetch": {"stages": 4, "prefetch": False},
    "stages4_warps4_no_prefetch": {"stages": 4, "warps": 4, "prefetch": False},
    "stages5": {"stages": 5},
    "bk32_stages6": {"block_k": 32, "stages": 6},
    "stages4_att_n128": {"stages": 4, "att_n": 128},
    "stages4_narrow_tiles": {"stages": 4, "o_n": 16, "gu_n": 16, "down_n": 16},
    # third round: the second round's best with two programs per SM where they fit
    "s4_w4_npf": {"stages": 4, "warps": 4, "prefetch": False},
    "s4_w4_npf_2sm": {"stages": 4, "warps": 4, "prefetch": False, "programs_per_sm": 2},
    "s3_w4_npf_2sm": {"stages": 3, "warps": 4, "prefetch": False, "programs_per_sm": 2},
    "s2_w4_npf_2sm": {"stages": 2, "warps": 4, "prefetch": False, "programs_per_sm": 2},
    # fourth round: the prefetch staggered one phase ahead of each GEMM
    "s4_w4_staggered": {"stages": 4, "warps": 4},
    "s4_w8_staggered": {"stages": 4, "warps": 8},
    "s3_w4_staggered": {"stages": 3, "warps": 4},
    "bk128_s3_w4_staggered": {"block_k": 128, "stages": 3, "warps": 4},
    "s3_w4_npf_2sm_narrow": {"stages": 3, "warps": 4, "prefetch": False, "programs_per_sm": 2, "o_n": 16,
                             "gu_n": 16, "down_n": 16},
}


class _Weights:
    """FastWeights' `expert` list on random weights (what PersistentExpert reads)."""

    def __init__(self, e, device):
        def linear(n, k):
            return LinearW((torch.randn(n, k, device=device) * k ** -0.5).to(torch.bfloat16), None)

        qkv_n = (e.num_heads + 2 * e.num_kv_heads) * e.head_dim
        self.expert = [{"qkv": linear(qkv_n, e.width), "o": linear(e.width, e.num_heads * e.head_dim),
                        "gate_up": linear(2 * e.mlp_dim, e.width), "down": linear(e.width, e.mlp_dim)}
                       for _ in range(e.depth)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configurations", nargs="+", default=["phyai", "libero_rl"], choices=list(common.CONFIGURATIONS))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-phases", action="store_true", help="skip the per-phase runs")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    from policies.fast.attention import graph_call_ms

    cfg = PolicyConfig.preset("pi05")
    e, device = cfg.expert, torch.device("cuda")
    weights = _Weights(e, device)
    record, summary = {"args": vars(args), "runs": []}, {}
    for name in args.configurations:
        spec = common.CONFIGURATIONS[name]
        rows = spec["chunk_size"]
        prefix = spec["cameras"] * cfg.vision.num_patches + spec["prompt_len"]
        cache_rows = prefix + rows
        caches = [[torch.randn(1, cache_rows, e.num_kv_heads, e.head_dim, device=device).to(torch.bfloat16)
                   for _ in range(e.depth)] for _ in range(2)]
        slots = (prefix + torch.arange(rows, device=device))[None]
        h = torch.randn(rows, e.width, device=device).to(torch.bfloat16)
        mod = torch.randn(2 * e.depth + 1, 3 * e.width, device=device) * 0.1
        cos, sin = (torch.rand(1, rows, e.head_dim, device=device).to(torch.bfloat16) for _ in range(2))
        run = {"configuration": name, "rows": rows, "cache_rows": cache_rows, "phases": [], "shapes": []}

        def time_step(shape, skip=0):
            kernel = persistent.PersistentExpert(weights, cfg, caches[0], caches[1], slots, rows, 1, device, shape)
            kernel.plan(torch.tensor([cache_rows], dtype=torch.int32, device=device))
            h0 = h.clone()
            call = lambda: kernel(h0, mod, cos, sin, skip)  # noqa: E731
            return graph_call_ms(call, calls=10, replays=7) * 1e3, (kernel.att_splits, kernel.programs)

        base = persistent.PersistentShape()
        everything = sum(persistent.SKIP_BITS.values()) - persistent.SKIP_BITS["barriers"]
        phase_runs = [("all", 0), ("barriers_only", everything)]
        phase_runs += [(f"only_{ph}", everything - bit) for ph, bit in persistent.SKIP_BITS.items() if ph != "barriers"]
        phase_runs += [("no_barriers", persistent.SKIP_BITS["barriers"])]
        for label, skip in [] if args.no_phases else phase_runs:
            us, _ = time_step(base, skip)
            run["phases"].append({"label": label, "skip": skip, "us_per_step": us})
            summary[f"{name}_phase_{label}_us"] = us
            print(f"{name} phase {label:16s} {us:9.1f} us per step", flush=True)
        for label in args.shapes:
            shape = dataclasses.replace(base, **SHAPES[label])
            problem = persistent.usable(rows, e, shape)
            if problem is not None:
                run["shapes"].append({"label": label, "error": problem})
                continue
            try:
                us, splits = time_step(shape)
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a result too
                run["shapes"].append({"label": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(f"{name} shape {label}: {exc}", flush=True)
                continue
            run["shapes"].append({"label": label, **dataclasses.asdict(shape), "att_splits": splits[0],
                                  "programs": splits[1], "us_per_step": us})
            summary[f"{name}_shape_{label}_us"] = us
            print(f"{name} shape {label:16s} {us:9.1f} us per step (att splits, programs {splits})", flush=True)
        record["runs"].append(run)
    write_result("sweep_persistent", record, summary, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
