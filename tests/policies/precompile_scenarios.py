"""policies/fast/precompile.py end to end, each scenario in a fresh process (`python -m
tests.policies.precompile_scenarios <name> <cache dir>`) on its own empty Triton cache, so that neither the
test process's interpreter mode nor its in-memory kernel caches leak in. Prints one JSON line.

- "fake_driver" (CPU): Triton's driver replaced by one that reports an sm_90 device, so launches reach the
  compile step without a GPU (the workers and the in-process lookup compile for that target with the wheel's
  ptxas; nothing is launched).
- "recall" (CPU, the same driver): a trace's specializations kept in a tuning cache (policies/fast/tuning.py)
  and the next trace of the same key skipped where Triton's cache holds them all.
- "first_call" (GPU): a tiny FastSampler's first call, every Triton compile of the process recorded by
  Triton's compilation listener; args: compile_workers.
- "kernel_keys" (CPU): every Triton kernel of the fast path (the `@functools.cache` factories of
  policies/fast that define `@triton.jit` kernels) with its JITFunction cache key; args: "real" imports, or
  "without_torch" as a compile worker imports them (compile_worker.py).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _skinny_launcher():
    import torch

    from policies.fast import skinny

    kernel = skinny._kernel()
    x = torch.zeros(50, 1024, dtype=torch.bfloat16)
    w = torch.zeros(2048, 1024, dtype=torch.bfloat16)
    out = torch.zeros(2, 50, 2048, dtype=torch.bfloat16)
    consts = dict(K_SPLIT=512, GELU_MUL=False, BN=64, BK=128, UPCAST=False, IEEE=False, PDL=0, PREFETCH_LINES=0,
                  PRELOAD=False, num_warps=4)

    def launch(block_m: int, warmup: bool = False):
        args = (x, w, out, 50, 2048, 1024, 1024, 0)
        if warmup:
            return kernel.warmup(*args, BM=block_m, grid=(1,), **consts)
        return kernel[(32, 2, 4)](*args, BM=block_m, **consts)

    return kernel, launch


def _fake_sm90() -> None:
    """Triton's driver replaced by one that reports an sm_90 device (what JITFunction.run asks of a driver
    before it compiles)."""
    import logging

    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    logging.basicConfig(level=logging.WARNING)

    class Sm90Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Sm90Driver())


def fake_driver() -> dict:
    import triton

    from policies.fast import precompile

    _fake_sm90()
    kernel, launch = _skinny_launcher()
    out = {}
    specs = []
    with precompile.recording_launches(specs):
        returned = [launch(16), launch(16), launch(32)]
    out["recorded"] = len(specs)
    out["distinct"] = len(set(specs))
    out["launch_returned"] = [r is None for r in returned]
    out["compiled_in_process"] = len(kernel.device_caches[0][0])
    out["hook_removed"] = triton.knobs.runtime.jit_cache_hook is None
    unique = list(dict.fromkeys(specs))
    out["on_disk_before"] = [precompile.on_disk(kernel, s) for s in unique]

    few = precompile.Precompiler(2)  # fewer missing kernels than MIN_TO_SPAWN: left to their launches
    out["few_ahead"] = few.ahead(lambda: launch(16))
    out["few_spawned"] = few.stats["spawned"]

    precompile.MIN_TO_SPAWN, precompile.KEEP_ALIVE_S = 1, 2.0
    pc = precompile.Precompiler(2)
    out["ahead"] = pc.ahead(lambda: launch(16), lambda: launch(32))  # no session around: waits for both
    out["compiled"] = pc.stats["compiled"]
    out["pool_kept_alive"] = pc._pool is not None
    out["stats"] = dict(pc.stats)
    out["on_disk_after"] = [precompile.on_disk(kernel, s) for s in unique]
    hits = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    launch(16, warmup=True)
    out["in_process_cache_hits"] = hits
    pool = pc._pool
    out["ahead_again"] = pc.ahead(lambda: launch(32))

    with pc.session():  # ahead only submits; the launch waits for its kernel, then loads it from the cache
        first = pc.ahead(lambda: launch(64))
        hits.clear()
        launch(64, warmup=True)
        out["session_launch_hit"] = hits
        out["session_waited"] = pc.stats["wait_s"] > 0
        bad = precompile.KernelSpec("policies.fast.skinny", "_kernel.<locals>.no_such_kernel", unique[0].data,
                                    unique[0].target, unique[0].key)
        pc._submit(bad)  # a worker's failure logs and is not counted
        pc._wait(bad)
    out["pool_reused"] = pool is not None and pc._pool is pool and pc.stats["spawned"] == 1
    out["session"] = first
    out["compiled_after_failure"] = pc.stats["compiled"]
    out["failed"] = pc.stats["failed"]
    out["hook_restored"] = triton.knobs.runtime.jit_cache_hook is None
    timer = pc._timer
    with pc.session():
        pass
    out["session_armed_no_timer"] = pc._timer is timer  # a session starts no timer thread of its own
    deadline = time.monotonic() + precompile.KEEP_ALIVE_S + 2.0
    while time.monotonic() < deadline:  # sampling calls: sessions without compiles keep no idle pool alive
        with pc.session():
            time.sleep(0.01)
    out["pool_closed_when_idle"] = pc._pool is None and not pc._pending
    with pc.session():
        pc.ahead(lambda: launch(128))  # still compiling at close: cut off quietly
    pc.close()
    out["closed_now"] = pc._pool is None and pc.stats["failed"] == 1
    out["torch_imports"] = pc.stats["torch_imports"]  # the workers compiled without importing torch
    out["resolved"] = precompile.resolve_kernel("policies.fast.kernels",
                                                "_triton_kernels.<locals>.flow_step_kernel").fn.__name__
    try:
        precompile.resolve_kernel("policies.fast.kernels", "_triton_kernels.<locals>.no_such")
    except LookupError as exc:
        out["resolve_error"] = str(exc)
    return out


def recall() -> dict:
    """(CPU, sm_90 stand-in driver) `Precompiler.ahead(..., recall=)`: a trace's specializations kept in a
    tuning cache; a later `ahead` of the same key skips its trace where Triton's cache holds all of them."""
    import dataclasses
    from pathlib import Path

    import torch

    from policies.fast import precompile, tuning

    _fake_sm90()
    _, launch = _skinny_launcher()
    precompile.MIN_TO_SPAWN = 1
    kept = tuning.TuningCache(Path(os.environ["TRITON_CACHE_DIR"]).parent / "tuning", torch.device("cpu"))
    key, out, traced = {"bucket": [1, 48, 2], "stages": ["denoise"]}, {}, []

    def trace(*blocks):
        return lambda: [traced.append(len(traced)), *(launch(b) for b in blocks)]

    pc = precompile.Precompiler(2)
    out["first"] = pc.ahead(trace(16, 32), recall=(kept, key))  # nothing kept: traced, compiled, kept
    out["kept"] = len(tuning.TuningCache(kept.directory, torch.device("cpu")).get("kernels", key))
    out["traced_first"] = len(traced)
    out["again"] = pc.ahead(trace(16, 32), recall=(kept, key))  # all on disk: no trace
    out["traced_again"] = len(traced)
    out["recalled"] = pc.stats["recalled"]
    launched = []  # a kept specialization missing from Triton's cache: traced again, compiled, the list grows
    with precompile.recording_launches(launched):
        launch(64)
    kept.put("kernels", key, [*kept.get("kernels", key), dataclasses.asdict(launched[0])])
    out["with_missing"] = pc.ahead(trace(16, 32, 64), recall=(kept, key))
    out["traced_with_missing"] = len(traced)
    out["kept_after"] = len(kept.get("kernels", key))
    out["stats"] = dict(pc.stats)
    pc.close()
    return out


def first_call(workers: str) -> dict:
    """A bf16 sampler at test_fast_gpu's shapes (the real head_dim and head counts): its first call's
    in-process compiles, and its chains and log-probs saved next to the cache for the test to compare."""
    import torch
    import triton

    from policies.fast.config import FastConfig
    from policies.fast.runner import FastSampler
    from policies.policy import build_policy
    from tests.policies.test_fast_gpu import gpu_cfg, inputs_for

    compiles = []
    triton.knobs.compilation.listener = lambda *, src, cache_hit, **_: compiles.append((src.name, cache_hit))
    cfg = gpu_cfg("bfloat16")
    torch.manual_seed(0)
    policy = build_policy(cfg, device="cuda")
    fast = FastSampler(policy.model, FastConfig(enabled=True, dtype="bfloat16", compile_workers=int(workers)))
    before = len(compiles)
    chains, logps = fast.sample_chains(*inputs_for(cfg, 3, seed=0))
    torch.cuda.synchronize()
    during = compiles[before:]
    torch.save({"chains": chains.cpu(), "logps": logps.cpu()}, os.environ["TRITON_CACHE_DIR"] + ".pt")
    return {"precompiled_kernels": fast.bucket_report()[0]["precompiled_kernels"],
            "workers": fast.precompiler.workers,
            "in_process_misses": sorted({name for name, hit in during if not hit}),
            "in_process_hits": sum(hit for _, hit in during)}


def kernel_keys(imports: str) -> dict:
    """{"module:qualname": cache key} of every kernel, and whether torch was a stand-in while they resolved."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("compile_worker", root / "policies/fast/compile_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # by path: importing it as policies.fast.compile_worker would import torch
    if imports == "without_torch":
        worker.without_torch()
    keys = {}
    for info in pkgutil.iter_modules([str(root / "policies/fast")]):
        name = f"policies.fast.{info.name}"
        if "@triton.jit" not in (root / "policies/fast" / f"{info.name}.py").read_text():
            continue  # not a kernel module (and it may need torch for real)
        module = importlib.import_module(name)
        for value in vars(module).values():
            factory = getattr(value, "__wrapped__", None)
            if factory is None or not hasattr(value, "cache_info") or inspect.signature(factory).parameters:
                continue
            if "@triton.jit" not in inspect.getsource(factory):
                continue
            made = value()
            for kernel in made if isinstance(made, (tuple, list)) else (made,):
                keys[f"{name}:{kernel.fn.__qualname__}"] = kernel.cache_key
    return {"keys": keys, "torch_stood_in": worker.torch_is_stood_in()}


SCENARIOS = {"fake_driver": fake_driver, "recall": recall, "first_call": first_call, "kernel_keys": kernel_keys}

if __name__ == "__main__":
    name, cache_dir, *rest = sys.argv[1:]
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    print("SCENARIO " + json.dumps(SCENARIOS[name](*rest)), flush=True)
