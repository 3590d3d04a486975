"""profile_denoise's attention sweep (`--attention-sweep`): SDPA and every Triton block setting of the
expert's or the prefix's attention, each timed as back-to-back calls in one CUDA graph and checked
against fp32 attention; and the graph timer both of profile_denoise's sweeps use."""

from __future__ import annotations

import itertools

import torch

from experiments import bench_predict_common as common
from policies.fast.attention import graph_call_ms
from policies.fast.triton_attention import TritonSplitKVAttention
from policies.lerobot_bridge import relative_l2

REPEATS = 20  # calls per captured graph in the sweeps


def graph_time_us(fn, device, iters: int) -> float:
    """Per-call time of fn, REPEATS calls captured back to back in one CUDA graph (the attention
    selector's protocol, attention.graph_call_ms; eager on CPU)."""
    if device.type != "cuda":
        return common.timed_ms(fn, device, 1, 2) * 1e3
    return graph_call_ms(fn, calls=REPEATS, replays=iters) * 1e3


def attention_sweep(cfg, spec: dict, device, args) -> list[dict]:
    """Per stage in --attention-stages and batch size: the expert's attention (chunk queries x 8
    heads against the prefix + chunk keys of one KV head) or the prefix's (every prefix token
    against the prefix): SDPA (K/V expanded to every head, and with enable_gqa) and every Triton
    block setting, timed in graphs, checked against fp32 attention."""
    from policies.fast.attention import SdpaAttention

    e = cfg.expert
    prefix_len = spec["cameras"] * cfg.vision.num_patches + spec["prompt_len"]
    out = []
    for stage in args.attention_stages:
        queries = spec["chunk_size"] if stage == "expert" else prefix_len
        rows = prefix_len + spec["chunk_size"]
        for batch in args.batch_sizes:
            g = torch.Generator(device="cpu").manual_seed(batch)
            q = torch.randn(batch, queries, e.num_heads, e.head_dim, generator=g).to(device, torch.bfloat16)
            kc, vc = (torch.randn(batch, rows, e.num_kv_heads, e.head_dim, generator=g).to(device, torch.bfloat16)
                      for _ in range(2))
            keys = rows if stage == "expert" else prefix_len
            key_len = torch.full((batch,), keys, dtype=torch.int32)
            ref = SdpaAttention(batch, rows, device)
            ref.plan(key_len)
            want = ref(q.float(), kc.float(), vc.float())
            entry = {"stage": stage, "batch": batch, "queries": queries, "keys": keys, "candidates": []}
            for gqa in (False, True):
                sdpa = SdpaAttention(batch, rows, device, native_gqa=gqa)
                sdpa.plan(key_len)
                name = "sdpa_gqa" if gqa else "sdpa"
                entry[f"{name}_rel_l2"] = relative_l2(sdpa(q, kc, vc).float(), want)
                entry[f"{name}_us"] = graph_time_us(lambda a=sdpa: a(q, kc, vc), device, args.iters)
            for (bm, bn, target, warps, stages), tma in itertools.product(
                    _attention_settings(stage, batch), (False, True) if args.attention_tma else (None,)):
                setting = {"block_m": bm, "block_n": bn, "target_blocks": target, "warps": warps, "stages": stages,
                           "tma": tma}
                try:
                    att = TritonSplitKVAttention(batch, queries, rows, e.num_heads, e.num_kv_heads, e.head_dim,
                                                 device, target_blocks=target, block_m=bm, block_n=bn, warps=warps,
                                                 stages=stages, tma=tma)
                except ValueError:  # TMA asked where the KV is split (or several KV heads): not a candidate
                    continue
                try:
                    att.plan(key_len)
                    err = relative_l2(att(q, kc, vc).float(), want)
                    us = graph_time_us(lambda a=att: a(q, kc, vc), device, args.iters)
                    entry["candidates"].append({**setting, "tma": att.tma, "splits": att.num_splits, "us": us,
                                                "rel_l2": err})
                except Exception as exc:  # shared memory too large for a setting, ...: recorded
                    entry["candidates"].append({**setting, "error": f"{type(exc).__name__}: {exc}"[:200]})
            timed = sorted((c for c in entry["candidates"] if "us" in c), key=lambda c: c["us"])
            entry["best"] = timed[0] if timed else None
            print(f"attention {stage} {queries}q x {keys}k b={batch}: sdpa {entry['sdpa_us']:.1f} us, sdpa gqa "
                  f"{entry['sdpa_gqa_us']:.1f} us, best triton {timed[0]['us'] if timed else float('nan'):.1f} us "
                  f"{timed[0] if timed else ''}", flush=True)
            out.append(entry)
    return out


def _attention_settings(stage: str, batch: int):
    """Triton (block_m, block_n, target_blocks, warps, stages) to try: the batch-1/2 decode-like set for
    the expert at small batch; at large batch small and large row blocks with and without KV splits for
    the expert, larger row blocks with 8 warps for many query rows (prefix, large batch)."""
    if stage == "expert" and batch <= 4:
        for bm in (16, 32, 64):
            for bn in (32, 64, 128):
                for target in (132, 264, 528):
                    yield bm, bn, target, 4, 2
        # round 22: few or no KV splits (a target the row blocks fill alone): no merge kernel, each block
        # walks more keys; with one split the TMA kernel can run (--attention-tma)
        for bm in (16, 32):
            for bn in (64, 128):
                for target in (8, 33, 66):
                    yield bm, bn, target * batch, 4, 2
        for bm, bn, target in ((32, 64, 132), (64, 64, 264), (16, 64, 264)):
            yield bm, bn, target, 8, 2
            yield bm, bn, target, 4, 3
        return
    if stage == "expert":  # few packed rows per sample (LIBERO's chunk 10: 80): small row blocks, KV splits
        # (32, 128, 132, 4, 2) and (128, bn, 132, 8, 2) come below with the other stages' settings
        for bn in (64, 128):
            for bm in (16, 32):
                for target in (132, 264):
                    if (bm, bn, target) != (32, 128, 132):
                        yield bm, bn, target, 4, 2
            yield 128, bn, 264, 8, 2
    yield 64, 64, 132, 4, 2  # the default between batch 2 and 15
    yield 32, 128, 132, 4, 2  # the batch-1 default
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for stages in (2, 3):
                yield bm, bn, 132, 8, stages
    if stage == "prefix" and batch <= 2:  # round 22: the prefix's ~1 wave of row blocks split in two
        yield 64, 64, 264, 4, 2
        yield 128, 64, 264, 8, 2
        yield 64, 64, 132, 4, 3  # the PhyAI b1 default with a third K/V stage (~224 KB of shared memory)
