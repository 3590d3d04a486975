"""RLinf extension module: `RLINF_EXT_MODULE=rollout.rlinf.ext` registers our model type.

RLinf imports the module named by RLINF_EXT_MODULE in every worker process (and in the launcher)
and calls its `register()` (rlinf/scheduler/cluster/utils.py `load_user_extension_module`); its
`get_model(cfg)` then finds our builder by `cfg.model_type` and calls it as
`builder(cfg, torch_dtype)` (torch_dtype from `cfg.precision`), moves the result to the worker's
device (unless `cfg.load_to_device` is false) and applies LoRA when `cfg.is_lora` (refused here).

RLinf's rollout worker builds its model from the ACTOR's model config (`actor.model`, with
`precision` and `model_path` taken from `rollout.model`), so the actor would get our model too.
With `vla_rollout.actor: openpi` (the default) the builder returns RLinf's own
`OpenPi0ForRLActionPrediction` (needs openpi installed there) in any RLinf worker that is not a
rollout worker: RLinf's FSDP actor then trains its own model and sends openpi-named weights,
which our rollout model receives in place. Outside RLinf workers (scripts, tests) and in
rollout workers the builder returns `VLARolloutPolicy`.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.rlinf.config import RLinfAdapterConfig

MODEL_TYPE = "vla_rollout_pi05"


def register() -> None:
    """Called by RLinf on every worker; re-registering is harmless (force=True)."""
    from rlinf.models import register_model

    register_model(MODEL_TYPE, build_model, category="embodied", force=True)


def build_model(cfg: Any, torch_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """RLinf's builder signature: (model config node, torch dtype or None)."""
    adapter_cfg = RLinfAdapterConfig.from_rlinf(cfg, torch_dtype)
    if adapter_cfg.vla_rollout.actor == "openpi" and running_role() == "worker":
        from rlinf.models.embodiment.openpi import get_model as build_openpi

        return build_openpi(cfg, torch_dtype)
    from rollout.rlinf.policy import VLARolloutPolicy

    return VLARolloutPolicy.from_config(adapter_cfg, build_device(cfg))


def running_role() -> str:
    """"rollout" inside RLinf's rollout worker, "worker" inside any other RLinf worker (the actor),
    "standalone" outside RLinf workers. RLinf sets `Worker.current_worker` when a worker starts."""
    from rlinf.scheduler import Worker

    worker = Worker.current_worker
    if worker is None:
        return "standalone"
    from rlinf.workers.rollout.hf.huggingface_worker import MultiStepRolloutWorker

    return "rollout" if isinstance(worker, MultiStepRolloutWorker) else "worker"


def build_device(cfg: Any) -> torch.device:
    """Build on the worker's accelerator (as get_model would move it there) rather than
    initialising 3B parameters on the CPU first."""
    from rlinf.scheduler import Worker

    platform = Worker.torch_platform
    load_to_device = cfg.get("load_to_device", True) if hasattr(cfg, "get") else True
    if platform is None or not platform.is_available() or not load_to_device:
        return torch.device("cpu")
    return torch.device(Worker.torch_device_type, platform.current_device())
