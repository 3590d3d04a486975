"""The first denoise step under the prefix: one graph for the prefix and the denoise loop, its first
step on a second stream (`policy.fast.overlap`).

Why: at small batch the prefix's GEMMs fill the GPU's tensor cores while the denoise loop is a chain
of small latency-bound kernels (docs/predict.md, "The denoise loop at small batch"). The expert's layer i in
step 0 needs only the prefix's K/V of layer i, which the prefix writes at the start of its layer i,
not the whole prefix. So step 0 runs on a high-priority side stream of the same graph: it forks at
the start of the prefix, each of its layers waits on an event recorded right after the prefix's
RoPE scatter of that layer, and the main stream joins it after the prefix; steps 1.. follow there.

What each expert layer of step 0 waits for, and why that suffices:
- the expert attends to the prefix slots [0, n_valid) of layer i's cache, written by that scatter;
- its own K/V go to the suffix slots n_valid + [0, chunk), which overlap the prefix's pad slots
  [n_valid, prefix) when a prompt is shorter than its bucket; the prefix's scatter writes those pad
  slots too, so the expert's scatter of layer i must come after it (the event orders both);
- the prefix's attention of layer i reads slots [0, prefix) while the expert may be writing the
  pad slots among them, but it masks keys past n_valid (finite values either way).
Numerics do not change: the same kernels on the same inputs (GPU test: bit-identical chains).

Step 0 launches without PDL and runs its MLP split (`FastSampler.step0_pdl = False`, the default), so no
early-launched grid waits on an SM that a prefix GEMM could use; `step0_pdl = True` keeps the denoise
graph's PDL and MLP plan. H200, whole calls, overlap off / on with step-0 PDL / on without
(profile_overlap_nvidia-h200_20261202-151522 and -151626, 3 rounds of 5 calls round-robin, medians, ms):
PhyAI b1 14.470 / 14.569 / 14.360, b2 23.863 / 23.870 / 23.415, b32 254.37 / 255.44 / 254.96; LIBERO b1
8.524 / 8.540 / 8.299, b2 12.240 / 12.207 / 12.118, b4 20.614 / 20.284 / 20.344, b16 72.45 / 73.13 / 72.67,
b64 269.56 / 269.63 / 270.19; bit-identical chains in every case. Hence "auto" up to 128 denoise rows.
Later runs put PhyAI b1 between -0.3% and +0.8% (H200, five runs) and at +1.4% (H100, round 16) against
off, while LIBERO b1-b4 and PhyAI b2 kept gaining: so since round 16 "auto" times both ways at a bucket's first
call and keeps the faster (`pick`).
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from policies.fast import tuning
from policies.fast.attention import event_ms
from policies.fast.config import OVERLAP_CHOICES

# "auto" considers the overlap up to this many denoise rows (batch x chunk) and keeps it where it times faster
# (`pick`): LIBERO b1-b4 and PhyAI b2 gained 1-4% a call in most runs, PhyAI b1 measured -0.3% to
# +1.4% in six runs since round 14; at 160 rows and more (LIBERO b16, b64, PhyAI b32) it was 0.2-0.4% slower
# (docstring).
AUTO_MAX_ROWS = 128
TIMING_ROUNDS, TIMING_REPLAYS = 5, 3  # pick: round-robin rounds, replays of each way per round


def choose(mode: str, rows: int, graphs: bool) -> bool | None:
    """Whether a bucket of `rows` denoise rows (batch x chunk) runs prefix and denoise as one overlapped
    graph: never without CUDA graphs (the side stream is a graph branch), "on" / "off" as said; "auto"
    off above AUTO_MAX_ROWS and None up to it: `pick` times both ways at the bucket's first call."""
    if mode not in OVERLAP_CHOICES:
        raise ValueError(f"policy.fast.overlap must be one of {OVERLAP_CHOICES}, got {mode!r}")
    if not graphs or mode == "off":
        return False
    if mode == "on":
        return True
    return None if rows <= AUTO_MAX_ROWS else False


def pick(sampler, bucket, timer=None, rounds: int = TIMING_ROUNDS, replays: int = TIMING_REPLAYS) -> bool:
    """"auto" at a bucket's first call, once vision and the inputs are in place: capture the prefix and
    denoise graphs and the overlapped one, replay the two ways round-robin (`rounds` rounds of `replays`
    replays each, `timer(fn)` -> ms, CUDA events by default), keep the faster by median and drop the
    other way's graphs. Both compute the same bits (module docstring), so the choice changes only time.
    The medians go to `bucket.overlap_ms` (bench_predict records them)."""
    ways = {False: ("prefix", "denoise"), True: ("prefix_denoise",)}
    timer = timer or (lambda fn: event_ms(fn, sampler.device))
    times = {way: [] for way in ways}
    for stages in ways.values():  # capture (and one replay) before any timing
        for stage in stages:
            sampler.run_stage(bucket, stage)
    for _ in range(rounds):
        for way, stages in ways.items():
            replay = lambda st=stages: [sampler.run_stage(bucket, s) for _ in range(replays) for s in st]  # noqa: E731
            times[way].append(timer(replay))
    medians = {way: statistics.median(ts) / replays for way, ts in times.items()}
    chosen = medians[True] < medians[False]
    for stage in ways[not chosen]:
        del bucket.graphs[stage]
    bucket.overlap_ms = {"off": medians[False], "on": medians[True]}
    return chosen


def pick_or_kept(sampler, bucket, kept_by: tuning.TuningCache, context: str) -> bool:
    """"auto": the way an earlier process timed faster for this bucket (`kept_by`, keyed by tuning.bucket_key with
    the sampler's `context` digest), else `pick`'s, which is then kept. `bucket.tuned["overlap"]` says which."""
    key = tuning.bucket_key(context, bucket)
    kept = kept_by.get("overlap", key)
    if kept is not None:
        bucket.overlap_ms, bucket.tuned["overlap"] = kept["overlap_ms"], "kept"
        return kept["on"]
    chosen = pick(sampler, bucket)
    kept_by.put("overlap", key, {"on": chosen, "overlap_ms": bucket.overlap_ms})
    bucket.tuned["overlap"] = "measured"
    return chosen


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of the highest priority: step 0's kernels take SMs as soon as prefix blocks retire."""
    return torch.cuda.Stream(device=device, priority=-100)  # clamped to the device's highest priority


@contextlib.contextmanager
def attention_pdl(attention, code: int):
    """Run `attention` with PDL mode `code` inside the block (backends without PDL are left alone)."""
    if not hasattr(attention, "pdl"):
        yield
        return
    before, attention.pdl = attention.pdl, code
    try:
        yield
    finally:
        attention.pdl = before


def stage_prefix_denoise(sampler, bk) -> None:
    """The prefix and the whole denoise loop, step 0 on a side stream (the module docstring). Off CUDA
    (the CPU tests) the same steps run one after another on the one stream. Prefix and expert have
    the same depth (PolicyConfig checks it), so layer i pairs with layer i."""
    cuda = sampler.device.type == "cuda"
    main = torch.cuda.current_stream(sampler.device) if cuda else None
    side = sampler.side_stream() if cuda else None
    if cuda:
        side.wait_stream(main)  # fork: the call's inputs (vision's image tokens, the noise) are in place
    kv_ready = [torch.cuda.Event() for _ in sampler.w.expert] if cuda else None
    sampler._stage_prefix(bk, kv_ready)
    pdl_code = sampler._pdl_for(bk) if sampler.step0_pdl else 0
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext(), attention_pdl(bk.expert_attn, pdl_code):
        cos, sin = sampler._denoise_start(bk)
        sampler._denoise_step(bk, 0, cos, sin, kv_ready, pdl_code, fuse_mlp=sampler.step0_pdl)
    if cuda:
        for table in (cos, sin):  # allocated on the side stream, read by steps 1.. on the main one
            table.record_stream(main)
        main.wait_stream(side)  # join
    for k in range(1, sampler.num_steps):
        sampler._denoise_step(bk, k, cos, sin)
