"""Every cuBLASLt algorithm for the policy's cuBLAS GEMMs, timed beside torch's own call (a probe).

    python -m experiments.probe_cublaslt                       # GPU: PhyAI b1/b32, LIBERO b1/b64
    python -m experiments.probe_cublaslt --batches 1 2 --configurations phyai

torch runs each GEMM with the first algorithm cuBLASLt's heuristic ranks. This asks the heuristic for
all it offers (policies/fast/cublaslt.py) on each shape the fast path hands to cuBLAS (SigLIP's qkv,
o, fc1 with its GELU epilogue, fc2 and projector; the prefix's qkv, o and down with the residual
added in the epilogue, and gate/up below the fused GeGLU kernel's rows) and times every one the way
the runner runs it: back to back inside a CUDA graph, the weight cycled over enough copies that it
comes from HBM, not L2, as in the model. One JSON: per shape torch's time (before and after the
algorithms, for drift), each algorithm's time, configuration and distance from torch's output.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from experiments import bench_predict_common as common
from experiments.results import write_result
from policies.config import PolicyConfig
from policies.fast import geglu_gemm
from policies.fast import kernels as K
from policies.fast.attention import cycled_graph_ms
from policies.fast.cublaslt import GemmShape, LtGemm
from policies.lerobot_bridge import relative_l2

DEFAULT_BATCHES = {"phyai": [1, 32], "libero_rl": [1, 64]}
COLD_BYTES = 160 << 20  # weight copies cycled per graph: more than the H200's 50 MB L2, three times over


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="pi05", help="PolicyConfig preset")
    p.add_argument("--configurations", nargs="+", default=list(DEFAULT_BATCHES), choices=list(common.CONFIGURATIONS))
    p.add_argument("--batches", nargs="+", type=int, default=None, help="override every configuration's batches")
    p.add_argument("--max-algorithms", type=int, default=64)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", action="store_true", help="write to benchmarks/results/")
    return p.parse_args(argv)


def gemm_cases(cfg: PolicyConfig, cameras: int, prompt_len: int, batch: int) -> dict[str, GemmShape]:
    """The fast path's cuBLAS GEMMs at one batch, by name (runner.py's stages)."""
    v, p = cfg.vision, cfg.prefix
    images = batch * cameras * v.num_patches
    tokens = batch * (cameras * v.num_patches + prompt_len)
    qkv_cols = (p.num_heads + 2 * p.num_kv_heads) * p.head_dim
    cases = {
        "vision_qkv": GemmShape(images, 3 * v.width, v.width, "bias"),
        "vision_o": GemmShape(images, v.width, v.width, "bias"),
        "vision_fc1": GemmShape(images, v.mlp_dim, v.width, "gelu_bias"),
        "vision_fc2": GemmShape(images, v.width, v.mlp_dim, "bias"),
        "vision_proj": GemmShape(images, p.width, v.width, "bias"),
        "prefix_qkv": GemmShape(tokens, qkv_cols, p.width),
        "prefix_o": GemmShape(tokens, p.width, p.num_heads * p.head_dim, accumulate=True),
        "prefix_down": GemmShape(tokens, p.width, p.mlp_dim, accumulate=True),
    }
    if tokens < geglu_gemm.AUTO_MIN_ROWS:  # below it the prefix's gate/up runs on cuBLAS
        cases["prefix_gate_up"] = GemmShape(tokens, 2 * p.mlp_dim, p.width)
    return cases


def torch_call(shape: GemmShape, x, w, b, out):
    """The GEMM as runner.py calls it."""
    if shape.accumulate:
        return out.addmm_(x, w.t())
    if shape.epilogue == "gelu_bias":
        return K.linear_gelu_tanh(x, w, b)
    return F.linear(x, w, b)


def probe_case(name: str, shape: GemmShape, max_algorithms: int, replays: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weight_bytes = shape.cols * shape.depth * 2
    copies = max(2, min(16, math.ceil(COLD_BYTES / weight_bytes)))
    x = torch.randn(shape.rows, shape.depth, device=dev, dtype=dt, generator=g)
    ws = [torch.randn(shape.cols, shape.depth, device=dev, dtype=dt, generator=g) / math.sqrt(shape.depth)
          for _ in range(copies)]
    b = torch.randn(shape.cols, device=dev, dtype=dt, generator=g) if shape.epilogue != "none" else None
    base = torch.randn(shape.rows, shape.cols, device=dev, dtype=dt, generator=g)
    out = base.clone()
    reference = torch_call(shape, x, ws[0], b, out).clone()

    def torch_fn(i):
        torch_call(shape, x, ws[i], b, out)

    row = {"name": name, "rows": shape.rows, "cols": shape.cols, "depth": shape.depth, "epilogue": shape.epilogue,
           "accumulate": shape.accumulate, "gflop": shape.flops / 1e9, "weight_copies": copies}
    row["torch_ms_before"] = cycled_graph_ms(torch_fn, copies, replays)
    plan = LtGemm(shape, dt, max_algorithms)
    algos = []
    for index in range(len(plan.results)):
        entry = plan.describe(index)
        try:
            out.copy_(base)
            entry["rel_l2_vs_torch"] = relative_l2(plan(x, ws[0], b, out, index).float(), reference.float())
            entry["ms"] = cycled_graph_ms(lambda i, index=index: plan(x, ws[i], b, out, index), copies, replays)
            entry["tflops"] = shape.flops / entry["ms"] / 1e9
        except RuntimeError as exc:
            entry["error"] = str(exc)[:200]
        algos.append(entry)
    row["torch_ms_after"] = cycled_graph_ms(torch_fn, copies, replays)
    plan.close()
    timed = [a for a in algos if "ms" in a]
    row["algorithms"] = algos
    row["torch_ms"] = min(row["torch_ms_before"], row["torch_ms_after"])
    row["torch_tflops"] = shape.flops / row["torch_ms"] / 1e9
    if timed:
        best = min(timed, key=lambda a: a["ms"])
        row["heuristic_first_ms"] = algos[0].get("ms")
        row["best_ms"], row["best_index"] = best["ms"], best["index"]
        row["best_vs_torch"] = best["ms"] / row["torch_ms"]
    print(f"  {name:16s} {shape.rows:6d}x{shape.cols:5d}x{shape.depth:5d} torch {row['torch_ms_before']:.4f}/"
          f"{row['torch_ms_after']:.4f} ms, first {row.get('heuristic_first_ms') or float('nan'):.4f}, best "
          f"{row.get('best_ms', float('nan')):.4f} (#{row.get('best_index')}, of {len(timed)}/{len(algos)}), "
          f"{row.get('best_vs_torch', float('nan')):.3f}x", flush=True)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_cublaslt: needs a CUDA GPU (cuBLASLt)")
    cfg = PolicyConfig.preset(args.policy)
    record, summary = {"args": vars(args), "runs": []}, {}
    for conf in args.configurations:
        spec = common.CONFIGURATIONS[conf]
        for batch in args.batches or DEFAULT_BATCHES[conf]:
            print(f"{conf} b{batch}", flush=True)
            cases = gemm_cases(cfg, spec["cameras"], spec["prompt_len"], batch)
            rows = [probe_case(name, shape, args.max_algorithms, args.replays) for name, shape in cases.items()]
            record["runs"].append({"configuration": conf, "batch": batch, "cases": rows})
            torch_total = sum(r["torch_ms"] for r in rows)
            best_total = sum(r.get("best_ms", r["torch_ms"]) for r in rows)
            summary[f"{conf}_b{batch}_torch_ms"] = torch_total
            summary[f"{conf}_b{batch}_best_ms"] = best_total
            print(f"  sum of one call of each: torch {torch_total:.4f} ms, best {best_total:.4f} ms", flush=True)
            torch.cuda.empty_cache()
    write_result("probe_cublaslt", record, summary, out_dir=args.out_dir, commit=args.commit)


if __name__ == "__main__":
    main()
