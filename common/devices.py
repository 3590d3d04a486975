"""The current CUDA device follows the tensors' device.

Code that makes streams, captures CUDA graphs or launches Triton kernels acts on the *current* device, not on
its tensors' one. A process that drives a model on cuda:1 while cuda:0 is current (the world-model server's
stage ring, a policy placed on another GPU in the trainer's process) must make its device current first: the
first two-GPU run of the stage ring failed its graph capture on cuda:1 (round 31)."""

from __future__ import annotations

import contextlib
import functools

import torch


def device_context(device: torch.device | str):
    """Make `device` current (kernels, streams, graph capture) for a CUDA device; nothing otherwise."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_own_device(method):
    """Run a method with its object's `device` current (device_context)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with device_context(self.device):
            return method(self, *args, **kwargs)
    return wrapper
