"""Page-locked host memory that does not stall the GPU work of other threads while it is made.

`torch.empty(..., pin_memory=True)` is one `cudaHostAlloc`: the driver maps, zeroes and locks every page while
it holds locks that the process's kernel launches and copies also take, so a large pinned buffer (the GRPO
prefix store's host spill: ~29 GiB, ~13 s on an H100's host) holds up every other CUDA call for as long as it
takes (and in other processes on the node too). `pinned_empty` makes the same memory in two phases:
1. ordinary pageable memory, every page touched (faulted in and zeroed by the kernel, no CUDA lock held) by a
   few threads of its own (a rollout driver runs torch with one intra-op thread);
2. `cudaHostRegister` of that memory, which only has to lock pages already there, called through ctypes on the
   runtime torch loaded so the calling thread lets go of the GIL (torch's binding keeps it).

A tensor's memory is registered whole (one call: a copy of a range that spans two registrations need not be
DMA-able as one), so callers that want short lock holds make several tensors (the prefix store's is one per layer).
The registration is undone (`cudaHostUnregister`) when the last tensor viewing the memory is gone, before the
memory is freed. Without CUDA it is plain memory (touched), so CPU runs and tests take the same path.

`mapped_on_device(host, device)` is a CUDA tensor over the same page-locked bytes (the device pointer CUDA maps
them at): kernels on it read the host memory across PCIe, with no copy on the host first.

`python -m experiments.probe_host_pinning` measures both ways and how long a thread's CUDA calls wait meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

PAGE = 4096
TOUCH_THREADS = 4  # page faults are CPU work: a few threads beside the env workers, not every core


def cuda_can_pin() -> bool:
    return torch.cuda.is_available()


@functools.cache
def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded, through ctypes (whose calls let go of the GIL: torch's own
    `cudart().cudaHostRegister` binding keeps it, so a thread registering gigabytes would stop every other Python
    thread meanwhile). None where it cannot be found (then torch's binding is used)."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostRegister.restype = ctypes.c_int
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaHostUnregister.restype = ctypes.c_int
            lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
            lib.cudaHostGetDevicePointer.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _register(ptr: int, nbytes: int) -> None:
    lib = _loaded_cudart()
    error = lib.cudaHostRegister(ptr, nbytes, 0) if lib else int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed: CUDA error {error}")


def _unregister(ptr: int) -> None:
    lib = _loaded_cudart()
    if lib:
        lib.cudaHostUnregister(ptr)
    else:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def pageable(nbytes: int) -> tuple[np.ndarray, torch.Tensor]:
    """(owner, flat uint8 tensor of `nbytes`, page-aligned), not yet touched. `owner` is the numpy array whose
    death frees the memory (the tensor and its views keep it alive)."""
    owner = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-owner.ctypes.data) % PAGE
    return owner, torch.from_numpy(owner[start:start + nbytes])


def pageable_touched(nbytes: int) -> tuple[np.ndarray, torch.Tensor]:
    """`pageable(nbytes)` with every page written once."""
    owner, flat = pageable(nbytes)
    threads = max(1, min(TOUCH_THREADS, os.cpu_count() or 1, nbytes // (64 * 2**20)))
    bounds = [nbytes * i // threads // PAGE * PAGE for i in range(threads)] + [nbytes]
    with ThreadPoolExecutor(threads) as pool:  # zero_ lets go of the GIL: the slices fault in side by side
        list(pool.map(lambda i: flat[bounds[i]:bounds[i + 1]].zero_(), range(threads)))
    return owner, flat


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` / `dtype` (zeroed) whose memory is page-locked for the GPU where `pin`
    and CUDA is available (module docstring: touched first, then registered)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    owner, flat = pageable_touched(nbytes)
    if pin and cuda_can_pin():
        ptr = flat.data_ptr()
        _register(ptr, nbytes)
        # runs as the owner array dies, i.e. after the last tensor on its memory, and before numpy frees it
        weakref.finalize(owner, _unregister, ptr)
    del owner  # the tensor's storage holds it now
    return flat.view(dtype).view(shape)


class _CudaArray:
    """A CUDA array interface over `nbytes` bytes at device pointer `ptr`, holding `host` (the memory's owner):
    torch keeps this object, so the page-locked memory, alive as long as a tensor over it."""

    def __init__(self, host: torch.Tensor, ptr: int, nbytes: int):
        self.host = host
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def mapped_on_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A tensor on CUDA `device` viewing the same bytes as `host`, a contiguous page-locked CPU tensor (registered by
    `pinned_empty` or made by cudaHostAlloc): a kernel that reads it (index_select, a copy) reads the host memory
    across PCIe, so gathering rows out of it costs no host copy and no CPU time. Writes to either are seen by the
    other once the writer's stream has finished. The bytes must stay page-locked while it lives (it keeps `host`)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"mapped_on_device maps host memory for a CUDA device, got device {device} "
                         f"(CUDA available: {torch.cuda.is_available()})")
    if host.device.type != "cpu" or not host.is_contiguous() or not host.is_pinned():
        raise ValueError(f"mapped_on_device needs a contiguous page-locked CPU tensor, got device {host.device}, "
                         f"contiguous {host.is_contiguous()}, pinned {host.is_pinned()}")
    lib = _loaded_cudart()
    if lib is None:
        raise RuntimeError("mapped_on_device: the CUDA runtime torch loaded was not found in /proc/self/maps")
    nbytes = host.numel() * host.element_size()
    with torch.cuda.device(device):
        pointer = ctypes.c_void_p()
        error = lib.cudaHostGetDevicePointer(ctypes.byref(pointer), host.data_ptr(), 0)
    if error != 0 or not pointer.value:
        raise RuntimeError(f"cudaHostGetDevicePointer of {nbytes / 2**30:.2f} GiB of page-locked memory failed: "
                           f"CUDA error {error}")
    flat = torch.as_tensor(_CudaArray(host, pointer.value, nbytes), device=device)
    return flat.view(host.dtype).view(host.shape)
