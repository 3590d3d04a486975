"""What the GRPO actor's host spends on one micro-batch's inputs, with the pixels and without them.

    python -m experiments.probe_actor_inputs [--rows 4096] [--micro-batch 128] [--repeats 20] [--device cuda]

Per micro-batch the actor selects its rows from the update's stored rows (`Samples.select`), rebuilds the policy's
observation on the device (`grpo.observations.observation_from_rows`) and the policy turns it into model inputs
(`policies.observation.model_inputs`). A LIBERO row's images (two 224 x 224 cameras, uint8: ~0.3 MB) used to be
gathered, staged in pinned memory and sent every time, even for micro-batches given their kept prefix K/V
(grpo.prefix_cache), whose forward reads no pixel; since round 62 those leave them out (`pixels=False`). This times
both ways on random rows of the pi05 preset's LIBERO shapes: the wall time of the three steps per micro-batch,
median and spread over --repeats random draws of rows (on CUDA a synchronize closes each, so the copies are in it).
One JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.results import write_result
from grpo.observations import observation_from_rows
from grpo.samples import Samples
from policies.config import PolicyConfig
from policies.observation import model_inputs

IMAGE_KEYS = ("agentview_image", "wrist_image")  # the LIBERO env's cameras (the pi05 preset's camera_map)


def libero_rows(cfg: PolicyConfig, rows: int, prompt_len: int, generator: torch.Generator) -> Samples:
    """`rows` stored rows of LIBERO's shapes with random contents."""
    size = cfg.vision.image_size
    steps = cfg.sampling.num_steps
    zeros = torch.zeros(rows, dtype=torch.int64)
    return Samples(
        images={k: torch.randint(0, 256, (rows, size, size, 3), dtype=torch.uint8, generator=generator)
                for k in IMAGE_KEYS},
        states=torch.randn(rows, 8, generator=generator),
        tokens=torch.randint(0, cfg.vocab_size, (rows, prompt_len), generator=generator),
        token_mask=torch.ones(rows, prompt_len, dtype=torch.bool),
        chains=torch.randn(rows, steps + 1, cfg.chunk_size, cfg.max_action_dim, generator=generator),
        denoise_inds=torch.randint(0, steps, (rows, 1), generator=generator),
        rollout_logprob=torch.zeros(rows), versions=zeros, trajectory=zeros, chunk=zeros,
        advantages=torch.zeros(rows), trajectory_length=zeros + 1,
    )


def one_micro_batch(cfg: PolicyConfig, samples: Samples, index: torch.Tensor, device: torch.device,
                    pixels: bool) -> float:
    """Seconds for the actor's input steps of one micro-batch (select, observation, model inputs)."""
    started = time.perf_counter()
    rows = samples.select(index, pixels=pixels)
    obs = observation_from_rows(cfg, rows.images, rows.states, rows.tokens, rows.token_mask, device, pixels=pixels)
    model_inputs(obs, cfg, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="stored rows of the update (the 8-epoch recipe's)")
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=48, help="stored prompt width (LIBERO's, trimmed)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    for key in ("rows", "micro_batch", "prompt_len", "repeats"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    if args.micro_batch > args.rows:
        raise SystemExit(f"--micro-batch ({args.micro_batch}) must not exceed --rows ({args.rows})")
    device = torch.device(args.device)
    cfg = PolicyConfig.preset("pi05")
    generator = torch.Generator().manual_seed(0)
    samples = libero_rows(cfg, args.rows, args.prompt_len, generator)
    times: dict[str, list[float]] = {"pixels": [], "no_pixels": []}
    for repeat in range(args.repeats + 1):  # the first round warms the allocators up, untimed
        index = torch.randperm(args.rows, generator=generator)[: args.micro_batch]
        for name in times:  # both ways on the same rows, in turn
            seconds = one_micro_batch(cfg, samples, index, device, pixels=name == "pixels")
            if repeat:
                times[name].append(seconds)
    results = {name: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3}
               for name, t in times.items()}
    for name, r in results.items():
        print(f"{name:10s} median {r['median_ms']:8.2f} ms  [{r['min_ms']:.2f}, {r['max_ms']:.2f}] per "
              f"{args.micro_batch}-row micro-batch")
    summary = {"device": str(device), "rows": args.rows, "micro_batch": args.micro_batch,
               "torch_threads": torch.get_num_threads(),
               **{f"{name}_median_ms": round(r["median_ms"], 3) for name, r in results.items()}}
    write_result("probe_actor_inputs", {"args": vars(args), "results": results, "times_s": times}, summary,
                 out_dir=args.out_dir, device=device)


if __name__ == "__main__":
    main()
