"""Source text of the NVRTC-compiled probe kernels: `cuda_common.cuh` (typedefs, bf16 packing, the
shared-memory address, the m16n8k16 mma) in front of the kernel's own file."""

from __future__ import annotations

from pathlib import Path

COMMON = Path(__file__).with_name("cuda_common.cuh")


def with_common(kernel: Path, defines: str = "") -> str:
    """`defines` (#define lines the kernel reads), then the shared helpers, then the kernel file."""
    return defines + COMMON.read_text() + kernel.read_text()
