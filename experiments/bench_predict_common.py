"""Pieces every side of the predict benchmark shares (experiments/bench_predict*.py).

- the two configurations (PhyAI's and LIBERO RL's shapes) and their seeded inputs: batch b's
  inputs and noise come from seed b, so every side (and the compile worker's process) sees the
  same ones;
- `time_calls`: the one timing protocol for every side: `warmup` calls (the first one's wall
  time recorded apart: graph capture, torch.compile), then the median of `iters` timed calls
  (CUDA events on GPU);
- memory marks: the same accounting for every side (peaks and what stays resident, CUDA graph
  pools included, see `memory_since`);
- `Budget`: the run's wall-time budget; a measurement that would overrun it is skipped and
  recorded, never shortened;
- `kernel_table`: device time per kernel name of one call under torch.profiler (profile_denoise,
  profile_stages).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.devices import auto_device
from policies.config import PolicyConfig
from policies.observation import ModelInputs

MIB = 2**20
CAMERAS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
CONFIGURATIONS = {
    "phyai": {"cameras": 3, "prompt_len": 200, "chunk_size": 50, "num_steps": 10},
    "libero_rl": {"cameras": 2, "prompt_len": 48, "chunk_size": 10, "num_steps": 4},
}


def run_device_and_dtype() -> tuple[torch.device, str]:
    """The GPU in bf16 where there is one, else the CPU in fp32 (the scripts' smoke runs)."""
    device = auto_device("auto")
    return device, "bfloat16" if device.type == "cuda" else "float32"


def configuration_policy_cfg(base: PolicyConfig, spec: dict, dtype: str) -> PolicyConfig:
    return base.replace(
        cameras=CAMERAS[: spec["cameras"]], chunk_size=spec["chunk_size"], dtype=dtype,
        max_token_len=max(base.max_token_len, spec["prompt_len"]),
        sampling={"num_steps": spec["num_steps"]},
    )


def make_inputs(cfg: PolicyConfig, batch: int, prompt_len: int, device: torch.device,
                seed: int) -> tuple[ModelInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cams, res = len(cfg.cameras), cfg.vision.image_size
    inputs = ModelInputs(
        images=(torch.rand(batch, cams, 3, res, res, generator=g) * 2 - 1).to(device),
        image_masks=torch.ones(batch, cams, dtype=torch.bool, device=device),
        tokens=torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device),
        token_mask=torch.ones(batch, prompt_len, dtype=torch.bool, device=device),
    )
    noise = torch.randn(batch, cfg.chunk_size, cfg.max_action_dim, generator=g).to(device)
    return inputs, noise


def chain_call_args(cfg: PolicyConfig, batch: int, prompt_len: int, device: torch.device,
                    stochastic_first: bool) -> tuple:
    """FastSampler.sample_chains' arguments for batch `batch` (seed `batch`): inputs, noise, step noise and the
    per-step stochastic flags, step 0 stochastic when `stochastic_first` (as in a rollout's SDE step)."""
    inputs, noise = make_inputs(cfg, batch, prompt_len, device, seed=batch)
    step_noise = torch.randn(batch, cfg.sampling.num_steps, cfg.chunk_size, cfg.max_action_dim,
                             generator=torch.Generator().manual_seed(batch)).to(device)
    stochastic = torch.zeros(batch, cfg.sampling.num_steps, dtype=torch.bool, device=device)
    stochastic[:, 0] = stochastic_first
    return inputs, noise, step_noise, stochastic


# --------------------------------------------------------------------------- time budget


class BudgetExceeded(RuntimeError):
    """A measurement would not finish within the run's time budget (it was not started)."""


@dataclass
class Budget:
    total_s: float
    start: float = 0.0

    def __post_init__(self):
        self.start = self.start or time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def require(self, seconds: float, what: str) -> None:
        if seconds > self.left():
            raise BudgetExceeded(f"{what}: needs ~{seconds:.0f} s, {max(self.left(), 0):.0f} s of "
                                 f"bench.time_budget_s={self.total_s:g} left")


# --------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
               budget: Budget | None = None, what: str = "measurement") -> dict:
    """{"first_call_s", "ms" (median of `iters`), "ms_all", "output" (the first call's result, on the CPU)}.
    The first call is timed on its own (graph capture, compilation). The `iters` timed calls,
    estimated from the last warm-up call, must fit the budget, else BudgetExceeded (raised before
    any timed call). At least one warm-up call always runs."""
    _sync(device)
    t0 = time.perf_counter()
    output = fn()
    _sync(device)
    first_s = last_s = time.perf_counter() - t0
    output = _to_cpu(output)  # before any later call can reuse its memory (cudagraph-tree outputs are)
    for _ in range(max(warmup, 1) - 1):
        last_s = _one_call_s(fn, device)
    if budget is not None:  # the last warm-up call's length estimates a timed call's
        budget.require(last_s * iters, what)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"first_call_s": first_s, "ms": statistics.median(times), "ms_all": times, "output": output}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _one_call_s(fn: Callable[[], object], device: torch.device) -> float:
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def timed_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of fn in ms (CUDA events on GPU, perf_counter on CPU) after warm-up."""
    return time_calls(fn, device, warmup, iters)["ms"]


# --------------------------------------------------------------------------- memory


@dataclass
class MemoryMark:
    allocated: int
    reserved: int


def memory_mark(device: torch.device) -> MemoryMark | None:
    """Collect garbage, synchronise, return cached free blocks to the driver, reset the peaks; the
    bytes now in use."""
    if device.type != "cuda":
        return None
    gc.collect()  # what an earlier side left unreachable (samplers, graphs) is freed before the mark
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return MemoryMark(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


def memory_since(mark: MemoryMark | None, device: torch.device) -> dict | None:
    """MiB since `mark`: `peak_alloc_mib` (most bytes in live tensors at once), `peak_reserved_mib`
    (most bytes the allocator held: what the process needed from the GPU), and `resident_mib`
    (what stays once cached free blocks are returned: live tensors plus the private pools of
    captured CUDA graphs, which stay reserved for their replays)."""
    if mark is None:
        return None
    torch.cuda.synchronize(device)
    peak_alloc = torch.cuda.max_memory_allocated(device) - mark.allocated
    peak_reserved = torch.cuda.max_memory_reserved(device) - mark.reserved
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_reserved(device) - mark.reserved
    return {"peak_alloc_mib": peak_alloc / MIB, "peak_reserved_mib": peak_reserved / MIB,
            "resident_mib": resident / MIB}


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------- subprocesses


def tail(path: str | os.PathLike, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


# --------------------------------------------------------------------------- kernel profile


def kernel_table(fn: Callable[[], object], device: torch.device, top: int) -> dict:
    """Device time per kernel name of one call of fn (top-level CPU op time on the CPU), largest
    first, after one unprofiled call: {"kernel_ms_total", "launches", "top": [{kernel, ms, calls,
    share}]}."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        _sync(device)
    per_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if (event.device_type.name == "CUDA") == on_gpu and (on_gpu or event.cpu_parent is None):
            per_name[event.name].append((event.device_time_total if on_gpu else event.cpu_time_total) / 1e3)
    rows = sorted(((n, sum(v), len(v)) for n, v in per_name.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"kernel_ms_total": total, "launches": sum(r[2] for r in rows),
            "top": [{"kernel": n[:140], "ms": ms, "calls": c, "share": ms / total if total else 0.0}
                    for n, ms, c in rows[:top]]}
