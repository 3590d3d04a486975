"""The current CUDA device follows the tensors' device.

Code that makes streams, captures CUDA graphs or launches Triton kernels acts on the *current* device, not on
its tensors' one. A process that drives a model on cuda:1 while cuda:0 is current (the world-model server's
stage ring, a policy placed on another GPU in the trainer's process) must make its device current first: the
first two-GPU run of the stage ring failed its graph capture on cuda:1 (round 31).

`visible_cuda_index` is the one rule for a configured GPU against the machine's (the trainer's placement,
the engine's ranks, the world-model server's rings): checked before anything is built, the refusal naming
the config key and its value."""

from __future__ import annotations

import contextlib
import functools
import re

import torch

from common.config import CUDA_DEVICE_PATTERN

_CUDA = re.compile(CUDA_DEVICE_PATTERN)  # torch.device's own spelling (common.config)


def visible_cuda_index(key: str, name: str | torch.device, cuda_count: int) -> int | None:
    """The GPU index the device `name` (config key `key`'s value) names, checked against the `cuda_count` GPUs
    this process sees (torch.cuda.device_count(), 0 without CUDA); None for a device of another type (cpu,
    meta, ...), which needs no GPU. "cuda" without an index is GPU 0: before anything is placed the current
    device is GPU 0, and "cuda" is visible exactly when some GPU is.

    A GPU the machine lacks is a ValueError naming `key` and `name`: "{key} is 'cuda:2', but only 2 GPU(s) are
    visible (cuda:0..cuda:1)", or "..., but no GPU is visible (torch.cuda.device_count() == 0)". A name that is
    no device is a ValueError naming both too (callers that accept fewer kinds refuse the others first, in
    their words)."""
    text = str(name)
    match = _CUDA.fullmatch(text)
    if match is None:
        try:
            torch.device(text)
        except RuntimeError as error:
            raise ValueError(f"{key} must be a device name (cpu, cuda, cuda:<index>, ...), got {text!r}") from error
        return None
    index = int(match.group(1) or 0)
    if index < cuda_count:
        return index
    if cuda_count == 0:
        raise ValueError(f"{key} is {text!r}, but no GPU is visible (torch.cuda.device_count() == 0)")
    raise ValueError(f"{key} is {text!r}, but only {cuda_count} GPU(s) are visible (cuda:0..cuda:{cuda_count - 1})")


def auto_device(name: str | torch.device) -> torch.device:
    """A script's or config's device setting as a device: "auto" is the GPU where torch sees one, else the CPU;
    any other name is taken as it is ("cuda" without an index: the current GPU, as torch reads it)."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`. A host tensor goes to a GPU through pinned memory without blocking: torch's blocking
    copy (a plain `.to(device)`) synchronises the stream, so the host waits for every kernel queued before it.
    Such copies of row indices and small inputs made the consistent GRPO actor's host wait for the GPU ~75 times
    per 128-row pass (round 53's host profile, `experiments.profile_actor --host-profile`). The pinned staging
    buffer comes from torch's caching host allocator, which keeps it until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def device_context(device: torch.device | str):
    """Make `device` current (kernels, streams, graph capture) for a CUDA device; nothing otherwise."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def graph_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool=None):
    """torch.cuda.graph on `stream`, restricting only this thread's CUDA calls while it captures.

    torch's default capture mode ("global") also makes a potentially unsafe CUDA call from *another* thread fail
    and invalidates the capture: the GRPO prefix store registers its host spill (`cudaHostRegister`,
    common/host_memory.py) on a thread of its own while the in-process engine captures its first graphs, and the
    8-epoch spill run died with cudaErrorStreamCaptureInvalidated in its first predict (round 59). "thread_local"
    keeps the check for the capturing thread's own calls, whose stream is what the graph records; work another
    thread queues on its own streams is not recorded either way (tests/common/register_during_capture.py)."""
    return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")


def on_own_device(method):
    """Run a method with its object's `device` current (device_context)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with device_context(self.device):
            return method(self, *args, **kwargs)
    return wrapper
