"""One line on the GPU's state before timings are trusted: the SM clock, whether a thermal or power slowdown is
active, and a bf16 8192^3 matmul's TFLOPS (an H100 / H200 gives ~600-750; a throttled card far less).

    python scripts/gpu_clock_check.py            # prints one JSON line
"""

from __future__ import annotations

import json
import subprocess
import time

import torch


def matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def smi_state(fields: str) -> dict[str, str]:
    """nvidia-smi's values of `fields` (comma-separated query names), or why there are none."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia_smi": str(error)}
    if out.returncode != 0:
        return {"nvidia_smi": (out.stdout + out.stderr).strip().splitlines()[0]}
    return dict(zip(fields.split(","), (v.strip() for v in out.stdout.split(",")), strict=False))


def main() -> None:
    fields = "clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_event_reasons.sw_thermal_slowdown"
    state = smi_state(fields)
    print("GPU_CLOCK " + json.dumps({"bf16_tflops": round(matmul_tflops(), 1), **state}), flush=True)


if __name__ == "__main__":
    main()
