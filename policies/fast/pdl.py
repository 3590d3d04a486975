"""Programmatic dependent launch (PDL) for the fast path's Triton kernels (Hopper and later).

Why: the denoise loop at batch 1 is ~1300 small dependent kernels; between two of them the GPU
sits idle while the next grid launches and ramps up, and a skinny GEMM cannot start streaming its
weights before its predecessor is done, although the weights do not depend on it. With PDL a
kernel is launched while its predecessor still runs: it does the work that needs nothing from
the predecessor (the skinny GEMMs prefetch their weight slab into L2), then waits
(`griddepcontrol.wait`: the predecessor has completed and its writes are visible) before reading
activations or writing anything. Every PDL kernel waits before its first activation read and
before any write, so ordering is transitive along the chain and buffers the allocator reuses
are never written early. Numerics do not change: a PDL run is bit-identical to a plain one
(tests/policies/test_fast_pdl_gpu.py).

Modes (`policy.fast.pdl`): "off"; "on": a kernel lets its dependent launch once it has passed its
own wait (one kernel prefetches ahead); "early": right at its start (the chain of launches runs
ahead as far as the SMs hold the waiting grids). "auto" = "on" where supported.
Kernels take the mode as the constexpr PDL: 0 off, 1 on, 2 early.
"""

from __future__ import annotations

import functools

import torch

from policies.fast.config import PDL_CHOICES, triton_interpreting

CODES = {"off": 0, "on": 1, "early": 2}
# "auto" turns PDL on up to this many denoise rows (batch x chunk; the skinny GEMMs' range, skinny.AUTO_MAX_ROWS).
# H200, denoise stage in ms, PDL on against off: at batch 1 -10% in both configurations
# (profile_denoise_nvidia-h200_20261201-141251.json, round 1); at batch 2 then +4% / -10%, with round 11's
# kernels -1.4% (PhyAI, 100 rows: 8.98 against 9.11) and -3.0% (LIBERO, 20 rows: 3.03 against 3.12), faster
# in each of 5 rounds (profile_denoise_nvidia-h200_20261202-110506.json); LIBERO b4 (40 rows, with the fused
# MLP that PDL enables there) 2.515 against 3.051 and b8 (80 rows) 3.278 against 3.554, but PhyAI b4 (200
# rows, cuBLAS GEMMs) 11.385 against 11.219 and b8 (400) 15.299 against 15.399, each in 3 of 3 rounds
# (profile_denoise_nvidia-h200_20261202-124512.json). Batches in between (LIBERO b16, 160 rows) not timed.
AUTO_MAX_ROWS = 128


@functools.cache
def supported(device_index: int = 0) -> bool:
    """Compute capability >= 9.0, compiled Triton (not the interpreter) with grid-dependency control."""
    if not torch.cuda.is_available() or triton_interpreting():
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def mode_code(mode: str, device: torch.device) -> int:
    """The kernels' PDL constexpr for `policy.fast.pdl` = mode on `device` (0 where unsupported)."""
    if mode not in PDL_CHOICES:
        raise ValueError(f"policy.fast.pdl must be one of {PDL_CHOICES}, got {mode!r}")
    if device.type != "cuda" or mode == "off" or not supported(device.index or 0):
        return 0
    return CODES["on" if mode == "auto" else mode]


def launch_kwargs(code: int) -> dict:
    """Extra launch arguments of a kernel launched with mode `code`."""
    return {"launch_pdl": True} if code else {}
