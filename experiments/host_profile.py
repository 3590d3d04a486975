"""Where a host-bound piece of work spends its host time: Python functions by cProfile, and the call sites that
synchronise with the GPU.

`host_profile(fn, device)` runs `fn` once with both watches on and returns:
- `functions`: the `top` functions of this repository by cumulative time (calls, own time, cumulative time), from
  cProfile. cProfile sees the calling thread only: autograd runs a CUDA backward on its own device thread, so a
  custom autograd Function's backward shows up in `syncs` but not here;
- `syncs`: on CUDA, each call site (the innermost frames of this repository, any thread) of an op that waited for
  the GPU (`torch.cuda.set_sync_debug_mode("warn")`: `.item()`, `.tolist()`, `bool()` of a tensor, `nonzero`,
  a copy to host memory...), with its count: each is a point where the host stops running ahead of the device.

Used by `experiments.profile_actor --host-profile`. The watches cost host time themselves (cProfile roughly doubles
Python's), so the wall time here is not the update's: time it without them.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import pstats
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

REPO = str(Path(__file__).resolve().parents[1])
HERE = str(Path(__file__).resolve())
SITE_FRAMES = 3  # frames of this repository named per sync site, innermost first


def repo_frames(stack: list[traceback.FrameSummary], limit: int = SITE_FRAMES) -> str:
    """The innermost `limit` frames of this repository as 'path:line (function)', innermost first."""
    frames = [f for f in stack if ours(f.filename)]
    return " <- ".join(f"{Path(f.filename).relative_to(REPO)}:{f.lineno} ({f.name})" for f in frames[::-1][:limit])


def ours(filename: str) -> bool:
    """A file of this repository (not its virtual environment's packages, not this module)."""
    return filename.startswith(REPO + "/") and "/.venv/" not in filename and filename != HERE


@contextlib.contextmanager
def sync_sites(device: torch.device) -> Iterator[collections.Counter]:
    """Count, by call site, the ops that synchronised with `device` (CUDA only; elsewhere an empty count)."""
    sites: collections.Counter = collections.Counter()
    if device.type != "cuda":
        yield sites
        return
    before_mode = torch.cuda.get_sync_debug_mode()
    before_show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites[repo_frames(traceback.extract_stack()[:-1]) or f"{filename}:{lineno}"] += 1
        else:
            before_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(before_mode)
            warnings.showwarning = before_show


def top_functions(profile: cProfile.Profile, top: int) -> list[dict]:
    """This repository's functions by cumulative time: calls, own ("tottime") and cumulative seconds."""
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profile).stats.items():
        if ours(filename):
            rows.append({"function": f"{Path(filename).relative_to(REPO)}:{line} ({name})", "calls": calls,
                         "own_s": own, "cumulative_s": cumulative})
    return sorted(rows, key=lambda r: r["cumulative_s"], reverse=True)[:top]


def host_profile(fn: Callable[[], object], device: torch.device, top: int = 40) -> dict:
    """Run `fn` once under cProfile and the sync watch (see the module's docstring)."""
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    profile = cProfile.Profile()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with sync_sites(device) as sites:
        start = time.perf_counter()
        profile.enable()
        try:
            fn()
        finally:
            profile.disable()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - start
    syncs = [{"site": site, "count": count} for site, count in sites.most_common()]
    return {"wall_s": wall_s, "functions": top_functions(profile, top), "syncs": syncs,
            "sync_count": sum(sites.values())}
