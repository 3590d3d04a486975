"""One-call check of what the GPU machine can do for this project (run there, not in CI).

Sections (each isolated; a failure is recorded and the next runs):
  attention  torch SDPA (masked / unmasked) vs torch varlen_attn at pi0.5 shapes, correctness+time
  flashinfer import + JIT-compile time + paged prefill at the expert shape
  lerobot    build LeRobot 0.6.1 PI05Policy with random bf16 weights, time one sample_actions
  libero     (separate process) EGL render + env.step timing on a carried LIBERO task
Writes $OUT/gpu_smoke.json (or ./gpu_smoke.json) and prints a summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

RESULTS: dict = {}


def section(name):
    def wrap(fn):
        def run():
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn()
            except Exception as exc:  # record and continue: one call must tell us everything
                RESULTS[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
            RESULTS.setdefault(name, {})["section_s"] = round(time.perf_counter() - t0, 2)
            print(f"[{name}] {json.dumps(RESULTS[name])[:1500]}", flush=True)
        return run
    return wrap


def cuda_time(fn, iters=20, warmup=3):
    """Median CUDA-event time in ms (the benchmarks' own timer)."""
    import torch

    from experiments.bench_predict import timed_ms

    return round(timed_ms(fn, torch.device("cuda"), warmup, iters), 4)


@section("attention")
def attention():
    import inspect

    import torch
    import torch.nn.functional as F

    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_sig"] = str(inspect.signature(varlen_attn))
    except Exception as exc:
        varlen_attn = None
        out["varlen_error"] = repr(exc)
    dev, dt = "cuda", torch.bfloat16
    for label, B, Q, P in (("expert_b32", 32, 50, 968), ("expert_b1", 1, 50, 968), ("prefix_b32", 32, 968, 0)):
        kv = P + (Q if label.startswith("expert") else 0)
        q = torch.randn(B, 8, Q, 256, device=dev, dtype=dt)
        k = torch.randn(B, 1, kv, 256, device=dev, dtype=dt)
        v = torch.randn(B, 1, kv, 256, device=dev, dtype=dt)
        valid = torch.randint(kv - 150, kv + 1, (B,), device=dev)
        mask = torch.arange(kv, device=dev)[None, :] < valid[:, None]
        ke, ve = k.expand(B, 8, kv, 256), v.expand(B, 8, kv, 256)
        ref = F.scaled_dot_product_attention(q.float(), ke.float(), ve.float(), attn_mask=mask[:, None, None, :])
        res = {}
        masked = mask[:, None, None, :]
        res["sdpa_mask_ms"] = cuda_time(lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=masked))
        res["sdpa_nomask_gqa_ms"] = cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        if varlen_attn is not None:
            try:
                qv = q.transpose(1, 2).reshape(B * Q, 8, 256)
                kvv = k.transpose(1, 2).reshape(B * kv, 1, 256)
                vvv = v.transpose(1, 2).reshape(B * kv, 1, 256)
                cu_q = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * Q
                cu_k = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * kv
                used = valid.to(torch.int32)

                def call():
                    return varlen_attn(qv, kvv, vvv, cu_q, cu_k, Q, kv, enable_gqa=True, seqused_k=used)

                o = call().reshape(B, Q, 8, 256).transpose(1, 2)
                res["varlen_rel_err"] = float((o.float() - ref).norm() / ref.norm())
                res["varlen_seqused_ms"] = cuda_time(call)
            except Exception as exc:
                res["varlen_error"] = repr(exc)[:500]
        out[label] = res
    return out


@section("flashinfer")
def flashinfer_check():
    import torch

    t0 = time.perf_counter()
    import flashinfer

    out = {"version": flashinfer.__version__, "import_s": round(time.perf_counter() - t0, 2)}
    B, Q, P = 32, 50, 968
    page = P + Q
    dev, dt = "cuda", torch.bfloat16
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    qo_indptr = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * Q
    kv_indptr = torch.arange(0, B + 1, device=dev, dtype=torch.int32)
    kv_indices = torch.arange(0, B, device=dev, dtype=torch.int32)
    valid = torch.randint(page - 150, page + 1, (B,), device=dev, dtype=torch.int32)
    t0 = time.perf_counter()
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, valid, 8, 1, 256, page, causal=False,
                 q_data_type=dt, kv_data_type=dt)
    q = torch.randn(B * Q, 8, 256, device=dev, dtype=dt)
    kv = torch.randn(B, 2, page, 1, 256, device=dev, dtype=dt)
    o = wrapper.run(q, kv)
    torch.cuda.synchronize()
    out["first_plan_run_s"] = round(time.perf_counter() - t0, 2)
    import torch.nn.functional as F

    k = kv[:, 0].transpose(1, 2)
    v = kv[:, 1].transpose(1, 2)
    mask = torch.arange(page, device=dev)[None, :] < valid[:, None]
    ref = F.scaled_dot_product_attention(
        q.view(B, Q, 8, 256).transpose(1, 2).float(), k.expand(B, 8, page, 256).float(),
        v.expand(B, 8, page, 256).float(), attn_mask=mask[:, None, None, :])
    got = o.view(B, Q, 8, 256).transpose(1, 2).float()
    out["rel_err"] = float((got - ref).norm() / ref.norm())
    out["paged_prefill_b32_ms"] = cuda_time(lambda: wrapper.run(q, kv))
    cache = os.path.expanduser("~/.cache/flashinfer")
    out["jit_cache"] = subprocess.run(["du", "-sh", cache], capture_output=True, text=True).stdout.strip()
    return out


@section("lerobot")
def lerobot_check():
    import torch

    t0 = time.perf_counter()
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    out = {"import_s": round(time.perf_counter() - t0, 2)}
    cfg = PI05Config(dtype="bfloat16", device="cuda")
    cfg.input_features = {
        f"observation.images.cam{i}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224)) for i in range(3)
    }
    cfg.output_features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(7,))}
    t0 = time.perf_counter()
    policy = PI05Policy(cfg).to("cuda").eval()
    out["build_s"] = round(time.perf_counter() - t0, 2)
    out["params"] = sum(p.numel() for p in policy.parameters())
    out["param_bytes_gib"] = round(sum(p.numel() * p.element_size() for p in policy.parameters()) / 2**30, 2)
    B = 1
    images = [torch.rand(B, 3, 224, 224, device="cuda") * 2 - 1 for _ in range(3)]
    masks = [torch.ones(B, dtype=torch.bool, device="cuda") for _ in range(3)]
    tokens = torch.randint(0, 257152, (B, 200), device="cuda")
    tmask = torch.ones(B, 200, dtype=torch.bool, device="cuda")
    noise = torch.randn(B, 50, 32, device="cuda")
    fn = lambda: policy.model.sample_actions(images, masks, tokens, tmask, noise=noise)  # noqa: E731
    out["b1_ms"] = cuda_time(fn, iters=5, warmup=2)
    out["keys_sample"] = [k for k in list(policy.state_dict())[:5]]
    return out


def libero_check():
    code = r"""
import json, time, os, numpy as np
t0 = time.perf_counter()
from envs.rendering import configure_gl
print("backend", configure_gl("auto"))
from envs.suites import get_task, make_robosuite_env, load_init_states
task = get_task("libero_10", 2)
env = make_robosuite_env(task, image_size=224)
out = {"make_s": round(time.perf_counter() - t0, 2)}
t0 = time.perf_counter(); env.reset(); out["reset_s"] = round(time.perf_counter() - t0, 2)
env.set_init_state(load_init_states(task)[0])
t0 = time.perf_counter()
for _ in range(20): env.step(np.zeros(7))
out["step_render_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 2)
inner = env.env
t0 = time.perf_counter()
for _ in range(20): inner.sim.render(camera_name="agentview", width=224, height=224)
out["render_one_cam_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 2)
print("LIBERO", json.dumps(out))
"""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main():
    libero_proc = libero_check() if os.environ.get("SMOKE_LIBERO", "1") == "1" else None
    attention()
    flashinfer_check()
    lerobot_check()
    if libero_proc is not None:
        text, _ = libero_proc.communicate(timeout=400)
        RESULTS["libero"] = {"rc": libero_proc.returncode, "log_tail": text[-3000:]}
        print("[libero]", text[-3000:])
    path = os.path.join(os.environ.get("OUT", "."), "gpu_smoke.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
