"""Measure the compute and bandwidth ceilings of a device for the stage roofline (torch, lazily).

Compute: a square matmul (2 n^3 FLOP). Bandwidth: a device-to-device copy (2 x bytes moved: read
and write). Both report the best of `repeats` timed runs after warm-up: a ceiling is what the
device can reach, not its typical speed. On CUDA the timing uses CUDA events.
"""

from __future__ import annotations

import time

from profiler.roofline import Ceilings


def measure_ceilings(device: str = "cpu", dtype: str = "float32", matmul_n: int = 1024,
                     copy_mb: int = 64, repeats: int = 5) -> Ceilings:
    import torch

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    a = torch.randn(matmul_n, matmul_n, device=dev, dtype=dt)
    b = torch.randn(matmul_n, matmul_n, device=dev, dtype=dt)
    matmul_s = _best_time(lambda: torch.mm(a, b), dev, repeats)
    elements = copy_mb * 2**20 // a.element_size()
    src = torch.empty(elements, device=dev, dtype=dt).uniform_()
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), dev, repeats)
    return Ceilings(
        peak_flops=2.0 * matmul_n**3 / matmul_s,
        peak_bytes_per_s=2.0 * src.numel() * src.element_size() / copy_s,
        source=f"measured on {device} ({dtype}: {matmul_n}^3 matmul, {copy_mb} MB copy)",
    )


def _best_time(fn, device, repeats: int) -> float:
    import torch

    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best
