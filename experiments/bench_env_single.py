"""One env in this process: control steps/s without images and with cameras at chunk end.

A single pass of 200 steps lasts ~0.5-3 s, so a one-time cost inside it (a function compiled on
first use, first-touch allocations, a CPU clocking up after an idle phase, processes of the
previous phase still exiting) moves the rate a lot. The H200 box once measured lean "cameras at
chunk end" at 332 steps/s above "no images" at 179: no images was the first timed pass in the
process, after a 5-step warm-up, right after 64 baseline processes had been torn down. So:
- every mode gets the same warm-up: one full untimed pass of each mode first;
- then `repeats` rounds, each running every mode once, in alternating order;
- every pass starts from the same episode start, so all passes simulate the same trajectory;
- the rate is the median over rounds; every pass's rate, the render time within the chunk-end
  passes (so its physics-only rate can be compared with "no images"), the load average and the
  CPU clock before and after are recorded.
bench_env runs this before any worker process exists.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("no_images", "cameras_at_chunk_end")


def cpu_mhz() -> float | None:
    """Mean current clock over CPUs from /proc/cpuinfo (None where not reported, e.g. some VMs)."""
    try:
        values = [float(line.split(":", 1)[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return sum(values) / len(values) if values else None


def timed_pass(env: Any, actions: np.ndarray, chunk_size: int, render: bool, seed: int) -> tuple[float, float]:
    """(wall s, render s) of one pass: episode start (untimed), then `actions`, rendering both
    cameras after every `chunk_size` steps when `render`."""
    env.begin_episode(0, seed)
    render_s = 0.0
    start = time.perf_counter()
    for k, action in enumerate(actions):
        env.control_step(action)
        if render and (k + 1) % chunk_size == 0:
            t0 = time.perf_counter()
            env.observation(render=True)
            render_s += time.perf_counter() - t0
    return time.perf_counter() - start, render_s


def run_rounds(env: Any, actions: np.ndarray, chunk_size: int, repeats: int, seed: int) -> dict[str, list]:
    """Warm-up pass of every mode, then `repeats` rounds in alternating order: (wall, render) per pass."""
    for mode in MODES:
        timed_pass(env, actions, chunk_size, mode == "cameras_at_chunk_end", seed)
    passes: dict[str, list] = {mode: [] for mode in MODES}
    for round_index in range(repeats):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            passes[mode].append(timed_pass(env, actions, chunk_size, mode == "cameras_at_chunk_end", seed))
    return passes


def summarize_passes(passes: dict[str, list], steps: int, chunk_size: int) -> dict[str, Any]:
    """Median rates per mode, every pass's rate, and the chunk-end passes' physics-only rate."""
    out: dict[str, Any] = {}
    for mode, runs in passes.items():
        rates = [steps / wall for wall, _ in runs]
        out[f"{mode}_steps_per_s"] = statistics.median(rates)
        out[f"{mode}_steps_per_s_passes"] = rates
    chunk_end = passes["cameras_at_chunk_end"]
    out["cameras_at_chunk_end_physics_steps_per_s"] = statistics.median(steps / (w - r) for w, r in chunk_end)
    renders = steps // chunk_size
    if renders:
        out["render_s_per_chunk_end"] = statistics.median(r / renders for _, r in chunk_end)
    return out


def measure_single_process(env_cfg: Any, repeats: int, steps: int, action_scale: float, seed: int) -> dict[str, Any]:
    """One LIBERO env (the first env's task) in this process; see the module docstring."""
    from envs.libero_env import LiberoEnv
    from envs.vector.catalog import env_slots

    env = LiberoEnv.from_config(env_cfg, env_slots(env_cfg)[0].task_id)
    rng = np.random.default_rng(seed)
    actions = rng.uniform(-action_scale, action_scale, (steps, 7))
    context = {"load_average_before": os.getloadavg(), "cpu_mhz_before": cpu_mhz()}
    try:
        passes = run_rounds(env, actions, env_cfg.chunk_size, repeats, seed)
    finally:
        env.close()
    context.update(load_average_after=os.getloadavg(), cpu_mhz_after=cpu_mhz(), repeats=repeats, steps=steps)
    return {**summarize_passes(passes, steps, env_cfg.chunk_size), "context": context}
