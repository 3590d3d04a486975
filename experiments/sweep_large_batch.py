"""Side-by-side timings of the large-batch alternatives for one layer's ops, on the real shapes.

    python -m experiments.sweep_large_batch                 # GPU: PhyAI b32 and LIBERO b64
    python -m experiments.sweep_large_batch --tiny          # CPU smoke (small shapes, wall clock)

profile_stages says where a stage's time goes; this times the candidate replacements of the ops
left after its GEMMs, each on the shapes of one layer at the throughput goals' batch sizes, one JSON:
- `vision_attention`: SigLIP's attention (72-wide heads) through SDPA as the runner calls it and SDPA
  with each backend forced (the H200 run at commit 2863fb9 also timed a Triton kernel reading the
  QKV projection in place, 72 = 64 + 16-wide dots: 0.207 ms against cuDNN's 0.150 at LIBERO b64,
  dropped);
- `residual`: the output projections (vision o / fc2, prefix o / down) as GEMM + add-norm kernel
  (today) against the residual added in the GEMM's epilogue (addmm, beta = 1) + a norm-only kernel;
- `vision_mlp`: fc1 (GELU epilogue) and fc2 with mlp_dim 4304 against zero-padded 4352 (a 128 multiple);
- `gate_up`: the prefix's gate/up GEMM with the weight as (N, K) (F.linear) and as (K, N);
- `geglu`: the prefix's gate/up GEMM + GeGLU kernel (today) against policies/fast/geglu_gemm.py's
  one-kernel GeGLU GEMM, every candidate tile;
- `prefix_attention`: the prefix's self-attention (GQA, 8 query heads on 1 KV head, key-length mask)
  through the Triton split-KV kernel, SDPA as the runner calls it, and SDPA with cuDNN forced (K/V
  expanded by a copy, as a stride-0 view, or passed as GQA), and the one-KV-head TMA kernel's blocks
  (policies/fast/triton_attention.py, TMA_ATTENTION_BLOCKS);
- `expert_attention`: the expert's attention (the chunk's queries against prefix + chunk) through the
  split-KV kernel and the TMA kernel's blocks;
- `split_k`: SigLIP's o and fc2 at small batch through cuBLAS against K split into a batched GEMM's
  fp32 partials summed by the add-norm kernel (`split_k_rows`).
`--sections` picks some; `--batches` overrides each configuration's batch size. Each row: ms per
call (CUDA-graph replay median on the GPU) and, where two ways compute the same thing, the relative
L2 distance between them.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

if not torch.cuda.is_available():  # the CPU smoke run's Triton kernels go through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.nn.functional as F  # noqa: E402

from experiments import bench_predict_common as common  # noqa: E402
from experiments.results import write_result  # noqa: E402
from policies.config import PolicyConfig  # noqa: E402
from policies.fast import kernels as K  # noqa: E402
from policies.lerobot_bridge import relative_l2  # noqa: E402

DEFAULT_BATCHES = {"phyai": 32, "libero_rl": 64}
SDPA_BACKENDS = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="pi05", help="PolicyConfig preset")
    p.add_argument("--configurations", nargs="+", default=["phyai", "libero_rl"], choices=list(common.CONFIGURATIONS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke: small shapes, wall-clock timing")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--batches", nargs="+", type=int, default=None,
                   help="batch sizes to run every configuration at (default: PhyAI 32, LIBERO 64)")
    p.add_argument("--geglu-tiles", choices=list(geglu_tile_lists()), default="candidates",
                   help="geglu section: every candidate tile; TUNED with each gelu form of its epilogue; or TUNED "
                        "alternating with its neighbours; the last two --geglu-rounds times (same card and operands)")
    p.add_argument("--geglu-rounds", type=int, default=2)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", action="store_true", help="write to benchmarks/results/")
    return p.parse_args(argv)


def time_ms(fn) -> float:
    if torch.cuda.is_available():
        from policies.fast.attention import graph_call_ms

        return graph_call_ms(fn, calls=5, replays=7)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype_name = common.run_device_and_dtype()
    dtype = getattr(torch, dtype_name)
    cfg = PolicyConfig.preset(args.policy)
    record, summary = {"args": vars(args), "runs": []}, {}
    for name, batch in [(n, b) for n in args.configurations
                        for b in ([1] if args.tiny else args.batches or [DEFAULT_BATCHES[n]])]:
        spec = common.CONFIGURATIONS[name]
        images = batch * spec["cameras"]
        tokens = batch * (spec["cameras"] * cfg.vision.num_patches + spec["prompt_len"])
        if args.tiny:
            images, tokens = 2, 64
        shapes = dict(images=images, prefix_tokens=tokens, device=device, dtype=dtype, cfg=cfg, tiny=args.tiny,
                      batch=batch, per_sample=tokens // batch, name=name,
                      geglu_tiles=args.geglu_tiles, geglu_rounds=args.geglu_rounds)
        run = {"configuration": name, "batch": batch, "images": images, "prefix_tokens": tokens}
        for section in args.sections:
            print(f"{name} b{batch} {section}", flush=True)
            run[section] = SECTIONS[section](**shapes)
        record["runs"].append(run)
        for section in args.sections:
            for row in run[section]:
                if "ms" in row:
                    summary[f"{name}_b{batch}_{section}_{row['variant']}_ms"] = row["ms"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_result("sweep_large_batch", record, summary, out_dir=args.out_dir, commit=args.commit)


def _row(section: str, variant: str, fn, reference=None) -> dict:
    row = {"variant": variant}
    try:
        out = fn()
        row["ms"] = time_ms(fn)
        if reference is not None:
            row["rel_l2_vs_first"] = relative_l2(out.float(), reference.float())
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    shown = f"{row['ms']:.3f} ms" if "ms" in row else row["error"]
    print(f"  {section:16s} {variant:32s} {shown} {row.get('rel_l2_vs_first', '')}", flush=True)
    return row


def vision_attention_rows(images, prefix_tokens, device, dtype, cfg, tiny, **_) -> list[dict]:
    v = cfg.vision
    tokens = v.num_patches if not tiny else 16
    heads, hd = v.num_heads, v.width // v.num_heads
    qkv = torch.randn(images * tokens, 3 * v.width, device=device, dtype=dtype)

    def sdpa():  # as runner._stage_vision calls it
        q, k, val = qkv.view(images, tokens, 3, heads, hd).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, val).transpose(1, 2).reshape(images * tokens, v.width)

    reference = sdpa()
    rows = [_row("vision_attn", "sdpa_auto", sdpa)]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def forced(backend):
            with sdpa_kernel(backend):
                return sdpa()

        for backend in SDPA_BACKENDS:
            call = functools.partial(forced, getattr(SDPBackend, backend))
            rows.append(_row("vision_attn", f"sdpa_{backend.lower()}", call, reference))
    return rows


def residual_rows(images, prefix_tokens, device, dtype, cfg, **_) -> list[dict]:
    """GEMM + add-norm (today) against addmm into the residual + norm only, per projection."""
    v, p = cfg.vision, cfg.prefix
    cases = [("vision_o", images * v.num_patches, v.width, v.width, True),
             ("vision_fc2", images * v.num_patches, v.mlp_dim, v.width, True),
             ("prefix_o", prefix_tokens, p.num_heads * p.head_dim, p.width, False),
             ("prefix_down", prefix_tokens, p.mlp_dim, p.width, False)]
    rows = []
    for label, m, k, n, layer_norm in cases:
        rows += _residual_case(label, min(m, 256) if device.type == "cpu" else m, k, n, layer_norm, device, dtype)
    return rows


def _residual_case(label, m, k, n, layer_norm, device, dtype) -> list[dict]:
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
    h0 = torch.randn(m, n, device=device, dtype=dtype)
    h = h0.clone()
    ones, zeros = torch.ones(n, device=device, dtype=dtype), torch.zeros(n, device=device, dtype=dtype)

    def norm(hh, y):
        if layer_norm:
            return K.add_layer_norm(hh, y, ones, zeros, 1e-6)
        return K.add_rms_norm(hh, y, None, zeros, None, 1e-6)

    def today():
        h.copy_(h0)  # the same copy in every variant; copy_only times it alone
        return norm(h, F.linear(x, w))[1]

    def epilogue():
        h.copy_(h0)
        h.addmm_(x, w.t())
        return norm(h, None)[1]

    reference = today()
    return [_row("residual", f"{label}_linear_add_norm", today),
            _row("residual", f"{label}_addmm_norm", epilogue, reference),
            _row("residual", f"{label}_copy_only", lambda: h.copy_(h0))]


def vision_mlp_rows(images, prefix_tokens, device, dtype, cfg, **_) -> list[dict]:
    v = cfg.vision
    m = images * v.num_patches if device.type == "cuda" else 64
    padded = -(-v.mlp_dim // 128) * 128
    x = torch.randn(m, v.width, device=device, dtype=dtype)
    w1 = torch.randn(padded, v.width, device=device, dtype=dtype) * v.width ** -0.5
    b1 = torch.randn(padded, device=device, dtype=dtype) * 0.1
    w1[v.mlp_dim:], b1[v.mlp_dim:] = 0, 0
    w2 = torch.randn(v.width, padded, device=device, dtype=dtype) * v.mlp_dim ** -0.5
    w2[:, v.mlp_dim:] = 0
    b2 = torch.zeros(v.width, device=device, dtype=dtype)
    w1s, b1s, w2s = w1[: v.mlp_dim].contiguous(), b1[: v.mlp_dim].contiguous(), w2[:, : v.mlp_dim].contiguous()
    act = K.linear_gelu_tanh(x, w1s, b1s)
    act_padded = K.linear_gelu_tanh(x, w1, b1)
    return [
        _row("vision_mlp", f"fc1_{v.mlp_dim}", lambda: K.linear_gelu_tanh(x, w1s, b1s)),
        _row("vision_mlp", f"fc1_{padded}", lambda: K.linear_gelu_tanh(x, w1, b1)[:, : v.mlp_dim], act),
        _row("vision_mlp", f"fc2_{v.mlp_dim}", lambda: F.linear(act, w2s, b2)),
        _row("vision_mlp", f"fc2_{padded}", lambda: F.linear(act_padded, w2, b2), F.linear(act, w2s, b2)),
    ]


def gate_up_rows(images, prefix_tokens, device, dtype, cfg, **_) -> list[dict]:
    p = cfg.prefix
    m = prefix_tokens if device.type == "cuda" else 64
    x = torch.randn(m, p.width, device=device, dtype=dtype)
    w = torch.randn(2 * p.mlp_dim, p.width, device=device, dtype=dtype) * p.width ** -0.5
    w_kn = w.t().contiguous()
    reference = F.linear(x, w)
    rows = [_row("gate_up", "linear_nk", lambda: F.linear(x, w)),
            _row("gate_up", "mm_kn", lambda: torch.mm(x, w_kn), reference)]
    return rows


def geglu_tile_lists() -> dict:
    """--geglu-tiles' choices: the tile list each one times."""
    from policies.fast import geglu_gemm

    return {"candidates": geglu_gemm.candidates, "epilogue": geglu_gemm.epilogue_candidates,
            "neighbours": geglu_gemm.neighbour_candidates}


def geglu_rows(images, prefix_tokens, device, dtype, cfg, tiny, expert_rows=None, geglu_tiles="candidates",
               geglu_rounds=2, **_) -> list[dict]:
    """cuBLAS gate/up + the GeGLU kernel (the runner's bf16 prefix MLP input) against the fused kernel;
    with `expert_rows` the expert's gate/up at that many rows (batch x chunk). geglu_tiles "epilogue":
    TUNED with each gelu form, "neighbours": TUNED alternating with its neighbours, geglu_rounds times."""
    from policies.fast import geglu_gemm

    p = cfg.prefix if expert_rows is None else cfg.expert
    m = prefix_tokens if expert_rows is None else expert_rows
    m, k, f = (m, p.width, p.mlp_dim) if not tiny else (64, 64, 64)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(2 * f, k, device=device, dtype=dtype) * k ** -0.5
    out = torch.empty(m, f, device=device, dtype=dtype)
    reference = K.gelu_tanh_mul(F.linear(x, w))
    rows = [_row("geglu", "cublas_then_kernel", lambda: K.gelu_tanh_mul(F.linear(x, w)))]
    if tiny:
        tiles = [geglu_gemm.GegluTile(16, 16, 32, warps=4, stages=2, wide=wide) for wide in (False, True)]
    elif expert_rows is not None:  # few row blocks: smaller tiles for more programs
        tiles = [geglu_gemm.TUNED, geglu_gemm.GegluTile(128, 128, 64, stages=3, warps=8)]
        tiles += [geglu_gemm.GegluTile(bm, bn, 64, stages=4, warps=4) for bm, bn in ((128, 64), (64, 128), (64, 64))]
    else:
        tiles = geglu_tile_lists()[geglu_tiles]() * (1 if geglu_tiles == "candidates" else geglu_rounds)
    for tile in tiles:
        if tile.fits(m, 2 * f, k) is None:
            run = functools.partial(geglu_gemm.geglu_linear, x, w, tile, out)
            rows.append(_row("geglu", geglu_gemm.tile_label(tile), run, reference))
    return rows


# (BLOCK_M, BLOCK_N, warps, stages) of the one-KV-head TMA kernel timed beside the split-KV one; 128 x 64
# with 3 stages or 128 x 128 would need more than the H200's 227 KB of shared memory. Also timed on the
# H200 and removed: a lazy running-max rescale (the acc rescale only when some row's max grew by > 2^8,
# a block-wide branch; the run at 37bd7cd, which stopped before its JSON: 0.692 / 0.535 ms against
# 0.530 / 0.425 without, PhyAI b32 / LIBERO b64) and Triton's warp specialisation of the K/V loop
# (tl.range(warp_specialize=True), ..._233827.json: the same times, 0.525 / 0.429).
TMA_ATTENTION_BLOCKS = [(128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2), (64, 64, 4, 2)]


def prefix_attention_rows(images, prefix_tokens, device, dtype, cfg, tiny, batch, per_sample, **_) -> list[dict]:
    """The prefix's attention on one layer's shapes: every sample's tokens all valid (the bench's inputs)."""
    t = per_sample if not tiny else 32
    return _attention_rows("prefix_attn", batch if not tiny else 1, t, t, t + 50, device, dtype, cfg.prefix,
                           with_cudnn=True)


def expert_attention_rows(device, dtype, cfg, tiny, batch, per_sample, name, **_) -> list[dict]:
    """The expert's attention: the chunk's queries against the prefix and the chunk (one denoise step)."""
    chunk = common.CONFIGURATIONS[name]["chunk_size"] if not tiny else 10
    keys = (per_sample if not tiny else 32) + chunk
    return _attention_rows("expert_attn", batch if not tiny else 1, chunk, keys, keys, device, dtype, cfg.expert)


def _attention_rows(section, b, t, key_rows, rows_per_slot, device, dtype, p, with_cudnn=False) -> list[dict]:
    """One layer's attention, b samples of t queries against key_rows keys (slots of rows_per_slot,
    attention.py's layout): the runner's Triton split-KV kernel, the TMA kernel's blocks, SDPA."""
    from policies.fast.attention import SdpaAttention

    heads, kv, hd = p.num_heads, p.num_kv_heads, p.head_dim
    q = torch.randn(b, t, heads, hd, device=device, dtype=dtype)
    k_cache = torch.randn(b, rows_per_slot, kv, hd, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    key_len = torch.full((b,), key_rows, dtype=torch.int32)
    sdpa = SdpaAttention(b, rows_per_slot, device)
    sdpa.plan(key_len)
    reference = sdpa(q, k_cache, v_cache)
    rows = [_row(section, "sdpa_auto", lambda: sdpa(q, k_cache, v_cache))]
    if device.type != "cuda":
        return rows
    from policies.fast.triton_attention import TritonSplitKVAttention

    split_kv = TritonSplitKVAttention(b, t, rows_per_slot, heads, kv, hd, device, tma=False)
    split_kv.plan(key_len)
    rows.append(_row(section, "triton", lambda: split_kv(q, k_cache, v_cache), reference))
    if kv == 1:
        for bm, bn, warps, stages in TMA_ATTENTION_BLOCKS:
            label = f"tma_{bm}x{bn}_w{warps}_s{stages}"
            try:
                attn = TritonSplitKVAttention(b, t, rows_per_slot, heads, kv, hd, device, block_m=bm, block_n=bn,
                                              warps=warps, stages=stages, tma=True)
            except ValueError as exc:  # e.g. a shape whose blocks would need a KV split
                rows.append({"variant": label, "error": str(exc)})
                continue
            attn.plan(key_len)
            rows.append(_row(section, label, functools.partial(attn, q, k_cache, v_cache), reference))
    if with_cudnn:
        rows += _cudnn_attention_rows(section, b, t, rows_per_slot, q, k_cache, v_cache, key_len, reference, device,
                                      sdpa)
    return rows


def _cudnn_attention_rows(section, b, t, rows_per_slot, q, k_cache, v_cache, key_len, reference, device, sdpa):
    """SDPA with a backend forced: K/V expanded by a copy (`sdpa`, the planned SdpaAttention the rows'
    reference came from), as a stride-0 view, or passed as GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from policies.fast.attention import SdpaAttention

    heads, hd = q.shape[2], q.shape[3]
    gqa = SdpaAttention(b, rows_per_slot, device, native_gqa=True)
    gqa.plan(key_len)
    mask = (torch.arange(rows_per_slot, device=device)[None, :] < t)[:, None, None, :].expand(b, 1, 1, -1)

    def view_expanded():  # K/V heads broadcast as a stride-0 view, no copy
        k = k_cache.transpose(1, 2).expand(b, heads, rows_per_slot, hd)
        v = v_cache.transpose(1, 2).expand(b, heads, rows_per_slot, hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, heads * hd)

    rows = []
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        for label, fn in (("copy", lambda: sdpa(q, k_cache, v_cache)), ("gqa", lambda: gqa(q, k_cache, v_cache)),
                          ("view", view_expanded)):
            def forced(fn=fn, backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return fn()
            rows.append(_row(section, f"sdpa_{backend.lower()}_{label}", forced, reference))
    return rows


def split_k_rows(images, device, dtype, cfg, **_) -> list[dict]:
    """SigLIP's residual projections (o, fc2) at small batch, where cuBLAS fills the SMs with small tiles
    (PhyAI b1: 768 rows, 112 x 64 tiles, 13.6 us a call on average): F.linear + the add-norm kernel
    (today) against K split S ways as one strided batched GEMM into fp32 partials that the add-norm
    kernel sums (its `y_splits` path, as the skinny projections use). The bias is left out of the split
    variants (it would go into the norm kernel); the rel L2 compares h after the step."""
    v = cfg.vision
    m = images * v.num_patches if device.type == "cuda" else 64
    rows = []
    for label, k in (("vision_o", v.width), ("vision_fc2", v.mlp_dim)):
        rows += _split_k_case(label, m, k, v.width, device, dtype)
    return rows


def _split_k_case(label, m, k, n, device, dtype) -> list[dict]:
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
    zeros, ones = torch.zeros(n, device=device, dtype=dtype), torch.ones(n, device=device, dtype=dtype)
    h0 = torch.randn(m, n, device=device, dtype=dtype)
    h = h0.clone()

    def today():
        h.copy_(h0)
        return K.add_layer_norm(h, F.linear(x, w, zeros), ones, zeros, 1e-6)[0]

    def split(s, fp32):
        xs = x.view(m, s, k // s).transpose(0, 1)  # (S, M, K/S), row stride K: no copy
        ws = w.view(n, s, k // s).permute(1, 2, 0)  # (S, K/S, N), column-major slices of W
        if not fp32:
            parts = torch.bmm(xs, ws)
        elif xs.is_cuda:
            parts = torch.bmm(xs, ws, out_dtype=torch.float32)
        else:  # CPU (--tiny) has no bmm with out_dtype: the same products, summed in fp32
            parts = torch.bmm(xs.float(), ws.float())
        h.copy_(h0)
        return K._add_norm_triton(h, parts, None, ones, zeros, 1e-6, layer_norm=True, y_splits=s)[0]

    reference = today().clone()
    rows = [_row("split_k", f"{label}_linear_add_norm", today),
            _row("split_k", f"{label}_copy_only", lambda: h.copy_(h0))]
    for s in (2, 3, 4, 6):
        if k % s == 0:
            for fp32 in (True, False):
                name = f"{label}_bmm{s}_{'fp32' if fp32 else 'bf16'}_add_norm"
                rows.append(_row("split_k", name, functools.partial(split, s, fp32), reference))
    return rows


def expert_geglu_rows(batch, cfg, **shapes) -> list[dict]:
    chunk = common.CONFIGURATIONS[shapes.pop("name")]["chunk_size"]
    return geglu_rows(cfg=cfg, expert_rows=batch * chunk, **shapes)


SECTIONS = {"vision_attention": vision_attention_rows, "residual": residual_rows, "vision_mlp": vision_mlp_rows,
            "gate_up": gate_up_rows, "geglu": geglu_rows, "expert_geglu": expert_geglu_rows,
            "prefix_attention": prefix_attention_rows, "expert_attention": expert_attention_rows,
            "split_k": split_k_rows}


if __name__ == "__main__":
    main()
