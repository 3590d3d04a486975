"""Shared helpers for the env tests: leak checks and result comparison."""

from __future__ import annotations

import os

import numpy as np
import psutil

from envs.vector import ChunkResult


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name.lstrip("/")))


def spawned_children() -> list[psutil.Process]:
    """Live spawn/forkserver children of this process (multiprocessing workers), excluding
    multiprocessing's own resource tracker."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in cmdline:
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_results_equal(a: ChunkResult, b: ChunkResult) -> None:
    for key in ("rewards", "terminated", "truncated", "valid", "success", "done", "lost"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    assert_obs_equal(a.obs, b.obs)


def assert_obs_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "prompt":
            assert a[key] == b[key]
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
