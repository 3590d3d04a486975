"""Round 19's question: how fast can ONE persistent CUDA kernel run the action expert's GEMM chain
at batch 1, with each CTA's weight tiles bulk-copied into shared memory a phase or two before their
inputs exist? (experiments/megakernel/layer_chain.cu: qkv, an attention stand-in, o, residual +
AdaRMS, gate_up + GeGLU, down, residual + AdaRMS; 18 layers a launch, one launch per denoise step.)

    python -m experiments.probe_megakernel            # GPU only; writes probe_megakernel_*.json

It checks the kernel against a plain PyTorch reference on fresh random weights (2 and 18 layers),
then times CUDA-graph replays of 10 launches (a 10-step denoise loop's layers) at 50 and 10 rows,
with the weight prefetch on and off, and reads per-phase clocks of one run (wait vs work per CTA).
The attention is not in the kernel: compare its us per layer-step with the per-kernel loop's
layer minus RoPE, attention and merge (profile_denoise --graph-timeline, by role).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from experiments import cuda_source
from experiments.megakernel import layout as L
from experiments.results import write_result

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# layer_chain's profiling modes (results garbage): phases that do not wait, or only the waits
PROFILING_FLAGS = {"": 0, "nowaits": 2, "synconly": 4}
# timed variants: (weights prefetched, profiling mode)
VARIANTS = ((True, ""), (False, ""), (True, "nowaits"), (True, "synconly"))


class Kernel:
    """layer_chain compiled at run time: NVRTC through torch.cuda._compile_kernel (torch >= 2.8),
    else CuPy's RawModule; launched on torch's current stream (so CUDA graphs capture it)."""

    def __init__(self):
        source, smem = cuda_source.with_common(L.SOURCE), L.ChainShape().smem_bytes()
        self.smem = smem
        compile_ = getattr(torch.cuda, "_compile_kernel", None)
        if compile_ is not None:
            self.backend = "torch_nvrtc"
            self.fn = compile_(source, "layer_chain", nvcc_options=["-std=c++17"])
            if hasattr(self.fn, "set_shared_memory_config"):
                self.fn.set_shared_memory_config(smem)
            else:
                from torch.cuda._utils import _get_gpu_runtime_library
                err = _get_gpu_runtime_library().cuFuncSetAttribute(
                    self.fn.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                if err:
                    raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared memory {smem}) failed: {err}")
        else:
            import cupy
            self.backend = "cupy"
            self.fn = cupy.RawModule(code=source, options=("-std=c++17",)).get_function("layer_chain")
            self.fn.max_dynamic_shared_size_bytes = smem

    def __call__(self, grid: int, args: list) -> None:
        if self.backend == "torch_nvrtc":
            self.fn(grid=(grid, 1, 1), block=(L.THREADS, 1, 1), args=args, shared_mem=self.smem)
            return
        import cupy
        import numpy as np
        conv = [a.data_ptr() if isinstance(a, torch.Tensor) else np.int32(a) for a in args]
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.fn((grid,), (L.THREADS,), tuple(conv), shared_mem=self.smem)


def random_model(layers: int, shape: L.ChainShape, seed: int) -> tuple[list[dict], torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def w(n, k):
        return (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(torch.bfloat16)

    weights = [{"qkv": w(shape.qkv, shape.width), "o": w(shape.width, shape.q_width),
                "gate_up": w(2 * shape.mlp, shape.width), "down": w(shape.width, shape.mlp)} for _ in range(layers)]
    mod = torch.randn(layers, 2, 3, shape.width, generator=gen, device="cuda") * 0.1
    return weights, mod


def pack_model(weights: list[dict], shape: L.ChainShape) -> dict[str, torch.Tensor]:
    phases = {p.name: p for p in shape.phases()}
    return {name: torch.cat([L.pack_weight(w[name], phases[name]) for w in weights]) for name in phases}


class Chain:
    """Device buffers of one kernel configuration (packed weights of every layer, activations)."""

    def __init__(self, kernel: Kernel, packed: dict, mod, rows: int, shape: L.ChainShape, prefetch: bool,
                 profiling: str = ""):
        dev = "cuda"
        phases = {p.name: p for p in shape.phases()}
        self.kernel, self.rows, self.layers = kernel, rows, mod.shape[0]
        self.flags = int(prefetch) | PROFILING_FLAGS[profiling]
        self.packed = packed
        self.mod = mod.float().contiguous().to(dev)
        act = lambda k: torch.zeros(k // L.CHUNK, L.ROWS, L.CHUNK, dtype=torch.bfloat16, device=dev)  # noqa: E731
        self.xa, self.att, self.xm, self.g = act(shape.width), act(shape.q_width), act(shape.width), act(shape.mlp)
        part = lambda s, n: torch.zeros(s, L.ROWS, n, dtype=torch.float32, device=dev)  # noqa: E731
        self.pq, self.po, self.pd = (part(phases[name].splits, phases[name].n) for name in ("qkv", "o", "down"))
        self.h = torch.zeros(L.ROWS, shape.width, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(self.layers, len(L.PHASES), dtype=torch.int32, device=dev)
        self.grid = torch.cuda.get_device_properties(0).multi_processor_count
        if self.grid < shape.tiles():
            raise RuntimeError(f"the probe needs >= {shape.tiles()} SMs (one tile per CTA), this GPU has {self.grid}")
        self.clocks = torch.zeros(self.grid, self.layers, len(L.PHASES), 3, dtype=torch.int64, device=dev)

    def set_inputs(self, xa: torch.Tensor, h: torch.Tensor) -> None:
        self.xa.copy_(L.pack_activation(xa.to(torch.bfloat16)).to(self.xa.device))
        self.h.zero_()
        self.h[: self.rows].copy_(h)

    def launch(self, clocks: bool = False) -> None:
        self.counters.zero_()
        w = self.packed
        self.kernel(self.grid, [w["qkv"], w["o"], w["gate_up"], w["down"], self.mod, self.xa, self.att, self.xm,
                                self.g, self.pq, self.po, self.pd, self.h, self.counters, self.clocks, int(clocks),
                                self.rows, self.layers, self.flags])

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return L.unpack_activation(self.xa.cpu(), self.rows), self.h[: self.rows].cpu()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check(kernel: Kernel, layers: int, rows_list: list[int], seed: int) -> list[dict]:
    shape = L.ChainShape()
    weights, mod = random_model(layers, shape, seed)
    packed = pack_model(weights, shape)
    out = []
    for rows in rows_list:
        h0 = torch.randn(rows, shape.width, generator=torch.Generator(device="cuda").manual_seed(seed + rows),
                         device="cuda")
        xa0 = L.ada_rms(h0, mod[0, 1]).to(torch.bfloat16)
        ref_xa, ref_h = L.reference_chain(xa0, h0, weights, mod, shape.q_width)
        for prefetch in (True, False):
            chain = Chain(kernel, packed, mod, rows, shape, prefetch)
            chain.set_inputs(xa0, h0)
            chain.launch()
            torch.cuda.synchronize()
            xa, h = chain.outputs()
            out.append({"layers": layers, "rows": rows, "prefetch": prefetch,
                        "xa_rel_l2": rel_l2(xa, ref_xa.cpu()), "h_rel_l2": rel_l2(h, ref_h.cpu()),
                        "finite": bool(torch.isfinite(h).all()),
                        "counters_ok": bool((chain.counters == chain.grid).all())})
            print("check", out[-1], flush=True)
    return out


def time_chain(chain: Chain, steps: int, replays: int, rounds: int) -> list[float]:
    """us per layer-step of CUDA-graph replays of `steps` launches (one denoise loop)."""
    for _ in range(2):
        chain.launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            chain.launch()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (replays * steps * chain.layers))
    return out


def phase_clocks(chain: Chain) -> dict:
    """Per phase, over layers 1.. and the CTAs that own a GEMM tile: mean cycles waiting for the
    phase's inputs and working (clock64 of each SM; differences within one CTA only)."""
    chain.launch(clocks=True)
    torch.cuda.synchronize()
    c = chain.clocks[:L.ChainShape().tiles(), 1:].double()
    wait = (c[..., 1] - c[..., 0]).mean(dim=(0, 1))
    work = (c[..., 2] - c[..., 1]).mean(dim=(0, 1))
    layer = (c[:, 1:, 0, 0] - c[:, :-1, 0, 0]).mean()
    return {"phases": list(L.PHASES), "wait_cycles": wait.tolist(), "work_cycles": work.tolist(),
            "layer_cycles": float(layer)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", nargs="+", type=int, default=[50, 10])
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    kernel = Kernel()
    checks = check(kernel, 2, args.rows, seed=2) + check(kernel, args.layers, args.rows, seed=18)
    shape = L.ChainShape()
    weights, mod = random_model(args.layers, shape, seed=0)
    packed = pack_model(weights, shape)
    del weights
    timings, summary = [], {"backend": kernel.backend}
    for rows in args.rows:
        h0 = torch.randn(rows, shape.width, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
        for prefetch, profiling in VARIANTS:
            chain = Chain(kernel, packed, mod, rows, shape, prefetch, profiling)
            chain.set_inputs(L.ada_rms(h0, mod[0, 1]).to(torch.bfloat16), h0)
            us = time_chain(chain, args.steps, args.replays, args.rounds)
            name = ("prefetch" if prefetch else "noprefetch") + (f"_{profiling}" if profiling else "")
            row = {"variant": name, "rows": rows, "prefetch": prefetch, "profiling": profiling, "us_per_layer_step": us,
                   "median_us": statistics.median(us), "clocks": phase_clocks(chain)}
            timings.append(row)
            print("time", row, flush=True)
            summary[f"r{rows}_{name}_us"] = row["median_us"]
            del chain
            torch.cuda.empty_cache()
    summary["max_check_rel_l2_2_layers"] = max(max(c["xa_rel_l2"], c["h_rel_l2"]) for c in checks if c["layers"] == 2)
    summary["checks_ok"] = all(c["finite"] and c["counters_ok"] for c in checks)
    write_result("probe_megakernel", {"args": vars(args), "checks": checks, "timings": timings}, summary,
                 out_dir=args.out_dir)


if __name__ == "__main__":
    main()
