"""GPU memory of an RL step: the per-step memory/* metrics, the card's clock after the rollout and the actor
(gpu/*), and what an actor's out-of-memory error says.

An 80 GB H100 ran the libero10_pi05 recipe at micro-batch 128 (consistent recompute, the engine's kept prefix) with
under 1 GiB to spare (README, "Round 51"): beside this process's 61 GiB at its peak, other processes (the env workers'
EGL contexts) and CUDA contexts used ~18 GiB. So a run says how close each step came, and which setting to turn when
one does not fit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

GIB = float(2**30)


def _cuda_indices(devices: Iterable[torch.device | str]) -> list[int]:
    """The CUDA device indices among `devices`, ordered and unique ("cuda" and "cuda:0" are one device)."""
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    return list(dict.fromkeys(d.index if d.index is not None else torch.cuda.current_device() for d in cuda))


def memory_metrics(devices: Iterable[torch.device | str]) -> dict[str, float]:
    """GPU memory of one RL step, per CUDA device this process computes on (the trainer's, an in-process
    engine's), in GiB: this process's peak allocated and reserved bytes since the last call (the peaks
    restart here, so each step reports its own) and the device's use now by every process (the caching
    allocator keeps what it reserved, so this is about the step's high-water mark plus the env workers'
    EGL contexts and any other process). Named memory/cuda0/peak_allocated_gib etc.; {} without CUDA."""
    out: dict[str, float] = {}
    for index in _cuda_indices(devices):
        device, name = torch.device("cuda", index), f"memory/cuda{index}"
        free, total = torch.cuda.mem_get_info(device)
        out[f"{name}/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out[f"{name}/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        out[f"{name}/device_used_gib"] = (total - free) / GIB
        out[f"{name}/device_total_gib"] = total / GIB
        torch.cuda.reset_peak_memory_stats(device)
    return out


def micro_batch_oom(rows: int, micro_batch: int, device: torch.device, levers: list[str]) -> str:
    """The message of an out-of-memory error in one of the actor's micro-batches: where (the micro-batch's rows and
    the key that sized it), how the card was shared (on CUDA) and the settings that make room, in that order."""
    where = f"CUDA out of memory in the actor's micro-batch of {rows} rows (grpo.micro_batch={micro_batch})"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        rest = max(total - free - reserved, 0)
        where += (f" on {device}: this process's allocator holds {reserved / GIB:.1f} GiB, the rest of the card's use "
                  f"(other processes, e.g. the env workers' EGL contexts, and CUDA contexts) {rest / GIB:.1f} GiB, "
                  f"of {total / GIB:.1f} GiB")
    return (f"{where}. To make room: " + "; ".join(levers)) if levers else where


def actor_levers(micro_batch: int, train_expert_only: bool, frozen_dtype: str | None, prefix_cache: str) -> list[str]:
    """The settings that shrink an actor micro-batch's memory, for this run's values (none it already uses)."""
    levers = []
    if micro_batch > 1:  # half of an even one still divides grpo.global_batch, which the config checks
        example = f"e.g. {micro_batch // 2}, " if micro_batch % 2 == 0 else ""
        levers.append(f"a smaller grpo.micro_batch ({example}the same update to rounding: the micro-batches' "
                      "gradients add up over each grpo.global_batch)")
    if train_expert_only and frozen_dtype is None:
        levers.append("policy.frozen_dtype=bfloat16 (the frozen vision and prefix weights in bf16 instead of fp32 "
                      "masters: 12.5 GiB on the libero10_pi05 step, README \"Round 51\")")
    if prefix_cache in ("device", "engine"):
        levers.append("grpo.prefix_cache_gib=GiB (fewer kept prefixes on the card; the others recompute theirs)")
    return levers


_NVML_WARNED: set[str] = set()


def card_state_metrics(devices: Iterable[torch.device | str], after: str) -> dict[str, float]:
    """The card's SM clock (MHz), temperature (C) and power draw (W) as NVML last sampled them, right `after` a
    phase, per CUDA device: gpu/cuda0/sm_clock_mhz_after_actor etc. Round 61 saw the same code's actor take 22 s on
    one H100 machine and 34 s on another while the CUDA-graph predict held 33 s on both: a clock that fell under
    load would show here. {} without CUDA or NVML (nvidia-ml-py), said once per reason."""
    out: dict[str, float] = {}
    for index in _cuda_indices(devices):
        try:
            clock, temperature = torch.cuda.clock_rate(index), torch.cuda.temperature(index)
            power_mw = torch.cuda.power_draw(index)
        except Exception as error:  # NVML has no error base torch exposes; metrics only
            reason = f"{type(error).__name__}: {error}"
            if reason not in _NVML_WARNED:
                _NVML_WARNED.add(reason)
                log.warning("GPU clocks not recorded (gpu/cuda%d/*): NVML query failed with %s", index, reason)
            return {}
        name = f"gpu/cuda{index}"
        out[f"{name}/sm_clock_mhz_after_{after}"] = float(clock)
        out[f"{name}/temperature_c_after_{after}"] = float(temperature)
        out[f"{name}/power_w_after_{after}"] = power_mw / 1000.0
    return out
