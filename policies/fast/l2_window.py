"""The prefix's K/V kept in L2 across the denoise steps (`policy.fast.l2_kv`): an access-policy window over
a bucket's K/V caches on every kernel of its graphs.

Why: at small batch each denoise step streams the expert's 623 MB of weights through the 50 MB L2, so the
prefix's K/V (~1 MB a layer at PhyAI batch 1, read once per step by that layer's attention) are gone from L2
by the next step and come from HBM again, queued behind the weight stream the PDL prefetches keep in flight.
The split-KV attention and its merge are ~9.6 us of each ~35 us layer-step (docs/predict.md, round 22: one
block streams K/V at ~35 GB/s). With the window, the caches' lines are marked persisting and stay in the L2
set-aside (`reserve`), which normal and streaming accesses (the weights) cannot evict.

How: CUDA attaches an access-policy window to a kernel launch, or to a kernel node of a graph. The graphs are
captured with `keep_graph=True`, every kernel node then gets the window (`apply`: cuGraphKernelNodeSetAttribute
through the driver API, ctypes), and the graph is instantiated after. The window covers one allocation, so the
bucket's K and V caches are views of one tensor (runner._bucket). The numerics do not change: only where lines
live in L2 (GPU test: bit-identical chains with the window on and off).

The set-aside is context-wide and persisting lines stay persisting after the graph ends, so a trainer sharing
the GPU gets that much less L2 until `reset_persisting()`; "auto" uses the window only for buckets whose K/V fit
the set-aside (`choose`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools

import torch

from policies.fast.config import L2_KV_CHOICES

# CUDA driver API values (cuda.h)
_ATTR_L2_CACHE_SIZE, _ATTR_MAX_PERSISTING_L2, _ATTR_MAX_WINDOW = 38, 108, 109
_LIMIT_PERSISTING_L2 = 0x06
_NODE_KERNEL = 0
_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
ACCESS_NORMAL, ACCESS_STREAMING, ACCESS_PERSISTING = 0, 1, 2


class AccessPolicyWindow(ctypes.Structure):
    """CUaccessPolicyWindow."""
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class KernelNodeAttrValue(ctypes.Union):
    """CUkernelNodeAttrValue (= CUlaunchAttributeValue): a 64-byte union."""
    _fields_ = [("pad", ctypes.c_char * 64), ("window", AccessPolicyWindow)]


@dataclasses.dataclass(frozen=True)
class Window:
    """An access-policy window: [base, base + num_bytes) persisting with probability `hit_ratio` per line, the
    other lines streaming."""
    base: int
    num_bytes: int
    hit_ratio: float

    def value(self) -> KernelNodeAttrValue:
        value = KernelNodeAttrValue()
        value.window = AccessPolicyWindow(self.base, self.num_bytes, self.hit_ratio, ACCESS_PERSISTING,
                                          ACCESS_STREAMING)
        return value


@dataclasses.dataclass(frozen=True)
class L2Limits:
    """The device's L2 size, the most of it a context may set aside for persisting lines, and the largest
    window, bytes (0, 0, 0 where the driver offers no persisting L2: before sm_80, MIG)."""
    l2_bytes: int
    max_persisting: int
    max_window: int


@functools.cache
def _driver() -> ctypes.CDLL:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    lib = ctypes.CDLL(name)
    lib.cuGraphKernelNodeSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(KernelNodeAttrValue)]
    lib.cuGraphKernelNodeGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(KernelNodeAttrValue)]
    lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    lib.cuGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    lib.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result} (policy.fast.l2_kv)")


def limits(device: torch.device) -> L2Limits:
    """What the device offers (CUDA only)."""
    torch.cuda.init()
    device = torch.device(device)
    lib, ordinal = _driver(), torch.cuda.current_device() if device.index is None else device.index
    values = []
    for attr in (_ATTR_L2_CACHE_SIZE, _ATTR_MAX_PERSISTING_L2, _ATTR_MAX_WINDOW):
        out = ctypes.c_int()
        _check(lib.cuDeviceGetAttribute(ctypes.byref(out), attr, ordinal), f"cuDeviceGetAttribute({attr})")
        values.append(out.value)
    return L2Limits(*values)


def choose(mode: str, kv_bytes: int, device: torch.device, graphs: bool) -> bool:
    """Whether a bucket whose K/V caches take `kv_bytes` gets the window: never without CUDA graphs (it is set on
    graph nodes) or where the device has no persisting L2; "on" wherever the window may be that large; "auto"
    where the K/V also fit the set-aside, so that every line of them can persist."""
    if mode not in L2_KV_CHOICES:
        raise ValueError(f"policy.fast.l2_kv must be one of {L2_KV_CHOICES}, got {mode!r}")
    if mode == "off" or not graphs or torch.device(device).type != "cuda":
        return False
    limit = limits(device)
    if limit.max_persisting <= 0 or kv_bytes > limit.max_window:
        return False
    return mode == "on" or kv_bytes <= limit.max_persisting


def reserve(device: torch.device, num_bytes: int) -> int:
    """Raise the context's L2 set-aside for persisting lines to `num_bytes` (capped at the device's maximum;
    never lowered here: another bucket may use it). Returns the set-aside now in place."""
    lib, cap = _driver(), limits(device).max_persisting
    with torch.cuda.device(device):
        current = ctypes.c_size_t()
        _check(lib.cuCtxGetLimit(ctypes.byref(current), _LIMIT_PERSISTING_L2), "cuCtxGetLimit")
        want = min(num_bytes, cap)
        if want > current.value:
            _check(lib.cuCtxSetLimit(_LIMIT_PERSISTING_L2, want), "cuCtxSetLimit")
            _check(lib.cuCtxGetLimit(ctypes.byref(current), _LIMIT_PERSISTING_L2), "cuCtxGetLimit")
        return current.value


def window_for(tensor: torch.Tensor, set_aside: int) -> Window:
    """The window over `tensor`'s bytes; where they exceed the set-aside only that share of lines persists (the
    rest would only evict each other)."""
    num_bytes = tensor.numel() * tensor.element_size()
    return Window(tensor.data_ptr(), num_bytes, min(1.0, set_aside / num_bytes) if num_bytes else 0.0)


def for_caches(mode: str, caches: torch.Tensor, graphs: bool) -> Window | None:
    """The window a bucket's graphs get over its K/V caches (one tensor), with the set-aside raised to hold them;
    None where `choose` says no."""
    num_bytes = caches.numel() * caches.element_size()
    if not choose(mode, num_bytes, caches.device, graphs):
        return None
    return window_for(caches, reserve(caches.device, num_bytes))


def _kernel_nodes(raw_graph: int) -> list[int]:
    lib = _driver()
    count = ctypes.c_size_t()
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    kernels = []
    for node in nodes[: count.value]:
        kind = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _NODE_KERNEL:
            kernels.append(node)
    return kernels


def new_graph(window: Window | None) -> torch.cuda.CUDAGraph:
    """A graph to capture into: kept after capture (not instantiated) where a window will be set on it."""
    return torch.cuda.CUDAGraph(keep_graph=True) if window is not None else torch.cuda.CUDAGraph()


def instantiate(graph: torch.cuda.CUDAGraph, window: Window | None) -> None:
    """After capture into `new_graph(window)`: with a window, set it on the kernel nodes and instantiate."""
    if window is not None:
        apply(graph, window)
        graph.instantiate()


def apply(graph: torch.cuda.CUDAGraph, window: Window) -> int:
    """Set `window` on every kernel node of a graph captured with keep_graph=True and not instantiated yet;
    returns how many. The caller instantiates it after."""
    lib, value = _driver(), window.value()
    nodes = _kernel_nodes(graph.raw_cuda_graph())
    for node in nodes:
        _check(lib.cuGraphKernelNodeSetAttribute(ctypes.c_void_p(node), _KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                                 ctypes.byref(value)), "cuGraphKernelNodeSetAttribute")
    return len(nodes)


def node_windows(graph: torch.cuda.CUDAGraph) -> list[Window]:
    """The window each kernel node of a kept graph carries (num_bytes 0: none); for tests."""
    lib, out = _driver(), []
    for node in _kernel_nodes(graph.raw_cuda_graph()):
        value = KernelNodeAttrValue()
        _check(lib.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), _KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                                 ctypes.byref(value)), "cuGraphKernelNodeGetAttribute")
        w = value.window
        out.append(Window(w.base_ptr or 0, w.num_bytes, w.hit_ratio))
    return out


def reset_persisting() -> None:
    """Turn every persisting L2 line of the context back to normal (cuCtxResetPersistingL2Cache)."""
    _check(_driver().cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def release(device: torch.device) -> None:
    """After the device's queued work: every persisting line back to normal and the set-aside back to 0, where
    the device has persisting L2 (a no-op elsewhere). On the H200 a set-aside shrinks the L2 that normal accesses
    get even with no persisting line in it (profile_denoise_nvidia-h200_20261204-091148: the PhyAI batch-2 denoise
    stage without the window took 10.18 ms under a 37.5 MB set-aside, against ~8.0-8.4 in earlier runs without
    one), so a trainer sharing the GPU, or a profile's next variant, should run after this. A bucket built
    earlier keeps its window; `reserve` before its next call gives its set-aside back."""
    if torch.device(device).type == "cuda" and limits(device).max_persisting > 0:
        torch.cuda.synchronize(device)
        reset_persisting()
        with torch.cuda.device(device):
            _check(_driver().cuCtxSetLimit(_LIMIT_PERSISTING_L2, 0), "cuCtxSetLimit")


def set_aside_for(device: torch.device, window: Window | None) -> None:
    """Only `window`'s set-aside in place (none for None): `release`, then `reserve` what the window needs. The
    profiles call it before timing each variant, so that each runs with its own set-aside only."""
    release(device)
    if window is not None:
        reserve(device, window.num_bytes)
