"""Shared pieces of the RLinf adapter tests: RLinf-like model configs and env observations, an
in-process channel for RLinf's async weight syncers, and a trainer-side openpi state dict.

The tests run against the real `rlinf` package (installed with --no-deps by scripts/setup.sh);
nothing of RLinf is stubbed: its import chain needs only our own dependencies (ray, omegaconf).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

try:
    import rlinf  # noqa: F401
except ImportError as exc:  # pragma: no cover - a set-up problem, not a test outcome
    raise ImportError(
        "the RLinf adapter tests need the rlinf package: bash scripts/setup.sh "
        '(or .venv/bin/python -m pip install --no-deps "rlinf==0.3.0")'
    ) from exc

from rlinf.scheduler import Worker

from policies.loaders import export_state_dict
from policies.models.pi05 import PI05Model
from rollout.rlinf import ext

TASKS = ["put the bowl on the plate", "open the top drawer", "turn on the stove"]
ACTION_Q01 = [-0.9, -0.8, -0.7, -0.3, -0.2, -0.1, -1.0]
ACTION_Q99 = [0.9, 0.7, 0.8, 0.3, 0.25, 0.1, 1.0]


def model_cfg(top: dict | None = None, openpi: dict | None = None, **vla_rollout) -> DictConfig:
    """RLinf's model node as examples/embodiment/config/model/pi0_5.yaml writes it (with keys
    the adapter must ignore), for the tiny policy: chunk 8, 5 executed actions, 4 steps."""
    node = {
        "model_type": ext.MODEL_TYPE,
        "model_path": None,
        "precision": None,
        "num_action_chunks": 5,
        "action_dim": 7,
        "is_lora": False,
        "lora_rank": 32,
        "use_proprio": True,
        "num_steps": 4,
        "add_value_head": False,
        "openpi": {
            "config_name": "pi05_libero",
            "num_images_in_input": 2,
            "noise_level": 0.5,
            "action_chunk": "${..num_action_chunks}",
            "num_steps": "${..num_steps}",
            "train_expert_only": True,
            "action_env_dim": "${..action_dim}",
            "noise_method": "flow_sde",
            "add_value_head": "${..add_value_head}",
            "use_dsrl": False,
        },
        "vla_rollout": {
            "policy": {"preset": "tiny", "inputs": {"action_q01": ACTION_Q01, "action_q99": ACTION_Q99}},
            "actor": "openpi",  # standalone (no RLinf worker): the builder returns ours
        },
    }
    node.update(top or {})
    node["openpi"].update(openpi or {})
    node["vla_rollout"].update(vla_rollout)
    return OmegaConf.create(node)


def build(cfg=None):
    """Through RLinf's own get_model, as its rollout worker builds the model."""
    from rlinf.models import get_model

    ext.register()
    return get_model(cfg if cfg is not None else model_cfg())


def env_obs(batch: int, size: int = 64, seed: int = 0, as_numpy: bool = False) -> dict:
    """RLinf's LIBERO env_obs: uint8 images (B, H, W, 3), no extra view, float32 states (B, 8)."""
    rng = np.random.default_rng(seed)
    obs = {
        "main_images": rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8),
        "wrist_images": rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8),
        "extra_view_images": None,
        "states": rng.uniform(-1, 1, (batch, 8)).astype(np.float32),
        "task_descriptions": [TASKS[i % len(TASKS)] for i in range(batch)],
    }
    if not as_numpy:
        obs.update({k: torch.from_numpy(v) for k, v in obs.items() if isinstance(v, np.ndarray)})
    return obs


def predict(model, obs: dict, seed: int, **kwargs):
    torch.manual_seed(seed)
    return model.predict_action_batch(env_obs=obs, **kwargs)


def trainer_state(model: PI05Model) -> dict[str, torch.Tensor]:
    """What RLinf's actor (openpi's PI0Pytorch) holds: openpi names and shapes, both unused heads
    (the PaliGemma one equal to the embedding, the expert one zeros), independent storage."""
    return export_state_dict(model, "openpi", include_unused_heads=True)


def new_trainer_state(model, seed: int = 123) -> dict[str, torch.Tensor]:
    """The actor after training: other values, same names and shapes (fp32, CPU)."""
    trainer = PI05Model(model.policy.cfg)
    trainer.init_weights(seed, 1.0)
    return trainer_state(trainer)


def expert_names(state: dict) -> list[str]:
    """RLinf's param_names_need_sync with train_expert_only: the trainable (expert) names."""
    trainable = ("gemma_expert.", "action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.")
    return [name for name in state if any(part in name for part in trainable)]


def sparse_update(state: dict, names: list[str], fraction: float = 0.02, seed: int = 0) -> int:
    """Change a few elements of each named tensor in place (as one optimizer step in bf16 does,
    PULSE); -> number of changed elements."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    for name in names:
        flat = state[name].view(-1)
        count = max(1, int(fraction * flat.numel()))
        index = torch.randperm(flat.numel(), generator=gen)[:count].to(flat.device)
        flat[index] += (0.5 + torch.rand(count, generator=gen)).to(flat.device, flat.dtype)
        changed += count
    return changed


def param_pointers(model: torch.nn.Module) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), f"{name} differs: max {(param - params_b[name]).abs().max()}"


class Channel:
    """An in-process twin of RLinf's send/recv between the actor's rank 0 and a rollout rank:
    two FIFO queues of Python objects (RLinf moves the same objects over Ray/NCCL)."""

    def __init__(self) -> None:
        self.to_rollout: asyncio.Queue = asyncio.Queue()
        self.to_actor: asyncio.Queue = asyncio.Queue()


@contextlib.contextmanager
def cpu_as_accelerator() -> Iterator[None]:
    """RLinf's patch SENDER only runs on an accelerator (it checks tensor devices against
    `Worker.torch_device_type`, None on a CPU-only machine): let the CPU play that role while a
    patch is built. The receiver runs unchanged (tests/rollout/test_rlinf_gpu.py runs both on CUDA)."""
    previous = Worker.torch_device_type
    Worker.torch_device_type = "cpu"
    try:
        yield
    finally:
        Worker.torch_device_type = previous
