"""The rollout/trainer log-prob gap: engine rollout vs the trainer's recompute of the same transitions.

    python -m experiments.logprob_gap                                   # CPU smoke: tiny policy
    python -m experiments.logprob_gap --policy pi05 --batch 64 --calls 4 --commit   # the H200 measurement

The engine (rollout.engine.PolicyEngine: the policy's fast path when enabled, i.e. on CUDA by
default: graphed bf16) predicts `calls` batches of `batch` random LIBERO-like observations in
train mode (flow-SDE, one random stochastic step per call, RLinf). The trainer (grpo.actor:
fp32 master weights, synced into the engine through update_weights as in training) recomputes
the chunk log-prob of every stored transition, once under bf16 autocast (the trainer's GPU
default) and once in fp32. Per recompute: mean and max |trainer - rollout| in nats per chunk
and the fraction of ratios exp(trainer - rollout) outside [1 - clip, 1 + clip] before any
update ("clipped at lr 0"). With the engine's fast path on (`--consistent`, the default then),
the fast path is pinned to one batch bucket (= --batch), one prompt bucket (--prompt-bucket) and
a batch-invariant attention backend (sdpa), and a third recompute runs in the consistent mode
(policy.fast.consistent_recompute: the rollout's kernels at the rollout's shapes, see
policies/fast/recompute.py). Summary keys gap_mean_nats / gap_max_nats / clip_frac_lr0 are the
consistent recompute's when it ran (the mode the trainer should use), else the bf16 one's;
every recompute is in `recompute`, the bf16 one also as `bf16_gap_mean_nats` etc. `--precision fp8`: the
engine's fast path runs its FP8 GEMMs (policy.fast.precision=fp8), and so does the consistent recompute, which
re-quantises each weight from the trainer's masters rounded to bf16; the plain recomputes stay bf16 / fp32.
JSON `grpo_logprob_gap_*` via experiments.results.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from common.devices import auto_device
from experiments.results import write_result
from grpo.actor import Actor, gap_metrics
from grpo.config import GRPOConfig
from grpo.distributed import full_parameters
from grpo.samples import Samples
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy
from policies.fast.config import FAST_OFF, PRECISIONS
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine

PROMPTS = [
    "put both the alphabet soup and the tomato sauce in the basket",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "turn on the stove and put the moka pot on it",
    "pick up the book and place it in the back compartment of the caddy",
]


def policy_config(args: argparse.Namespace, cuda: bool) -> PolicyConfig:
    """The LIBERO RL configuration (2 cameras, chunk 10, 4 steps, noise 0.5) of the chosen preset."""
    overrides = {"chunk_size": args.chunk, "sampling": {"num_steps": args.steps, "noise_level": 0.5,
                                                        "train_mode": "sde"}}
    if args.policy != "tiny":
        overrides["cameras"] = ["base_0_rgb", "left_wrist_0_rgb"]
        overrides["dtype"] = "bfloat16" if cuda else "float32"
    fast = {"on": True, "off": False, "auto": cuda}[args.fast]
    overrides["fast"] = {"enabled": fast}
    if args.precision != "bf16":
        if not fast:
            raise SystemExit(f"--precision {args.precision} needs the engine's fast path (--fast on, or auto on CUDA)")
        overrides["fast"]["precision"] = args.precision
    if fast and args.consistent != "off":
        # pinned shapes + a batch-invariant backend: what the consistent recompute needs
        overrides["fast"].update(attention="sdpa", batch_buckets=[args.batch], prompt_buckets=[args.prompt_bucket],
                                 consistent_recompute=True)
    return PolicyConfig.preset(args.policy, **overrides)


def raw_observations(cfg: PolicyConfig, n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    size = cfg.vision.image_size
    return {
        "agentview_image": rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
        "wrist_image": rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
        "state": rng.uniform(-1, 1, (n, cfg.state_dim)).astype(np.float32),
        "prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)],
    }


def rollout_rows(engine: PolicyEngine, cfg: PolicyConfig, batch: int, calls: int, seed: int,
                 keep_prefix: bool = False) -> Samples:
    """`calls` train-mode predicts of `batch` random rows as the collector stores them; with `keep_prefix`, each
    row's prefix K/V stays in the engine's store (PolicyEngine.keep_prefixes), its id in Samples.prefix_row."""
    parts = []
    for call in range(calls):
        raw = raw_observations(cfg, batch, seed + call)
        out = engine.predict(raw, mode="train", keep_prefix=keep_prefix)
        parts.append(Samples(
            images={k: torch.from_numpy(raw[k]) for k in ("agentview_image", "wrist_image")},
            states=torch.from_numpy(raw["state"]), tokens=out.tokens.long(), token_mask=out.token_mask.bool(),
            chains=out.chains, denoise_inds=out.denoise_inds, rollout_logprob=out.chunk_logprob.float(),
            versions=torch.full((batch,), out.version), trajectory=torch.arange(batch) + call * batch,
            chunk=torch.zeros(batch, dtype=torch.int64), advantages=torch.zeros(batch),
            trajectory_length=torch.ones(batch, dtype=torch.int64), prefix_row=out.prefix_rows,
        ))
    return Samples.concat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="tiny", choices=["tiny", "pi05_small", "pi05"])
    parser.add_argument("--batch", type=int, default=8, help="rows per predict call (the issue's run: 64)")
    parser.add_argument("--calls", type=int, default=2, help="predict calls (each its own SDE step index)")
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4, help="denoise steps K")
    parser.add_argument("--fast", default="auto", choices=["auto", "on", "off"],
                        help="engine fast path (auto: on CUDA)")
    parser.add_argument("--consistent", default="auto", choices=["auto", "off"],
                        help="auto: with the fast path, also measure the consistent recompute")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS),
                        help="the fast path's policy.fast.precision, the engine's and the consistent recompute's")
    parser.add_argument("--prompt-bucket", type=int, default=128, help="the pinned prompt bucket (tokens)")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--commit", action="store_true", help="write the JSON to benchmarks/results/")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = auto_device(args.device)  # "auto": cuda where torch sees a GPU, else cpu
    cuda = device.type == "cuda"
    cfg = policy_config(args, cuda)
    trainer_policy = build_policy(trainer_policy_config(cfg), device)
    engine = PolicyEngine(EngineConfig(devices=str(device), seed=args.seed), cfg)
    try:
        start = time.perf_counter()
        # the real path: the trainer's fp32 weights pushed into the engine (cast to its dtype)
        engine.update_weights(full_parameters(trainer_policy.model, full=True), version=1)
        rows = rollout_rows(engine, cfg, args.batch, args.calls, args.seed)
        rollout_s = time.perf_counter() - start
    finally:
        engine.close()
    results, timings = {}, {}
    plain_policy = build_policy(cfg.replace(dtype="float32", fast=FAST_OFF),
                                device) if cfg.fast.consistent_recompute else trainer_policy
    plain_policy.model.load_state_dict(trainer_policy.model.state_dict())
    variants = [("bf16", "bf16", plain_policy), ("fp32", "none", plain_policy)]
    if cfg.fast.consistent_recompute:
        variants.append(("consistent", "bf16", trainer_policy))
    for name, autocast, policy in variants:
        actor = Actor(policy, GRPOConfig(autocast=autocast, micro_batch=args.micro_batch), show_progress=False)
        start = time.perf_counter()
        trainer_lp = actor.recompute(rows)
        timings[name] = time.perf_counter() - start
        m = gap_metrics(trainer_lp, rows.rollout_logprob, args.clip, args.clip)
        results[name] = {"gap_mean_nats": m["rollout/logprob_gap"], "gap_max_nats": m["rollout/logprob_gap_max"],
                         "clip_frac_lr0": m["rollout/logprob_gap_clip_frac"],
                         "rollout_chunk_logprob_mean": float(rows.rollout_logprob.mean())}
        print(f"{name} recompute: mean gap {results[name]['gap_mean_nats']:.4f} nats, max "
              f"{results[name]['gap_max_nats']:.4f}, clipped at lr 0 {results[name]['clip_frac_lr0']:.2%}")
    headline = results.get("consistent", results["bf16"])
    bf16 = {f"bf16_{k}": v for k, v in results["bf16"].items() if k != "rollout_chunk_logprob_mean"}
    summary = {**headline, **bf16, "headline_recompute": "consistent" if "consistent" in results else "bf16",
               "policy": args.policy, "rows": len(rows), "engine_fast_path": cfg.fast.enabled,
               "engine_dtype": cfg.dtype, "recompute": results}
    payload = {"config": {**vars(args), "policy_cfg": cfg.to_dict()},
               "denoise_indices": sorted({int(i) for i in rows.denoise_inds[:, 0]}),
               # one call each, the first: the engine's graph captures and compiles and each recompute's first
               # micro-batches are inside (wall seconds of this run, not a speed: the bench scripts time those)
               "cold_timings_s": {"rollout": rollout_s, **{f"recompute_{k}": v for k, v in timings.items()}}}
    write_result("grpo_logprob_gap", payload, summary, out_dir=args.out, commit=args.commit, device=device)


if __name__ == "__main__":
    main()
