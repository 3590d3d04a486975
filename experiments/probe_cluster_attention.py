"""Where the fused attention + merge + o kernel's time goes (experiments/cluster_attention/fused.py; GPU only).

    python -m experiments.probe_cluster_attention [--out-dir DIR]

At the expert's batch-1 shapes (PhyAI: 50 queries, 1018 cache rows; LIBERO: 10, 570), each cluster size
that fits, with the loops over K unrolled by 4 or not (`roll_k`: a smaller kernel), one JSON with:
- `us`: one call's GPU time, 20 back-to-back calls captured in a CUDA graph (attention.graph_call_ms),
  without and with the PDL launch attribute; beside it the separate kernels it replaces (the Triton
  split-KV attention, its merge and the skinny o projection at the tuned tile), timed the same way;
- `max_active_clusters`: how many of the launch's clusters the GPU holds at once;
- `phases`: from a build that stamps clock64 at each phase in thread 0 of every CTA, the median over
  CTAs of each phase's cycles (PDL wait, copies, attention, cluster barrier 1, merge, barrier 2, o),
  and from globaltimer the spread of the CTAs' start times and the launch's span, in ns.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from experiments.cluster_attention import fused as CA
from experiments.results import write_result
from policies.fast import skinny
from policies.fast.attention import graph_call_ms
from policies.fast.triton_attention import TritonSplitKVAttention

SHAPES = {"phyai_b1": (50, 1018), "libero_b1": (10, 570)}
PHASES = ("pdl_wait", "copies", "attention", "barrier1", "merge", "barrier2", "o_projection")


def inputs(rows: int, slots: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, rows, 8, 256, generator=g, device="cuda").bfloat16()
    k = torch.randn(1, slots, 1, 256, generator=g, device="cuda").bfloat16()
    v = torch.randn(1, slots, 1, 256, generator=g, device="cuda").bfloat16()
    w = (torch.randn(1024, 2048, generator=g, device="cuda") / 2048 ** 0.5).bfloat16()
    return q, k, v, w, torch.tensor([slots - 7], dtype=torch.int32, device="cuda")


def separate_us(rows: int, slots: int) -> float:
    """The kernels the fused one replaces: split-KV attention + merge, then the skinny o projection."""
    q, k, v, w, key_len = inputs(rows, slots)
    attn = TritonSplitKVAttention(1, rows, slots, 8, 1, 256, torch.device("cuda"))
    attn.plan(key_len)
    tile = skinny.choose_tile("auto", rows, 1024, 2048, False, torch.device("cuda"))
    return 1e3 * graph_call_ms(lambda: skinny.skinny_linear(attn(q, k, v).reshape(rows, -1), w, tile), calls=20)


def phases(shape: CA.ClusterShape) -> dict:
    q, k, v, w, key_len = inputs(shape.rows, shape.slots)
    fused = CA.ClusterAttentionO(1, CA.ClusterShape(**{**shape.__dict__, "stamps": True}), torch.device("cuda"))
    fused.plan(key_len)
    for _ in range(3):
        fused(q, k, v, w)
    torch.cuda.synchronize()
    st = fused.stamps.cpu()
    deltas = {name: statistics.median((st[:, i + 1] - st[:, i]).tolist()) for i, name in enumerate(PHASES)}
    return {"cycles": deltas, "total_cycles": statistics.median((st[:, 7] - st[:, 0]).tolist()),
            "start_spread_ns": int(st[:, 8].max() - st[:, 8].min()), "span_ns": int(st[:, 9].max() - st[:, 8].min()),
            "end_spread_ns": int(st[:, 9].max() - st[:, 9].min())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", nargs="+", type=int, default=[16, 8, 4])
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_cluster_attention needs a CUDA device")
    rows_out, summary = [], {}
    for name, (rows, slots) in SHAPES.items():
        base = separate_us(rows, slots)
        summary[f"{name}_separate_us"] = base
        for splits, roll_k in itertools.product(args.splits, (False, True)):
            shape = CA.ClusterShape(rows=rows, slots=slots, splits=splits, roll_k=roll_k)
            row = {"shape": name, "splits": splits, "roll_k": roll_k, "problem": shape.problem(),
                   "separate_us": base}
            if row["problem"] is None:
                q, k, v, w, key_len = inputs(rows, slots)
                for pdl in (False, True):
                    fused = CA.ClusterAttentionO(1, shape, torch.device("cuda"), pdl=pdl)
                    fused.plan(key_len)
                    row[f"us_pdl{int(pdl)}"] = 1e3 * graph_call_ms(lambda f=fused: f(q, k, v, w), calls=20)
                row["max_active_clusters"] = fused.max_active_clusters()
                row["phases"] = phases(shape)
                summary[f"{name}_s{splits}{'_rolled' * roll_k}_us"] = row["us_pdl0"]
            print(row, flush=True)
            rows_out.append(row)
    write_result("probe_cluster_attention", {"rows": rows_out}, summary, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
