"""LeRobot 0.6.1's PI05, the predict benchmark's baseline, in each variant a user could run.

Every variant has the same random weights: `build_lerobot(cfg, device, seed=1)` is deterministic
(seeded init on the device, then the AdaRMS projections randomised), so a worker process rebuilds
the very weights the parent measured (checked with a checksum):
- "shipped": LeRobot's bf16 mode as it ships, which keeps SigLIP, its projector and the norms in
  fp32 (part of our speed-up over it is that precision, not engineering);
- "bf16": every weight of PaliGemma and the expert in bf16, SigLIP included, as ours runs; only
  the expert's AdaRMS condition projections stay fp32 (LeRobot feeds them the fp32 time
  embedding; ours precomputes their output tables in fp32 too);
- "compiled_<mode>": LeRobot's own compile option (PI05Config.compile_model=True with
  compile_mode=<mode>: torch.compile of sample_actions) over the weights of
  `bench.lerobot_compile_precision`, built here and run in worker processes that compile side by
  side, then time one at a time, each killed at a deadline (`experiments.bench_predict_compiled`).

On a CPU box without LeRobot (it needs Python >= 3.12), LEROBOT_SITE (tests/policies/lerobot_stub.py)
loads LeRobot's own pi05 files for the smoke run; elsewhere the baseline is skipped and recorded.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import torch

from experiments import bench_predict_common as common
from policies.config import PolicyConfig
from policies.lerobot_bridge import build_lerobot_core, lerobot_config, lerobot_inputs

EAGER_VARIANTS = ("shipped", "bf16")


def import_lerobot_pi05():
    """(LeRobot's modeling_pi05 module, None) or (None, why it is not importable here)."""
    try:
        from lerobot.policies.pi05 import modeling_pi05

        return modeling_pi05, None
    except Exception as exc:  # noqa: BLE001 - LeRobot 0.6.1 needs Python >= 3.12; recorded, skipped
        reason = f"{type(exc).__name__}: {exc}"
    if os.environ.get("LEROBOT_SITE"):  # CPU dev boxes: LeRobot's pi05 files with stand-ins for the rest
        from tests.policies.lerobot_stub import load_lerobot_pi05

        module = load_lerobot_pi05()
        if module is not None:
            return module, None
    return None, reason


def build_lerobot(cfg: PolicyConfig, device: torch.device, seed: int = 1, compile_mode: str | None = None):
    """LeRobot's PI05Pytorch (its `cfg.dtype` mode) with random weights, or None where it is missing.
    `compile_mode`: LeRobot's compile option on (torch.compile of sample_actions in that mode)."""
    modeling, reason = import_lerobot_pi05()
    if modeling is None:
        print(f"LeRobot pi05 not importable here ({reason}); timing ours only")
        return None
    torch.manual_seed(seed)
    fields = {k: v for k, v in vars(lerobot_config(cfg)).items() if k != "rtc_config"}
    if compile_mode:
        fields.update(compile_model=True, compile_mode=compile_mode)
    try:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        lr_cfg = PI05Config(**fields)
    except Exception:  # noqa: BLE001 - the stub path has no PI05Config: a namespace of its fields suffices
        lr_cfg = SimpleNamespace(**fields, rtc_config=None)
    with torch.device(device):  # random init on the device: minutes faster than on the host
        core = build_lerobot_core(modeling, cfg, lr_cfg)
    core.to(device).eval()
    with torch.no_grad():
        for name, p in core.named_parameters():
            if ".dense." in name:  # LeRobot zero-inits AdaRMS; randomise so time conditioning matters
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
                else:
                    p.zero_()
                    p[2 * p.numel() // 3:] = 1.0  # gate bias 1: residual branches stay open
    return core


def to_all_bf16(core) -> int:
    """The "bf16" variant, in place: every fp32 weight of PaliGemma + the expert to bf16 except the
    AdaRMS condition projections (`.dense.`); returns how many tensors changed dtype."""
    changed = 0
    for name, p in core.paligemma_with_expert.named_parameters():
        if p.dtype == torch.float32 and ".dense." not in name:
            p.data = p.data.to(torch.bfloat16)  # as LeRobot's own to_bfloat16_for_selected_params
            changed += 1
    return changed


def bf16_copy(core):
    clone = copy.deepcopy(core)
    to_all_bf16(clone)
    return clone


def param_mib(module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / common.MIB


def weights_checksum(module) -> float:
    return float(sum(torch.sum(p.detach(), dtype=torch.float64) for p in module.parameters()))


def measure_lerobot(core, inputs, noise, steps: int, device: torch.device, warmup: int, iters: int,
                    budget: common.Budget | None = None, what: str = "lerobot",
                    mark: common.MemoryMark | None = None) -> dict:
    """One variant at one batch size: timing, memory beyond its weights, and its actions (fp32, CPU).
    Memory counts from `mark` where given (a compile worker's: its compile's first call included),
    else from the start of this measurement."""
    args = lerobot_inputs(inputs)
    with torch.no_grad():
        mark = mark or common.memory_mark(device)
        call = lambda: core.sample_actions(*args, noise=noise, num_steps=steps)  # noqa: E731
        timing = common.time_calls(call, device, warmup, iters, budget, what)
        memory = common.memory_since(mark, device)
    return {"ms": timing["ms"], "first_call_s": timing["first_call_s"], "ms_all": timing["ms_all"],
            "memory_delta": memory, "actions": timing["output"].float().cpu()}
